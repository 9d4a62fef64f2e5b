//! Prefill's products with Q8_0, Q4_0, Q4_K and Q6_K weights in integers on CPUs with AVX-512
//! VNNI:
//! the weights of 16 rows are unpacked once into a panel of unsigned 8-bit levels (four
//! columns of all 16 rows in each 64-byte register), and every row of `x`, rounded to 8 bits
//! per block of the type ([`Rows8`]), is multiplied against it. One `vpdpbusd` multiplies a
//! register by four activations, broadcast, and adds the 64 products into the rows' 16 i32
//! lanes, where gemm's f32 FMA does 16 products and the AVX2 panel's `vpmaddubsw` 32 (with a
//! second instruction to widen them).
//!
//! Levels are unsigned: a weight is `d * (u - OFFSET)` for the 32-weight types (Q4_0's
//! nibbles, offset 8; Q8_0's signed bytes moved up by 128), whose offset is taken off each
//! block's integer sum as `OFFSET * sum(x)`; Q4_K's nibbles carry their sub-block scales and
//! minima as in `quant_panels`, Q6_K's six-bit levels their signed scales per 16 weights and an
//! offset of 32. The sums are exact integers per block (super-block for Q4_K),
//! as in decode's kernels, so the bound of `matmul::activation_rounding` holds; a row's f32
//! sum takes its blocks in order, whatever the group or task it falls in.

use std::arch::x86_64::*;

use super::quant_dots::{k4_scales, Dot8};
use super::quant_rows::Rows8;
use crate::quant::{BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8_0, QK, QK_K};

/// Weight rows per panel: one i32 lane each.
pub(super) const ROWS: usize = 16;

/// Columns of four weights per 32-weight (sub-)block.
const COLUMNS: usize = QK / 4;

/// Rows of `x` multiplied against the panel together (`x_rows!`), so that each panel register
/// loaded serves several rows, and the rows' sums are eight independent chains of `vpdpbusd`.
/// (Eight against four was not resolved by measurement on the noisy machine it was written on.)
const X_ROWS: usize = 8;

/// Sub-blocks of 32 weights per Q4_K super-block.
const SUBS: usize = QK_K / QK;

/// A block type whose weights the panel holds as unsigned levels.
pub(super) trait Levels: Dot8 {
    /// 32-weight sub-blocks per block.
    const SUBS: usize;
    /// Weights `32 j + 4 c .. + 4` of the block as unsigned levels, for `c` in `0..8`.
    fn words(&self, j: usize) -> [u32; COLUMNS];
}

/// A 32-weight type: weight `i` is `d * (u_i - OFFSET)`.
pub(super) trait Block32: Levels {
    const OFFSET: i32;
    /// The block's f16 scale, as bits.
    fn d(&self) -> u16;
}

/// The four bytes of `bytes` at `at`, as a little-endian word.
fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

const NIBBLES: u32 = 0x0f0f_0f0f;

impl Levels for BlockQ4_0 {
    const SUBS: usize = 1;
    /// Weight `i` is the low nibble of byte `i`, weight `i + 16` its high nibble.
    fn words(&self, _: usize) -> [u32; COLUMNS] {
        std::array::from_fn(|c| (word(&self.qs, 4 * (c % 4)) >> (4 * (c / 4))) & NIBBLES)
    }
}

impl Block32 for BlockQ4_0 {
    const OFFSET: i32 = 8;
    fn d(&self) -> u16 {
        self.d.to_bits()
    }
}

impl Levels for BlockQ8_0 {
    const SUBS: usize = 1;
    /// The signed bytes plus 128 (their top bit flipped).
    fn words(&self, _: usize) -> [u32; COLUMNS] {
        let qs: &[u8; QK] = bytemuck::cast_ref(&self.qs);
        std::array::from_fn(|c| word(qs, 4 * c) ^ 0x8080_8080)
    }
}

impl Block32 for BlockQ8_0 {
    const OFFSET: i32 = 128;
    fn d(&self) -> u16 {
        self.d.to_bits()
    }
}

