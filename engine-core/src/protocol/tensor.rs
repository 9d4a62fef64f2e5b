//! Tensors on the wire: raw little-endian bytes after the metadata, described (dtype, shape)
//! in the metadata. Values (residuals, queries, partials, DeltaNet states) travel as f32; KV
//! rows travel in the type their page stores them in (`f32`, `f16`, `q8_0`, `q4_0`: ggml's
//! block layouts), so a page crosses a link as the bytes it is held in and a split stays
//! bit-exact.

use serde::{Deserialize, Serialize};

use crate::cache_types::{Encoded, KvType};

/// How a tensor is described in the metadata.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub dtype: KvType,
    pub shape: Vec<u64>,
}

impl TensorDesc {
    /// Whether the shape's values are whole blocks of its type: a compact type's last
    /// dimension is whole blocks (a row never ends inside a block).
    pub(crate) fn whole_blocks(&self) -> bool {
        let block = self.dtype.block() as u64;
        block == 1 || self.shape.last().is_some_and(|&w| w.is_multiple_of(block))
    }

    /// The bytes this tensor takes, unless its size overflows or it is not whole blocks.
    pub(crate) fn bytes(&self) -> Option<u64> {
        let values = self
            .shape
            .iter()
            .try_fold(1u64, |acc, &x| acc.checked_mul(x))?;
        self.whole_blocks()
            .then(|| self.dtype.checked_bytes(values))
            .flatten()
    }
}

/// A tensor as it travels: its shape and its values encoded (row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct WireTensor {
    pub shape: Vec<usize>,
    pub data: Encoded,
}

impl WireTensor {
    /// f32 values of `shape`.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        WireTensor::new(shape, Encoded::f32(&data))
    }

    /// Rows already encoded (KV rows as their page holds them).
    pub fn new(shape: Vec<usize>, data: Encoded) -> Self {
        WireTensor { shape, data }
    }

    pub fn dtype(&self) -> KvType {
        self.data.ty
    }

    /// Values the shape holds.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values, widened where the tensor travelled compact.
    pub fn values(&self) -> Vec<f32> {
        self.data.values()
    }

    pub fn desc(&self) -> TensorDesc {
        TensorDesc {
            dtype: self.data.ty,
            shape: self.shape.iter().map(|&d| d as u64).collect(),
        }
    }

    pub fn encoded_len(&self) -> usize {
        self.data.bytes.len()
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.data.bytes);
    }

    /// Decode `bytes`, whose length the caller has already matched to `desc`.
    pub(crate) fn decode(desc: &TensorDesc, shape: Vec<usize>, bytes: &[u8]) -> WireTensor {
        WireTensor::new(
            shape,
            Encoded {
                ty: desc.dtype,
                bytes: bytes.to_vec(),
            },
        )
    }
}
