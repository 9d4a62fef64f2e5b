//! Decode's dot products with quantised weights on AVX2, in integers: each row of `x` is
//! rounded to 16-bit integers per block of 32 with an f32 scale (`Rows16`), each weight
//! sub-block of 32 is widened to 16-bit integers in registers (`Widen16`), and `vpmaddwd`
//! multiplies 16 pairs per instruction, where f32 needs a widening to 32 bits, a conversion
//! and an FMA per 8 weights. llama.cpp rounds the activations to 8 bits (Q8_0/Q8_K); 16 bits
//! keep them within 2^-16 of their block's largest magnitude, so a product differs from the
//! dequantised weights' f32 product by at most `sum |w| * scale / 2` per block (the bound the
//! tests check), about 3e-5 of it, rather than 1e-3 or more.

use std::arch::x86_64::*;

use super::matmul::sum_lanes;
use crate::quant::{scale_min_k4, BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8_0, QuantBlock, QK};

/// Rows of `x` of `k` values each as `d[b] * q[i]` for block `b` of 32 (`k` a whole number of
/// blocks), with `sums[b] = d[b] * sum(q of block b)` for the types that subtract a minimum.
pub struct Rows16 {
    pub k: usize,
    q: Vec<i16>,
    d: Vec<f32>,
    sums: Vec<f32>,
}

/// The largest magnitude of a block maps to this.
const Q16_MAX: f32 = 32767.0;

impl Rows16 {
    /// `x` (`[t, k]`) rounded to nearest per block: the largest magnitude becomes 32767.
    pub fn quantise(x: &[f32], k: usize) -> Rows16 {
        assert!(k.is_multiple_of(QK) && x.len().is_multiple_of(k));
        let blocks = x.len() / QK;
        let mut r = Rows16 {
            k,
            q: Vec::with_capacity(x.len()),
            d: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
        };
        for block in x.chunks_exact(QK) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / Q16_MAX;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for &v in block {
                // Half away from zero, as `round` (a libm call on baseline x86_64) would.
                let q = (v * id + 0.5f32.copysign(v)).clamp(-Q16_MAX, Q16_MAX) as i16;
                sum += i32::from(q);
                r.q.push(q);
            }
            r.d.push(d);
            r.sums.push(d * sum as f32);
        }
        r
    }

    fn rows(&self) -> usize {
        self.q.len() / self.k
    }
}

/// 32 weights of a quantised type as 16-bit integers with their scales: weight `i` is
/// `scale[i / 16] * w[i] - min`.
pub struct Sub32 {
    w: [__m256i; 2],
    scale: [f32; 2],
    min: f32,
}

/// A quantised type whose sub-blocks of 32 weights the kernel widens to 16-bit integers.
pub trait Widen16: QuantBlock {
    /// Whether any sub-block has a nonzero `min` (the kernel then needs the rows' sums).
    const HAS_MIN: bool = false;
    /// Whether both halves of every sub-block share one scale (the kernel then adds their
    /// integer products before converting them).
    const ONE_SCALE: bool = true;
    /// Calls `f(j, weights 32 j .. 32 j + 32)` for each sub-block of the block in turn, with
    /// what the sub-blocks share (scales, loads) computed once.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    unsafe fn each_sub32(&self, f: impl FnMut(usize, Sub32));
}

/// 32 bytes as two vectors of 16 i16, by sign extension or (`unsigned`) zero extension.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn to_i16(v: __m256i, unsigned: bool) -> [__m256i; 2] {
    let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    if unsigned {
        [_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)]
    } else {
        [_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)]
    }
}

/// 32 bytes at `p`.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(p: &[u8; 32]) -> __m256i {
    // SAFETY: 32 bytes read from a 32-byte array.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// The 32-byte chunk `i` of `bytes`.
#[inline(always)]
fn chunk32(bytes: &[u8], i: usize) -> &[u8; 32] {
    bytes[32 * i..][..32].try_into().expect("32 bytes")
}

