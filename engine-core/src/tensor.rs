//! Weight storage: a matrix or vector in its checkpoint dtype, backed either by a memory-mapped
//! file (native; zero-copy, so a 1.5 GB checkpoint costs page cache, not heap) or by owned memory
//! (synthetic models, wasm, and files whose tensor offsets are not aligned for their dtype).

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

use crate::interleaved::{self, BlockQ8_0x8};

pub use crate::quant::{
    BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, QuantBlock, Q8_0_BLOCK, QK, QK_K,
};

/// Storage dtypes the engine reads. Compute is always f32. The quantised ones are llama.cpp's
/// (`crate::quant`), read from GGUF files; tether writes each of them too, as `llama-quantize`
/// does without an importance matrix (`crate::quant::Quantise`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Iq4Nl,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Xs,
}

/// Each type's name (llama.cpp's, lower case), ggml type id, elements and bytes per block.
const TYPES: [(DType, &str, u32, usize, usize); 15] = [
    (DType::F32, "f32", 0, 1, 4),
    (DType::F16, "f16", 1, 1, 2),
    (DType::BF16, "bf16", 30, 1, 2),
    (DType::Q4_0, "q4_0", 2, QK, size_of::<BlockQ4_0>()),
    (DType::Q4_1, "q4_1", 3, QK, size_of::<BlockQ4_1>()),
    (DType::Q5_0, "q5_0", 6, QK, size_of::<BlockQ5_0>()),
    (DType::Q5_1, "q5_1", 7, QK, size_of::<BlockQ5_1>()),
    (DType::Q8_0, "q8_0", 8, QK, size_of::<BlockQ8_0>()),
    (DType::Q2K, "q2_k", 10, QK_K, size_of::<BlockQ2K>()),
    (DType::Q3K, "q3_k", 11, QK_K, size_of::<BlockQ3K>()),
    (DType::Q4K, "q4_k", 12, QK_K, size_of::<BlockQ4K>()),
    (DType::Q5K, "q5_k", 13, QK_K, size_of::<BlockQ5K>()),
    (DType::Q6K, "q6_k", 14, QK_K, size_of::<BlockQ6K>()),
    (DType::Iq4Nl, "iq4_nl", 20, QK, size_of::<BlockIq4Nl>()),
    (DType::Iq4Xs, "iq4_xs", 23, QK_K, size_of::<BlockIq4Xs>()),
];

impl DType {
    fn entry(self) -> &'static (DType, &'static str, u32, usize, usize) {
        TYPES
            .iter()
            .find(|e| e.0 == self)
            .expect("every DType has an entry")
    }

    /// Elements per block and bytes per block (1 element for the float types).
    pub fn block(self) -> (usize, usize) {
        let &(_, _, _, elems, bytes) = self.entry();
        (elems, bytes)
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
        self.entry().1
    }

    /// ggml's id of the type (`ggml_type`), as GGUF files store it.
    pub fn ggml_id(self) -> u32 {
        self.entry().2
    }

    pub fn from_ggml_id(id: u32) -> Option<DType> {
        TYPES.iter().find(|e| e.2 == id).map(|e| e.0)
    }

    pub fn parse(s: &str) -> Option<DType> {
        let s = s.to_ascii_lowercase();
        let alias = match s.as_str() {
            "fp32" | "float32" => "f32",
            "bfloat16" => "bf16",
            "fp16" | "float16" => "f16",
            s => s,
        };
        TYPES.iter().find(|e| e.1 == alias).map(|e| e.0)
    }

    /// Whether the type stores blocks of weights with shared scales.
    pub fn is_quantised(self) -> bool {
        self.block().0 > 1
    }
}

/// A `match` on a [`Data`] whose quantised variants all run `$body` with `$e` bound to their
/// blocks (`&Elems<B>`, `B: QuantBlock`, monomorphised per type); `$rest` are the other arms.
macro_rules! match_quant {
    ($data:expr, $e:ident => $body:expr, $($rest:tt)*) => {
        match $data {
            $crate::tensor::Data::Q4_0($e) => $body,
            $crate::tensor::Data::Q4_1($e) => $body,
            $crate::tensor::Data::Q5_0($e) => $body,
            $crate::tensor::Data::Q5_1($e) => $body,
            $crate::tensor::Data::Q8_0($e) => $body,
            $crate::tensor::Data::Iq4Nl($e) => $body,
            $crate::tensor::Data::Q2K($e) => $body,
            $crate::tensor::Data::Q3K($e) => $body,
            $crate::tensor::Data::Q4K($e) => $body,
            $crate::tensor::Data::Q5K($e) => $body,
            $crate::tensor::Data::Q6K($e) => $body,
            $crate::tensor::Data::Iq4Xs($e) => $body,
            $($rest)*
        }
    };
}
pub(crate) use match_quant;

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

