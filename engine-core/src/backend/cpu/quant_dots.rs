//! Decode's dot products with quantised weights on AVX2, in integers, as llama.cpp computes
//! them: each row of `x` is rounded to 8-bit integers with an f32 scale per block of the
//! weight type (`Rows8`: 32 values for Q8_0 and Q4_0, a 256-value super-block for the
//! k-quants, as llama.cpp's `q8_0` and `q8_K` rows), the weights stay 8-bit (their nibbles or
//! bit fields unpacked in registers), and `vpmaddubsw` multiplies 32 unsigned-by-signed pairs
//! per instruction. The k-quants' 6- or 8-bit sub-block scales are integers too, applied by
//! the `vpmaddwd` that widens the pair sums, so a super-block's products are summed in i32 and
//! converted to f32 once.
//!
//! Rounding to 8 bits moves each activation by at most half a step (1/254 of its block's
//! largest magnitude), so a product differs from the dequantised weights' f32 product by at
//! most `matmul::activation_rounding` (the bound the tests check) beyond f32 rounding. Every
//! integer sum below is bounded where it is formed so that it fits its i16 or i32 lane.

use std::arch::x86_64::*;

use super::matmul::{avx2_available, prefetch_ahead, sum_lanes};
use super::quant_rows::{Rows8, SUM_LEN};
use super::vnni_dots;
use crate::quant::{
    BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, QuantBlock, IQ4_VALUES, QK, QK_K,
};

/// `R` rows of `x` as one weight row's blocks see them: block `b` of each row (the weight
/// type's length) has values `q[r][b * LEN..]`, scale `d[r][b]` and per-16 sums
/// `sums[r][b * LEN / 16..]`.
pub struct Rows<'a, const R: usize> {
    q: [&'a [i8]; R],
    d: [&'a [f32]; R],
    sums: [&'a [i16]; R],
}

impl<const R: usize> Rows<'_, R> {
    /// Row `r`'s 32 values from `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load32(&self, r: usize, at: usize) -> __m256i {
        let q: &[i8; QK] = self.q[r][at..][..QK].try_into().expect("32 values");
        // SAFETY: 32 bytes read from `q`.
        unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
    }

    /// Row `r`'s 64 values from `at`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    fn load64(&self, r: usize, at: usize) -> __m512i {
        let q: &[i8; 2 * QK] = self.q[r][at..][..2 * QK].try_into().expect("64 values");
        // SAFETY: 64 bytes read from `q`.
        unsafe { _mm512_loadu_si512(q.as_ptr().cast()) }
    }

    /// The sum of row `r`'s values in block `b` of 32.
    #[inline]
    fn sum32(&self, r: usize, b: usize) -> i32 {
        let at = b * QK / SUM_LEN;
        i32::from(self.sums[r][at]) + i32::from(self.sums[r][at + 1])
    }

    /// Row `r`'s 16 sums of super-block `b` (of 256 values).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn sums16(&self, r: usize, b: usize) -> __m256i {
        let s: &[i16; QK_K / SUM_LEN] = self.sums[r][b * QK_K / SUM_LEN..][..QK_K / SUM_LEN]
            .try_into()
            .expect("16 sums");
        // SAFETY: 32 bytes read from `s`.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }
}

/// A quantised type whose blocks the kernel multiplies into rows of 8-bit activations, which
/// share one scale per block of the type's length ([`Rows8::quantise`]'s `block`).
pub trait Dot8: QuantBlock {
    /// The block's weights as the kernel multiplies them. Inlined into the kernel, which has
    /// the CPU features (AVX2, FMA, F16C) its intrinsics need.
    fn unpack(&self) -> Unpacked;

    /// Decode's products (one row of `x`) for the leading whole groups of weight rows of `w`
    /// (`[out.len(), x.k]`), where the type has a kernel on `isa` that takes several rows at
    /// once (eight on AVX2, sixteen on VNNI): their results go to the start of `out`, and the
    /// return value says how many rows that was (the rest go through `unpack`). Inlined into
    /// the kernel like `unpack`.
    #[inline(always)]
    fn row_groups(_isa: Isa, _w: &[Self], _x: &Rows8, _out: &mut [f32]) -> usize {
        0
    }

    /// Whether [`Self::row_groups`] takes any rows: then several rows of `x` go through it one
    /// at a time ([`row_groups_each`]), so that each gets its one-row products.
    const GROUPED: bool = false;
}

/// A block as the kernel multiplies it. It lives in registers only, made and taken apart in
/// one inlined `accumulate` or `accumulate_wide` (so the variants' sizes differ at no cost).
#[allow(clippy::large_enum_variant)]
pub enum Unpacked {
    /// 32 weights, weight `i` being `d * q[i] + offset`: `q` unsigned bytes, or (`signed`)
    /// signed levels whose magnitudes multiply `x` with their signs moved onto it.
    Block32 {
        q: __m256i,
        signed: bool,
        d: f32,
        offset: f32,
    },
    Super(SuperBlock),
}

