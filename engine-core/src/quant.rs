//! llama.cpp's quantised weight formats: each block byte for byte as ggml stores it, and its
//! weights by ggml's definition (`dequantize_row_*` in ggml-quants.c: the same float operations
//! in the same order, so the values are the reference's bit for bit). The kernels
//! (`backend::cpu::matmul`, the WGSL ones) compute with these values. Each is also written
//! ([`Quantise`]: the quantisers `llama-quantize` runs without an importance matrix, so the
//! blocks are its own byte for byte).

use half::f16;

use crate::tensor::DType;

/// Weights per block of the 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL).
pub const QK: usize = 32;

/// Weights per Q8_0 block.
pub const Q8_0_BLOCK: usize = QK;

/// Weights per k-quant super-block (Q2_K to Q6_K, IQ4_XS).
pub const QK_K: usize = 256;

/// A block of quantised weights and its values.
pub trait QuantBlock: bytemuck::Pod + Send + Sync {
    /// Weights per block.
    const LEN: usize;
    const DTYPE: DType;
    /// Writes the block's `LEN` weights to `out`.
    fn dequantise_into(&self, out: &mut [f32]);
}

/// A block type tether writes, by the ggml quantiser `llama-quantize` runs for it when it has
/// no importance matrix (`quantize_row_*_ref` in ggml-quants.c, but for IQ4_NL
/// `quantize_iq4_nl`): the same f32 operations in the same order, so the blocks are llama.cpp's
/// byte for byte.
pub trait Quantise: QuantBlock {
    /// The block of `x`.
    ///
    /// # Panics
    /// Unless `x` holds exactly `Self::LEN` weights.
    fn quantise(x: &[f32]) -> Self;
}

/// `x` as the `N` weights of one block.
fn block_of<const N: usize>(x: &[f32]) -> &[f32; N] {
    x.try_into()
        .unwrap_or_else(|_| panic!("a block takes {N} weights, not {}", x.len()))
}

/// ggml's `nearest_int`: `x` rounded to the nearest integer, halves to even, read from the low
/// mantissa bits of `x + 1.5 * 2^23` (for |x| < 2^22, as ggml asserts).
fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0).to_bits();
    (bits & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `1 / d`, or 0 for a zero `d` (ggml's `d ? 1/d : 0`).
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Below this largest magnitude ggml quantises a group of weights as all zeros
/// (`GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// The first of the values of largest magnitude, as ggml finds it (`if (ax > amax)`): 0 when
/// all are zeros.
fn max_magnitude(x: &[f32]) -> f32 {
    let (_, max) = x.iter().fold((0.0f32, 0.0f32), |(amax, max), &v| {
        if v.abs() > amax {
            (v.abs(), v)
        } else {
            (amax, max)
        }
    });
    max
}

/// Q4_0: weight = `d * (q - 8)`, 4-bit `q`; byte `j` holds weights `j` (low nibble) and `j + 16`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// Q4_1: weight = `d * q + m`, 4-bit `q`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// Q5_0: weight = `d * (q - 16)`, 5-bit `q` (the fifth bits in `qh`, a little-endian u32).
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q5_1: weight = `d * q + m`, 5-bit `q`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q8_0: weight `i` is `d * qs[i]`.
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// IQ4_NL: weight = `d * IQ4_VALUES[q]`, 4-bit `q` laid out as Q4_0's.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockIq4Nl {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// Q2_K: 16 sub-blocks of 16 weights, each with a 4-bit scale and min (`scales`);
/// weight = `d * sc * q - dmin * m`, 2-bit `q`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// Q3_K: 16 sub-blocks of 16 weights with 6-bit scales packed in `scales`;
/// weight = `d * (sc - 32) * (q - 4 * !h)`, 2-bit `q` and a high bit `h` in `hmask`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// Q4_K: 8 sub-blocks of 32 weights, each with a 6-bit scale and min (packed in `scales`),
/// scaled by `d` and `dmin`; weight = `d * sc * q - dmin * m` with 4-bit `q`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: as Q4_K with a fifth bit per weight in `qh`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 sub-blocks of 16 weights with signed 8-bit scales; weight = `d * sc * (q - 32)`
/// with 6-bit `q` (low 4 bits in `ql`, high 2 in `qh`).
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// IQ4_XS: 8 sub-blocks of 32 weights with 6-bit scales (low 4 bits in `scales_l`, high 2 in
/// `scales_h`); weight = `d * (sc - 32) * IQ4_VALUES[q]`.
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockIq4Xs {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}

/// The 16 non-linear levels of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Q4_0/Q4_1/IQ4_NL's nibbles: weight `j` (low) and `j + 16` (high) of byte `j`, as `level`
/// maps them.
#[inline(always)]
fn nibbles(qs: &[u8; QK / 2], out: &mut [f32], level: impl Fn(u8) -> f32) {
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
        *lo = level(q & 0xF);
        *hi = level(q >> 4);
    }
}

/// Q5_0/Q5_1's 5-bit values: the nibbles with their fifth bit from `qh`.
#[inline(always)]
fn fives(qh: [u8; 4], qs: &[u8; QK / 2], out: &mut [f32], level: impl Fn(u8) -> f32) {
    let qh = u32::from_le_bytes(qh);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for (j, ((&q, lo), hi)) in qs.iter().zip(lo).zip(hi).enumerate() {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        *lo = level((q & 0xF) | h0);
        *hi = level((q >> 4) | h1);
    }
}

/// Q4_0's and Q5_0's `d` and levels of `x` (`quantize_row_q{4,5}_0_ref`): `d` maps the weight
/// of largest magnitude to level 0, `-2^(BITS-1) * d` (so `d` has its opposite sign); the others
/// round half up, clamped to the top level.
fn symmetric_levels<const BITS: u32>(x: &[f32; QK]) -> (f16, [u8; QK]) {
    let max = max_magnitude(x);
    let zero = (1 << (BITS - 1)) as f32;
    let d = max / -zero;
    let id = inverse(d);
    let top = (1u8 << BITS) - 1;
    // The sum is in [0, 2^BITS + 1): `as` truncates it as C's (int8_t) cast does.
    let levels = x.map(|v| ((v * id + (zero + 0.5)) as u8).min(top));
    (f16::from_f32(d), levels)
}

/// Q4_1's and Q5_1's `d`, `m` and levels of `x` (`quantize_row_q{4,5}_1_ref`): `m` is the
/// smallest weight, `d` spreads the range over the levels, each weight rounds half up (ggml
/// clamps only Q4_1's to the top level, but the sum never passes it: the same for both).
fn asymmetric_levels<const BITS: u32>(x: &[f32; QK]) -> (f16, f16, [u8; QK]) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let top = (1u8 << BITS) - 1;
    let d = (max - min) / f32::from(top);
    let id = inverse(d);
    let levels = x.map(|v| (((v - min) * id + 0.5) as u8).min(top));
    (f16::from_f32(d), f16::from_f32(min), levels)
}

