//! Decode's dot products with quantised weights on aarch64, in integers as on x86_64
//! (`quant_dots`): each row of `x` is rounded to 8 bits per block of the weight type
//! ([`Rows8`]), each weight block is unpacked to signed 8-bit levels with integer sub-block
//! scales ([`Levels`]), and their products are summed in i32 with NEON (`smull`, pairwise
//! adds), converted to f32 once per block. NEON is part of every aarch64 target, so there is no
//! run-time check. The dot-product extension's `sdot` would take four times fewer
//! instructions, but its intrinsics are not stable Rust yet.
//!
//! The types without levels here (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K) take the portable kernel.
//!
//! Compile-checked for the Apple targets and run (its tests) under qemu-user on Linux; not run
//! or timed on Apple hardware.

use std::arch::aarch64::*;

use super::quant_rows::{Rows8, SUM_LEN};
use crate::quant::{
    scale_min_k4, BlockIq4Nl, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1,
    BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, QuantBlock, IQ4_VALUES, QK, QK_K,
};

/// A block's scales: weight `i` is `d * sc[i / SUB] * q[i] - dmin * m[i / SUB]`.
pub struct Scales {
    d: f32,
    dmin: f32,
    sc: [i16; QK_K / 16],
    m: [i16; QK_K / 16],
}

impl Scales {
    /// One scale for the whole block (the 32-weight types).
    fn one(d: f32) -> Scales {
        let mut sc = [0; QK_K / 16];
        sc[0] = 1;
        Scales {
            d,
            dmin: 0.0,
            sc,
            m: [0; QK_K / 16],
        }
    }
}

/// A quantised type as signed 8-bit levels and integer scales, where it has them here
/// (`INTEGER`; the others keep the portable kernel).
pub trait Levels: QuantBlock {
    /// Whether [`Levels::levels`] is implemented.
    const INTEGER: bool = true;
    /// Weights per scale: the block's length for the 32-weight types.
    const SUB: usize = Self::LEN;

    /// Writes the block's `LEN` levels to the start of `q` and returns its scales.
    fn levels(&self, _q: &mut [i8; QK_K]) -> Scales {
        unreachable!("{:?} has no integer levels", Self::DTYPE)
    }
}

/// `level(nibble)` for Q4_0's layout: low nibbles are weights 0..16, high ones 16..32.
#[inline(always)]
fn nibble_levels(qs: &[u8; QK / 2], q: &mut [i8], level: impl Fn(u8) -> i8) {
    let (lo, hi) = q.split_at_mut(QK / 2);
    for ((&b, lo), hi) in qs.iter().zip(lo).zip(hi) {
        *lo = level(b & 0xF);
        *hi = level(b >> 4);
    }
}

impl Levels for BlockQ8_0 {
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        q[..QK].copy_from_slice(&self.qs);
        Scales::one(self.d.to_f32())
    }
}

impl Levels for BlockQ4_0 {
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        nibble_levels(&self.qs, q, |n| n as i8 - 8);
        Scales::one(self.d.to_f32())
    }
}

impl Levels for BlockIq4Nl {
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        nibble_levels(&self.qs, q, |n| IQ4_VALUES[usize::from(n)]);
        Scales::one(self.d.to_f32())
    }
}

/// Q4_K's and Q5_K's levels (sub-block `j` of 32: bytes `32 (j / 2)..` of `qs`, low nibbles
/// for even `j`, with the fifth bit `j` of `qh[l]` for Q5_K) and their 6-bit scales and minima.
fn k4_levels(
    (d, dmin, scales): (f32, f32, &[u8; 12]),
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
    q: &mut [i8; QK_K],
) -> Scales {
    let mut s = Scales {
        d,
        dmin,
        sc: [0; QK_K / 16],
        m: [0; QK_K / 16],
    };
    for j in 0..QK_K / QK {
        let (sc, m) = scale_min_k4(j, scales);
        (s.sc[j], s.m[j]) = (i16::from(sc), i16::from(m));
        let bytes = &qs[QK * (j / 2)..][..QK];
        for (l, (&b, q)) in bytes.iter().zip(&mut q[QK * j..][..QK]).enumerate() {
            let nibble = if j % 2 == 0 { b & 0xF } else { b >> 4 };
            let high = qh.map_or(0, |h| ((h[l] >> j) & 1) << 4);
            *q = (nibble | high) as i8;
        }
    }
    s
}

impl Levels for BlockQ4K {
    const SUB: usize = QK;
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        let d = (self.d.to_f32(), self.dmin.to_f32(), &self.scales);
        k4_levels(d, &self.qs, None, q)
    }
}

impl Levels for BlockQ5K {
    const SUB: usize = QK;
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        let d = (self.d.to_f32(), self.dmin.to_f32(), &self.scales);
        k4_levels(d, &self.qs, Some(&self.qh), q)
    }
}