/// A super-block of 256 weights in 8 chunks of 32 (16 sub-blocks of 16): weight `l` of
/// sub-block `g` is `d * sc[g] * q[l] - dm * m[g]`, `q` unsigned bytes or (`signed`) signed
/// levels, `sc` and `m` one i16 lane per sub-block.
pub struct SuperBlock {
    chunks: [__m256i; QK_K / QK],
    signed: bool,
    sc: __m256i,
    m: Option<__m256i>,
    d: f32,
    dm: f32,
}

impl Unpacked {
    fn unsigned(q: __m256i, d: f32, offset: f32) -> Unpacked {
        Unpacked::Block32 {
            q,
            signed: false,
            d,
            offset,
        }
    }

    fn signed(q: __m256i, d: f32) -> Unpacked {
        Unpacked::Block32 {
            q,
            signed: true,
            d,
            offset: 0.0,
        }
    }
}

/// `u` and `x` as `vpmaddubsw` takes them: for signed levels `v`, their magnitudes and `x`
/// with their signs (a magnitude is at most 128, -128's, which is 128 as an unsigned byte).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signs_moved(v: __m256i, x: __m256i, signed: bool) -> (__m256i, __m256i) {
    match signed {
        true => (_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v)),
        false => (v, x),
    }
}

/// Adds the products of `block`, block `b` of its row, with the `R` rows into `acc` (eight
/// lanes per row to be summed), and a 32-weight block's offset terms into `mins`
/// (subtracted).
///
/// Not a `target_feature` function, so that it is always inlined into its caller (see
/// [`scaled_chunks`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline(always)]
unsafe fn accumulate<B: Dot8, const R: usize>(
    block: &B,
    x: &Rows<'_, R>,
    b: usize,
    acc: &mut [__m256; R],
    mins: &mut [f32; R],
) {
    // SAFETY: the caller has the features.
    unsafe {
        match block.unpack() {
            Unpacked::Block32 {
                q,
                signed,
                d,
                offset,
            } => {
                accumulate32(q, signed, d, x, b, acc);
                if offset != 0.0 {
                    offsets(-offset, x, b, mins);
                }
            }
            Unpacked::Super(s) => finish_k(scaled_chunks(&s, x, b), &s, x, b, acc),
        }
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

/// `u . s` for 32 unsigned bytes `u` and signed bytes `s`, as eight i32 lanes each summing
/// four products, the pairs first summed in i16 (`vpmaddubsw` saturates: every caller keeps
/// `2 * max u * 127` within i16) and then multiplied by `scale` (16 i16 lanes) and summed in
/// pairs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_us(u: __m256i, s: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale)
}

/// The 32-weight types with one f16 scale per block: `acc += d * dx * (q . x)` (with
/// `signed`, their magnitudes and `x` with their signs); four products per lane of at most
/// 128 * 127 each.
///
/// Not a `target_feature` function, so that it is always inlined into its caller (see
/// [`scaled_chunks`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline(always)]
unsafe fn accumulate32<const R: usize>(
    q: __m256i,
    signed: bool,
    d: f32,
    x: &Rows<'_, R>,
    b: usize,
    acc: &mut [__m256; R],
) {
    // SAFETY: the caller has the features.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        for (r, acc) in acc.iter_mut().enumerate() {
            let (u, xr) = signs_moved(q, x.load32(r, QK * b), signed);
            let p = _mm256_cvtepi32_ps(dot_us(u, xr, ones));
            *acc = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x.d[r][b]), *acc);
        }
    }
}

/// Q4_0's, Q4_1's, IQ4_NL's and IQ4_XS's 32 weights from 16 bytes: the low nibbles are
/// weights 0..16, the high ones 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(qs: &[u8; QK / 2]) -> __m256i {
    // SAFETY: 16 bytes read from `qs`.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let nib = _mm_set1_epi8(0xF);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16::<4>(q), nib),
        _mm_and_si128(q, nib),
    )
}

/// Q5_0's and Q5_1's 32 weights: the nibbles with bit `i` of `qh` as weight `i`'s fifth bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fives(qh: [u8; 4], qs: &[u8; QK / 2]) -> __m256i {
    // Byte i of the vector takes byte i / 8 of `qh` and keeps bit i % 8 of it.
    let bytes = _mm256_shuffle_epi8(
        _mm256_set1_epi32(i32::from_le_bytes(qh)),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_or_si256(nibbles(qs), _mm256_and_si256(set, _mm256_set1_epi8(16)))
}

/// IQ4_NL's and IQ4_XS's signed levels of 32 nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_levels(nibbles: __m256i) -> __m256i {
    let table: [i8; 16] = IQ4_VALUES;
    // SAFETY: 16 bytes read from `table`.
    let table = unsafe { _mm_loadu_si128(table.as_ptr().cast()) };
    _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles)
}

/// Adds `scale * dx * sum(x)` over the 32 values of each row's block `b` (of 32) to `mins`.
#[inline]
fn offsets<const R: usize>(scale: f32, x: &Rows<'_, R>, b: usize, mins: &mut [f32; R]) {
    for (r, m) in mins.iter_mut().enumerate() {
        *m += scale * x.d[r][b] * x.sum32(r, b) as f32;
    }
}

// SAFETY (every `unpack`): it runs inlined into `accumulate`, whose caller checked the CPU.