/// The low four bits of levels `j` and `j + 16` in byte `j`, as [`nibbles`] reads them.
fn pack_nibbles(levels: &[u8; QK]) -> [u8; QK / 2] {
    std::array::from_fn(|j| (levels[j] & 0xF) | ((levels[j + QK / 2] & 0xF) << 4))
}

/// The fifth bit of level `i` in bit `i` of a little-endian u32, as [`fives`] reads them.
fn pack_fifth_bits(levels: &[u8; QK]) -> [u8; 4] {
    let qh = (levels.iter().enumerate()).fold(0u32, |qh, (i, &q)| qh | (u32::from(q >> 4) << i));
    qh.to_le_bytes()
}

impl QuantBlock for BlockQ4_0 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q4_0;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        nibbles(&self.qs, out, |q| (i32::from(q) - 8) as f32 * d);
    }
}

impl Quantise for BlockQ4_0 {
    fn quantise(x: &[f32]) -> Self {
        let (d, levels) = symmetric_levels::<4>(block_of(x));
        BlockQ4_0 {
            d,
            qs: pack_nibbles(&levels),
        }
    }
}

impl QuantBlock for BlockQ4_1 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q4_1;
    fn dequantise_into(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        nibbles(&self.qs, out, |q| f32::from(q) * d + m);
    }
}

impl Quantise for BlockQ4_1 {
    fn quantise(x: &[f32]) -> Self {
        let (d, m, levels) = asymmetric_levels::<4>(block_of(x));
        BlockQ4_1 {
            d,
            m,
            qs: pack_nibbles(&levels),
        }
    }
}

impl QuantBlock for BlockQ5_0 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q5_0;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        fives(self.qh, &self.qs, out, |q| (i32::from(q) - 16) as f32 * d);
    }
}

impl Quantise for BlockQ5_0 {
    fn quantise(x: &[f32]) -> Self {
        let (d, levels) = symmetric_levels::<5>(block_of(x));
        BlockQ5_0 {
            d,
            qh: pack_fifth_bits(&levels),
            qs: pack_nibbles(&levels),
        }
    }
}

impl QuantBlock for BlockQ5_1 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q5_1;
    fn dequantise_into(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        fives(self.qh, &self.qs, out, |q| f32::from(q) * d + m);
    }
}

impl Quantise for BlockQ5_1 {
    fn quantise(x: &[f32]) -> Self {
        let (d, m, levels) = asymmetric_levels::<5>(block_of(x));
        BlockQ5_1 {
            d,
            m,
            qh: pack_fifth_bits(&levels),
            qs: pack_nibbles(&levels),
        }
    }
}

impl QuantBlock for BlockQ8_0 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q8_0;
    fn dequantise_into(&self, out: &mut [f32]) {
        let out: &mut [f32; QK] = out.try_into().expect("a Q8_0 block widens into 32 values");
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * f32::from(q);
        }
    }
}

/// `quantize_row_q8_0_ref`: the scale maps the largest magnitude to 127, each weight rounds to
/// nearest (halves away from zero).
impl Quantise for BlockQ8_0 {
    fn quantise(x: &[f32]) -> Self {
        let x: &[f32; QK] = block_of(x);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = inverse(d);
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs: x.map(|v| (v * id).round() as i8),
        }
    }
}

impl BlockQ8_0 {
    /// The 32 weights as f32.
    #[inline(always)]
    pub fn dequantise(&self) -> [f32; QK] {
        let d = self.d.to_f32();
        self.qs.map(|q| d * f32::from(q))
    }
}

impl QuantBlock for BlockIq4Nl {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Iq4Nl;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        nibbles(&self.qs, out, |q| d * f32::from(IQ4_VALUES[q as usize]));
    }
}

/// Q2_K's and Q3_K's 2-bit layout: each 128-weight half takes 32 bytes of `qs`, shift `2 * j`
/// giving its `j`-th 32 weights, in two sub-blocks of 16 (`level(sub-block, byte index in the
/// half, 2-bit value)`).
#[inline(always)]
fn twos(qs: &[u8; QK_K / 4], out: &mut [f32], level: impl Fn(usize, usize, usize, u8) -> f32) {
    for (half, (q, out)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(128))
        .enumerate()
    {
        for (j, out) in out.chunks_exact_mut(32).enumerate() {
            let sub = 8 * half + 2 * j;
            for (l, o) in out.iter_mut().enumerate() {
                *o = level(sub + l / 16, l, 4 * half + j, (q[l] >> (2 * j)) & 3);
            }
        }
    }
}

/// The low two bits of Q2_K's/Q3_K's levels as [`twos`] reads them: byte `l` of each half's
/// 32 holds its weights `l + 32 * j` at shift `2 * j`.
fn pack_twos(levels: &[u8; QK_K]) -> [u8; QK_K / 4] {
    std::array::from_fn(|i| {
        let at = 128 * (i / 32) + i % 32;
        (0..4).fold(0, |b, j| b | ((levels[at + 32 * j] & 3) << (2 * j)))
    })
}

impl QuantBlock for BlockQ2K {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Q2K;
    fn dequantise_into(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        twos(&self.qs, out, |sub, _, _, q| {
            let sc = self.scales[sub];
            let (dl, ml) = (d * f32::from(sc & 0xF), dmin * f32::from(sc >> 4));
            dl * f32::from(q) - ml
        });
    }
}

/// `quantize_row_q2_K_ref`: each sub-block of 16 gets [`make_qkx2_quants`]' scale and min
/// (weights `|x|`, absolute error), stored in 4 bits against the largest scale (`d`) and min
/// (`dmin`); then each weight takes the nearest level of the stored ones (those of a sub-block
/// whose stored scale is 0 keep their fitted level).
impl Quantise for BlockQ2K {
    fn quantise(x: &[f32]) -> Self {
        let x: &[f32; QK_K] = block_of(x);
        let mut levels = [0u8; QK_K];
        let fits: [_; 16] = fit_sub_blocks(x, &mut levels, |x: &[f32; 16]| {
            make_qkx2_quants(3, x, &x.map(f32::abs), -0.5, 15, true)
        });
        let (d, sc) = scale_steps(fits.map(|f| f.0), 15.0);
        let (dmin, m) = scale_steps(fits.map(|f| f.1), 15.0);
        let scales = std::array::from_fn(|j| sc[j] | (m[j] << 4));
        relevel::<16>(x, &mut levels, (0, 3), |j| {
            let sc = scales[j];
            (
                d.to_f32() * f32::from(sc & 0xF),
                Some(dmin.to_f32() * f32::from(sc >> 4)),
            )
        });
        BlockQ2K {
            scales,
            qs: pack_twos(&levels),
            d,
            dmin,
        }
    }
}

