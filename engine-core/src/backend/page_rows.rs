//! How a KV page stores its rows: f32 values where the backend keeps them, compact rows
//! ([`KvType`]) packed on a device that reads them (the GPU's f16 pages), or compact rows on
//! the host, widened to f32 only inside the attention kernels, a row at a time
//! ([`PageRows::row_into`]).

use super::Act;
use crate::cache_types::{Encoded, KvType};

/// A page's K or V rows, `[rows, kv_heads, head_dim]`.
#[derive(Debug)]
pub enum PageRows {
    /// f32 rows where the backend keeps values (a device buffer of the page's capacity on a
    /// GPU), written by [`super::Backend::write`].
    Values(Act),
    /// Rows in a compact type on a device that packs them ([`super::Backend::packs_kv`]):
    /// the bytes the host would hold, in 32-bit words (a buffer of the page's capacity),
    /// written by [`super::Backend::write_packed`].
    Device { ty: KvType, words: Act },
    /// Rows in a compact type on the host, [`KvType::row_bytes`] each, the page's rows only.
    Packed { ty: KvType, bytes: Vec<u8> },
}

/// Bytes as little-endian 32-bit words carried in f32 values (bits unchanged, the last word
/// padded with zeros), for a device buffer of packed rows.
pub(crate) fn words_of(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect()
}

/// The first `len` bytes of words read back from a device buffer of packed rows.
pub(crate) fn bytes_of(words: &[f32], len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = words
        .iter()
        .flat_map(|w| w.to_bits().to_le_bytes())
        .collect();
    bytes.truncate(len);
    bytes
}

impl PageRows {
    /// Rows of `x` as a host backend keeps them: f32 values as they are, else compact.
    pub fn host(ty: KvType, x: Vec<f32>) -> PageRows {
        match ty {
            KvType::F32 => PageRows::Values(Act::Host(x)),
            ty => PageRows::packed(ty, &x),
        }
    }

    /// Rows that arrived as a page stores them (from the page file, a link): f32 rows
    /// uploaded to `be` as values, compact rows uploaded as they are where `be` packs them on
    /// its device, else kept on the host as they are.
    pub fn arrived(be: &dyn super::Backend, x: Encoded) -> PageRows {
        match x.ty {
            KvType::F32 => PageRows::Values(be.upload(x.values())),
            ty if be.packs_kv(ty) => PageRows::Device {
                ty,
                words: be.upload(words_of(&x.bytes)),
            },
            ty => PageRows::Packed { ty, bytes: x.bytes },
        }
    }

    /// Compact rows of `x` (whole blocks of `ty`).
    pub fn packed(ty: KvType, x: &[f32]) -> PageRows {
        let mut bytes = Vec::new();
        ty.encode_into(x, &mut bytes);
        PageRows::Packed { ty, bytes }
    }

    /// Rows `at ..` of a packed page become `x` (whole rows of `row` values): every row below
    /// `at` must have been written; rows past it are dropped first (a truncated page is
    /// overwritten in place).
    pub fn write_packed(&mut self, at: usize, row: usize, x: &[f32]) {
        let PageRows::Packed { ty, bytes } = self else {
            panic!("write_packed on a page of f32 values");
        };
        let at = at * ty.row_bytes(row);
        assert!(at <= bytes.len(), "writing at byte {at} would leave a gap");
        bytes.truncate(at);
        ty.encode_into(x, bytes);
    }

    /// Rows `from .. from + n` of `src` (rows of `row` values already in the page's type)
    /// written at row `at`, as [`Self::write_packed`] writes values.
    pub fn write_encoded(&mut self, at: usize, row: usize, src: &[u8], from: usize, n: usize) {
        let PageRows::Packed { ty, bytes } = self else {
            panic!("write_encoded on a page of f32 values");
        };
        let size = ty.row_bytes(row);
        assert!(
            at * size <= bytes.len(),
            "writing at row {at} would leave a gap"
        );
        bytes.truncate(at * size);
        bytes.extend_from_slice(&src[from * size..(from + n) * size]);
    }

    /// The bytes of a packed page's rows.
    pub fn packed_bytes(&self) -> &[u8] {
        match self {
            PageRows::Packed { bytes, .. } => bytes,
            _ => panic!("packed_bytes on a page not packed on the host"),
        }
    }

    /// Row `j` of a packed page (rows of `row` values) widened into `out`.
    pub fn row_into(&self, j: usize, row: usize, out: &mut [f32]) {
        let PageRows::Packed { ty, bytes } = self else {
            panic!("row_into on a page not packed on the host");
        };
        let n = ty.row_bytes(row);
        ty.decode_into(&bytes[j * n..(j + 1) * n], &mut out[..row]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{BlockQ4_0, BlockQ8_0, QuantBlock, Quantise, QK};
    use half::f16;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect()
    }

    /// Each type's rows are the ggml blocks of the same values (the weight formats' quantisers,
    /// checked against llama.cpp's bytes in `quant.rs`), and come back as those blocks' values.
    #[test]
    fn rows_are_ggml_blocks_and_widen_to_their_values() {
        let x = values(2 * 64);
        for ty in KvType::ALL {
            let page = PageRows::packed(ty, &x);
            let mut row = vec![0.0f32; 64];
            page.row_into(1, 64, &mut row);
            let want: Vec<f32> = match ty {
                KvType::F32 => x[64..].to_vec(),
                KvType::F16 => x[64..].iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
                KvType::Q8_0 => x[64..]
                    .chunks(QK)
                    .flat_map(|b| BlockQ8_0::quantise(b).dequantise())
                    .collect(),
                KvType::Q4_0 => x[64..]
                    .chunks(QK)
                    .flat_map(|b| {
                        let mut o = [0.0f32; QK];
                        BlockQ4_0::quantise(b).dequantise_into(&mut o);
                        o
                    })
                    .collect(),
            };
            assert_eq!(row, want, "{}", ty.name());
            let PageRows::Packed { bytes, .. } = &page else {
                unreachable!()
            };
            assert_eq!(bytes.len(), 2 * ty.row_bytes(64));
        }
        assert_eq!(KvType::Q8_0.row_bytes(256), 8 * 34);
        assert_eq!(KvType::Q4_0.row_bytes(256), 8 * 18);
    }

    #[test]
    fn a_rewritten_row_replaces_the_rows_from_there() {
        let x = values(3 * 32);
        let mut page = PageRows::packed(KvType::Q8_0, &x);
        page.write_packed(1, 32, &x[64..]);
        let mut row = vec![0.0f32; 32];
        page.row_into(1, 32, &mut row);
        let mut want = vec![0.0f32; 32];
        PageRows::packed(KvType::Q8_0, &x[64..]).row_into(0, 32, &mut want);
        assert_eq!(row, want);
        let PageRows::Packed { bytes, .. } = &page else {
            unreachable!()
        };
        assert_eq!(bytes.len(), 2 * 34);
    }
}
