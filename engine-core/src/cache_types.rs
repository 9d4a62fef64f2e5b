//! The types a KV cache stores keys and values in (`f32`, `f16`, `q8_0`, `q4_0`, as
//! llama.cpp's `--cache-type-k` / `--cache-type-v` name them), and their rows' bytes.
//!
//! A compact row is the bytes llama.cpp's cache would hold for it: ggml's block layouts
//! (`quant::BlockQ8_0`, `quant::BlockQ4_0`, IEEE half), written by ggml's reference
//! quantisers (`quantize_row_*_ref`, what `llama-quantize` and every non-x86 build run; x86
//! llama.cpp's SIMD Q8_0 quantiser rounds halves to even where the reference rounds them away
//! from zero, so a tie can land one level apart). A page's rows in these types:
//! `backend::PageRows`. Rows that leave a page (for a link, a helper, the page file) leave as
//! these bytes: [`Encoded`].

use half::f16;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::quant::{BlockQ4_0, BlockQ8_0, QuantBlock, Quantise};
use crate::tensor::DType;

/// The type a KV cache stores keys or values in, and the type a tensor travels in on a link
/// (by the same names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvType {
    /// Exact: the values as the layer computed them.
    #[default]
    F32,
    F16,
    Q8_0,
    Q4_0,
}

impl KvType {
    pub const ALL: [KvType; 4] = [KvType::F32, KvType::F16, KvType::Q8_0, KvType::Q4_0];

    /// The storage type of the same layout: its name (llama.cpp's, `--cache-type-k f16`)
    /// and its block sizes come from the one table of `tensor::DType`.
    fn dtype(self) -> DType {
        match self {
            KvType::F32 => DType::F32,
            KvType::F16 => DType::F16,
            KvType::Q8_0 => DType::Q8_0,
            KvType::Q4_0 => DType::Q4_0,
        }
    }

    pub fn name(self) -> &'static str {
        self.dtype().name()
    }

    pub fn parse(s: &str) -> Result<KvType> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                let names: Vec<&str> = KvType::ALL.iter().map(|t| t.name()).collect();
                Error::Invalid(format!(
                    "cache type `{s}`: expected one of {}",
                    names.join(", ")
                ))
            })
    }

    /// Values per block: a row is whole blocks.
    pub fn block(self) -> usize {
        self.dtype().block().0
    }

    /// Bytes of a row of `values` values (a whole number of blocks).
    pub fn row_bytes(self, values: usize) -> usize {
        values / self.block() * self.dtype().block().1
    }

    /// Bytes of `values` values, if they are whole blocks and the count does not overflow
    /// (a size a peer announced).
    pub fn checked_bytes(self, values: u64) -> Option<u64> {
        let (block, bytes) = self.dtype().block();
        values
            .is_multiple_of(block as u64)
            .then(|| (values / block as u64).checked_mul(bytes as u64))
            .flatten()
    }

    /// Whether heads of `head_dim` values can be stored as this type: each head whole blocks,
    /// as llama.cpp requires (a block never spans two heads).
    pub fn check_head(self, head_dim: usize) -> Result<()> {
        if head_dim.is_multiple_of(self.block()) {
            Ok(())
        } else {
            Err(Error::Invalid(format!(
                "a KV head of {head_dim} values is not whole {}-value blocks of {}",
                self.block(),
                self.name()
            )))
        }
    }

    /// `x` (whole rows) appended to `out` in this type.
    pub(crate) fn encode_into(self, x: &[f32], out: &mut Vec<u8>) {
        match self {
            KvType::F32 => out.extend(x.iter().flat_map(|v| v.to_le_bytes())),
            KvType::F16 => out.extend(x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes())),
            KvType::Q8_0 => encode_blocks::<BlockQ8_0>(x, out),
            KvType::Q4_0 => encode_blocks::<BlockQ4_0>(x, out),
        }
    }

    /// The values of `bytes` (whole blocks of this type) into `out`, one per value.
    pub(crate) fn decode_into(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            KvType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            // A page's bytes lie at an even address in practice (the allocator's alignment),
            // so the vectorised widening reads them in place; one at a time otherwise.
            KvType::F16 => match bytemuck::try_cast_slice::<u8, f16>(bytes) {
                Ok(h) => crate::convert::f16_to_f32(h, &mut out[..h.len()]),
                Err(_) => {
                    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                }
            },
            KvType::Q8_0 => decode_blocks::<BlockQ8_0>(bytes, out),
            KvType::Q4_0 => decode_blocks::<BlockQ4_0>(bytes, out),
        }
    }
}