impl BlockQ3K {
    /// The 16 six-bit scales, unpacked as ggml's `dequantize_row_q3_K` does.
    pub(crate) fn unpacked_scales(&self) -> [i8; 16] {
        let w = |i: usize| u32::from_le_bytes(self.scales[4 * i..4 * i + 4].try_into().unwrap());
        let (a0, a1, tmp) = (w(0), w(1), w(2));
        let (m1, m2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
        let aux = [
            (a0 & m2) | ((tmp & m1) << 4),
            (a1 & m2) | (((tmp >> 2) & m1) << 4),
            ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4),
            ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4),
        ];
        let bytes: [u8; 16] = bytemuck::cast(aux.map(u32::to_le));
        bytes.map(|b| b as i8)
    }
}

impl QuantBlock for BlockQ3K {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Q3K;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let scales = self.unpacked_scales();
        twos(&self.qs, out, |sub, l, bit, q| {
            let dl = d * f32::from(i16::from(scales[sub]) - 32);
            let high = if self.hmask[l] & (1 << bit) != 0 {
                0
            } else {
                4
            };
            dl * f32::from(q as i8 - high)
        });
    }
}

/// The inverse of [`BlockQ3K::unpacked_scales`] (as `quantize_row_q3_K_ref` packs them):
/// scale `j`'s low four bits in byte `j % 8` (high nibble from `j` = 8 on), its top two in
/// byte `8 + j % 4` at shift `2 * (j / 4)`.
fn pack_q3k_scales(scales: [u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (j, sc) in scales.into_iter().enumerate() {
        s[j % 8] |= (sc & 0xF) << (4 * (j / 8));
        s[8 + j % 4] |= (sc >> 4) << (2 * (j / 4));
    }
    s
}

/// ggml's `make_q3_quants` as the Q3_K ref calls it (`do_rmse`): signed levels `-nmax..nmax`
/// of 16 weights (stored offset by `nmax`), first from the weight of largest magnitude at
/// level `-nmax`, then up to five rounds that move single weights to the level their
/// least-squares fit to the others asks for (weights `x²`) while that fits the whole better.
/// Returns the fitted scale and the levels; all zeros for a sub-block of zeros.
fn make_q3_quants(nmax: i32, x: &[f32; 16]) -> (f32, [u8; 16]) {
    let max = max_magnitude(x);
    if max.abs() < GROUP_MAX_EPS {
        return (0.0, [0; 16]);
    }
    let iscale = -(nmax as f32) / max;
    let mut l = x.map(|x| nearest_int(iscale * x).clamp(-nmax, nmax - 1));
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (&x, &l) in x.iter().zip(&l) {
        let (w, l) = (x * x, l as f32);
        sumlx += w * x * l;
        suml2 += w * l * l;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (&x, l) in x.iter().zip(&mut l) {
            let (w, old) = (x * x, *l as f32);
            let slx = sumlx - w * x * old;
            if slx > 0.0 {
                let sl2 = suml2 - w * old * old;
                let new = nearest_int(x * sl2 / slx).clamp(-nmax, nmax - 1);
                if new != *l {
                    let (slx, sl2) = (slx + w * x * new as f32, sl2 + w * new as f32 * new as f32);
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        (*l, sumlx, suml2, changed) = (new, slx, sl2, true);
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    let scale = if suml2 > 0.0 { sumlx / suml2 } else { 0.0 };
    (scale, l.map(|l| (l + nmax) as u8))
}

/// `quantize_row_q3_K_ref`: each sub-block of 16 gets [`make_q3_quants`]' scale, stored in 6
/// bits against the scale of largest magnitude (at -32); then each weight takes the nearest
/// level `-4..4` of the stored scale (those of a sub-block whose stored scale is 0 keep their
/// fitted level), its high bit in `hmask` and low two in `qs`.
impl Quantise for BlockQ3K {
    fn quantise(x: &[f32]) -> Self {
        let x: &[f32; QK_K] = block_of(x);
        let mut levels = [0u8; QK_K];
        let fits: [_; 16] = fit_sub_blocks(x, &mut levels, |x| make_q3_quants(4, x));
        let max_scale = max_magnitude(&fits);
        let mut b = BlockQ3K {
            hmask: [0; QK_K / 8],
            qs: [0; QK_K / 4],
            scales: [0; 12],
            d: f16::ZERO,
        };
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            // As C's (int8_t) cast: modulo 256, then clamped.
            let six_bits = |s: f32| ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            b.scales = pack_q3k_scales(fits.map(six_bits));
            b.d = f16::from_f32(1.0 / iscale);
        }
        let scales = b.unpacked_scales();
        relevel::<16>(x, &mut levels, (-4, 3), |j| {
            (b.d.to_f32() * f32::from(scales[j] - 32), None)
        });
        b.hmask = std::array::from_fn(|l| {
            (0..8).fold(0, |h, bit| h | ((levels[32 * bit + l] >> 2) << bit))
        });
        b.qs = pack_twos(&levels);
        b
    }
}

/// Sub-block `j`'s 6-bit scale and min of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (sc, m)
}

/// Q4_K's and Q5_K's weights: sub-block `j` (32 weights from 32 bytes of `qs`, low nibbles
/// for even `j`, high for odd) scaled `d * sc - dmin * m`, with a fifth bit from `qh` for Q5_K.
fn dequantise_k4(
    (d, dmin): (f16, f16),
    scales: &[u8; 12],
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
    out: &mut [f32],
) {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    for (j, (q, out)) in qs
        .chunks_exact(32)
        .zip(out.chunks_exact_mut(64))
        .enumerate()
    {
        let (s1, m1) = scale_min_k4(2 * j, scales);
        let (s2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        for (l, &q) in q.iter().enumerate() {
            let high = |bit: usize| qh.map_or(0, |h| ((h[l] >> bit) & 1) << 4);
            out[l] = d1 * f32::from((q & 0xF) | high(2 * j)) - m1;
            out[l + 32] = d2 * f32::from((q >> 4) | high(2 * j + 1)) - m2;
        }
    }
}

/// The inverse of [`scale_min_k4`]: eight 6-bit (scale, min) pairs in 12 bytes, pairs 0-3 in
/// the low 6 bits of bytes 0-3 (scales) and 4-7 (mins), pairs 4-7 in the nibbles of bytes 8-11
/// with their top two bits in the top two of bytes 0-7.
fn pack_scale_min_k4(pairs: [(u8, u8); 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (j, (sc, m)) in pairs.into_iter().enumerate() {
        if j < 4 {
            s[j] = sc;
            s[j + 4] = m;
        } else {
            s[j + 4] = (sc & 0xF) | ((m & 0xF) << 4);
            s[j - 4] |= (sc >> 4) << 6;
            s[j] |= (m >> 4) << 6;
        }
    }
    s
}

/// ggml's `make_qkx2_quants` as the Q2_K, Q4_K and Q5_K refs call it (`rdelta` 0.1): levels
/// `0..=nmax` of `N` weights as `scale * l - min`. From the levels of the weights' range it
/// tries `nstep + 1` more scales, `(nmax + rmin + 0.1 * step) / range`, fits the scale and min
/// to each try's levels by weighted least squares and keeps the least weighted error (absolute
/// with `use_mad`, else squared). Returns the scale and the min (as a positive offset), and
/// the levels.
fn make_qkx2_quants<const N: usize>(
    nmax: u8,
    x: &[f32; N],
    w: &[f32; N],
    rmin: f32,
    nstep: u8,
    use_mad: bool,
) -> ((f32, f32), [u8; N]) {
    let (mut min, mut max) = (x[0], x[0]);
    let (mut sum_w, mut sum_x) = (w[0], w[0] * x[0]);
    for (&x, &w) in x.iter().zip(w).skip(1) {
        if x < min {
            min = x;
        }
        if x > max {
            max = x;
        }
        sum_w += w;
        sum_x += w * x;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        return ((0.0, -min), [0; N]);
    }
    let levels = |iscale: f32, min: f32| {
        x.map(|x| nearest_int(iscale * (x - min)).clamp(0, nmax.into()) as u8)
    };
    let error = |scale: f32, min: f32, levels: &[u8; N]| {
        let terms = x.iter().zip(w).zip(levels);
        terms.fold(0.0f32, |e, ((&x, &w), &l)| {
            let diff = scale * f32::from(l) + min - x;
            let loss = if use_mad { diff.abs() } else { diff * diff };
            e + w * loss
        })
    };
    let iscale = f32::from(nmax) / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = levels(iscale, min);
    let mut best_error = error(scale, min, &best);
    for step in 0..=nstep {
        // ggml's `min` moves with each better fit, and so does the range of the next try.
        let iscale = (rmin + 0.1 * f32::from(step) + f32::from(nmax)) / (max - min);
        let l = levels(iscale, min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for ((&x, &w), &l) in x.iter().zip(w).zip(&l) {
            let l = f32::from(l);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let this_error = error(this_scale, this_min, &l);
            if this_error < best_error {
                (best, best_error, scale, min) = (l, this_error, this_scale, this_min);
            }
        }
    }
    ((scale, -min), best)
}

/// The k-quants' first pass: each sub-block of `N` weights of `x` fitted by `fit`, its levels
/// into `levels`; returns the `S` fits (scale, or scale and min).
fn fit_sub_blocks<const N: usize, const S: usize, F>(
    x: &[f32; QK_K],
    levels: &mut [u8; QK_K],
    mut fit: impl FnMut(&[f32; N]) -> (F, [u8; N]),
) -> [F; S] {
    const { assert!(N * S == QK_K) };
    std::array::from_fn(|j| {
        let (f, q) = fit(block_of(&x[N * j..][..N]));
        levels[N * j..][..N].copy_from_slice(&q);
        f
    })
}

/// The scales (or mins) of Q2_K's, Q4_K's and Q5_K's sub-blocks as their refs store them:
/// steps of `max / top` in f16 (`max` the largest, by ggml's `>`: never -0 as f32::max could
/// give), and each one's number of steps, modulo 256 as C's (uint8_t) stores them.
fn scale_steps<const S: usize>(values: [f32; S], top: f32) -> (f16, [u8; S]) {
    let max = (values.iter()).fold(0.0f32, |m, &v| if v > m { v } else { m });
    let inv = if max > 0.0 { top / max } else { 0.0 };
    let steps = values.map(|v| nearest_int(inv * v) as u8);
    (f16::from_f32(max / top), steps)
}

/// The k-quants' last pass: each weight of sub-block `j` (of `N` weights) takes the level `q`
/// in `lo..=hi` nearest `(x + dm) / d`, `(d, dm)` the sub-block's stored scale and min from
/// `scale(j)` (plain `x / d` without a min), stored as `q - lo`. Where `d` is 0 ggml leaves
/// the levels as first fitted.
fn relevel<const N: usize>(
    x: &[f32; QK_K],
    levels: &mut [u8; QK_K],
    (lo, hi): (i32, i32),
    scale: impl Fn(usize) -> (f32, Option<f32>),
) {
    let sub_blocks = x.chunks_exact(N).zip(levels.chunks_exact_mut(N));
    for (j, (x, levels)) in sub_blocks.enumerate() {
        let (d, dm) = scale(j);
        if d == 0.0 {
            continue;
        }
        for (l, &x) in levels.iter_mut().zip(x) {
            let x = dm.map_or(x, |dm| x + dm);
            *l = (nearest_int(x / d).clamp(lo, hi) - lo) as u8;
        }
    }
}

/// A Q4_K/Q5_K super-block (`quantize_row_q{4,5}_K_ref`): its `d`, `dmin`, packed scales and
/// levels `0..=nmax` of its 256 weights.
struct SuperBlockK4 {
    d: f16,
    dmin: f16,
    scales: [u8; 12],
    levels: [u8; QK_K],
}

impl SuperBlockK4 {
    /// Each sub-block of 32 gets [`make_qkx2_quants`]' scale and min (each weight weighted by
    /// the sub-block's rms plus its magnitude), stored in 6 bits against the largest scale
    /// (`d`) and min (`dmin`); then each weight takes the nearest level of the stored ones
    /// (those of a sub-block whose stored scale is 0 keep their fitted level).
    fn quantise(x: &[f32; QK_K], nmax: u8, rmin: f32, nstep: u8) -> SuperBlockK4 {
        let mut levels = [0u8; QK_K];
        let fits: [_; 8] = fit_sub_blocks(x, &mut levels, |x: &[f32; 32]| {
            let sum_x2 = x.iter().fold(0.0f32, |s, &v| s + v * v);
            let av_x = (sum_x2 / 32.0).sqrt();
            let weights = x.map(|v| av_x + v.abs());
            make_qkx2_quants(nmax, x, &weights, rmin, nstep, false)
        });
        let (d, sc) = scale_steps(fits.map(|f| f.0), 63.0);
        let (dmin, m) = scale_steps(fits.map(|f| f.1), 63.0);
        let scales = pack_scale_min_k4(std::array::from_fn(|j| (sc[j].min(63), m[j].min(63))));
        relevel::<32>(x, &mut levels, (0, nmax.into()), |j| {
            let (sc, m) = scale_min_k4(j, &scales);
            (
                d.to_f32() * f32::from(sc),
                Some(dmin.to_f32() * f32::from(m)),
            )
        });
        SuperBlockK4 {
            d,
            dmin,
            scales,
            levels,
        }
    }

    /// The low four bits of the levels as [`dequantise_k4`] reads `qs`: byte `l` of each 32
    /// holds weight `l` of an even sub-block (low nibble) and of the odd one after it.
    fn nibbles(&self) -> [u8; QK_K / 2] {
        let q = &self.levels;
        std::array::from_fn(|i| {
            let at = 64 * (i / 32) + i % 32;
            (q[at] & 0xF) | ((q[at + 32] & 0xF) << 4)
        })
    }

    /// The fifth bits of Q5_K's levels as [`dequantise_k4`] reads `qh`: bit `j` of byte `l` is
    /// that of weight `l` of sub-block `j`.
    fn fifth_bits(&self) -> [u8; QK_K / 8] {
        let q = &self.levels;
        std::array::from_fn(|l| (0..8).fold(0, |h, j| h | ((q[32 * j + l] >> 4) << j)))
    }
}

impl QuantBlock for BlockQ4K {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Q4K;
    fn dequantise_into(&self, out: &mut [f32]) {
        dequantise_k4((self.d, self.dmin), &self.scales, &self.qs, None, out);
    }
}

/// `quantize_row_q4_K_ref`.
impl Quantise for BlockQ4K {
    fn quantise(x: &[f32]) -> Self {
        let b = SuperBlockK4::quantise(block_of(x), 15, -1.0, 20);
        BlockQ4K {
            d: b.d,
            dmin: b.dmin,
            scales: b.scales,
            qs: b.nibbles(),
        }
    }
}

impl QuantBlock for BlockQ5K {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Q5K;
    fn dequantise_into(&self, out: &mut [f32]) {
        dequantise_k4(
            (self.d, self.dmin),
            &self.scales,
            &self.qs,
            Some(&self.qh),
            out,
        );
    }
}

/// `quantize_row_q5_K_ref`.
impl Quantise for BlockQ5K {
    fn quantise(x: &[f32]) -> Self {
        let b = SuperBlockK4::quantise(block_of(x), 31, -0.5, 15);
        BlockQ5K {
            d: b.d,
            dmin: b.dmin,
            scales: b.scales,
            qh: b.fifth_bits(),
            qs: b.nibbles(),
        }
    }
}

impl QuantBlock for BlockQ6K {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Q6K;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (half, out) in out.chunks_exact_mut(128).enumerate() {
            let ql = &self.ql[64 * half..][..64];
            let qh = &self.qh[32 * half..][..32];
            let sc = &self.scales[8 * half..][..8];
            for l in 0..32 {
                let is = l / 16;
                let q = [
                    (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, &q) in q.iter().enumerate() {
                    let q = i32::from(q) - 32;
                    out[l + 32 * k] = (d * f32::from(sc[is + 2 * k])) * q as f32;
                }
            }
        }
    }
}

/// ggml's `make_qx_quants` as the Q6_K ref calls it (`rmse_type` 1: weights `x²`, no
/// importance): signed levels `-nmax..nmax` of 16 weights (stored offset by `nmax`), the scale
/// from the weight of largest magnitude at level `-nmax`, then the best weighted least-squares
/// fit of 19 scales `(nmax + 0.1 * step) / max`, `step` in -9..=9. Returns the scale and the
/// levels; all zeros for a sub-block of zeros (levels 0, not `nmax`, as ggml's).
fn make_qx_quants(nmax: i32, x: &[f32; 16]) -> (f32, [u8; 16]) {
    let max = max_magnitude(x);
    if max.abs() < GROUP_MAX_EPS {
        return (0.0, [0; 16]);
    }
    let level = |iscale: f32, x: f32| nearest_int(iscale * x).clamp(-nmax, nmax - 1);
    let levels = |iscale: f32| x.map(|x| (level(iscale, x) + nmax) as u8);
    // Σ w·x·l and Σ w·l² over the weights, w = x².
    let sums = |iscale: f32| {
        x.iter().fold((0.0f32, 0.0f32), |(sumlx, suml2), &x| {
            let (l, w) = (level(iscale, x) as f32, x * x);
            (sumlx + w * x * l, suml2 + w * l * l)
        })
    };
    let iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    let mut best_levels = levels(iscale);
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            best_levels = levels(iscale);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    (scale, best_levels)
}

/// Q6_K's levels `0..64` in `ql` (low four bits) and `qh` (top two), as
/// [`BlockQ6K::dequantise_into`] reads them: per half of 128 weights, byte `l` of its 64 in
/// `ql` holds weights `l` and `l + 64`, its byte `l` in `qh` the top bits of `l + 32 * k`.
fn pack_q6k(levels: &[u8; QK_K]) -> ([u8; QK_K / 2], [u8; QK_K / 4]) {
    let ql = std::array::from_fn(|i| {
        let at = 128 * (i / 64) + i % 64;
        (levels[at] & 0xF) | ((levels[at + 64] & 0xF) << 4)
    });
    let qh = std::array::from_fn(|i| {
        let at = 128 * (i / 32) + i % 32;
        (0..4).fold(0, |h, k| h | ((levels[at + 32 * k] >> 4) << (2 * k)))
    });
    (ql, qh)
}

/// `quantize_row_q6_K_ref`: each sub-block of 16 gets [`make_qx_quants`]' scale, stored as a
/// signed 8-bit multiple of `d` (the largest-magnitude scale at -128); then each weight takes
/// the nearest level of the stored scale (those of a sub-block whose stored scale is 0 keep
/// their fitted level). A super-block of zeros is all zero bytes.
impl Quantise for BlockQ6K {
    fn quantise(x: &[f32]) -> Self {
        let x: &[f32; QK_K] = block_of(x);
        let mut levels = [0u8; QK_K];
        let fits: [_; 16] = fit_sub_blocks(x, &mut levels, |x| make_qx_quants(32, x));
        let max_scale = max_magnitude(&fits);
        if max_scale.abs() < GROUP_MAX_EPS {
            return bytemuck::Zeroable::zeroed();
        }
        let iscale = -128.0 / max_scale;
        let d = f16::from_f32(1.0 / iscale);
        let scales = fits.map(|s| nearest_int(iscale * s).min(127) as i8);
        relevel::<16>(x, &mut levels, (-32, 31), |j| {
            (d.to_f32() * f32::from(scales[j]), None)
        });
        let (ql, qh) = pack_q6k(&levels);
        BlockQ6K { ql, qh, scales, d }
    }
}

impl BlockIq4Xs {
    /// Sub-block `j`'s scale, `-32..32`: four bits of `scales_l`, two of `scales_h`.
    pub(crate) fn scale(&self, j: usize) -> i16 {
        let low = (self.scales_l[j / 2] >> (4 * (j % 2))) & 0xF;
        let high = ((self.scales_h >> (2 * j)) & 3) as u8;
        i16::from(low | (high << 4)) - 32
    }
}

impl QuantBlock for BlockIq4Xs {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Iq4Xs;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (ib, (qs, out)) in self
            .qs
            .chunks_exact(QK / 2)
            .zip(out.chunks_exact_mut(QK))
            .enumerate()
        {
            let dl = d * f32::from(self.scale(ib));
            let qs: &[u8; QK / 2] = qs.try_into().expect("16 bytes");
            nibbles(qs, out, |q| dl * f32::from(IQ4_VALUES[q as usize]));
        }
    }
}

/// ggml's `best_index_int8` on [`IQ4_VALUES`]: the index of the level nearest `x` (of two as
/// near, the upper; the top one for NaN, by ggml's bisection).
fn iq4_index(x: f32) -> u8 {
    let value = |i: usize| f32::from(IQ4_VALUES[i]);
    if x <= value(0) {
        return 0;
    }
    if x >= value(15) {
        return 15;
    }
    let (mut lo, mut hi) = (0, 15);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < value(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let nearest = if x - value(hi - 1) < value(hi) - x {
        hi - 1
    } else {
        hi
    };
    nearest as u8
}

/// The IQ4 levels of the weights `x` against the inverse scale `id`.
fn iq4_levels(x: &[f32; QK], id: f32) -> [u8; QK] {
    x.map(|x| iq4_index(id * x))
}

/// A block's scale as `quantize_row_iq4_nl_impl` fits it with no importance matrix (weights
/// `x²`, `ntry` 7): the weighted least-squares scale of the levels at `d = -max / IQ4_VALUES[0]`
/// (`max` the weight of largest magnitude), or of those at any of 15 more inverse scales,
/// `(IQ4_VALUES[0] + step) / max` for `step` in -7..=7, that fit better. 0 for a block of
/// zeros.
fn iq4_block_scale(x: &[f32; QK]) -> f32 {
    let max = max_magnitude(x);
    if max.abs() < GROUP_MAX_EPS {
        return 0.0;
    }
    let v0 = IQ4_VALUES[0];
    // Σ w·q·x and Σ w·q² over the weights, w = x².
    let sums = |id: f32| {
        x.iter().fold((0.0f32, 0.0f32), |(sumqx, sumq2), &x| {
            let (q, w) = (f32::from(IQ4_VALUES[iq4_index(id * x) as usize]), x * x);
            (sumqx + w * q * x, sumq2 + w * q * q)
        })
    };
    let (sumqx, sumq2) = sums(1.0 / (-max / f32::from(v0)));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for step in -7..=7 {
        let (sumqx, sumq2) = sums((step + i32::from(v0)) as f32 / max);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// `quantize_iq4_nl` without an importance matrix, as `llama-quantize` runs it (not
/// `quantize_row_iq4_nl_ref`, which searches no scales): [`iq4_block_scale`], and each weight
/// at its nearest level.
impl Quantise for BlockIq4Nl {
    fn quantise(x: &[f32]) -> Self {
        let x: &[f32; QK] = block_of(x);
        let d = iq4_block_scale(x);
        BlockIq4Nl {
            d: f16::from_f32(d),
            qs: pack_nibbles(&iq4_levels(x, inverse(d))),
        }
    }
}

/// `quantize_iq4_xs` without an importance matrix (= `quantize_row_iq4_xs_ref`): each block of
/// 32 gets [`iq4_block_scale`], stored in 6 bits against the scale of largest magnitude (at
/// -32); then each weight takes the nearest level of its block's stored scale (before the f16
/// rounding of `d`).
impl Quantise for BlockIq4Xs {
    fn quantise(x: &[f32]) -> Self {
        let x: &[f32; QK_K] = block_of(x);
        let scales: [f32; QK_K / QK] =
            std::array::from_fn(|ib| iq4_block_scale(block_of(&x[QK * ib..][..QK])));
        let d = -max_magnitude(&scales) / 32.0;
        let id = inverse(d);
        let mut b = BlockIq4Xs {
            d: f16::from_f32(d),
            scales_h: 0,
            scales_l: [0; QK_K / 64],
            qs: [0; QK_K / 2],
        };
        for (ib, (&s, qs)) in scales.iter().zip(b.qs.chunks_exact_mut(QK / 2)).enumerate() {
            let l = nearest_int(id * s).clamp(-32, 31);
            let levels = iq4_levels(block_of(&x[QK * ib..][..QK]), inverse(d * l as f32));
            qs.copy_from_slice(&pack_nibbles(&levels));
            let l = (l + 32) as u8;
            b.scales_l[ib / 2] |= (l & 0xF) << (4 * (ib % 2));
            b.scales_h |= u16::from(l >> 4) << (2 * ib);
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The levels weight `i` of a block can take: `d * q + m` for `q` in `q` (of those, IQ4's
    /// [`IQ4_VALUES`], at most `gap` steps apart; else 1). `rounding`: how far they can be from
    /// the levels ggml chose against, where it chose them before the f16 rounding of `d` and
    /// `m`. `reach`: whether the levels reach each weight within a step, as they do when chosen
    /// from the block's range (a weighted least-squares fit, as the k-quants' and IQ4's, may
    /// clamp a sub-block's extremes by more).
    struct Levels {
        d: f32,
        m: f32,
        q: (i32, i32),
        gap: f32,
        rounding: f32,
        reach: bool,
    }

    trait LevelsOf: Quantise {
        fn levels(&self, i: usize) -> Levels;
    }

    /// Half an f16 ulp of `v` (normal or subnormal).
    fn f16_half_ulp(v: f32) -> f32 {
        (v.abs() / 2048.0).max(2f32.powi(-25))
    }

    /// A 32-weight block's levels, `d * q + m`, chosen from its range before the f16 rounding.
    fn block_levels(d: f16, m: f16, q: (i32, i32)) -> Levels {
        let (d, m) = (d.to_f32(), m.to_f32());
        let top = q.0.abs().max(q.1.abs()) as f32;
        Levels {
            rounding: 2.0 * (f16_half_ulp(d) * top + f16_half_ulp(m)),
            reach: true,
            ..k_levels(d, m, q)
        }
    }

    /// A k-quant sub-block's levels, `d * q + m`, chosen against the stored scales.
    fn k_levels(d: f32, m: f32, q: (i32, i32)) -> Levels {
        Levels {
            d,
            m,
            q,
            gap: 1.0,
            rounding: 0.0,
            reach: false,
        }
    }

    /// An IQ4 block's levels, `d * IQ4_VALUES[q]` with `d = d16 * sc`, chosen against `d16`
    /// before its f16 rounding.
    fn iq4_table_levels(d16: f16, sc: i32) -> Levels {
        let d = d16.to_f32() * sc as f32;
        Levels {
            gap: 24.0,
            rounding: 2.0 * f16_half_ulp(d16.to_f32()) * (sc.abs() * 127) as f32,
            ..k_levels(d, 0.0, (-127, 113))
        }
    }

    impl LevelsOf for BlockQ4_0 {
        fn levels(&self, _: usize) -> Levels {
            block_levels(self.d, f16::ZERO, (-8, 7))
        }
    }

    impl LevelsOf for BlockQ5_0 {
        fn levels(&self, _: usize) -> Levels {
            block_levels(self.d, f16::ZERO, (-16, 15))
        }
    }

    impl LevelsOf for BlockQ4_1 {
        fn levels(&self, _: usize) -> Levels {
            block_levels(self.d, self.m, (0, 15))
        }
    }

    impl LevelsOf for BlockQ5_1 {
        fn levels(&self, _: usize) -> Levels {
            block_levels(self.d, self.m, (0, 31))
        }
    }

    impl LevelsOf for BlockQ8_0 {
        fn levels(&self, _: usize) -> Levels {
            block_levels(self.d, f16::ZERO, (-127, 127))
        }
    }

    fn k4_levels(d: f16, dmin: f16, scales: &[u8; 12], i: usize, top: i32) -> Levels {
        let (sc, m) = scale_min_k4(i / 32, scales);
        let (d, m) = (d.to_f32() * f32::from(sc), dmin.to_f32() * f32::from(m));
        k_levels(d, -m, (0, top))
    }

    impl LevelsOf for BlockQ2K {
        fn levels(&self, i: usize) -> Levels {
            let sc = self.scales[i / 16];
            let d = self.d.to_f32() * f32::from(sc & 0xF);
            let m = self.dmin.to_f32() * f32::from(sc >> 4);
            k_levels(d, -m, (0, 3))
        }
    }

    impl LevelsOf for BlockQ3K {
        fn levels(&self, i: usize) -> Levels {
            let sc = self.unpacked_scales()[i / 16] - 32;
            k_levels(self.d.to_f32() * f32::from(sc), 0.0, (-4, 3))
        }
    }

    impl LevelsOf for BlockQ4K {
        fn levels(&self, i: usize) -> Levels {
            k4_levels(self.d, self.dmin, &self.scales, i, 15)
        }
    }

    impl LevelsOf for BlockQ5K {
        fn levels(&self, i: usize) -> Levels {
            k4_levels(self.d, self.dmin, &self.scales, i, 31)
        }
    }

    impl LevelsOf for BlockQ6K {
        fn levels(&self, i: usize) -> Levels {
            let d = self.d.to_f32() * f32::from(self.scales[i / 16]);
            k_levels(d, 0.0, (-32, 31))
        }
    }

    impl LevelsOf for BlockIq4Nl {
        fn levels(&self, _: usize) -> Levels {
            iq4_table_levels(self.d, 1)
        }
    }

    impl LevelsOf for BlockIq4Xs {
        fn levels(&self, i: usize) -> Levels {
            iq4_table_levels(self.d, i32::from(self.scale(i / QK)))
        }
    }

    /// Quantises and dequantises the whole blocks of `x` and checks each weight: within half a
    /// gap of the nearest level of its block (plus its distance from the levels' range, where
    /// the format clamps it, and their f16 rounding where the quantiser levelled before it).
    /// With `reach`, levels chosen from the block's range must also reach each weight within a
    /// step (Q4_0's and Q5_0's top level is a step short of the largest magnitude's opposite).
    fn round_trip<B: LevelsOf>(x: &[f32], case: &str, reach: bool) {
        let mut y = vec![0.0; B::LEN];
        for (n, x) in x.chunks_exact(B::LEN).enumerate() {
            let b = B::quantise(x);
            b.dequantise_into(&mut y);
            for (i, (&x, &y)) in x.iter().zip(&y).enumerate() {
                let l = b.levels(i);
                let (d, m) = (l.d, l.m);
                let ends = [d * l.q.0 as f32 + m, d * l.q.1 as f32 + m];
                let (lo, hi) = (ends[0].min(ends[1]), ends[0].max(ends[1]));
                let outside = (lo - x).max(x - hi).max(0.0);
                let f32_rounding = 4.0 * f32::EPSILON * (x.abs().max(y.abs()) + m.abs());
                let slack = l.rounding + f32_rounding;
                let what = format!("{} {case}, block {n}, weight {i}", B::DTYPE.name());
                assert!(
                    (x - y).abs() <= l.gap * d.abs() / 2.0 + outside + slack,
                    "{what}: {x} dequantises to {y} (levels {lo}..={hi} by {d})"
                );
                assert!(
                    !(reach && l.reach) || outside <= d.abs() + slack,
                    "{what}: {x} is {outside} from the levels {lo}..={hi} (by {d})"
                );
            }
        }
    }

    /// `n` values uniform in `[lo, hi)` (xorshift).
    fn uniform(seed: u64, n: usize, (lo, hi): (f32, f32)) -> Vec<f32> {
        let mut s = seed;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..n).map(|_| lo + (hi - lo) * next()).collect()
    }

    fn round_trips<B: LevelsOf>() {
        let n = 8 * B::LEN;
        round_trip::<B>(&uniform(1, n, (-1.0, 1.0)), "uniform", true);
        round_trip::<B>(&uniform(2, n, (0.5, 1.5)), "positive", true);
        round_trip::<B>(&uniform(3, n, (-3e-3, 1e-3)), "small", true);
        round_trip::<B>(&vec![0.0; n], "zeros", false);
        round_trip::<B>(&vec![0.37; n], "constant", false);
        round_trip::<B>(&vec![-2.5; n], "negative constant", false);
        for outlier in [100.0, -100.0] {
            let mut x = uniform(4, n, (-0.01, 0.01));
            x.iter_mut().step_by(B::LEN).for_each(|v| *v = outlier);
            round_trip::<B>(&x, &format!("outlier {outlier}"), false);
        }
    }

    #[test]
    fn every_quantiser_gives_the_nearest_levels() {
        round_trips::<BlockQ4_0>();
        round_trips::<BlockQ4_1>();
        round_trips::<BlockQ5_0>();
        round_trips::<BlockQ5_1>();
        round_trips::<BlockQ8_0>();
        round_trips::<BlockIq4Nl>();
        round_trips::<BlockQ2K>();
        round_trips::<BlockQ3K>();
        round_trips::<BlockQ4K>();
        round_trips::<BlockQ5K>();
        round_trips::<BlockQ6K>();
        round_trips::<BlockIq4Xs>();
    }

    /// IQ4_NL has no `llama-quantize` fixture: these are the blocks ggml's `quantize_iq4_nl`
    /// (ggml-quants.c built with gcc for x86-64) writes for the same weights, with a sub-block
    /// of zeros and an outlier.
    #[test]
    fn iq4_nl_blocks_are_ggmls() {
        let x: [f32; 3 * QK] = std::array::from_fn(|i| match i {
            32..40 => 0.0,
            70 => 40.0,
            i => ((i * 7919) % 251) as f32 / 64.0 - 125.0 / 64.0,
        });
        let ggml: [[u8; 18]; 3] = [
            [
                0x24, 0x24, 0xd0, 0x59, 0xe1, 0x7b, 0xf3, 0x9c, 0x14, 0xbe, 0x36, 0xcf, 0x48, 0xe1,
                0x6a, 0xf2, 0x8c, 0x13,
            ],
            [
                0x96, 0xa3, 0xa8, 0x08, 0x88, 0xf8, 0x68, 0xe8, 0x48, 0xd8, 0x20, 0xb7, 0x1f, 0x95,
                0x0e, 0x73, 0xfc, 0x52,
            ],
            [
                0x0a, 0xb5, 0x78, 0x88, 0x88, 0x88, 0x88, 0x87, 0x80, 0x88, 0x88, 0x78, 0x88, 0x88,
                0x88, 0x88, 0x87, 0x88,
            ],
        ];
        for (n, (x, ggml)) in x.chunks_exact(QK).zip(&ggml).enumerate() {
            let ours = BlockIq4Nl::quantise(x);
            assert_eq!(bytemuck::bytes_of(&ours), ggml, "block {n}");
        }
    }

    /// Zeros quantise to zeros; Q2_K's, Q3_K's and Q6_K's super-block of zeros is all zero
    /// bytes, as ggml's, and IQ4_XS's `d` is -0 (ggml's `-max_scale / 32`).
    #[test]
    fn zeros_give_zeros() {
        let zeros = [0.0; QK_K];
        assert_eq!(bytemuck::bytes_of(&BlockQ2K::quantise(&zeros)), [0; 84]);
        assert_eq!(bytemuck::bytes_of(&BlockQ3K::quantise(&zeros)), [0; 110]);
        assert_eq!(bytemuck::bytes_of(&BlockQ6K::quantise(&zeros)), [0; 210]);
        assert_eq!(BlockIq4Xs::quantise(&zeros).d.to_bits(), 0x8000);
        let b = BlockQ4K::quantise(&zeros);
        assert_eq!((b.d.to_bits(), b.dmin.to_bits(), b.qs), (0, 0, [0; 128]));
    }

    #[test]
    fn nearest_int_rounds_halves_to_even() {
        let cases = [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (2.4999, 2),
            (-7.6, -8),
        ];
        for (x, want) in cases {
            assert_eq!(nearest_int(x), want, "{x}");
        }
    }

    /// More IQ4_NL blocks against ggml's `quantize_iq4_nl` (as above), by their FNV-1a hash:
    /// 512 of [`uniform`] weights and 64 whose scales are f16 subnormals (the choice of levels
    /// against the f32 scale, and the edges of the scale search, show in few blocks; the hash
    /// pins `uniform`'s values too).
    #[test]
    fn iq4_nl_blocks_hash_as_ggmls() {
        let x = [
            uniform(5, 512 * QK, (-1.0, 1.0)),
            uniform(6, 64 * QK, (-1e-6, 1e-6)),
        ]
        .concat();
        let blocks: Vec<BlockIq4Nl> = x.chunks_exact(QK).map(BlockIq4Nl::quantise).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&blocks);
        let fnv1a = (bytes.iter()).fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        assert_eq!(fnv1a, 0x6916_44c2_eb4c_c155);
    }

    #[test]
    fn packed_q3k_scales_unpack_as_ggml_reads_them() {
        let scales: [u8; 16] = std::array::from_fn(|j| (j * 13 + 7) as u8 % 64);
        let b = BlockQ3K {
            scales: pack_q3k_scales(scales),
            ..bytemuck::Zeroable::zeroed()
        };
        assert_eq!(b.unpacked_scales(), scales.map(|s| s as i8));
    }

    #[test]
    fn iq4_index_takes_the_nearest_level() {
        let cases = [
            (-200.0, 0),
            (-115.6, 0),
            (-115.5, 1),
            (0.0, 8),
            (-4.5, 8),
            (-4.6, 7),
            (101.0, 15),
            (1e9, 15),
            (f32::NAN, 15),
        ];
        for (x, want) in cases {
            assert_eq!(iq4_index(x), want, "{x}");
        }
    }

    #[test]
    fn packed_k4_scales_unpack_as_ggml_reads_them() {
        let pairs: [(u8, u8); 8] =
            std::array::from_fn(|j| ((j * 9 + 5) as u8 % 64, (63 - j * 7) as u8));
        let packed = pack_scale_min_k4(pairs);
        for (j, &pair) in pairs.iter().enumerate() {
            assert_eq!(scale_min_k4(j, &packed), pair, "pair {j}");
        }
    }

    #[test]
    #[should_panic(expected = "a block takes 32 weights, not 31")]
    fn a_short_block_is_refused() {
        BlockQ4_0::quantise(&[0.0; 31]);
    }
}
