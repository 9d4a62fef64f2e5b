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
    /// llama.cpp's k-quants: super-blocks of 256 weights ([`BlockQ4K`], [`BlockQ5K`],
    /// [`BlockQ6K`]), read from GGUF files (tether does not quantise to them).
    Q4K,
    Q5K,
    Q6K,
}

impl DType {
    /// Elements per block and bytes per block (1 element for the float types).
    pub fn block(self) -> (usize, usize) {
        match self {
            DType::F32 => (1, 4),
            DType::BF16 | DType::F16 => (1, 2),
            DType::Q8_0 => (Q8_0_BLOCK, std::mem::size_of::<BlockQ8_0>()),
            DType::Q4K => (QK_K, std::mem::size_of::<BlockQ4K>()),
            DType::Q5K => (QK_K, std::mem::size_of::<BlockQ5K>()),
            DType::Q6K => (QK_K, std::mem::size_of::<BlockQ6K>()),
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
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" => Some(DType::F16),
            "q8_0" => Some(DType::Q8_0),
            "q4_k" => Some(DType::Q4K),
            "q5_k" => Some(DType::Q5K),
            "q6_k" => Some(DType::Q6K),
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

/// Weights per k-quant super-block.
pub const QK_K: usize = 256;

/// A block of quantised weights as ggml stores it, and its values by ggml's definition (the
/// float operations in ggml's order, so the values are the reference's bit for bit).
pub trait QuantBlock: bytemuck::Pod + Send + Sync {
    /// Weights per block.
    const LEN: usize;
    /// Writes the block's `LEN` weights to `out`.
    fn dequantise_into(&self, out: &mut [f32]);
}

impl QuantBlock for BlockQ8_0 {
    const LEN: usize = Q8_0_BLOCK;
    fn dequantise_into(&self, out: &mut [f32]) {
        out.copy_from_slice(&self.dequantise());
    }
}

/// Q4_K: 8 sub-blocks of 32 weights, each with a 6-bit scale and min (packed in `scales`),
/// scaled by `d` and `dmin`; weight = `d * sc * q - dmin * m` with 4-bit `q`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: as Q4_K with a fifth bit per weight in `qh`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 sub-blocks of 16 weights with signed 8-bit scales; weight = `d * sc * (q - 32)`
/// with 6-bit `q` (low 4 bits in `ql`, high 2 in `qh`).
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// Sub-block `j`'s 6-bit scale and min of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8; 12]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// Q4_K's and Q5_K's weights: sub-block `j` (32 weights from 32 bytes of `qs`, low nibbles
/// for even `j`, high for odd) scaled `d * sc - dmin * m`, with a fifth bit from `qh` for Q5_K.
fn dequantise_k4(
    (d, dmin): (f16, f16),
    scales: &[u8; 12],
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
    out: &mut [f32],
) {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    for (j, (q, out)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (s1, m1) = scale_min_k4(2 * j, scales);
        let (s2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1, d2, m2) = (d * s1, dmin * m1, d * s2, dmin * m2);
        for (l, &q) in q.iter().enumerate() {
            let high = |bit: usize| qh.map_or(0, |h| ((h[l] >> bit) & 1) << 4);
            out[l] = d1 * f32::from((q & 0xF) | high(2 * j)) - m1;
            out[l + 32] = d2 * f32::from((q >> 4) | high(2 * j + 1)) - m2;
        }
    }
}

impl QuantBlock for BlockQ4K {
    const LEN: usize = QK_K;
    fn dequantise_into(&self, out: &mut [f32]) {
        dequantise_k4((self.d, self.dmin), &self.scales, &self.qs, None, out);
    }
}

impl QuantBlock for BlockQ5K {
    const LEN: usize = QK_K;
    fn dequantise_into(&self, out: &mut [f32]) {
        dequantise_k4(
            (self.d, self.dmin),
            &self.scales,
            &self.qs,
            Some(&self.qh),
            out,
        );
    }
}

impl QuantBlock for BlockQ6K {
    const LEN: usize = QK_K;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (half, out) in out.chunks_exact_mut(128).enumerate() {
            let ql = &self.ql[64 * half..][..64];
            let qh = &self.qh[32 * half..][..32];
            let sc = &self.scales[8 * half..][..8];
            for l in 0..32 {
                let is = l / 16;
                let q = [
                    (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, &q) in q.iter().enumerate() {
                    let q = i32::from(q) - 32;
                    out[l + 32 * k] = (d * f32::from(sc[is + 2 * k])) * q as f32;
                }
            }
        }
    }
}

/// Elements `range` (block-aligned) of quantised `blocks` as f32 into `out`.
fn dequantise_range<B: QuantBlock>(blocks: &[B], range: Range<usize>, out: &mut [f32]) {
    assert!(
        range.start.is_multiple_of(B::LEN) && range.end.is_multiple_of(B::LEN),
        "a quantised range off block boundaries"
    );
    assert_eq!(out.len(), range.len());
    let blocks = &blocks[range.start / B::LEN..range.end / B::LEN];
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(B::LEN)) {
        b.dequantise_into(o);
    }
}

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
    Q4K(Elems<BlockQ4K>),
    Q5K(Elems<BlockQ5K>),
    Q6K(Elems<BlockQ6K>),
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
            Data::Q8_0(_) => DType::Q8_0,
            Data::Q4K(_) => DType::Q4K,
            Data::Q5K(_) => DType::Q5K,
            Data::Q6K(_) => DType::Q6K,
        }
    }

    /// Elements (weights), not blocks.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(e) => e.len(),
            Data::BF16(e) => e.len(),
            Data::F16(e) => e.len(),
            Data::Q8_0(e) => e.len() * Q8_0_BLOCK,
            Data::Q4K(e) => e.len() * QK_K,
            Data::Q5K(e) => e.len() * QK_K,
            Data::Q6K(e) => e.len() * QK_K,
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
            Data::Q8_0(e) => dequantise_range(e, range, out),
            Data::Q4K(e) => dequantise_range(e, range, out),
            Data::Q5K(e) => dequantise_range(e, range, out),
            Data::Q6K(e) => dequantise_range(e, range, out),
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
            Data::Q4K(e) => bytemuck::cast_slice(e),
            Data::Q5K(e) => bytemuck::cast_slice(e),
            Data::Q6K(e) => bytemuck::cast_slice(e),
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
            DType::Q4K | DType::Q5K | DType::Q6K => {
                panic!(
                    "tether reads {} weights; it does not quantise to them",
                    dtype.name()
                )
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