impl Dot8 for BlockQ8_0 {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let q = unsafe { load_chunk(bytemuck::cast_slice(&self.qs), 0) };
        Unpacked::signed(q, self.d.to_f32())
    }
}

/// `q - zero` in each byte: Q4_0's and Q5_0's levels as signed weights, so that their offset
/// needs no sum of the activations (which cost a scalar product per block and row).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn centred(q: __m256i, zero: i8) -> __m256i {
    _mm256_sub_epi8(q, _mm256_set1_epi8(zero))
}

impl Dot8 for BlockQ4_0 {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        Unpacked::signed(unsafe { centred(nibbles(&self.qs), 8) }, self.d.to_f32())
    }

    const GROUPED: bool = true;

    #[inline(always)]
    fn row_groups(isa: Isa, w: &[Self], x: &Rows8, out: &mut [f32]) -> usize {
        // SAFETY: the kernels' callers checked that the CPU has `isa`'s instructions.
        unsafe {
            match isa {
                Isa::Vnni => vnni_dots::q4_0_groups(w, x, out),
                Isa::Avx2 | Isa::Avx512 => q4_0_groups(w, x, out),
            }
        }
    }
}

/// Weight rows `8 g .. 8 g + 8`, block `b`, as four registers of eight 32-bit lanes: register
/// `j` holds bytes `4 j .. 4 j + 4` of each row's 16 (lane `r` row `r`), the nibbles of
/// weights `4 j ..` (low) and `16 + 4 j ..` (high).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0_columns(blocks: [&BlockQ4_0; 8]) -> [__m256i; 4] {
    // SAFETY: 16 bytes read from each block's `qs`.
    let load = |r: usize| unsafe { _mm_loadu_si128(blocks[r].qs.as_ptr().cast()) };
    let pair =
        |r: usize| _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(load(r)), load(r + 4));
    // A 4x4 transpose of 32-bit words within each 128-bit half (rows 0..4 low, 4..8 high).
    let (y0, y1, y2, y3) = (pair(0), pair(1), pair(2), pair(3));
    let (t0, t1) = (_mm256_unpacklo_epi32(y0, y1), _mm256_unpackhi_epi32(y0, y1));
    let (t2, t3) = (_mm256_unpacklo_epi32(y2, y3), _mm256_unpackhi_epi32(y2, y3));
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// [`Dot8::row_groups`] for Q4_0: eight weight rows against one row of `x` at a time, each
/// register holding four weights of every row (`q4_0_columns`) and multiplying them by the
/// same four activations, broadcast. Against one row at a time (`unpack`), each block's
/// scalar work (its scale, the activation's scale, the conversions) is done once for eight
/// rows and the signs need no moving: the unsigned nibbles `u` multiply `x`, and the offset
/// (`q = u - 8`) subtracts `8 * sum(x)` once per block. The integer sums are exact; each
/// row's f32 sum takes its blocks in order, so a row's result does not depend on the group or
/// task it falls in.
///
/// An i16 lane sums eight `vpmaddubsw` pairs of at most 2 * 15 * 127: 30480.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0_groups(w: &[BlockQ4_0], x: &Rows8, out: &mut [f32]) -> usize {
    if x.rows() != 1 {
        return 0;
    }
    let per_row = x.k / QK;
    let (nib, ones) = (_mm256_set1_epi8(0xF), _mm256_set1_epi16(1));
    let groups = out.len() / 8;
    for (g, dst) in out.chunks_exact_mut(8).enumerate() {
        let rows = &w[8 * g * per_row..][..8 * per_row];
        // The next group's bytes, spread over this group's blocks.
        let ahead = rows.as_ptr_range().end.cast::<i8>();
        let stride = 8 * size_of::<BlockQ4_0>();
        let mut acc = _mm256_setzero_ps();
        for b in 0..per_row {
            for line in (0..stride).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(stride * b + line));
            }
            let blocks: [&BlockQ4_0; 8] = std::array::from_fn(|r| &rows[r * per_row + b]);
            let xq: &[i8; QK] = x.q[QK * b..][..QK].try_into().expect("32 values");
            let word = |i: usize| {
                let bytes: &[i8; 4] = xq[4 * i..][..4].try_into().expect("4 values");
                _mm256_set1_epi32(i32::from_le_bytes(bytes.map(|v| v as u8)))
            };
            let mut pairs = _mm256_setzero_si256();
            for (j, &q) in q4_0_columns(blocks).iter().enumerate() {
                let low = _mm256_and_si256(q, nib);
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(low, word(j)));
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(high, word(4 + j)));
            }
            let dots = _mm256_sub_epi32(
                _mm256_madd_epi16(pairs, ones),
                _mm256_set1_epi32(8 * (i32::from(x.sums[2 * b]) + i32::from(x.sums[2 * b + 1]))),
            );
            let d = _mm_set_epi16(
                blocks[7].d.to_bits() as i16,
                blocks[6].d.to_bits() as i16,
                blocks[5].d.to_bits() as i16,
                blocks[4].d.to_bits() as i16,
                blocks[3].d.to_bits() as i16,
                blocks[2].d.to_bits() as i16,
                blocks[1].d.to_bits() as i16,
                blocks[0].d.to_bits() as i16,
            );
            let scale = _mm256_mul_ps(_mm256_cvtph_ps(d), _mm256_set1_ps(x.d[b]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc);
        }
        // SAFETY: eight floats written to `dst`.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), acc) };
    }
    8 * groups
}

