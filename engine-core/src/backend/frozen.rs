//! A frozen KV page: one that decode only reads, re-packed once into fp16 in a layout a
//! decode kernel streams (issue 39). A backend that has such a kernel
//! ([`super::Backend::freeze_page`]) keeps the packed copy beside the page's rows; decode
//! attention of one row reads it, everything else (prefill, moves, the page file) the rows.
//!
//! Keys are transposed per KV head in blocks of [`LANES`]: `[block][head_dim][LANES]`, so one
//! vector load holds dimension `d` of sixteen keys and the group's queries multiply it
//! broadcast, sixteen scores per accumulator and no reduction. Values are laid out per KV head
//! in chunks of [`LANES`] dimensions, `[chunk][key][LANES]`, so a weighted sum sweeps
//! contiguous memory for each chunk of the output.
//!
//! fp16 K and V are a departure from an f32 page (none from an f16 one), and a kernel's sums
//! run in another order than the paged kernel's: a frozen page's partials are close to the
//! paged kernel's, not equal (docs/FROZEN_PAGES.md).

use half::f16;

use super::{KvPage, PageRows};

/// Keys (and value dimensions) a block holds: sixteen f32 fill a 512-bit register.
pub const LANES: usize = 16;

/// One frozen page of one attention layer.
pub struct FrozenPage {
    /// The first position, as the page it was packed from.
    pub start: usize,
    pub len: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// Per KV head: `[len / LANES][head_dim][LANES]`, the last block padded with zeros.
    pub(crate) keys: Vec<f16>,
    /// Per KV head: `[head_dim / LANES][len][LANES]`.
    pub(crate) values: Vec<f16>,
}

impl FrozenPage {
    /// Pack `page` (every key and value row of `kv_heads` heads of `d`, whatever its type; on
    /// the host). Heads must be whole multiples of [`LANES`] (Qwen3.5's 256 are).
    pub fn pack(kv_heads: usize, d: usize, page: &KvPage) -> FrozenPage {
        assert!(
            d.is_multiple_of(LANES),
            "a frozen page needs heads of whole {LANES}-value chunks"
        );
        let (len, row) = (page.len, kv_heads * d);
        let blocks = len.div_ceil(LANES);
        let mut keys = vec![f16::ZERO; kv_heads * blocks * d * LANES];
        let mut values = vec![f16::ZERO; kv_heads * d * len];
        let (mut k, mut v) = (vec![0.0f32; row], vec![0.0f32; row]);
        for j in 0..len {
            read_row(&page.k, j, row, &mut k);
            read_row(&page.v, j, row, &mut v);
            let (b, lane) = (j / LANES, j % LANES);
            for h in 0..kv_heads {
                let kh = &mut keys[h * blocks * d * LANES..][b * d * LANES..];
                let vh = &mut values[h * d * len..];
                for i in 0..d {
                    kh[i * LANES + lane] = f16::from_f32(k[h * d + i]);
                    vh[(i / LANES) * len * LANES + j * LANES + i % LANES] =
                        f16::from_f32(v[h * d + i]);
                }
            }
        }
        FrozenPage {
            start: page.start,
            len,
            kv_heads,
            head_dim: d,
            keys,
            values,
        }
    }

    /// Bytes the packed page holds (K and V, fp16, the last key block's padding included).
    pub fn bytes(&self) -> usize {
        2 * (self.keys.len() + self.values.len())
    }
}

impl std::fmt::Debug for FrozenPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FrozenPage({}..{}, {} bytes)",
            self.start,
            self.start + self.len,
            self.bytes()
        )
    }
}

/// Row `j` of a page on this backend (f32 values, or compact rows), as f32.
fn read_row(rows: &PageRows, j: usize, row: usize, out: &mut [f32]) {
    match rows {
        PageRows::Values(a) => out.copy_from_slice(&crate::backend::cpu::host(a)[j * row..][..row]),
        packed => packed.row_into(j, row, out),
    }
}
