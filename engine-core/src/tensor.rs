//! Weight storage: a matrix or vector in its checkpoint dtype, backed either by a memory-mapped
//! file (native; zero-copy, so a 1.5 GB checkpoint costs page cache, not heap) or by owned memory
//! (synthetic models, wasm, and files whose tensor offsets are not aligned for their dtype).

use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

/// Storage dtypes the engine reads. Compute is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// llama.cpp's Q8_0: blocks of 32 weights sharing an f16 scale ([`BlockQ8_0`]).
    Q8_0,
}

impl DType {
    /// Elements per block and bytes per block (1 element for the float types).
    pub fn block(self) -> (usize, usize) {
        match self {
            DType::F32 => (1, 4),
            DType::BF16 | DType::F16 => (1, 2),
            DType::Q8_0 => (Q8_0_BLOCK, std::mem::size_of::<BlockQ8_0>()),
        }
    }

    /// Bytes `elems` elements take (a whole number of blocks), if that fits a usize.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        let (block, bytes) = self.block();
        elems
            .is_multiple_of(block)
            .then(|| (elems / block).checked_mul(bytes))
            .flatten()
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::Q8_0 => "q8_0",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" => Some(DType::F16),
            "q8_0" => Some(DType::Q8_0),
            _ => None,
        }
    }

    /// Whether the type stores blocks of weights with a shared scale.
    pub fn is_quantised(self) -> bool {
        self.block().0 > 1
    }
}

/// Weights per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;

/// One Q8_0 block, byte for byte as ggml stores it: weight `i` is `d * qs[i]`.
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; Q8_0_BLOCK],
}

impl BlockQ8_0 {
    /// ggml's reference quantisation (`quantize_row_q8_0_ref`): the scale maps the largest
    /// magnitude to 127, each weight rounds to nearest (halves away from zero).
    pub fn quantise(x: &[f32; Q8_0_BLOCK]) -> BlockQ8_0 {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs: x.map(|v| (v * id).round() as i8),
        }
    }

    /// The 32 weights as f32.
    #[inline(always)]
    pub fn dequantise(&self) -> [f32; Q8_0_BLOCK] {
        let d = self.d.to_f32();
        self.qs.map(|q| d * f32::from(q))
    }
}

/// Bytes shared by many tensors (one mapped file, or one owned buffer per tensor).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A typed view of `T` elements. `Mapped` ranges are checked for alignment when they are made,
/// so dereferencing never fails.
#[derive(Clone)]
pub enum Elems<T: bytemuck::Pod> {
    Mapped {
        bytes: SharedBytes,
        range: Range<usize>,
    },
    Owned(Arc<[T]>),
}

impl<T: bytemuck::Pod> Elems<T> {
    /// Borrow `range` of `bytes` as `T`s if it is aligned, else copy it into owned memory.
    pub fn from_bytes(bytes: &SharedBytes, range: Range<usize>) -> Self {
        let slice = &(**bytes).as_ref()[range.clone()];
        match bytemuck::try_cast_slice::<u8, T>(slice) {
            Ok(_) => Elems::Mapped {
                bytes: bytes.clone(),
                range,
            },
            Err(_) => Elems::Owned(bytemuck::pod_collect_to_vec::<u8, T>(slice).into()),
        }
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for Elems<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Elems::Mapped { bytes, range } => {
                bytemuck::cast_slice(&(**bytes).as_ref()[range.clone()])
            }
            Elems::Owned(v) => v,
        }
    }
}

/// Elements of one tensor in its storage dtype.
#[derive(Clone)]
pub enum Data {
    F32(Elems<f32>),
    BF16(Elems<bf16>),
    F16(Elems<f16>),
    Q8_0(Elems<BlockQ8_0>),
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
            Data::Q8_0(_) => DType::Q8_0,
        }
    }

    /// Elements (weights), not blocks.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(e) => e.len(),
            Data::BF16(e) => e.len(),
            Data::F16(e) => e.len(),
            Data::Q8_0(e) => e.len() * Q8_0_BLOCK,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Convert `range` of the elements to f32 into `out` (same length as `range`). For a
    /// quantised type the range must start and end on block boundaries (rows of a matrix whose
    /// width is a whole number of blocks do).
    pub fn to_f32_into(&self, range: Range<usize>, out: &mut [f32]) {
        match self {
            Data::F32(e) => out.copy_from_slice(&e[range]),
            Data::BF16(e) => crate::backend::cpu::convert::bf16_to_f32(&e[range], out),
            Data::F16(e) => crate::backend::cpu::convert::f16_to_f32(&e[range], out),
            Data::Q8_0(e) => {
                assert!(
                    range.start.is_multiple_of(Q8_0_BLOCK) && range.end.is_multiple_of(Q8_0_BLOCK),
                    "a Q8_0 range off block boundaries"
                );
                assert_eq!(out.len(), range.len());
                let blocks = &e[range.start / Q8_0_BLOCK..range.end / Q8_0_BLOCK];
                for (b, o) in blocks.iter().zip(out.chunks_exact_mut(Q8_0_BLOCK)) {
                    o.copy_from_slice(&b.dequantise());
                }
            }
        }
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.to_f32_into(0..self.len(), &mut out);
        out
    }

    /// Raw little-endian bytes (for writing safetensors files).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Data::F32(e) => bytemuck::cast_slice(e),
            Data::BF16(e) => bytemuck::cast_slice(e),
            Data::F16(e) => bytemuck::cast_slice(e),
            Data::Q8_0(e) => bytemuck::cast_slice(e),
        }
    }

    /// Owned data from f32 values, stored as `dtype` (round to nearest even; Q8_0 as ggml
    /// quantises, `values` a whole number of blocks).
    pub fn from_f32(values: &[f32], dtype: DType) -> Data {
        match dtype {
            DType::F32 => Data::F32(Elems::Owned(values.into())),
            DType::BF16 => Data::BF16(Elems::Owned(
                values.iter().map(|&v| bf16::from_f32(v)).collect(),
            )),
            DType::F16 => Data::F16(Elems::Owned(
                values.iter().map(|&v| f16::from_f32(v)).collect(),
            )),
            DType::Q8_0 => {
                assert_eq!(values.len() % Q8_0_BLOCK, 0, "Q8_0 takes whole blocks");
                Data::Q8_0(Elems::Owned(
                    values
                        .chunks_exact(Q8_0_BLOCK)
                        .map(|c| BlockQ8_0::quantise(c.try_into().expect("a block")))
                        .collect(),
                ))
            }
        }
    }
}

/// A weight tensor: data plus its shape (row-major; a Linear weight is `[out, in]`).
#[derive(Clone)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
}

/// A Linear weight `[rows = out, cols = in]`, ready for the backend's matmul.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Data,
}

impl Matrix {
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Bytes the matrix occupies in its storage dtype.
    pub fn nbytes(&self) -> usize {
        self.data.as_bytes().len()
    }

    /// Row `r` converted to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.data
            .to_f32_into(r * self.cols..(r + 1) * self.cols, out);
    }
}