impl Levels for BlockQ4K {
    const SUBS: usize = SUBS;
    /// Bytes 32 i .. 32 i + 32 of `qs` hold sub-block 2 i in their low nibbles and 2 i + 1 in
    /// their high ones.
    fn words(&self, j: usize) -> [u32; COLUMNS] {
        std::array::from_fn(|c| (word(&self.qs, QK * (j / 2) + 4 * c) >> (4 * (j % 2))) & NIBBLES)
    }
}

impl Levels for BlockQ6K {
    const SUBS: usize = SUBS;
    /// Sub-block `j = 4 h + k` is weights `l + 32 k` of half `h` (l < 32): the low four bits
    /// from `ql` (byte `l + 32 (k % 2)` of the half's 64, the high nibble for `k >= 2`), the
    /// high two from `qh` (byte `l` of the half's 32, bits `2 k`); 0 to 63, the weight being
    /// `d * sc * (u - 32)`.
    fn words(&self, j: usize) -> [u32; COLUMNS] {
        let (h, k) = (j / 4, j % 4);
        std::array::from_fn(|c| {
            let low = (word(&self.ql, 64 * h + 32 * (k % 2) + 4 * c) >> (4 * (k / 2))) & NIBBLES;
            let high = (word(&self.qh, 32 * h + 4 * c) >> (2 * k)) & 0x0303_0303;
            low | (high << 4)
        })
    }
}

/// Sixteen values as one register's lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn lanes32(v: [u32; ROWS]) -> __m512i {
    // SAFETY: 64 bytes read from `v`.
    unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
}

/// Sixteen f16 values, as bits, widened to f32 lanes.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
fn halves(h: [u16; ROWS]) -> __m512 {
    // SAFETY: 32 bytes read from `h`.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(h.as_ptr().cast()) })
}

/// Sixteen weight rows, unpacked: for 32-weight sub-block `s` (over the whole row) and column
/// `c`, `q[s * COLUMNS + c]` holds weights `32 s + 4 c .. + 4` of each row (lane `r` row `r`);
/// `d[b]` the rows' scales of block `b`. Q4_K's besides: `sc[s]` the rows' 6-bit scales of
/// sub-block `s` (i32 lanes), `m[b * SUBS / 2 + i]` their minima of sub-blocks `2 i` and
/// `2 i + 1` of super-block `b` (16-bit lanes `2 r` and `2 r + 1`), `dmin[b]` their f16 minimum
/// scales.
struct Panel {
    q: Vec<__m512i>,
    d: Vec<__m512>,
    sc: Vec<__m512i>,
    m: Vec<__m512i>,
    dmin: Vec<__m512>,
}

impl Panel {
    /// The levels of sixteen rows of `per_row` blocks each (`rows`, row-major), with no scales.
    #[target_feature(enable = "avx512f")]
    fn levels<B: Levels>(rows: &[B], per_row: usize) -> Panel {
        let mut q = Vec::with_capacity(per_row * B::SUBS * COLUMNS);
        for b in 0..per_row {
            for j in 0..B::SUBS {
                let words: [[u32; COLUMNS]; ROWS] =
                    std::array::from_fn(|r| rows[r * per_row + b].words(j));
                q.extend((0..COLUMNS).map(|c| lanes32(words.map(|w| w[c]))));
            }
        }
        Panel {
            q,
            d: Vec::new(),
            sc: Vec::new(),
            m: Vec::new(),
            dmin: Vec::new(),
        }
    }

    #[target_feature(enable = "avx512f,f16c")]
    fn block32<B: Block32>(rows: &[B], per_row: usize) -> Panel {
        let mut p = Panel::levels(rows, per_row);
        p.d = (0..per_row)
            .map(|b| halves(std::array::from_fn(|r| rows[r * per_row + b].d())))
            .collect();
        p
    }

    #[target_feature(enable = "avx512f,f16c")]
    fn q4k(rows: &[BlockQ4K], per_row: usize) -> Panel {
        let mut p = Panel::levels(rows, per_row);
        for b in 0..per_row {
            let blocks: [&BlockQ4K; ROWS] = std::array::from_fn(|r| &rows[r * per_row + b]);
            let scales = blocks.map(|blk| k4_scales(&blk.scales));
            p.d.push(halves(blocks.map(|blk| blk.d.to_bits())));
            p.dmin.push(halves(blocks.map(|blk| blk.dmin.to_bits())));
            for j in 0..SUBS {
                p.sc.push(lanes32(scales.map(|(sc, _)| u32::from(sc[j]))));
            }
            for i in 0..SUBS / 2 {
                let pair = |(_, m): ([u8; 8], [u8; 8])| {
                    u32::from(m[2 * i]) | (u32::from(m[2 * i + 1]) << 16)
                };
                p.m.push(lanes32(scales.map(pair)));
            }
        }
        p
    }
}