impl Levels for BlockQ6K {
    const SUB: usize = 16;
    /// Levels `q - 32` of the 6-bit values (half `h` of 128: weight `l + 32 k` takes the low
    /// bits from `ql[64 h + l + 32 (k % 2)]`, the high nibble for `k >= 2`, and bits `2 k` of
    /// `qh[32 h + l]`), with signed 8-bit scales per 16.
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        for (half, q) in q.chunks_exact_mut(128).enumerate() {
            let ql = &self.ql[64 * half..][..64];
            let qh = &self.qh[32 * half..][..32];
            for l in 0..32 {
                for k in 0..4 {
                    let low = ql[l + 32 * (k % 2)] >> (4 * (k / 2)) & 0xF;
                    let high = (qh[l] >> (2 * k)) & 3;
                    q[l + 32 * k] = (low | (high << 4)) as i8 - 32;
                }
            }
        }
        Scales {
            d: self.d.to_f32(),
            dmin: 0.0,
            sc: self.scales.map(i16::from),
            m: [0; QK_K / 16],
        }
    }
}

impl Levels for BlockIq4Xs {
    const SUB: usize = QK;
    fn levels(&self, q: &mut [i8; QK_K]) -> Scales {
        let mut sc = [0; QK_K / 16];
        for (j, (qs, q)) in self
            .qs
            .chunks_exact(QK / 2)
            .zip(q.chunks_exact_mut(QK))
            .enumerate()
        {
            sc[j] = self.scale(j);
            let qs: &[u8; QK / 2] = qs.try_into().expect("16 bytes");
            nibble_levels(qs, q, |n| IQ4_VALUES[usize::from(n)]);
        }
        Scales {
            d: self.d.to_f32(),
            dmin: 0.0,
            sc,
            m: [0; QK_K / 16],
        }
    }
}

impl Levels for BlockQ4_1 {
    const INTEGER: bool = false;
}
impl Levels for BlockQ5_0 {
    const INTEGER: bool = false;
}
impl Levels for BlockQ5_1 {
    const INTEGER: bool = false;
}
impl Levels for BlockQ2K {
    const INTEGER: bool = false;
}
impl Levels for BlockQ3K {
    const INTEGER: bool = false;
}

/// `sum a[i] * b[i]` over 16 or 32 signed bytes: products in i16 (at most 128 * 127), summed
/// pairwise into i32.
#[inline]
fn dot(a: &[i8], b: &[i8]) -> i32 {
    // SAFETY: NEON is part of every aarch64 target; each load reads 16 bytes of a chunk of 16.
    unsafe {
        let mut acc = vdupq_n_s32(0);
        for (a, b) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
            let (a, b) = (vld1q_s8(a.as_ptr()), vld1q_s8(b.as_ptr()));
            acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            acc = vpadalq_s16(acc, vmull_high_s8(a, b));
        }
        vaddvq_s32(acc)
    }
}

/// Weight rows `w` (`[rows, x.k]`) into `out` (`[rows, t]`) against the `t` rows of `x`
/// (quantised per block of `B::LEN`). Each row's sum takes its blocks in order.
///
/// The integer sums are bounded: at most 16 sub-blocks (Q6_K's: 16 * 32 * 127 each, times a
/// scale of at most 128) or 8 (IQ4_XS's: 32 * 127 * 127, times 32; Q5_K's: 32 * 31 * 127,
/// times 63) give under 2^28.
pub fn dots_task<B: Levels>(x: &Rows8, w: &[B], out: &mut [f32]) {
    assert!(B::INTEGER, "{:?} has no integer levels", B::DTYPE);
    assert_eq!(
        x.q.len(),
        x.d.len() * B::LEN,
        "rows quantised per block of B::LEN"
    );
    let (t, k, per_row) = (x.rows(), x.k, x.k / B::LEN);
    let mut q = [0i8; QK_K];
    for (wr, out_r) in w.chunks_exact(per_row).zip(out.chunks_exact_mut(t)) {
        out_r.fill(0.0);
        for (b, block) in wr.iter().enumerate() {
            let s = block.levels(&mut q);
            for (r, o) in out_r.iter_mut().enumerate() {
                let at = r * k + b * B::LEN;
                let xq = &x.q[at..][..B::LEN];
                let mut products = 0i32;
                let subs = q[..B::LEN]
                    .chunks_exact(B::SUB)
                    .zip(xq.chunks_exact(B::SUB));
                for (&sc, (q, xq)) in s.sc.iter().zip(subs) {
                    products += i32::from(sc) * dot(q, xq);
                }
                let mut minima = 0i32;
                if s.dmin != 0.0 {
                    let sums =
                        x.sums[at / SUM_LEN..][..B::LEN / SUM_LEN].chunks_exact(B::SUB / SUM_LEN);
                    for (&m, sums) in s.m.iter().zip(sums) {
                        let sum: i32 = sums.iter().map(|&v| i32::from(v)).sum();
                        minima += i32::from(m) * sum;
                    }
                }
                let dx = x.d[r * per_row + b];
                *o += s.d * dx * products as f32 - s.dmin * dx * minima as f32;
            }
        }
    }
}
