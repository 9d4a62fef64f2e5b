//! Decode's dot products with quantised weights on AVX2, in integers, as llama.cpp computes
//! them but with 16-bit activations: each row of `x` is rounded to 16-bit integers with an f32
//! scale per block of the weight type (`Rows16`: 32 values for Q8_0 and Q4_0, a 256-value
//! super-block for the k-quants), the weights are widened to 16-bit integers in registers, and
//! `vpmaddwd` multiplies 16 pairs per instruction. The k-quants' 6- or 8-bit sub-block scales
//! are integers too, so a super-block's products are summed in i32 and converted to f32 once.
//!
//! llama.cpp rounds activations to 8 bits; 16 bits keep each within half a step (2^-16 of its
//! block's largest magnitude), so a product differs from the dequantised weights' f32 product
//! by at most `matmul::activation_rounding` (the bound the tests check) beyond f32 rounding.
//! Every integer sum below is bounded where it is formed so that it fits its i32 lane.

use std::arch::x86_64::*;

use super::matmul::sum_lanes;
use crate::quant::{
    scale_min_k4, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0, QuantBlock, QK, QK_K,
};

/// Rows of `x` (`k` values each) as `d[b] * q[i]`, `b` the block of `block` values holding
/// value `i`; `sums[c]` is the sum of `q` over the 32 values of chunk `c` (for Q4_K's minima).
pub struct Rows16 {
    k: usize,
    q: Vec<i16>,
    d: Vec<f32>,
    sums: Vec<i32>,
}

/// The largest magnitude of a block maps to this.
const Q16_MAX: f32 = 32767.0;

impl Rows16 {
    /// `x` (`[t, k]`) rounded to nearest per block of `block` values (which divides `k`): the
    /// largest magnitude of each becomes 32767. None if a value is infinite or NaN.
    pub fn quantise(x: &[f32], k: usize, block: usize) -> Option<Rows16> {
        assert!(block.is_multiple_of(QK) && k.is_multiple_of(block));
        assert!(x.len().is_multiple_of(k));
        let mut r = Rows16 {
            k,
            q: Vec::with_capacity(x.len()),
            d: Vec::with_capacity(x.len() / block),
            sums: Vec::with_capacity(x.len() / QK),
        };
        for values in x.chunks_exact(block) {
            // NaN is not below infinity either, so one comparison per value finds both.
            let amax = values.iter().try_fold(0.0f32, |m, v| {
                (v.abs() < f32::INFINITY).then(|| m.max(v.abs()))
            })?;
            let d = amax / Q16_MAX;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for chunk in values.chunks_exact(QK) {
                let mut sum = 0i32;
                for &v in chunk {
                    let q = (v * id).round().clamp(-Q16_MAX, Q16_MAX) as i16;
                    sum += i32::from(q);
                    r.q.push(q);
                }
                r.sums.push(sum);
            }
            r.d.push(d);
        }
        Some(r)
    }

    fn rows(&self) -> usize {
        self.q.len() / self.k
    }
}

/// `R` rows of `x` as one weight row's blocks see them: block `b` of each row (the weight
/// type's length) has values `q[r][b * LEN..]`, scale `d[r][b]` and per-32 sums
/// `sums[r][b * LEN / 32..]`.
pub struct Rows<'a, const R: usize> {
    q: [&'a [i16]; R],
    d: [&'a [f32]; R],
    sums: [&'a [i32]; R],
}

impl<const R: usize> Rows<'_, R> {
    /// Row `r`'s 32 values from `at` as two vectors of 16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load32(&self, r: usize, at: usize) -> [__m256i; 2] {
        let q: &[i16; QK] = self.q[r][at..][..QK].try_into().expect("32 values");
        // SAFETY: 16 i16 (32 bytes) read from each half of `q`.
        unsafe {
            [
                _mm256_loadu_si256(q.as_ptr().cast()),
                _mm256_loadu_si256(q[16..].as_ptr().cast()),
            ]
        }
    }
}

/// A quantised type whose blocks the kernel multiplies into rows of 16-bit activations, which
/// share one scale per block of the type's length ([`Rows16::quantise`]'s `block`).
pub trait Dot16: QuantBlock {
    /// Adds the products of this block, block `b` of its row, with the `R` rows into `acc`
    /// (eight lanes per row to be summed), and its minimum terms into `mins` (subtracted).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    unsafe fn accumulate<const R: usize>(
        &self,
        x: &Rows<'_, R>,
        b: usize,
        acc: &mut [__m256; R],
        mins: &mut [f32; R],
    );
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

