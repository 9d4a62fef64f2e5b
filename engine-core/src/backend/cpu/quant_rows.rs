//! Rows of activations rounded to 8-bit integers per block, as the integer kernels multiply
//! them (`quant_dots` and `quant_panels` on x86_64, `quant_neon` on aarch64): llama.cpp's
//! `q8_0` and `q8_K` rows.
//!
//! Rounding to 8 bits moves each activation by at most half a step (1/254 of its block's
//! largest magnitude): `matmul::activation_rounding` is the bound that follows for a product.

use rayon::prelude::*;

use crate::quant::QK;

/// Values per entry of [`Rows8`]'s `sums`: Q6_K's sub-block (Q4_0's and Q4_K's 32 are two).
pub(super) const SUM_LEN: usize = 16;

/// Rows of `x` (`k` values each) as `d[b] * q[i]`, `b` the block of `block` values holding
/// value `i`; `sums[c]` is the sum of `q` over the 16 values of chunk `c` (for the weight
/// types' offsets and minima, which multiply the sum of the activations).
pub struct Rows8 {
    pub(super) k: usize,
    pub(super) q: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) sums: Vec<i16>,
    /// Each row on its own ([`Rows8::each_row`]), made once for every task that asks.
    #[cfg(target_arch = "x86_64")]
    alone: std::sync::OnceLock<Vec<Rows8>>,
}

/// Rows of `x` per task when [`Rows8::quantise`] works in parallel.
const PARALLEL_ROWS: usize = 32;

/// The largest magnitude of a block maps to this (never -128, so that `vpsignb` can flip any
/// value).
const Q8_MAX: f32 = 127.0;

impl Rows8 {
    /// `x` (`[t, k]`) rounded to nearest per block of `block` values (which divides `k`): the
    /// largest magnitude of each becomes 127. None if a value is infinite or NaN.
    pub fn quantise(x: &[f32], k: usize, block: usize) -> Option<Rows8> {
        assert!(block.is_multiple_of(QK) && k.is_multiple_of(block));
        assert!(x.len().is_multiple_of(k));
        let mut r = Rows8 {
            k,
            q: vec![0; x.len()],
            d: vec![0.0; x.len() / block],
            sums: vec![0; x.len() / SUM_LEN],
            #[cfg(target_arch = "x86_64")]
            alone: std::sync::OnceLock::new(),
        };
        let finite = if x.len() < 2 * PARALLEL_ROWS * k {
            quantise_into(x, block, &mut r.q, &mut r.d, &mut r.sums)
        } else {
            // Prefill's rows in parallel, each task into its own part of the vectors:
            // serially, 512 rows took 7% of a prefill.
            let n = PARALLEL_ROWS * k;
            x.par_chunks(n)
                .zip(r.q.par_chunks_mut(n))
                .zip(r.d.par_chunks_mut(n / block))
                .zip(r.sums.par_chunks_mut(n / SUM_LEN))
                .all(|(((x, q), d), sums)| quantise_into(x, block, q, d, sums))
        };
        finite.then_some(r)
    }

    pub(super) fn rows(&self) -> usize {
        self.q.len() / self.k
    }

    /// Every row alone, as quantising it alone would give it (rounding is per block of a row),
    /// for the kernels that take one row of `x` (Q4_0's grouped, interleaved Q8_0); copied
    /// once, however many tasks ask.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn each_row(&self) -> &[Rows8] {
        self.alone.get_or_init(|| {
            let (k, blocks) = (self.k, self.d.len() / self.rows());
            (0..self.rows())
                .map(|r| Rows8 {
                    k,
                    q: self.q[r * k..][..k].to_vec(),
                    d: self.d[r * blocks..][..blocks].to_vec(),
                    sums: self.sums[r * k / SUM_LEN..][..k / SUM_LEN].to_vec(),
                    alone: std::sync::OnceLock::new(),
                })
                .collect()
        })
    }

    /// The rows as the kernels see them, `d[b] * q[i]`.
    #[cfg(test)]
    pub fn values(&self) -> Vec<f32> {
        let block = self.q.len() / self.d.len();
        let q = self.q.chunks_exact(block).zip(&self.d);
        q.flat_map(|(q, &d)| q.iter().map(move |&q| d * f32::from(q)))
            .collect()
    }
}

/// `x` (whole blocks of `block`) rounded into `q`, `d` and `sums` as [`Rows8`] holds them;
/// false if a value is infinite or NaN. Written as plain loops over fixed-size chunks, which
/// the compiler vectorises.
fn quantise_into(x: &[f32], block: usize, q: &mut [i8], d: &mut [f32], sums: &mut [i16]) -> bool {
    let blocks = x
        .chunks_exact(block)
        .zip(q.chunks_exact_mut(block))
        .zip(d.iter_mut())
        .zip(sums.chunks_exact_mut(block / SUM_LEN));
    for (((values, q), d), sums) in blocks {
        // The largest magnitude, as bits: the bits of non-negative floats order as their
        // values do, and infinity's and NaN's are above every finite value's.
        let amax = values
            .iter()
            .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
        if amax >= f32::INFINITY.to_bits() {
            return false;
        }
        *d = f32::from_bits(amax) / Q8_MAX;
        let id = if *d > 0.0 { 1.0 / *d } else { 0.0 };
        let chunks = values
            .chunks_exact(SUM_LEN)
            .zip(q.chunks_exact_mut(SUM_LEN));
        for ((values, q), sum) in chunks.zip(sums.iter_mut()) {
            for (q, &v) in q.iter_mut().zip(values) {
                *q = (v * id).round().clamp(-Q8_MAX, Q8_MAX) as i8;
            }
            // At most 16 * 127.
            *sum = q.iter().map(|&q| i16::from(q)).sum();
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::{Rows8, PARALLEL_ROWS};

    /// Rows quantised in parallel (prefill's many rows) are the rows quantised one by one.
    #[test]
    fn parallel_quantisation_is_row_by_row() {
        let (k, rows) = (512, 2 * PARALLEL_ROWS + 5);
        let x = crate::backend::cpu::matmul::tests::values(rows * k, 3);
        let all = Rows8::quantise(&x, k, 256).unwrap();
        for (r, row) in x.chunks_exact(k).enumerate() {
            let one = Rows8::quantise(row, k, 256).unwrap();
            assert_eq!(one.q, all.q[r * k..][..k]);
            assert_eq!(one.d, all.d[r * 2..][..2]);
            assert_eq!(one.sums, all.sums[r * k / 16..][..k / 16]);
        }
        let mut bad = x.clone();
        bad[rows * k - 1] = f32::NAN;
        assert!(Rows8::quantise(&bad, k, 256).is_none());
    }
}