impl<T: bytemuck::Pod> Elems<T> {
    /// The bytes, if they are borrowed from a mapping rather than owned.
    pub fn mapped(&self) -> Option<&[u8]> {
        match self {
            Elems::Mapped { bytes, range } => Some(&(**bytes).as_ref()[range.clone()]),
            Elems::Owned(_) => None,
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
    Q4_0(Elems<BlockQ4_0>),
    Q4_1(Elems<BlockQ4_1>),
    Q5_0(Elems<BlockQ5_0>),
    Q5_1(Elems<BlockQ5_1>),
    Q8_0(Elems<BlockQ8_0>),
    Iq4Nl(Elems<BlockIq4Nl>),
    Q2K(Elems<BlockQ2K>),
    Q3K(Elems<BlockQ3K>),
    Q4K(Elems<BlockQ4K>),
    Q5K(Elems<BlockQ5K>),
    Q6K(Elems<BlockQ6K>),
    Iq4Xs(Elems<BlockIq4Xs>),
    /// Q8_0 weights with eight rows interleaved ([`crate::interleaved`]): made in memory for
    /// the CPU's decode, never read from a file; its dtype is Q8_0 and its [`Data::as_bytes`]
    /// the file's.
    Q8_0x8 {
        blocks: Elems<BlockQ8_0x8>,
        /// Blocks per row.
        per_row: usize,
    },
}

/// The type of quantised `blocks`.
fn quant_dtype<B: QuantBlock>(_: &[B]) -> DType {
    B::DTYPE
}

/// The weights in quantised `blocks`.
fn quant_len<B: QuantBlock>(blocks: &[B]) -> usize {
    blocks.len() * B::LEN
}

impl Data {
    /// `range` of `bytes` as `dtype` (borrowed where aligned, see [`Elems::from_bytes`]); the
    /// range must hold whole elements or blocks.
    pub fn from_bytes(dtype: DType, bytes: &SharedBytes, range: Range<usize>) -> Data {
        let r = range;
        match dtype {
            DType::F32 => Data::F32(Elems::from_bytes(bytes, r)),
            DType::BF16 => Data::BF16(Elems::from_bytes(bytes, r)),
            DType::F16 => Data::F16(Elems::from_bytes(bytes, r)),
            DType::Q4_0 => Data::Q4_0(Elems::from_bytes(bytes, r)),
            DType::Q4_1 => Data::Q4_1(Elems::from_bytes(bytes, r)),
            DType::Q5_0 => Data::Q5_0(Elems::from_bytes(bytes, r)),
            DType::Q5_1 => Data::Q5_1(Elems::from_bytes(bytes, r)),
            DType::Q8_0 => Data::Q8_0(Elems::from_bytes(bytes, r)),
            DType::Iq4Nl => Data::Iq4Nl(Elems::from_bytes(bytes, r)),
            DType::Q2K => Data::Q2K(Elems::from_bytes(bytes, r)),
            DType::Q3K => Data::Q3K(Elems::from_bytes(bytes, r)),
            DType::Q4K => Data::Q4K(Elems::from_bytes(bytes, r)),
            DType::Q5K => Data::Q5K(Elems::from_bytes(bytes, r)),
            DType::Q6K => Data::Q6K(Elems::from_bytes(bytes, r)),
            DType::Iq4Xs => Data::Iq4Xs(Elems::from_bytes(bytes, r)),
        }
    }

    /// The stored bytes, if they are borrowed from a mapping (a checkpoint or GGUF file, or
    /// [`crate::resident`]'s copy) rather than owned.
    pub fn mapped(&self) -> Option<&[u8]> {
        match_quant!(self, e => e.mapped(),
            Data::Q8_0x8 { blocks, .. } => blocks.mapped(),
            Data::F32(e) => e.mapped(),
            Data::BF16(e) => e.mapped(),
            Data::F16(e) => e.mapped(),
        )
    }

    pub fn dtype(&self) -> DType {
        match_quant!(self, e => quant_dtype(e),
            Data::Q8_0x8 { .. } => DType::Q8_0,
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
        )
    }

    /// Elements (weights), not blocks.
    pub fn len(&self) -> usize {
        match_quant!(self, e => quant_len(e),
            Data::Q8_0x8 { blocks, .. } => blocks.len() * interleaved::ROWS * QK,
            Data::F32(e) => e.len(),
            Data::BF16(e) => e.len(),
            Data::F16(e) => e.len(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Convert `range` of the elements to f32 into `out` (same length as `range`). For a
    /// quantised type the range must start and end on block boundaries (rows of a matrix whose
    /// width is a whole number of blocks do).
    pub fn to_f32_into(&self, range: Range<usize>, out: &mut [f32]) {
        match_quant!(self, e => dequantise_range(e, range, out),
            Data::Q8_0x8 { blocks, per_row } => interleaved::to_f32_into(blocks, *per_row, range, out),
            Data::F32(e) => out.copy_from_slice(&e[range]),
            Data::BF16(e) => crate::convert::bf16_to_f32(&e[range], out),
            Data::F16(e) => crate::convert::f16_to_f32(&e[range], out),
        )
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.to_f32_into(0..self.len(), &mut out);
        out
    }

    /// The bytes as they lie in memory (interleaved weights in their own order): what tells
    /// one tensor's storage from another's, as a cache key.
    pub fn stored(&self) -> &[u8] {
        match_quant!(self, e => bytemuck::cast_slice(e),
            Data::Q8_0x8 { blocks, .. } => bytemuck::cast_slice(blocks),
            Data::F32(e) => bytemuck::cast_slice(e),
            Data::BF16(e) => bytemuck::cast_slice(e),
            Data::F16(e) => bytemuck::cast_slice(e),
        )
    }

    /// Raw little-endian bytes in the file's layout (for writing safetensors and GGUF files,
    /// and the model's identity): borrowed, except for interleaved weights, put back in order.
    pub fn as_bytes(&self) -> Cow<'_, [u8]> {
        match self {
            Data::Q8_0x8 { blocks, per_row } => {
                Cow::Owned(interleaved::file_bytes(blocks, *per_row))
            }
            data => Cow::Borrowed(data.stored()),
        }
    }

    /// Owned data from f32 values, stored as `dtype` (round to nearest even; the quantised
    /// types as ggml's quantisers write them without an importance matrix,
    /// [`crate::quant::Quantise`]).
    ///
    /// # Panics
    /// For a quantised type, unless `values` are a whole number of its blocks.
    pub fn from_f32(values: &[f32], dtype: DType) -> Data {
        fn quantised<B: crate::quant::Quantise>(values: &[f32]) -> Elems<B> {
            assert!(
                values.len().is_multiple_of(B::LEN),
                "{} takes whole blocks of {} weights, not {}",
                B::DTYPE.name(),
                B::LEN,
                values.len()
            );
            // Blocks are independent: quantised in parallel, in order (`tether quantize`'s time).
            use rayon::prelude::*;
            Elems::Owned(values.par_chunks_exact(B::LEN).map(B::quantise).collect())
        }
        match dtype {
            DType::F32 => Data::F32(Elems::Owned(values.into())),
            DType::BF16 => Data::BF16(Elems::Owned(
                values.iter().map(|&v| bf16::from_f32(v)).collect(),
            )),
            DType::F16 => Data::F16(Elems::Owned(
                values.iter().map(|&v| f16::from_f32(v)).collect(),
            )),
            DType::Q4_0 => Data::Q4_0(quantised(values)),
            DType::Q4_1 => Data::Q4_1(quantised(values)),
            DType::Q5_0 => Data::Q5_0(quantised(values)),
            DType::Q5_1 => Data::Q5_1(quantised(values)),
            DType::Q8_0 => Data::Q8_0(quantised(values)),
            DType::Iq4Nl => Data::Iq4Nl(quantised(values)),
            DType::Q2K => Data::Q2K(quantised(values)),
            DType::Q3K => Data::Q3K(quantised(values)),
            DType::Q4K => Data::Q4K(quantised(values)),
            DType::Q5K => Data::Q5K(quantised(values)),
            DType::Q6K => Data::Q6K(quantised(values)),
            DType::Iq4Xs => Data::Iq4Xs(quantised(values)),
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
        self.data.stored().len()
    }

    /// Row `r` converted to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.data
            .to_f32_into(r * self.cols..(r + 1) * self.cols, out);
    }
}