impl Dot8 for BlockQ4_1 {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let q = unsafe { nibbles(&self.qs) };
        Unpacked::unsigned(q, self.d.to_f32(), self.m.to_f32())
    }
}

impl Dot8 for BlockQ5_0 {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let q = unsafe { centred(fives(self.qh, &self.qs), 16) };
        Unpacked::signed(q, self.d.to_f32())
    }
}

impl Dot8 for BlockQ5_1 {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let q = unsafe { fives(self.qh, &self.qs) };
        Unpacked::unsigned(q, self.d.to_f32(), self.m.to_f32())
    }
}

impl Dot8 for BlockIq4Nl {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let q = unsafe { iq4_levels(nibbles(&self.qs)) };
        Unpacked::signed(q, self.d.to_f32())
    }
}

impl Dot8 for BlockIq4Xs {
    /// Eight sub-blocks of 32 signed levels with scales `sc - 32` (each for both halves of
    /// 16): a pair sums to at most 2 * 128 * 127 in i16; each i32 lane sums 32 products of at
    /// most 128 * 127 * 32.
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let sc: [i16; 16] = std::array::from_fn(|g| self.scale(g / 2));
        let chunks = std::array::from_fn(|j| {
            let qs: &[u8; QK / 2] = self.qs[QK / 2 * j..][..QK / 2]
                .try_into()
                .expect("16 bytes");
            unsafe { iq4_levels(nibbles(qs)) }
        });
        Unpacked::Super(SuperBlock {
            chunks,
            signed: true,
            // SAFETY: 32 bytes read from `sc`.
            sc: unsafe { _mm256_loadu_si256(sc.as_ptr().cast()) },
            m: None,
            d: self.d.to_f32(),
            dm: 0.0,
        })
    }
}

/// The k-quants' super-block of 256 weights as 16 sub-blocks of 16 with integer scales `sc`
/// (16 i16 lanes, one per sub-block; the 32-weight sub-blocks of Q4_K, Q5_K and IQ4_XS give
/// each of their halves the same scale): `iacc += sum_g sc_g (q . x)_g` for each row, chunk
/// `c` of `chunks` holding sub-blocks `2 c` and `2 c + 1` (with `signed`, as
/// [`signs_moved`] takes them).
///
/// Not a `target_feature` function, so that it can be `inline(always)`: with `#[inline]` and
/// the features, a build for x86-64-v3 left it a call (and `accumulate` one per block), which
/// took a third of a Q4_K_M decode step on AVX2's paths (its eight registers of weights went
/// through memory); the native build left this and `scaled_pairs` calls too.
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
unsafe fn scaled_chunks<const R: usize>(s: &SuperBlock, x: &Rows<'_, R>, b: usize) -> [__m256i; R] {
    // SAFETY: the caller has AVX2.
    unsafe {
        let (sc, chunks, signed) = (s.sc, &s.chunks, s.signed);
        let halves = [
            _mm256_permute2x128_si256::<0x00>(sc, sc),
            _mm256_permute2x128_si256::<0x11>(sc, sc),
        ];
        let mut iacc = [_mm256_setzero_si256(); R];
        for (c, &q) in chunks.iter().enumerate() {
            // Sub-block 2c's scale in the low eight lanes, 2c + 1's in the high eight: the pair
            // sums of bytes 0..16 are the low 128 bits of `vpmaddubsw`'s result. Element `e` of a
            // half is its bytes 2e and 2e + 1.
            let e = (2 * c % 8) as i16 * 2;
            let pick = _mm256_set_m128i(
                _mm_set1_epi16(((e + 3) << 8) | (e + 2)),
                _mm_set1_epi16(((e + 1) << 8) | e),
            );
            let s = _mm256_shuffle_epi8(halves[c / 4], pick);
            for (r, iacc) in iacc.iter_mut().enumerate() {
                let (u, xr) = signs_moved(q, x.load32(r, QK_K * b + QK * c), signed);
                *iacc = _mm256_add_epi32(*iacc, dot_us(u, xr, s));
            }
        }
        iacc
    }
}

/// `acc += d * dx * iacc - dm * dx * sum_g m_g sum(x)_g` for each row, `m` one i16 lane per
/// sub-block of 16 of block `b`: the k-quants' minima or offsets (at most 128 * 2032 * 2 per
/// lane of `vpmaddwd`).
///
/// Not a `target_feature` function, so that it is always inlined into its caller (see
/// [`scaled_chunks`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline(always)]
unsafe fn finish_k<const R: usize>(
    iacc: [__m256i; R],
    s: &SuperBlock,
    x: &Rows<'_, R>,
    b: usize,
    acc: &mut [__m256; R],
) {
    // SAFETY: the caller has the features.
    unsafe {
        let (d, dm, m) = (s.d, s.dm, s.m);
        for r in 0..R {
            let dx = x.d[r][b];
            let p = _mm256_cvtepi32_ps(iacc[r]);
            acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx), acc[r]);
            if let Some(m) = m {
                let offsets = _mm256_cvtepi32_ps(_mm256_madd_epi16(m, x.sums16(r, b)));
                acc[r] = _mm256_fmadd_ps(offsets, _mm256_set1_ps(-dm * dx), acc[r]);
            }
        }
    }
}