/// Q6_K's sub-blocks of 16 weights per super-block.
const SUBS16: usize = QK_K / 16;

impl Panel {
    /// Q6_K's panel: `sc[b * 16 + g]` the rows' signed scales of sub-block `g` of 16 (i32
    /// lanes), `m[b * 8 + i]` those of sub-blocks `2 i` and `2 i + 1` in 16-bit lanes `2 r` and
    /// `2 r + 1`, `d[b]` the rows' f16 scales and `dmin[b]` 32 times them: the offset of 32 is
    /// taken off as Q4_K's minima are.
    #[target_feature(enable = "avx512f,f16c")]
    fn q6k(rows: &[BlockQ6K], per_row: usize) -> Panel {
        let mut p = Panel::levels(rows, per_row);
        for b in 0..per_row {
            let blocks: [&BlockQ6K; ROWS] = std::array::from_fn(|r| &rows[r * per_row + b]);
            let d = halves(blocks.map(|blk| blk.d.to_bits()));
            p.d.push(d);
            p.dmin.push(_mm512_mul_ps(d, _mm512_set1_ps(32.0)));
            for g in 0..SUBS16 {
                p.sc.push(lanes32(blocks.map(|blk| i32::from(blk.scales[g]) as u32)));
            }
            for i in 0..SUBS16 / 2 {
                let pair = |blk: &BlockQ6K| {
                    let lane = |g: usize| u32::from(i16::from(blk.scales[g]) as u16);
                    lane(2 * i) | (lane(2 * i + 1) << 16)
                };
                p.m.push(lanes32(blocks.map(pair)));
            }
        }
        p
    }
}

/// Rows of `x` with the sums of their 32-value blocks: `sums[r * (k / 32) + s]`, at most
/// 32 * 127 in magnitude.
fn sums32(x: &Rows8) -> Vec<i32> {
    x.sums
        .chunks_exact(QK / super::quant_rows::SUM_LEN)
        .map(|s| s.iter().map(|&v| i32::from(v)).sum())
        .collect()
}

/// Where a panel's results go: value `(r, o)` (row `r` of `x`, weight row `o` of the panel) at
/// `ptr + r * stride + o`.
struct Out {
    ptr: *mut f32,
    stride: usize,
}

impl Out {
    /// Row `r`'s sixteen values.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, and `ptr` be valid for row `r`'s sixteen values.
    #[inline(always)]
    unsafe fn store(&self, r: usize, v: __m512) {
        // SAFETY: forwarded from the caller.
        unsafe { _mm512_storeu_ps(self.ptr.add(r * self.stride), v) };
    }
}

/// For `R` rows of `x` from row `r0`: the products of columns `columns` of sub-block `s` of
/// the panel (whose activations are values `32 s .. 32 s + 32` of each row) as 16 i32 lanes per
/// row. The columns' registers and the rows' activations are taken as arrays first, so that
/// the unrolled loop indexes them with constants and checks no bounds.
#[inline(always)]
fn sub_block<const R: usize>(
    p: &Panel,
    x: &Rows8,
    r0: usize,
    s: usize,
    columns: std::ops::Range<usize>,
) -> [__m512i; R] {
    let q: &[__m512i; COLUMNS] = p.q[s * COLUMNS..][..COLUMNS].try_into().expect("columns");
    let xs: [&[i8; QK]; R] = std::array::from_fn(|r| {
        x.q[(r0 + r) * x.k + QK * s..][..QK]
            .try_into()
            .expect("a sub-block")
    });
    // SAFETY: inlined into the kernels, whose callers checked the CPU.
    unsafe {
        let mut dot = [_mm512_setzero_si512(); R];
        for c in columns {
            let q = q[c];
            for (dot, xs) in dot.iter_mut().zip(xs) {
                // Four activations, broadcast to every lane.
                let four = [xs[4 * c], xs[4 * c + 1], xs[4 * c + 2], xs[4 * c + 3]];
                let four = _mm512_set1_epi32(i32::from_le_bytes(four.map(|v| v as u8)));
                *dot = _mm512_dpbusd_epi32(*dot, q, four);
            }
        }
        dot
    }
}