/// Values encoded in a [`KvType`]: K or V rows as a page stores them, taken off it whole (what
/// a link carries and the page file writes, so a page moves without being widened), or f32
/// values (queries, partials, states) on their way over a link.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    pub ty: KvType,
    pub bytes: Vec<u8>,
}

impl Encoded {
    /// f32 values as they travel.
    pub fn f32(x: &[f32]) -> Encoded {
        Encoded::of(KvType::F32, x)
    }

    /// `x` (whole blocks of `ty`) encoded.
    pub fn of(ty: KvType, x: &[f32]) -> Encoded {
        let mut bytes = Vec::with_capacity(ty.row_bytes(x.len()));
        ty.encode_into(x, &mut bytes);
        Encoded { ty, bytes }
    }

    /// Whole rows of `width` values held, if the bytes are whole rows.
    pub fn rows(&self, width: usize) -> Option<usize> {
        let row = self.ty.row_bytes(width);
        let whole = row > 0 && width.is_multiple_of(self.ty.block());
        (whole && self.bytes.len().is_multiple_of(row)).then(|| self.bytes.len() / row)
    }

    /// Keep the first `rows` rows of `width` values.
    pub fn truncate(&mut self, rows: usize, width: usize) {
        self.bytes.truncate(rows * self.ty.row_bytes(width));
    }

    /// The values (widened where the type is compact): for a backend that keeps f32 rows, or
    /// a tensor of values.
    pub fn values(&self) -> Vec<f32> {
        let n = self.bytes.len() / self.ty.row_bytes(self.ty.block()) * self.ty.block();
        let mut out = vec![0.0; n];
        self.ty.decode_into(&self.bytes, &mut out);
        out
    }
}

fn encode_blocks<B: Quantise>(x: &[f32], out: &mut Vec<u8>) {
    for block in x.chunks_exact(B::LEN) {
        out.extend_from_slice(bytemuck::bytes_of(&B::quantise(block)));
    }
}

fn decode_blocks<B: QuantBlock>(bytes: &[u8], out: &mut [f32]) {
    let size = std::mem::size_of::<B>();
    for (o, b) in out.chunks_exact_mut(B::LEN).zip(bytes.chunks_exact(size)) {
        bytemuck::pod_read_unaligned::<B>(b).dequantise_into(o);
    }
}

/// The types of a cache's keys and of its values, chosen separately as llama.cpp does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CacheTypes {
    pub k: KvType,
    pub v: KvType,
}

impl CacheTypes {
    /// Exact pages (what the fixtures are checked with).
    pub const F32: CacheTypes = CacheTypes {
        k: KvType::F32,
        v: KvType::F32,
    };

    /// Bytes of K and V for one position of one layer of rows of `values` values.
    pub fn position_bytes(self, values: usize) -> usize {
        self.k.row_bytes(values) + self.v.row_bytes(values)
    }

    pub fn check_head(self, head_dim: usize) -> Result<()> {
        self.k.check_head(head_dim)?;
        self.v.check_head(head_dim)
    }
}

impl std::fmt::Display for CacheTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "K {} / V {}", self.k.name(), self.v.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_as_llama_cpp_spells_them() {
        for ty in KvType::ALL {
            assert_eq!(KvType::parse(ty.name()).unwrap(), ty);
        }
        assert_eq!(KvType::parse("Q8_0").unwrap(), KvType::Q8_0);
        let e = KvType::parse("q5_1").unwrap_err().to_string();
        assert!(e.contains("f32, f16, q8_0, q4_0"), "{e}");
        assert!(KvType::Q4_0.check_head(16).is_err());
        assert!(KvType::Q8_0.check_head(64).is_ok());
        assert!(KvType::F16.check_head(16).is_ok());
    }
}
