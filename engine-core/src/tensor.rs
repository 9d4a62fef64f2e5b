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
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" => Some(DType::F16),
            _ => None,
        }
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
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Data::F32(e) => e.len(),
            Data::BF16(e) => e.len(),
            Data::F16(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Convert `range` of the elements to f32 into `out` (same length as `range`).
    pub fn to_f32_into(&self, range: Range<usize>, out: &mut [f32]) {
        match self {
            Data::F32(e) => out.copy_from_slice(&e[range]),
            Data::BF16(e) => crate::backend::cpu::convert::bf16_to_f32(&e[range], out),
            Data::F16(e) => crate::backend::cpu::convert::f16_to_f32(&e[range], out),
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
        }
    }

    /// Owned data from f32 values, stored as `dtype` (round to nearest even).
    pub fn from_f32(values: &[f32], dtype: DType) -> Data {
        match dtype {
            DType::F32 => Data::F32(Elems::Owned(values.into())),
            DType::BF16 => Data::BF16(Elems::Owned(
                values.iter().map(|&v| bf16::from_f32(v)).collect(),
            )),
            DType::F16 => Data::F16(Elems::Owned(
                values.iter().map(|&v| f16::from_f32(v)).collect(),
            )),
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
        self.rows * self.cols * self.dtype().size()
    }

    /// Row `r` converted to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.data
            .to_f32_into(r * self.cols..(r + 1) * self.cols, out);
    }
}