/// Eight bytes, each twice, as 16 i16 lanes: a 32-weight sub-block's scale or minimum for both
/// of its halves of 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn twice(bytes: [u8; 8]) -> __m256i {
    let v = _mm_cvtsi64_si128(i64::from_le_bytes(bytes));
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v))
}

/// Q4_K's and Q5_K's eight 6-bit scales and minima, unpacked from their 12 bytes as
/// `quant::scale_min_k4` reads them, four at a time in 32-bit words: `a`, `b` and `c` are bytes
/// 0..4, 4..8 and 8..12. Scales 0..4 and minima 0..4 are the low six bits of `a` and `b`;
/// scales 4..8 take the low nibbles of `c` and the top two bits of `a`, minima 4..8 the high
/// nibbles of `c` and the top two bits of `b`.
pub(super) fn k4_scales(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes(s[4 * i..][..4].try_into().expect("4 bytes"));
    let (a, b, c) = (word(0), word(1), word(2));
    let (low6, nibble, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (c & nibble) | (((a >> 6) & top2) << 4);
    let m_hi = ((c >> 4) & nibble) | (((b >> 6) & top2) << 4);
    let join = |lo: u32, hi: u32| (u64::from(lo) | (u64::from(hi) << 32)).to_le_bytes();
    (join(a & low6, sc_hi), join(b & low6, m_hi))
}

/// Q4_K's and Q5_K's super-block: `d * sc_j * q - dmin * m_j` over eight sub-blocks of 32, `q`
/// the 4-bit nibbles of `qs` (sub-blocks 2i and 2i + 1 the low and high nibbles of the 32
/// bytes `i`) and, for Q5_K, a fifth bit from `qh` (bit `j` of byte `l` for weight `l` of
/// sub-block `j`). A pair sums to at most 2 * 31 * 127 in i16; each i32 lane sums 32 products
/// of at most 31 * 127 * 63, under 2^24.
#[inline(always)]
fn unpack_k4(
    (d, dmin): (f32, f32),
    scales: &[u8; 12],
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
) -> Unpacked {
    // SAFETY: inlined into `accumulate`, whose caller checked the CPU.
    unsafe {
        let (sc, m) = k4_scales(scales);
        let nib = _mm256_set1_epi8(0xF);
        let high = qh.map(|h| load_chunk(h, 0));
        let chunks = std::array::from_fn(|j| {
            let q = load_chunk(qs, j / 2);
            let q = if j.is_multiple_of(2) {
                q
            } else {
                _mm256_srli_epi16::<4>(q)
            };
            let q = _mm256_and_si256(q, nib);
            high.map_or(q, |bits| _mm256_or_si256(q, high_bit(bits, j, 16)))
        });
        Unpacked::Super(SuperBlock {
            chunks,
            signed: false,
            sc: twice(sc),
            m: Some(twice(m)),
            d,
            dm: dmin,
        })
    }
}

impl Dot8 for BlockQ4K {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let d = (self.d.to_f32(), self.dmin.to_f32());
        unpack_k4(d, &self.scales, &self.qs, None)
    }
}

impl Dot8 for BlockQ5K {
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        let d = (self.d.to_f32(), self.dmin.to_f32());
        unpack_k4(d, &self.scales, &self.qs, Some(&self.qh))
    }
}

/// 16 signed bytes as 16 i16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen16(bytes: [i8; 16]) -> __m256i {
    // SAFETY: 16 bytes read from `bytes`.
    _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) })
}

impl Dot8 for BlockQ6K {
    /// `d * sc_g * (q - 32)` over the 16 sub-blocks `g` of 16, `q` the unsigned 6-bit values
    /// (the offset: `32 d sc_g` per weight): a pair sums to at most 2 * 63 * 127 in i16, and
    /// each i32 lane sums 32 products of at most 63 * 127 * 128, under 2^26.
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        // Chunk c = 4 h + k of 32 weights is `l + 32 k` of half `h` (l < 32): the low 4 bits
        // from `ql` (byte l + 32 (k % 2) of the half's 64, the high nibble for k >= 2), the
        // high 2 from `qh` (byte l of the half's 32, bits 2k).
        // SAFETY: inlined into `accumulate`, whose caller checked the CPU.
        unsafe {
            let (nib, three) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
            let chunks = std::array::from_fn(|c| {
                let (h, k) = (c / 4, c % 4);
                let lo = load_chunk(&self.ql, 2 * h + k % 2);
                let lo = if k < 2 {
                    lo
                } else {
                    _mm256_srli_epi16::<4>(lo)
                };
                let shift = _mm_cvtsi32_si128(2 * k as i32);
                let hi = _mm256_srl_epi16(load_chunk(&self.qh, h), shift);
                let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(hi, three));
                _mm256_or_si256(_mm256_and_si256(lo, nib), hi)
            });
            let sc = widen16(self.scales);
            let d = self.d.to_f32();
            Unpacked::Super(SuperBlock {
                chunks,
                signed: false,
                sc,
                m: Some(sc),
                d,
                dm: 32.0 * d,
            })
        }
    }
}

