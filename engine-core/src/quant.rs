//! llama.cpp's quantised weight formats: each block byte for byte as ggml stores it, and its
//! weights by ggml's definition (`dequantize_row_*` in ggml-quants.c: the same float operations
//! in the same order, so the values are the reference's bit for bit). The kernels
//! (`backend::cpu::matmul`, the WGSL ones) compute with these values; only Q8_0 is also written
//! (`BlockQ8_0::quantise`), the rest are read from GGUF files that llama.cpp wrote.

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

impl QuantBlock for BlockQ4_0 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q4_0;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        nibbles(&self.qs, out, |q| (i32::from(q) - 8) as f32 * d);
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

impl QuantBlock for BlockQ5_0 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q5_0;
    fn dequantise_into(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        fives(self.qh, &self.qs, out, |q| (i32::from(q) - 16) as f32 * d);
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

impl QuantBlock for BlockQ8_0 {
    const LEN: usize = QK;
    const DTYPE: DType = DType::Q8_0;
    fn dequantise_into(&self, out: &mut [f32]) {
        out.copy_from_slice(&self.dequantise());
    }
}

impl BlockQ8_0 {
    /// ggml's reference quantisation (`quantize_row_q8_0_ref`): the scale maps the largest
    /// magnitude to 127, each weight rounds to nearest (halves away from zero).
    pub fn quantise(x: &[f32; QK]) -> BlockQ8_0 {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs: x.map(|v| (v * id).round() as i8),
        }
    }

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

impl BlockQ3K {
    /// The 16 six-bit scales, unpacked as ggml's `dequantize_row_q3_K` does.
    fn unpacked_scales(&self) -> [i8; 16] {
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

impl QuantBlock for BlockQ4K {
    const LEN: usize = QK_K;
    const DTYPE: DType = DType::Q4K;
    fn dequantise_into(&self, out: &mut [f32]) {
        dequantise_k4((self.d, self.dmin), &self.scales, &self.qs, None, out);
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
            let low = (self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
            let high = ((self.scales_h >> (2 * ib)) & 3) as u8;
            let dl = d * (i32::from(low | (high << 4)) - 32) as f32;
            let qs: &[u8; QK / 2] = qs.try_into().expect("16 bytes");
            nibbles(qs, out, |q| dl * f32::from(IQ4_VALUES[q as usize]));
        }
    }
}
