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
        let rows = x.len() / k;
        if rows < 2 * PARALLEL_ROWS {
            return Rows8::quantise_rows(x, k, block);
        }
        // Prefill's rows in parallel: serially, 512 rows took 7% of a prefill.
        let parts: Vec<Rows8> = x
            .par_chunks(PARALLEL_ROWS * k)
            .map(|rows| Rows8::quantise_rows(rows, k, block))
            .collect::<Option<_>>()?;
        Some(Rows8 {
            k,
            q: parts.iter().flat_map(|p| &p.q).copied().collect(),
            d: parts.iter().flat_map(|p| &p.d).copied().collect(),
            sums: parts.iter().flat_map(|p| &p.sums).copied().collect(),
        })
    }

    /// [`Rows8::quantise`] on the calling thread.
    fn quantise_rows(x: &[f32], k: usize, block: usize) -> Option<Rows8> {
        let mut r = Rows8 {
            k,
            q: Vec::with_capacity(x.len()),
            d: Vec::with_capacity(x.len() / block),
            sums: Vec::with_capacity(x.len() / SUM_LEN),
        };
        for values in x.chunks_exact(block) {
            // NaN is not below infinity either, so one comparison per value finds both.
            let amax = values.iter().try_fold(0.0f32, |m, v| {
                (v.abs() < f32::INFINITY).then(|| m.max(v.abs()))
            })?;
            let d = amax / Q8_MAX;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for chunk in values.chunks_exact(SUM_LEN) {
                // At most 16 * 127.
                let mut sum = 0i16;
                for &v in chunk {
                    let q = (v * id).round().clamp(-Q8_MAX, Q8_MAX) as i8;
                    sum += i16::from(q);
                    r.q.push(q);
                }
                r.sums.push(sum);
            }
            r.d.push(d);
        }
        Some(r)
    }

    pub(super) fn rows(&self) -> usize {
        self.q.len() / self.k
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
