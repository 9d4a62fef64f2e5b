//! Tensors on the wire: raw little-endian f32 or f16 after the metadata, described (dtype,
//! shape) in the metadata. Always f32 in memory: f16 is only a wire encoding (for residuals
//! where the plan allows it; KV rows and states travel as f32 so a split stays bit-exact).

use half::f16;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireDtype {
    F32,
    F16,
}

impl WireDtype {
    pub fn size(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::F16 => 2,
        }
    }
}

/// How a tensor is described in the metadata.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub dtype: WireDtype,
    pub shape: Vec<u64>,
}

/// A tensor as the engine sees it: f32 values, row-major, with its shape and the dtype it is
/// (or was) sent as.
#[derive(Clone, Debug, PartialEq)]
pub struct WireTensor {
    pub dtype: WireDtype,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl WireTensor {
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        WireTensor {
            dtype: WireDtype::F32,
            shape,
            data,
        }
    }

    pub fn desc(&self) -> TensorDesc {
        TensorDesc {
            dtype: self.dtype,
            shape: self.shape.iter().map(|&d| d as u64).collect(),
        }
    }

    pub fn encoded_len(&self) -> usize {
        self.data.len() * self.dtype.size()
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self.dtype {
            WireDtype::F32 => {
                for v in &self.data {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            WireDtype::F16 => {
                for v in &self.data {
                    out.extend_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
        }
    }

    /// Decode `bytes`, whose length the caller has already matched to `desc`.
    pub(crate) fn decode(desc: &TensorDesc, shape: Vec<usize>, bytes: &[u8]) -> WireTensor {
        let data = match desc.dtype {
            WireDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            WireDtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        WireTensor {
            dtype: desc.dtype,
            shape,
            data,
        }
    }
}