/// The 32-byte chunk `i` of `bytes`, loaded.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_chunk(bytes: &[u8], i: usize) -> __m256i {
    let c: &[u8; 32] = bytes[32 * i..][..32].try_into().expect("32 bytes");
    // SAFETY: 32 bytes read from a 32-byte array.
    unsafe { _mm256_loadu_si256(c.as_ptr().cast()) }
}

/// `w . x` for 32 i16 weights and row `r`'s 32 values from `at`: eight i32 lanes, each the sum
/// of four products.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn madd32<const R: usize>(w: [__m256i; 2], x: &Rows<'_, R>, r: usize, at: usize) -> __m256i {
    let [x0, x1] = x.load32(r, at);
    _mm256_add_epi32(_mm256_madd_epi16(w[0], x0), _mm256_madd_epi16(w[1], x1))
}

/// The 32-weight types with one f16 scale per block: `acc += d * dx * (w . x)`, the four
/// products per lane at most 128 * 32767 each (exact in i32, and in f32 below 2^24).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn accumulate32<const R: usize>(
    w: [__m256i; 2],
    d: f32,
    x: &Rows<'_, R>,
    b: usize,
    acc: &mut [__m256; R],
) {
    for (r, acc) in acc.iter_mut().enumerate() {
        let p = _mm256_cvtepi32_ps(madd32(w, x, r, QK * b));
        *acc = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x.d[r][b]), *acc);
    }
}

impl Dot16 for BlockQ8_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate<const R: usize>(
        &self,
        x: &Rows<'_, R>,
        b: usize,
        acc: &mut [__m256; R],
        _: &mut [f32; R],
    ) {
        let w = to_i16(load_chunk(bytemuck::cast_slice(&self.qs), 0), false);
        accumulate32(w, self.d.to_f32(), x, b, acc);
    }
}

impl Dot16 for BlockQ4_0 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate<const R: usize>(
        &self,
        x: &Rows<'_, R>,
        b: usize,
        acc: &mut [__m256; R],
        _: &mut [f32; R],
    ) {
        // SAFETY: 16 bytes read from the block's 16-byte `qs`.
        let q = unsafe { _mm_loadu_si128(self.qs.as_ptr().cast()) };
        let nib = _mm_set1_epi8(0xF);
        let (lo, hi) = (
            _mm_and_si128(q, nib),
            _mm_and_si128(_mm_srli_epi16::<4>(q), nib),
        );
        let eight = _mm256_set1_epi16(8);
        let w = [lo, hi].map(|v| _mm256_sub_epi16(_mm256_cvtepu8_epi16(v), eight));
        accumulate32(w, self.d.to_f32(), x, b, acc);
    }
}

/// Q4_K's and Q5_K's super-block: `d * dx * sum_j sc_j (q . x)_j - dmin * dx * sum_j m_j
/// sum(x)_j` over eight sub-blocks of 32, `q` the 4-bit nibbles of `qs` and, for Q5_K, a fifth
/// bit from `qh` (bit `j` of byte `l` for weight `l` of sub-block `j`). Each lane sums 32
/// products of at most 31 * 63 * 32767, under 2^31.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_k4<const R: usize>(
    (d, dmin): (f32, f32),
    scales: &[u8; 12],
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
    x: &Rows<'_, R>,
    b: usize,
    acc: &mut [__m256; R],
    mins: &mut [f32; R],
) {
    let sm: [(u8, u8); 8] = std::array::from_fn(|j| scale_min_k4(j, scales));
    let nib = _mm256_set1_epi8(0xF);
    let high = qh.map(|h| load_chunk(h, 0));
    let mut iacc = [_mm256_setzero_si256(); R];
    // Sub-blocks 2i and 2i + 1: the low and high nibbles of 32 bytes.
    for i in 0..4 {
        let q = load_chunk(qs, i);
        let halves = [
            _mm256_and_si256(q, nib),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib),
        ];
        for (h, q) in halves.into_iter().enumerate() {
            let j = 2 * i + h;
            let q = match high {
                // 16 where bit j of the byte is set.
                Some(bits) => {
                    let bit = _mm256_set1_epi8(1 << j);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, bit), bit);
                    _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)))
                }
                None => q,
            };
            let s = _mm256_set1_epi16(i16::from(sm[j].0));
            let w = to_i16(q, true).map(|w| _mm256_mullo_epi16(w, s));
            for (r, iacc) in iacc.iter_mut().enumerate() {
                *iacc = _mm256_add_epi32(*iacc, madd32(w, x, r, QK_K * b + QK * j));
            }
        }
    }
    for r in 0..R {
        let dx = x.d[r][b];
        let p = _mm256_cvtepi32_ps(iacc[r]);
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx), acc[r]);
        // At most 8 * 63 * 32 * 32767.
        let sums = &x.sums[r][8 * b..][..8];
        let msum: i32 = sm.iter().zip(sums).map(|(sm, s)| i32::from(sm.1) * s).sum();
        mins[r] += dmin * dx * msum as f32;
    }
}

