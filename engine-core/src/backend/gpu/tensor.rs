//! Device-resident data: activations ([`GpuTensor`], pooled) and weights ([`GpuMatrix`], split
//! into row blocks that each fit one storage binding), with upload and read-back.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;

use half::f16;
use shaders::WeightFormat;

use super::context::{Gpu, GpuError};
use super::device::Buffer;
use super::packing::{quant_format, quant_rows};
use super::pool::Pooled;
use crate::tensor::{Data, Matrix};

/// `len` 4-byte elements (f32, or u32 for ids, positions and argmax results) on the device.
/// Cloning shares the buffer; the buffer returns to the pool when the last clone (and every
/// unsubmitted batch that binds it) is gone. The shape is the caller's business, as with the
/// CPU ops' slices.
#[derive(Clone)]
pub struct GpuTensor {
    buf: Arc<Pooled>,
    len: usize,
}

impl GpuTensor {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn bytes(&self) -> u64 {
        self.len as u64 * 4
    }

    pub(super) fn buffer(&self) -> &Buffer {
        &self.buf
    }

    pub(super) fn pooled(&self) -> &Arc<Pooled> {
        &self.buf
    }
}

/// One block of a weight matrix: rows `row0 .. row0 + rows`, in its own buffer.
pub(super) struct WeightBlock {
    pub(super) buffer: Buffer,
    pub(super) row0: usize,
    pub(super) rows: usize,
}

/// A Linear weight `[rows, cols]` on the device in `format`, rows padded to `stride` elements.
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub(super) stride: usize,
    pub(super) blocks: Vec<WeightBlock>,
}

impl GpuMatrix {
    /// Number of row blocks (one dispatch each).
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

/// Row `r` of `data` (`cols` wide) as f32 into `out`.
fn row_f32(data: &Data, cols: usize, r: usize, out: &mut [f32]) {
    data.to_f32_into(r * cols..(r + 1) * cols, out);
}

impl Gpu {
    /// An uninitialised tensor of `len` elements from the pool.
    pub fn alloc(&self, len: usize) -> GpuTensor {
        GpuTensor {
            buf: Arc::new(self.pool.take(len as u64 * 4, |size| self.new_buffer(size))),
            len,
        }
    }

    fn upload_bytes(&self, bytes: &[u8], len: usize) -> GpuTensor {
        let t = self.alloc(len);
        self.write(&t, bytes);
        t
    }

    pub fn upload_f32(&self, data: &[f32]) -> GpuTensor {
        self.upload_bytes(bytemuck::cast_slice(data), data.len())
    }

    pub fn upload_u32(&self, data: &[u32]) -> GpuTensor {
        self.upload_bytes(bytemuck::cast_slice(data), data.len())
    }

    pub fn zeros(&self, len: usize) -> GpuTensor {
        self.upload_f32(&vec![0.0; len])
    }

    /// [`Gpu::start_read`] waited for on this thread.
    #[cfg(not(target_arch = "wasm32"))]
    fn read_back(&self, parts: &[(&GpuTensor, Range<usize>)]) -> Result<Vec<u8>, GpuError> {
        pollster::block_on(self.start_read(parts))
    }

    /// In a browser a map callback fires only after control returns to the page's event loop,
    /// so waiting here would hang the tab: fail at once, before recording anything, and name
    /// the read to await instead.
    #[cfg(target_arch = "wasm32")]
    fn read_back(&self, _parts: &[(&GpuTensor, Range<usize>)]) -> Result<Vec<u8>, GpuError> {
        Err(GpuError::ReadBack(
            "a browser tab cannot wait for the GPU: await `Backend::read_ranges` (or \
             `Gpu::read_ranges`) instead of downloading"
                .into(),
        ))
    }

    /// [`Gpu::download_ranges`] as a future, for a caller that must not block (in a browser,
    /// where the read completes only after control returns to the event loop). The copies are
    /// recorded and submitted when this is called, so ops recorded later do not change what is
    /// read; the future owns the staging buffer. Natively its first poll waits for the device,
    /// so it is ready at once.
    pub fn read_ranges(
        &self,
        parts: &[(&GpuTensor, Range<usize>)],
    ) -> impl Future<Output = Result<Vec<f32>, GpuError>> {
        let read = self.start_read(parts);
        async move { Ok(bytemuck::pod_collect_to_vec(&read.await?)) }
    }

    pub fn download_f32(&self, t: &GpuTensor) -> Result<Vec<f32>, GpuError> {
        self.download_ranges(&[(t, 0..t.len())])
    }

    pub fn download_u32(&self, t: &GpuTensor) -> Result<Vec<u32>, GpuError> {
        Ok(bytemuck::pod_collect_to_vec(
            &self.read_back(&[(t, 0..t.len())])?,
        ))
    }