/// Rows `r0 .. r0 + R` of `x` times a 32-weight type's panel: per block, the integer sum less
/// `OFFSET * sum(x)`, scaled by the rows' and the activations' scales.
#[inline(always)]
fn rows_times_block32<const R: usize>(
    p: &Panel,
    offset: i32,
    x: &Rows8,
    sums: &[i32],
    r0: usize,
    dst: &Out,
) {
    // SAFETY: inlined into `block32`, whose caller checked the CPU; its caller made `dst`
    // valid for these rows.
    unsafe {
        let blocks = x.k / QK;
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..blocks {
            let dot = sub_block::<R>(p, x, r0, b, 0..COLUMNS);
            for r in 0..R {
                let at = (r0 + r) * blocks + b;
                let exact = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(offset * sums[at]));
                let scale = _mm512_mul_ps(p.d[b], _mm512_set1_ps(x.d[at]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
            }
        }
        for (r, &acc) in acc.iter().enumerate() {
            dst.store(r0 + r, acc);
        }
    }
}

/// Rows `r0 .. r0 + R` of `x` times a k-quant panel: per super-block, the integer sum of each
/// sub-block's products times its scale, `sum_g sc_g (u . x)_g`, and of its minimum times the
/// activations' sum over it, `sum_g m_g sum(x)_g` (`pairs` holds those sums two to a word),
/// scaled by `d` and `dmin` and the activations' scale. Q4_K (`SIXTEENS` false): eight
/// sub-blocks of 32, at most 8 * 63 * 32 * 15 * 127 per lane (under 2^25) and 8 * 63 * 32 * 127.
/// Q6_K (`SIXTEENS`): sixteen sub-blocks of 16 with signed scales, whose offset of 32 is the
/// "minimum" (`dmin = 32 d`): at most 16 * 128 * 16 * 63 * 127 (under 2^28) and
/// 16 * 128 * 16 * 127.
#[inline(always)]
fn rows_times_k<const R: usize, const SIXTEENS: bool>(
    p: &Panel,
    x: &Rows8,
    pairs: &[i32],
    r0: usize,
    dst: &Out,
) {
    let minima = if SIXTEENS { SUBS16 / 2 } else { SUBS / 2 };
    // SAFETY: inlined into `q4k` and `q6k`, whose callers checked the CPU and made `dst`
    // valid for these rows.
    unsafe {
        let per_row = x.k / QK_K;
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..per_row {
            let mut sums = [_mm512_setzero_si512(); R];
            for j in 0..SUBS {
                let s = b * SUBS + j;
                // (Loops, not closures: a closure would not share the kernel's instructions.)
                if SIXTEENS {
                    let first = sub_block::<R>(p, x, r0, s, 0..COLUMNS / 2);
                    let second = sub_block::<R>(p, x, r0, s, COLUMNS / 2..COLUMNS);
                    let (sc0, sc1) = (p.sc[2 * s], p.sc[2 * s + 1]);
                    for r in 0..R {
                        let both = _mm512_add_epi32(
                            _mm512_mullo_epi32(first[r], sc0),
                            _mm512_mullo_epi32(second[r], sc1),
                        );
                        sums[r] = _mm512_add_epi32(sums[r], both);
                    }
                } else {
                    let dot = sub_block::<R>(p, x, r0, s, 0..COLUMNS);
                    for r in 0..R {
                        sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(dot[r], p.sc[s]));
                    }
                }
            }
            for r in 0..R {
                let at = (r0 + r) * per_row + b;
                let xs = &pairs[at * minima..][..minima];
                let mut mins = _mm512_setzero_si512();
                for (&m, &xs) in p.m[b * minima..][..minima].iter().zip(xs) {
                    mins = _mm512_add_epi32(mins, _mm512_madd_epi16(m, _mm512_set1_epi32(xs)));
                }
                let dx = _mm512_set1_ps(x.d[at]);
                let (d, dmin) = (_mm512_mul_ps(p.d[b], dx), _mm512_mul_ps(p.dmin[b], dx));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), d, acc[r]);
                acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), dmin, acc[r]);
            }
        }
        for (r, &acc) in acc.iter().enumerate() {
            dst.store(r0 + r, acc);
        }
    }
}