/// Q2_K's and Q3_K's 2-bit values of chunk `c` = 4 h + j of 32 weights (each 128-weight half
/// takes 32 bytes of `qs`, shift `2 j` giving its `j`-th 32) plus, with `hmask`, 4 where Q3_K's
/// high bit is set (bit `c` of byte `l` for weight `l` of the chunk): at most 7, so each i32
/// lane sums 32 products of at most 7 * 127 * 32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn twos(qs: &[u8; QK_K / 4], hmask: Option<&[u8; QK_K / 8]>) -> [__m256i; QK_K / QK] {
    let high = hmask.map(|h| load_chunk(h, 0));
    std::array::from_fn(|c| {
        let shift = _mm_cvtsi32_si128(2 * (c % 4) as i32);
        let u = _mm256_and_si256(
            _mm256_srl_epi16(load_chunk(qs, c / 4), shift),
            _mm256_set1_epi8(3),
        );
        high.map_or(u, |bits| _mm256_or_si256(u, high_bit(bits, c, 4)))
    })
}

/// `value` in each byte whose byte of `bits` has bit `bit` set, else 0: a weight's high bit
/// kept apart from its low ones (Q5_K's fifth, worth 16; Q3_K's third, worth 4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high_bit(bits: __m256i, bit: usize, value: i8) -> __m256i {
    let mask = _mm256_set1_epi8(1 << bit);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(value))
}

impl Dot8 for BlockQ2K {
    /// `d * sc_g * q - dmin * m_g` over 16 sub-blocks of 16, the 4-bit `sc` and `m` in
    /// `scales`.
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        // SAFETY: inlined into `accumulate`, whose caller checked the CPU.
        unsafe {
            let s = _mm_loadu_si128(self.scales.as_ptr().cast());
            let nib = _mm_set1_epi8(0xF);
            Unpacked::Super(SuperBlock {
                chunks: twos(&self.qs, None),
                signed: false,
                sc: _mm256_cvtepu8_epi16(_mm_and_si128(s, nib)),
                m: Some(_mm256_cvtepu8_epi16(_mm_and_si128(
                    _mm_srli_epi16::<4>(s),
                    nib,
                ))),
                d: self.d.to_f32(),
                dm: self.dmin.to_f32(),
            })
        }
    }
}

impl Dot8 for BlockQ3K {
    /// `d * (sc_g - 32) * (u - 4)`, `u` the 2-bit value plus 4 where the high bit is set.
    #[inline(always)]
    fn unpack(&self) -> Unpacked {
        // SAFETY: inlined into `accumulate`, whose caller checked the CPU.
        unsafe {
            let sc = widen16(self.unpacked_scales().map(|s| s - 32));
            let d = self.d.to_f32();
            Unpacked::Super(SuperBlock {
                chunks: twos(&self.qs, Some(&self.hmask)),
                signed: false,
                sc,
                m: Some(sc),
                d,
                dm: 4.0 * d,
            })
        }
    }
}

/// The instructions a kernel multiplies with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX2 with FMA and F16C: 32 bytes per instruction.
    Avx2,
    /// AVX-512 F and BW besides: a super-block's chunks in pairs, 64 bytes per instruction
    /// (the 32-weight types stay on AVX2's instructions: their per-block scales would need
    /// as many instructions to pair as pairing saves).
    Avx512,
    /// AVX-512 with VNNI besides: Q4_0's rows sixteen at a time with `vpdpbusd` (`vnni_dots`),
    /// and prefill's integer panels (`quant_panels`).
    Vnni,
}

impl Isa {
    /// The widest this CPU runs, if it has AVX2 at all. `TETHER_ISA=avx2` in the environment
    /// caps it at AVX2, so that an AVX-512 machine can stand in for an AVX2-only one when
    /// comparing code paths (docs/PERFORMANCE.md); read once.
    pub fn best() -> Option<Isa> {
        static BEST: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let capped = std::env::var_os("TETHER_ISA").is_some_and(|v| v == "avx2");
            let avx512 = !capped
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw");
            let isa = match avx512 {
                true if is_x86_feature_detected!("avx512vnni") => Isa::Vnni,
                true => Isa::Avx512,
                false => Isa::Avx2,
            };
            avx2_available().then_some(isa)
        })
    }
}

/// Weight rows `w` (`[rows, k]`) into `out` (`[rows, t]`) against the `t` rows of `x`
/// (quantised per block of `B::LEN`), up to four rows of `x` per pass over a weight row.
///
/// # Safety
/// The CPU must support `isa`'s instructions.
pub unsafe fn dots_task<B: Dot8>(isa: Isa, x: &Rows8, w: &[B], out: &mut [f32]) {
    // SAFETY: forwarded from the caller.
    unsafe { strided_dots_task(isa, x, w, x.k / B::LEN, out) }
}