impl Widen16 for BlockQ8_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn each_sub32(&self, mut f: impl FnMut(usize, Sub32)) {
        let q = load32(bytemuck::cast_ref(&self.qs));
        let d = self.d.to_f32();
        f(
            0,
            Sub32 {
                w: to_i16(q, false),
                scale: [d; 2],
                min: 0.0,
            },
        );
    }
}

impl Widen16 for BlockQ4_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn each_sub32(&self, mut f: impl FnMut(usize, Sub32)) {
        // SAFETY: 16 bytes read from the block's 16-byte `qs`.
        let q = unsafe { _mm_loadu_si128(self.qs.as_ptr().cast()) };
        let nib = _mm_set1_epi8(0xF);
        let lo = _mm_and_si128(q, nib);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), nib);
        let eight = _mm256_set1_epi16(8);
        let d = self.d.to_f32();
        f(
            0,
            Sub32 {
                w: [lo, hi].map(|v| _mm256_sub_epi16(_mm256_cvtepu8_epi16(v), eight)),
                scale: [d; 2],
                min: 0.0,
            },
        );
    }
}

impl Widen16 for BlockQ4K {
    const HAS_MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn each_sub32(&self, mut f: impl FnMut(usize, Sub32)) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        let nib = _mm256_set1_epi8(0xF);
        // Sub-blocks 2i and 2i + 1: the low and high nibbles of 32 bytes.
        for i in 0..4 {
            let q = load32(chunk32(&self.qs, i));
            let halves = [
                _mm256_and_si256(q, nib),
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib),
            ];
            for (h, q) in halves.into_iter().enumerate() {
                let j = 2 * i + h;
                let (sc, m) = scale_min_k4(j, &self.scales);
                f(
                    j,
                    Sub32 {
                        w: to_i16(q, true),
                        scale: [d * sc; 2],
                        min: dmin * m,
                    },
                );
            }
        }
    }
}

impl Widen16 for BlockQ6K {
    const ONE_SCALE: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn each_sub32(&self, mut f: impl FnMut(usize, Sub32)) {
        // Weights 32 j.. are `l + 32 k` of half `h` (j = 4 h + k, l < 32): the low 4 bits from
        // `ql` (byte l + 32 (k % 2) of the half's 64, the high nibble for k >= 2), the high 2
        // from `qh` (byte l of the half's 32, bits 2k), scale `sc[8 h + l / 16 + 2 k]`.
        let d = self.d.to_f32();
        let (nib, three, bias) = (
            _mm256_set1_epi8(0xF),
            _mm256_set1_epi8(3),
            _mm256_set1_epi8(32),
        );
        for h in 0..2 {
            let ql = [
                load32(chunk32(&self.ql, 2 * h)),
                load32(chunk32(&self.ql, 2 * h + 1)),
            ];
            let qh = load32(chunk32(&self.qh, h));
            let his = [
                qh,
                _mm256_srli_epi16::<2>(qh),
                _mm256_srli_epi16::<4>(qh),
                _mm256_srli_epi16::<6>(qh),
            ];
            for (k, hi) in his.into_iter().enumerate() {
                let lo = if k < 2 {
                    ql[k]
                } else {
                    _mm256_srli_epi16::<4>(ql[k - 2])
                };
                let lo = _mm256_and_si256(lo, nib);
                let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(hi, three));
                let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), bias);
                let sc = &self.scales[8 * h + 2 * k..][..2];
                f(
                    4 * h + k,
                    Sub32 {
                        w: to_i16(q, false),
                        scale: [d * f32::from(sc[0]), d * f32::from(sc[1])],
                        min: 0.0,
                    },
                );
            }
        }
    }
}