/// `body` for runs of `$n` rows of `x` from row `$r0`: as many of `X_ROWS` as there are, then at most one each of four, two and one, so that four instantiations of a kernel
/// cover every count.
macro_rules! x_rows {
    ($t:expr, |$r0:ident, $n:ident| $body:expr) => {{
        let mut $r0 = 0;
        x_rows!(@runs $t, $r0, $n, $body, X_ROWS);
        x_rows!(@runs $t, $r0, $n, $body, 4);
        x_rows!(@runs $t, $r0, $n, $body, 2);
        x_rows!(@runs $t, $r0, $n, $body, 1);
    }};
    (@runs $t:expr, $r0:ident, $n:ident, $body:expr, $size:expr) => {
        while $t - $r0 >= $size {
            const $n: usize = $size;
            $body;
            $r0 += $size;
        }
    };
}

/// The kernels' loop: for each group of sixteen rows of `$w` (`$len` weights a block), its
/// panel `$panel(rows, blocks per row)`, and `$body` for every run of `$n` rows of `x` from
/// `$r0`, into `$dst`.
macro_rules! each_panel {
    ($w:expr, $x:expr, $out:expr, $stride:expr, $len:expr, $panel:expr,
     |$p:ident, $r0:ident, $n:ident, $dst:ident| $body:expr) => {{
        let per_row = $x.k / $len;
        for g in 0..$w.len() / per_row / ROWS {
            let $p = $panel(&$w[ROWS * g * per_row..][..ROWS * per_row], per_row);
            let $dst = Out {
                // SAFETY: the kernel's caller made `out` valid for the group's columns.
                ptr: unsafe { $out.add(ROWS * g) },
                stride: $stride,
            };
            x_rows!($x.rows(), |$r0, $n| $body);
        }
    }};
}

/// A 32-weight type's weight rows `w` (whole groups of sixteen) against every row of `x`, into
/// `out[r * stride + o]` for row `r` of `x` and weight row `o`.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI, AVX2, FMA and F16C; `out` must be valid for
/// those writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn block32<B: Block32>(w: &[B], x: &Rows8, out: *mut f32, stride: usize) {
    let sums = sums32(x);
    each_panel!(w, x, out, stride, QK, Panel::block32, |p, r0, R, dst| {
        rows_times_block32::<R>(&p, B::OFFSET, x, &sums, r0, &dst)
    });
}

/// Q4_K's weight rows `w` (whole groups of sixteen) against every row of `x`, as [`block32`].
///
/// # Safety
/// As [`block32`]'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4k(w: &[BlockQ4K], x: &Rows8, out: *mut f32, stride: usize) {
    // The activations' sums over sub-blocks 2 i and 2 i + 1 of 32, in the low and high 16 bits.
    let pairs = pairs(&sums32(x));
    each_panel!(w, x, out, stride, QK_K, Panel::q4k, |p, r0, R, dst| {
        rows_times_k::<R, false>(&p, x, &pairs, r0, &dst)
    });
}

/// Q6_K's weight rows `w` (whole groups of sixteen) against every row of `x`, as [`block32`].
///
/// # Safety
/// As [`block32`]'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q6k(w: &[BlockQ6K], x: &Rows8, out: *mut f32, stride: usize) {
    // The activations' sums over sub-blocks 2 i and 2 i + 1 of 16, in the low and high 16 bits.
    let sums: Vec<i32> = x.sums.iter().map(|&s| i32::from(s)).collect();
    let pairs = pairs(&sums);
    each_panel!(w, x, out, stride, QK_K, Panel::q6k, |p, r0, R, dst| {
        rows_times_k::<R, true>(&p, x, &pairs, r0, &dst)
    });
}

/// Consecutive sums in pairs: the first in the low 16 bits, the second in the high ones (each
/// within i16), as `vpmaddwd` takes them.
fn pairs(sums: &[i32]) -> Vec<i32> {
    sums.chunks_exact(2)
        .map(|s| (s[0] & 0xFFFF) | (s[1] << 16))
        .collect()
}