/// [`dots_task`] over weight rows that start every `stride` blocks of `w` (a row being
/// `x.k / B::LEN` blocks): one KV head's keys in a page of q8_0 rows of every head.
///
/// # Safety
/// The CPU must support `isa`'s instructions.
pub unsafe fn strided_dots_task<B: Dot8>(
    isa: Isa,
    x: &Rows8,
    w: &[B],
    stride: usize,
    out: &mut [f32],
) {
    assert_eq!(
        x.q.len(),
        x.d.len() * B::LEN,
        "rows quantised per block of B::LEN"
    );
    assert!(stride >= x.k / B::LEN);
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            Isa::Avx2 => dots_task_avx2(x, w, stride, out),
            Isa::Avx512 | Isa::Vnni => dots_task_avx512(isa, x, w, stride, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_task_avx2<B: Dot8>(x: &Rows8, w: &[B], stride: usize, out: &mut [f32]) {
    // SAFETY: the caller checked the CPU.
    unsafe { rows_task::<B, false>(Isa::Avx2, x, (w, stride), out) }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dots_task_avx512<B: Dot8>(isa: Isa, x: &Rows8, w: &[B], stride: usize, out: &mut [f32]) {
    // SAFETY: the caller checked the CPU.
    unsafe { rows_task::<B, true>(isa, x, (w, stride), out) }
}

/// `dots_task`'s body, inlined into each entry point so that it is compiled with that
/// entry's instructions (`WIDE`: AVX-512's).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, with `WIDE` AVX-512 F and BW, and `isa`'s
/// instructions.
#[inline(always)]
unsafe fn rows_task<B: Dot8, const WIDE: bool>(
    isa: Isa,
    x: &Rows8,
    (w, stride): (&[B], usize),
    out: &mut [f32],
) {
    let (t, per_row) = (x.rows(), x.k / B::LEN);
    // The grouped kernels read whole rows one after another.
    let done = match (stride == per_row, t) {
        (true, 1) => B::row_groups(isa, w, x, out),
        (true, _) if B::GROUPED => row_groups_each(isa, x, w, out),
        _ => 0,
    };
    let (w, out) = (&w[done * stride..], &mut out[done * t..]);
    let rows = w.chunks(stride).map(|r| &r[..per_row]);
    for (wr, out_r) in rows.zip(out.chunks_exact_mut(t)) {
        for (g, dst) in out_r.chunks_mut(4).enumerate() {
            let r0 = 4 * g;
            // SAFETY: forwarded from the caller.
            unsafe {
                match dst.len() {
                    4 => dst.copy_from_slice(&dots::<B, 4, WIDE>(wr, x, r0)),
                    3 => dst.copy_from_slice(&dots::<B, 3, WIDE>(wr, x, r0)),
                    2 => dst.copy_from_slice(&dots::<B, 2, WIDE>(wr, x, r0)),
                    _ => dst.copy_from_slice(&dots::<B, 1, WIDE>(wr, x, r0)),
                }
            }
        }
    }
}

/// [`Dot8::row_groups`] for several rows of `x`, each on its own (the grouped kernels take
/// one row), 16 weight rows at a time so that they stay in cache while every row of `x`
/// passes: each row gets the products its one-row step gets, from the same leading rows of
/// `w` (chunks start on multiples of 16, so the grouped kernels' groups of 8 or 16 fall where
/// they fall for one row). Returns the weight rows done, as `row_groups` does.
#[inline(always)]
fn row_groups_each<B: Dot8>(isa: Isa, x: &Rows8, w: &[B], out: &mut [f32]) -> usize {
    const CHUNK: usize = 16;
    let (t, per_row) = (x.rows(), x.k / B::LEN);
    let singles = x.each_row();
    let mut one = [0.0f32; CHUNK];
    let mut done = 0;
    for (c, dst) in out.chunks_mut(CHUNK * t).enumerate() {
        let rows = dst.len() / t;
        let wc = &w[c * CHUNK * per_row..][..rows * per_row];
        let mut got = 0;
        for (r, single) in singles.iter().enumerate() {
            got = B::row_groups(isa, wc, single, &mut one[..rows]);
            for (i, &v) in one[..got].iter().enumerate() {
                dst[i * t + r] = v;
            }
        }
        done += got;
        if got < rows {
            break;
        }
    }
    done
}

/// Dot products of one weight row with rows `r0 .. r0 + R` of `x`, block by block, into two
/// sets of accumulators taken in turn (so that consecutive blocks' FMAs do not wait on each
/// other).
///
/// # Safety
/// As [`rows_task`].
#[inline(always)]
unsafe fn dots<B: Dot8, const R: usize, const WIDE: bool>(
    w: &[B],
    x: &Rows8,
    r0: usize,
) -> [f32; R] {
    let k = x.k;
    let row = |r: usize| r0 + r;
    let rows = Rows {
        q: std::array::from_fn(|r| &x.q[row(r) * k..][..k]),
        d: std::array::from_fn(|r| &x.d[row(r) * k / B::LEN..][..k / B::LEN]),
        sums: std::array::from_fn(|r| &x.sums[row(r) * k / SUM_LEN..][..k / SUM_LEN]),
    };
    // SAFETY: forwarded from the caller.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); R]; 2];
        let mut mins = [0.0f32; R];
        for (b, block) in w.iter().enumerate() {
            prefetch_ahead(block);
            match WIDE {
                true => accumulate_wide(block, &rows, b, &mut acc[0], &mut mins),
                false => accumulate(block, &rows, b, &mut acc[0], &mut mins),
            }
            acc.swap(0, 1);
        }
        std::array::from_fn(|r| {
            let mut lanes = [0.0f32; 8];
            let sum = _mm256_add_ps(acc[0][r], acc[1][r]);
            _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
            sum_lanes(&lanes) - mins[r]
        })
    }
}

/// [`accumulate`] with a super-block's chunks multiplied in pairs, one 512-bit register each.
///
/// Not a `target_feature` function, so that it is always inlined into its caller (see
/// [`scaled_chunks`]).
///
/// # Safety
/// The CPU must have AVX-512 F and BW, AVX2, FMA and F16C.
#[inline(always)]
unsafe fn accumulate_wide<B: Dot8, const R: usize>(
    block: &B,
    x: &Rows<'_, R>,
    b: usize,
    acc: &mut [__m256; R],
    mins: &mut [f32; R],
) {
    // SAFETY: the caller has the features.
    unsafe {
        match block.unpack() {
            Unpacked::Super(s) => finish_k(scaled_pairs(&s, x, b), &s, x, b, acc),
            // Nothing to pair: the variant is known per type, so this unpacks once.
            Unpacked::Block32 { .. } => accumulate(block, x, b, acc, mins),
        }
    }
}

/// For each pair `p` of chunks (`2 p` and `2 p + 1`), the sub-block of each of the 32 i16
/// lanes of `vpmaddubsw`'s result: lane `l` sums weights `2 l` and `2 l + 1` of the pair's 64,
/// which lie in sub-block `4 p + l / 8` of 16.
const PAIR_SCALES: [[i16; 32]; 4] = {
    let mut idx = [[0i16; 32]; 4];
    let mut p = 0;
    while p < 4 {
        let mut l = 0;
        while l < 32 {
            idx[p][l] = (4 * p + l / 8) as i16;
            l += 1;
        }
        p += 1;
    }
    idx
};

/// [`scaled_chunks`] two chunks at a time: the same sums, 32 i16 lanes of pair sums each
/// multiplied by its sub-block's scale, folded to eight i32 lanes at the end.
///
/// Not a `target_feature` function, so that it is always inlined into its caller (see
/// [`scaled_chunks`]).
///
/// # Safety
/// The CPU must have AVX-512 F and BW, AVX2, FMA and F16C.
#[inline(always)]
unsafe fn scaled_pairs<const R: usize>(s: &SuperBlock, x: &Rows<'_, R>, b: usize) -> [__m256i; R] {
    // SAFETY: the caller has the features.
    unsafe {
        let (sc, chunks, signed) = (s.sc, &s.chunks, s.signed);
        let sc = _mm512_zextsi256_si512(sc);
        let mut iacc = [_mm512_setzero_si512(); R];
        for (p, idx) in PAIR_SCALES.iter().enumerate() {
            let q =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(chunks[2 * p]), chunks[2 * p + 1]);
            // 64 bytes read from `idx`.
            let s = _mm512_permutexvar_epi16(_mm512_loadu_si512(idx.as_ptr().cast()), sc);
            for (r, iacc) in iacc.iter_mut().enumerate() {
                let (u, xr) = signs_moved_wide(q, x.load64(r, QK_K * b + 2 * QK * p), signed);
                let products = _mm512_madd_epi16(_mm512_maddubs_epi16(u, xr), s);
                *iacc = _mm512_add_epi32(*iacc, products);
            }
        }
        iacc.map(|v| _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v)))
    }
}

/// [`signs_moved`] for 64 bytes (AVX-512 has no `vpsignb`: the magnitudes, and `x` negated
/// where `v` is negative).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
fn signs_moved_wide(v: __m512i, x: __m512i, signed: bool) -> (__m512i, __m512i) {
    match signed {
        true => {
            let negative = _mm512_movepi8_mask(v);
            let x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            (_mm512_abs_epi8(v), x)
        }
        false => (v, x),
    }
}

#[cfg(test)]
mod tests {
    /// The word-at-a-time unpacking gives `quant::scale_min_k4`'s scales and minima for every
    /// value of each byte.
    #[test]
    fn k4_scales_unpack_as_scale_min_k4() {
        for seed in 0..2000u32 {
            let s: [u8; 12] = std::array::from_fn(|i| {
                (seed.wrapping_mul(2_654_435_761).rotate_left(i as u32 * 5) >> (i % 3)) as u8
            });
            let (sc, m) = super::k4_scales(&s);
            for j in 0..8 {
                assert_eq!(
                    (sc[j], m[j]),
                    crate::quant::scale_min_k4(j, &s),
                    "{s:?} {j}"
                );
            }
        }
    }
}