impl Dot16 for BlockQ4K {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate<const R: usize>(
        &self,
        x: &Rows<'_, R>,
        b: usize,
        acc: &mut [__m256; R],
        mins: &mut [f32; R],
    ) {
        let d = (self.d.to_f32(), self.dmin.to_f32());
        // SAFETY: the caller checked the CPU.
        unsafe { accumulate_k4(d, &self.scales, &self.qs, None, x, b, acc, mins) }
    }
}

impl Dot16 for BlockQ5K {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate<const R: usize>(
        &self,
        x: &Rows<'_, R>,
        b: usize,
        acc: &mut [__m256; R],
        mins: &mut [f32; R],
    ) {
        let d = (self.d.to_f32(), self.dmin.to_f32());
        let qh = Some(&self.qh);
        // SAFETY: the caller checked the CPU.
        unsafe { accumulate_k4(d, &self.scales, &self.qs, qh, x, b, acc, mins) }
    }
}

impl Dot16 for BlockQ6K {
    /// Per half of 128 weights, `d * dx * sum_j sc_j ((q - 32) . x)_j` over its eight
    /// sub-blocks of 16: each lane sums 16 products of at most 32 * 128 * 32767, under 2^31.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate<const R: usize>(
        &self,
        x: &Rows<'_, R>,
        b: usize,
        acc: &mut [__m256; R],
        _: &mut [f32; R],
    ) {
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
            let ql = [load_chunk(&self.ql, 2 * h), load_chunk(&self.ql, 2 * h + 1)];
            let qh = load_chunk(&self.qh, h);
            let his = [
                qh,
                _mm256_srli_epi16::<2>(qh),
                _mm256_srli_epi16::<4>(qh),
                _mm256_srli_epi16::<6>(qh),
            ];
            let mut iacc = [_mm256_setzero_si256(); R];
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
                let w = to_i16(q, false);
                let w = [
                    _mm256_mullo_epi16(w[0], _mm256_set1_epi16(i16::from(sc[0]))),
                    _mm256_mullo_epi16(w[1], _mm256_set1_epi16(i16::from(sc[1]))),
                ];
                for (r, iacc) in iacc.iter_mut().enumerate() {
                    let at = QK_K * b + QK * (4 * h + k);
                    *iacc = _mm256_add_epi32(*iacc, madd32(w, x, r, at));
                }
            }
            for r in 0..R {
                let p = _mm256_cvtepi32_ps(iacc[r]);
                acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x.d[r][b]), acc[r]);
            }
        }
    }
}

/// Weight rows `w` (`[rows, k]`) into `out` (`[rows, t]`) against the `t` rows of `x`
/// (quantised per block of `B::LEN`), up to four rows of `x` per pass over a weight row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dots_task<B: Dot16>(x: &Rows16, w: &[B], out: &mut [f32]) {
    assert_eq!(
        x.q.len(),
        x.d.len() * B::LEN,
        "rows quantised per block of B::LEN"
    );
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

/// Dot products of one weight row with rows `r0 .. r0 + R` of `x`, block by block, into two
/// sets of accumulators taken in turn (so that consecutive blocks' FMAs do not wait on each
/// other).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots<B: Dot16, const R: usize>(w: &[B], x: &Rows16, r0: usize) -> [f32; R] {
    let k = x.k;
    let row = |r: usize| r0 + r;
    let rows = Rows {
        q: std::array::from_fn(|r| &x.q[row(r) * k..][..k]),
        d: std::array::from_fn(|r| &x.d[row(r) * k / B::LEN..][..k / B::LEN]),
        sums: std::array::from_fn(|r| &x.sums[row(r) * k / QK..][..k / QK]),
    };
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    let mut mins = [0.0f32; R];
    for (b, block) in w.iter().enumerate() {
        // SAFETY: the caller checked the CPU.
        unsafe { block.accumulate(&rows, b, &mut acc[0], &mut mins) };
        acc.swap(0, 1);
    }
    std::array::from_fn(|r| {
        let mut lanes = [0.0f32; 8];
        let sum = _mm256_add_ps(acc[0][r], acc[1][r]);
        // SAFETY: 8 floats stored into `lanes`.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        sum_lanes(&lanes) - mins[r]
    })
}