    /// Element ranges of f32 tensors, concatenated, in one submission. Waits for the device, so
    /// it fails in a browser: await [`Gpu::read_ranges`] there.
    pub fn download_ranges(
        &self,
        parts: &[(&GpuTensor, Range<usize>)],
    ) -> Result<Vec<f32>, GpuError> {
        Ok(bytemuck::pod_collect_to_vec(&self.read_back(parts)?))
    }

    /// Uploads a weight matrix in `format`, in row blocks that each fit one binding.
    /// bf16 and f32 weights stored as f16 are rounded to nearest (bf16 -> f16 is exact for
    /// values in f16's normal range).
    pub fn upload_matrix(&self, m: &Matrix, format: WeightFormat) -> Result<GpuMatrix, GpuError> {
        self.upload_matrix_blocked(m, format, self.max_binding())
    }

    /// [`Gpu::upload_matrix`] with blocks of at most `block_bytes` (tests force tiny blocks).
    pub fn upload_matrix_blocked(
        &self,
        m: &Matrix,
        format: WeightFormat,
        block_bytes: u64,
    ) -> Result<GpuMatrix, GpuError> {
        // Quantised blocks are moved, never re-rounded: a matrix of a quantised type with
        // kernels goes to the device in that type's format (packing.rs), and nothing else does;
        // the quantised types without kernels (Q4_1, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS) not at
        // all.
        let dtype = m.data.dtype();
        let allowed = if dtype.is_quantised() {
            quant_format(dtype) == Some(format)
        } else {
            format.block().is_none()
        };
        if !allowed {
            return Err(GpuError::Unsupported(format!(
                "a {} matrix as {} device weights",
                dtype.name(),
                format.name()
            )));
        }
        if let Some((block, _)) = format.block() {
            if !m.cols.is_multiple_of(block) {
                return Err(GpuError::Unsupported(format!(
                    "{} rows of {} weights are not whole blocks of {block}",
                    dtype.name(),
                    m.cols
                )));
            }
        }
        if format == WeightFormat::F16 && !self.has_f16() {
            return Err(GpuError::Unsupported(format!(
                "native f16 weights need shader-f16, which {} lacks (use f16-packed)",
                self.adapter_name()
            )));
        }
        assert!(m.cols > 0, "a weight matrix with no columns");
        assert_eq!(m.data.len(), m.rows * m.cols);
        let stride = format.row_stride(m.cols);
        let row_bytes = format.row_bytes(m.cols) as u64;
        let rows_per_block = usize::try_from(block_bytes / row_bytes.max(1))
            .unwrap_or(usize::MAX)
            .min(m.rows)
            .max(usize::from(m.rows == 0));
        if rows_per_block == 0 {
            return Err(GpuError::Unsupported(format!(
                "one row of {} values ({row_bytes} bytes) exceeds a binding of {block_bytes} bytes",
                m.cols
            )));
        }
        let mut blocks = Vec::new();
        let mut row = vec![0.0f32; m.cols];
        for row0 in (0..m.rows).step_by(rows_per_block) {
            let rows = rows_per_block.min(m.rows - row0);
            let bytes: Vec<u8> = match format {
                _ if format.block().is_some() => quant_rows(&m.data, m.cols, row0..row0 + rows),
                WeightFormat::F32 => {
                    let mut v = vec![0.0f32; rows * stride];
                    for r in 0..rows {
                        row_f32(&m.data, m.cols, row0 + r, &mut v[r * stride..][..m.cols]);
                    }
                    bytemuck::cast_slice(&v).to_vec()
                }
                WeightFormat::F16Packed | WeightFormat::F16 => {
                    let mut v = vec![f16::ZERO; rows * stride];
                    for r in 0..rows {
                        let dst = &mut v[r * stride..][..m.cols];
                        match &m.data {
                            Data::F16(e) => {
                                dst.copy_from_slice(&e[(row0 + r) * m.cols..][..m.cols])
                            }
                            data => {
                                row_f32(data, m.cols, row0 + r, &mut row);
                                for (d, s) in dst.iter_mut().zip(&row) {
                                    *d = f16::from_f32(*s);
                                }
                            }
                        }
                    }
                    bytemuck::cast_slice(&v).to_vec()
                }
                _ => unreachable!("the quantised formats are packed above"),
            };
            blocks.push(WeightBlock {
                buffer: self.weights(&bytes),
                row0,
                rows,
            });
        }
        Ok(GpuMatrix {
            rows: m.rows,
            cols: m.cols,
            format,
            stride,
            blocks,
        })
    }
}
