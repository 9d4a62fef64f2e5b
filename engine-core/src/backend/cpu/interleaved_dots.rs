//! Decode's products (one row of `x`) with interleaved Q8_0 weights ([`crate::interleaved`]) on
//! AVX2: eight weight rows at a time, one i32 lane each. Each 32-byte load holds four weights
//! of every row and multiplies the same four activations, broadcast; `|v|` times `x` with
//! `v`'s signs (`vpmaddubsw` takes one unsigned side, and a pair sums to at most 2 * 128 * 127,
//! so each is widened to i32 before the next is added). The eight rows' scales convert in one
//! instruction, and one f32 multiply-add per block serves all eight rows: on Zen 1 (256-bit
//! multiplies at half speed) the one-row kernel spent more on that per-block work than on the
//! multiplies. Each row's f32 sum takes its blocks in order, so a row's result does not depend
//! on the task it falls in.

use std::arch::x86_64::*;

use super::matmul::prefetch_ahead;
use super::quant_rows::Rows8;
use crate::interleaved::{BlockQ8_0x8, ROWS};
use crate::quant::QK;

/// Weight rows `w` (whole groups of eight, `x.k / 32` blocks each) against the one row of `x`
/// (quantised per 32 values) into `out` (a value per weight row).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn task(x: &Rows8, w: &[BlockQ8_0x8], out: &mut [f32]) {
    assert_eq!(x.rows(), 1, "decode's one row");
    let per_row = x.k / QK;
    assert_eq!(w.len() * ROWS, out.len() * per_row);
    let ones = _mm256_set1_epi16(1);
    for (group, dst) in w.chunks_exact(per_row).zip(out.chunks_exact_mut(ROWS)) {
        let mut acc = _mm256_setzero_ps();
        for (b, block) in group.iter().enumerate() {
            prefetch_ahead(block);
            let xq: &[i8; QK] = x.q[QK * b..][..QK].try_into().expect("32 values");
            let mut dots = _mm256_setzero_si256();
            for j in 0..QK / 4 {
                let word: &[i8; 4] = xq[4 * j..][..4].try_into().expect("4 values");
                let xs = _mm256_set1_epi32(i32::from_le_bytes(word.map(|v| v as u8)));
                let column: &[i8; 32] = block.qs[32 * j..][..32].try_into().expect("32 bytes");
                // SAFETY: 32 bytes read from `column`.
                let v = unsafe { _mm256_loadu_si256(column.as_ptr().cast()) };
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(xs, v));
                dots = _mm256_add_epi32(dots, _mm256_madd_epi16(pairs, ones));
            }
            // SAFETY: 16 bytes read from the eight scales.
            let d = unsafe { _mm_loadu_si128(block.d.as_ptr().cast()) };
            let scale = _mm256_mul_ps(_mm256_cvtph_ps(d), _mm256_set1_ps(x.d[b]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc);
        }
        // SAFETY: eight floats written to `dst`.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), acc) };
    }
}