/// Weight rows `w` (`[rows, k]`) into `out` (`[rows, t]`) against the `t` rows of `x`, up to
/// four rows of `x` per pass over a weight row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dots_task<B: Widen16>(x: &Rows16, w: &[B], out: &mut [f32]) {
    let (t, per_row) = (x.rows(), x.k / B::LEN);
    for (wr, out_r) in w.chunks_exact(per_row).zip(out.chunks_exact_mut(t)) {
        for (g, dst) in out_r.chunks_mut(4).enumerate() {
            let r0 = 4 * g;
            // SAFETY: the caller checked the CPU.
            unsafe {
                match dst.len() {
                    4 => dst.copy_from_slice(&dots::<B, 4>(wr, x, r0)),
                    3 => dst.copy_from_slice(&dots::<B, 3>(wr, x, r0)),
                    2 => dst.copy_from_slice(&dots::<B, 2>(wr, x, r0)),
                    _ => dst.copy_from_slice(&dots::<B, 1>(wr, x, r0)),
                }
            }
        }
    }
}

/// Dot products of one weight row with rows `r0 .. r0 + R` of `x`: per sub-block of 32, two
/// `vpmaddwd` per row give eight i32 lanes per half, converted to f32 and scaled by the weight's
/// and the row's scales into two accumulators per row (four for one or two rows, alternating
/// by sub-block, so that enough FMA chains are in flight).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots<B: Widen16, const R: usize>(w: &[B], x: &Rows16, r0: usize) -> [f32; R] {
    let k = x.k;
    assert!(x.q.len() >= (r0 + R) * k);
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut mins = [0.0f32; R];
    for (b, block) in w.iter().enumerate() {
        // Each sub-block's minimum term, summed once per block: a running sum would make
        // every sub-block wait on the previous one's add.
        let mut block_mins = [[0.0f32; 8]; R];
        // SAFETY: the caller checked the CPU.
        unsafe {
            block.each_sub32(|j, s| {
                let at = b * B::LEN + j * QK;
                for (r, (acc_r, min_r)) in acc.iter_mut().zip(&mut block_mins).enumerate() {
                    let row = (r0 + r) * k + at;
                    let xq: &[i16; QK] = x.q[row..][..QK].try_into().unwrap();
                    let xb = row / QK;
                    // 16 i16 (32 bytes) read from each half of `xq`.
                    let (x0, x1) = (
                        _mm256_loadu_si256(xq.as_ptr().cast()),
                        _mm256_loadu_si256(xq[16..].as_ptr().cast()),
                    );
                    let (p0, p1) = (_mm256_madd_epi16(s.w[0], x0), _mm256_madd_epi16(s.w[1], x1));
                    let d = x.d[xb];
                    if B::ONE_SCALE {
                        // At most 4 * 128 * 32767 per lane: exact in i32 and in f32.
                        let p = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
                        acc_r[0] = _mm256_fmadd_ps(p, _mm256_set1_ps(s.scale[0] * d), acc_r[0]);
                    } else {
                        let (p0, p1) = (_mm256_cvtepi32_ps(p0), _mm256_cvtepi32_ps(p1));
                        acc_r[0] = _mm256_fmadd_ps(p0, _mm256_set1_ps(s.scale[0] * d), acc_r[0]);
                        acc_r[1] = _mm256_fmadd_ps(p1, _mm256_set1_ps(s.scale[1] * d), acc_r[1]);
                    }
                    if B::HAS_MIN {
                        min_r[j % 8] = s.min * x.sums[xb];
                    }
                }
                if R <= 2 {
                    // The other pair of accumulators next time (constant indices: the
                    // accumulators stay in registers).
                    for a in &mut acc {
                        *a = [a[2], a[3], a[0], a[1]];
                    }
                }
            });
        }
        if B::HAS_MIN {
            for (m, block) in mins.iter_mut().zip(&block_mins) {
                *m += sum_lanes(block);
            }
        }
    }
    std::array::from_fn(|r| {
        let mut lanes = [0.0f32; 8];
        let [a, b, c, d] = acc[r];
        let sum = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
        // SAFETY: 8 floats stored into `lanes`.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        sum_lanes(&lanes) - mins[r]
    })
}
