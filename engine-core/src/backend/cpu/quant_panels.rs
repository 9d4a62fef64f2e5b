//! Prefill's products in integers: which panel kernel a CPU and a weight type take (here for
//! AVX2, `vnni_panels` for AVX-512 VNNI), and the tasks that run it.
//!
//! Q4_K on AVX2: the weights of eight rows are
//! unpacked once into a panel (their 4-bit levels as bytes, four columns of all eight rows in
//! each 32-byte register; their sub-block scales and minima as 16-bit lanes, two per row), and
//! every row of `x`, rounded to 8 bits per 256 values ([`Rows8`]), is multiplied against the
//! panel. `vpmaddubsw` then takes 32 products per instruction where gemm's f32 FMA takes 8, and
//! the weights are neither widened to f32 nor packed for each block of rows as gemm needs them.
//! Q4_0 on AVX2 the same way, with one f16 scale per row and block of 32, its offset of 8 taken
//! off as `8 * sum(x)`.
//!
//! The products are the decode kernel's (`quant_dots`): the same 8-bit activations, exact
//! integer sums per super-block, so the bound of `matmul::activation_rounding` holds. A row's
//! f32 sum takes its super-blocks in order, whatever the group or task it falls in.

use std::arch::x86_64::*;

use super::matmul::{column_blocks, rows_per_task};
use super::quant_dots::{dots_task, k4_scales, Dot8, Isa};
use super::quant_rows::Rows8;
use super::vnni_panels::{self, Block32, Levels};
use crate::quant::{BlockQ4K, BlockQ4_0, BlockQ8_0, QK, QK_K};
use crate::tensor::{DType, Data};

/// Sub-blocks of 32 weights per super-block.
const SUBS: usize = QK_K / QK;

/// Columns of four weights per sub-block.
const COLUMNS: usize = QK / 4;

/// Rows of `x` multiplied against the panel together, so that each panel register loaded
/// serves several rows (four: their sums and accumulators take 12 of the 16 registers).
const X_ROWS: usize = 4;

/// Eight weight rows of Q4_K, unpacked: for super-block `b`, sub-block `j` and column `c`,
/// `q[(b * SUBS + j) * COLUMNS + c]` holds weights `32 j + 4 c .. + 4` of each row (lane `r`
/// row `r`, one byte per weight); `sc[b * SUBS + j]` row `r`'s 6-bit scale of sub-block `j`
/// in 16-bit lanes `2 r` and `2 r + 1`; `m[b * SUBS / 2 + i]` row `r`'s minima of sub-blocks
/// `2 i` and `2 i + 1` in lanes `2 r` and `2 r + 1`; `d` and `dmin` the rows' f16 scales.
struct Panel {
    q: Vec<__m256i>,
    sc: Vec<__m256i>,
    m: Vec<__m256i>,
    d: Vec<__m256>,
    dmin: Vec<__m256>,
}

impl Panel {
    fn new(blocks: usize) -> Panel {
        // SAFETY: an all-zero vector is a valid value.
        let zero = unsafe { _mm256_setzero_si256() };
        Panel {
            q: vec![zero; blocks * SUBS * COLUMNS],
            sc: vec![zero; blocks * SUBS],
            m: vec![zero; blocks * SUBS / 2],
            d: vec![unsafe { _mm256_setzero_ps() }; blocks],
            dmin: vec![unsafe { _mm256_setzero_ps() }; blocks],
        }
    }

    /// Unpacks eight rows of `per_row` super-blocks each (`rows`, row-major).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fill(&mut self, rows: &[BlockQ4K], per_row: usize) {
        let nib = _mm256_set1_epi8(0xF);
        for b in 0..per_row {
            let blocks: [&BlockQ4K; 8] = std::array::from_fn(|r| &rows[r * per_row + b]);
            let scales = blocks.map(|blk| k4_scales(&blk.scales));
            let lanes = |f: &dyn Fn(usize) -> i16| {
                let v: [i16; 16] = std::array::from_fn(f);
                // SAFETY: 32 bytes read from `v`.
                unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
            };
            for j in 0..SUBS {
                self.sc[b * SUBS + j] = lanes(&|l| i16::from(scales[l / 2].0[j]));
            }
            for i in 0..SUBS / 2 {
                self.m[b * SUBS / 2 + i] = lanes(&|l| i16::from(scales[l / 2].1[2 * i + l % 2]));
            }
            let halves = |f: &dyn Fn(&BlockQ4K) -> u16| {
                let h: [u16; 8] = blocks.map(f);
                // SAFETY: 16 bytes read from `h`.
                _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr().cast()) })
            };
            self.d[b] = halves(&|blk| blk.d.to_bits());
            self.dmin[b] = halves(&|blk| blk.dmin.to_bits());
            // Bytes 32 i .. 32 i + 32 of `qs` hold sub-block 2 i in their low nibbles and
            // 2 i + 1 in their high ones.
            for i in 0..SUBS / 2 {
                for c in 0..COLUMNS {
                    let words: [u32; 8] = blocks.map(|blk| {
                        let at = QK * i + 4 * c;
                        u32::from_le_bytes(blk.qs[at..at + 4].try_into().expect("4 bytes"))
                    });
                    // SAFETY: 32 bytes read from `words`.
                    let q = unsafe { _mm256_loadu_si256(words.as_ptr().cast()) };
                    let at = |j: usize| (b * SUBS + j) * COLUMNS + c;
                    self.q[at(2 * i)] = _mm256_and_si256(q, nib);
                    self.q[at(2 * i + 1)] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nib);
                }
            }
        }
    }
}

/// The panel kernels this CPU has.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Panels {
    /// Q4_K and Q4_0, eight rows per 256-bit register (this module).
    Avx2,
    /// Q8_0, Q4_0, Q4_K and Q6_K, sixteen rows per 512-bit register (`vnni_panels`).
    Vnni,
}

impl Panels {
    /// AVX2's where the CPU has it without AVX-512 (with AVX-512 but no VNNI, gemm's 512-bit
    /// f32 kernel was faster than AVX2's panel: docs/PERFORMANCE.md); VNNI's where it has
    /// AVX-512 VNNI. `TETHER_ISA=avx2` takes AVX2's, as [`Isa::best`] says.
    fn best() -> Option<Panels> {
        match Isa::best()? {
            Isa::Avx2 => Some(Panels::Avx2),
            Isa::Avx512 => None,
            Isa::Vnni => Some(Panels::Vnni),
        }
    }
}

/// Whether prefill with `dtype` weights multiplies in integers on this CPU
/// (`matmul::integer_prefill`).
pub fn takes(dtype: DType) -> bool {
    takes_on(Panels::best(), dtype)
}

/// Whether `panels`' kernels multiply `dtype` ([`matmul_on`] returns true for it).
pub(super) fn takes_on(panels: Option<Panels>, dtype: DType) -> bool {
    match panels {
        Some(Panels::Avx2) => matches!(dtype, DType::Q4K | DType::Q4_0),
        Some(Panels::Vnni) => matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4K | DType::Q6K),
        None => false,
    }
}

/// `out[t, n] = x[t, k] . w[n, k]^T` on this CPU's panel kernel for `w`'s type, in tasks of
/// whole groups of its rows (the last rows, short of a group, on decode's kernel). False, with
/// `out` untouched, where [`takes`] says no or a value of `x` is not finite (which cannot be
/// rounded to integers): the caller takes gemm then.
pub fn matmul(x: &[f32], t: usize, w: &Data, n: usize, out: &mut [f32]) -> bool {
    matmul_on(Panels::best(), x, t, w, n, out)
}

/// [`matmul`] on `panels`' kernels, which the CPU must have (the tests run AVX2's on CPUs
/// that would take VNNI's).
pub(super) fn matmul_on(
    panels_: Option<Panels>,
    x: &[f32],
    t: usize,
    w: &Data,
    n: usize,
    out: &mut [f32],
) -> bool {
    use vnni_panels::{block32, q4k, q6k, ROWS};
    match (panels_, w) {
        (Some(Panels::Avx2), Data::Q4K(e)) => panels(x, t, e, n, out, (8, Isa::Avx2), groups),
        (Some(Panels::Avx2), Data::Q4_0(e)) => panels(x, t, e, n, out, (8, Isa::Avx2), groups_q4_0),
        (Some(Panels::Vnni), Data::Q4K(e)) => panels(x, t, e, n, out, (ROWS, Isa::Vnni), q4k),
        (Some(Panels::Vnni), Data::Q6K(e)) => panels(x, t, e, n, out, (ROWS, Isa::Vnni), q6k),
        (Some(Panels::Vnni), Data::Q4_0(e)) => {
            panels(x, t, e, n, out, (ROWS, Isa::Vnni), block32::<BlockQ4_0>)
        }
        (Some(Panels::Vnni), Data::Q8_0(e)) => {
            panels(x, t, e, n, out, (ROWS, Isa::Vnni), block32::<BlockQ8_0>)
        }
        _ => false,
    }
}

/// A panel kernel's product: `x` rounded per block of `B::LEN`; `kernel(rows of w, x, out,
/// n)` for each task's whole groups of `group` rows (`out` offset to the task's first
/// column); the rest on decode's kernel for `isa`, which the CPU must have, as it must the
/// kernel's instructions.
fn panels<B: Dot8>(
    x: &[f32],
    t: usize,
    w: &[B],
    n: usize,
    out: &mut [f32],
    (group, isa): (usize, Isa),
    kernel: unsafe fn(&[B], &Rows8, *mut f32, usize),
) -> bool {
    let k = x.len() / t;
    let Some(rows) = Rows8::quantise(x, k, B::LEN) else {
        return false;
    };
    let per_row = k / B::LEN;
    let block = rows_per_task(n).next_multiple_of(group);
    let grouped = n / group * group;
    column_blocks(out, grouped, block, |o0, group_rows, dst| {
        // SAFETY: `Panels::best` checked the CPU; the task writes columns `o0 .. o0 +
        // group_rows` of `out` (`[t, n]`), which no other task writes.
        unsafe {
            kernel(
                &w[o0 * per_row..][..group_rows * per_row],
                &rows,
                dst.add(o0),
                n,
            )
        }
    });
    if grouped < n {
        let mut tail = vec![0.0f32; (n - grouped) * t];
        // SAFETY: the CPU has `isa`'s instructions.
        unsafe { dots_task(isa, &rows, &w[grouped * per_row..], &mut tail) };
        for (o, values) in tail.chunks_exact(t).enumerate() {
            for (r, &v) in values.iter().enumerate() {
                out[r * n + grouped + o] = v;
            }
        }
    }
    true
}

/// Weight rows `w` (whole groups of eight) against every row of `x`, into `out[r * stride +
/// o]` for row `r` of `x` and weight row `o`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `out` must be valid for those writes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups(w: &[BlockQ4K], x: &Rows8, out: *mut f32, stride: usize) {
    let (t, per_row) = (x.rows(), x.k / QK_K);
    let mut panel = Panel::new(per_row);
    for g in 0..w.len() / per_row / 8 {
        panel.fill(&w[8 * g * per_row..][..8 * per_row], per_row);
        for r0 in (0..t).step_by(X_ROWS) {
            let dst = Out {
                // SAFETY: forwarded from the caller.
                ptr: unsafe { out.add(8 * g) },
                stride,
            };
            match (t - r0).min(X_ROWS) {
                4 => rows_times_panel::<4>(&panel, x, r0, &dst),
                3 => rows_times_panel::<3>(&panel, x, r0, &dst),
                2 => rows_times_panel::<2>(&panel, x, r0, &dst),
                _ => rows_times_panel::<1>(&panel, x, r0, &dst),
            }
        }
    }
}

/// Eight weight rows of Q4_0, unpacked: `q[b * COLUMNS + c]` holds weights `4 c .. 4 c + 4` of
/// each row's block `b` as unsigned nibbles (lane `r` row `r`, one byte per weight; the
/// weight is `d * (u - 8)`), `d[b]` the rows' f16 scales.
struct PanelQ4_0 {
    q: Vec<__m256i>,
    d: Vec<__m256>,
}

impl PanelQ4_0 {
    /// Unpacks eight rows of `per_row` blocks each (`rows`, row-major), reusing the buffers
    /// of the group before.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fill(&mut self, rows: &[BlockQ4_0], per_row: usize) {
        let PanelQ4_0 { q, d } = self;
        q.clear();
        d.clear();
        for b in 0..per_row {
            let blocks: [&BlockQ4_0; 8] = std::array::from_fn(|r| &rows[r * per_row + b]);
            let words = blocks.map(|blk| blk.words(0));
            q.extend((0..COLUMNS).map(|c| {
                let column: [u32; 8] = std::array::from_fn(|r| words[r][c]);
                // SAFETY: 32 bytes read from `column`.
                unsafe { _mm256_loadu_si256(column.as_ptr().cast()) }
            }));
            let h = blocks.map(|blk| blk.d());
            // SAFETY: 16 bytes read from `h`.
            d.push(_mm256_cvtph_ps(unsafe {
                _mm_loadu_si128(h.as_ptr().cast())
            }));
        }
    }
}

/// [`groups`] for Q4_0: weight rows `w` (whole groups of eight) against every row of `x`, into
/// `out[r * stride + o]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `out` must be valid for those writes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn groups_q4_0(w: &[BlockQ4_0], x: &Rows8, out: *mut f32, stride: usize) {
    let (t, per_row) = (x.rows(), x.k / QK);
    let mut panel = PanelQ4_0 {
        q: Vec::with_capacity(per_row * COLUMNS),
        d: Vec::with_capacity(per_row),
    };
    for g in 0..w.len() / per_row / 8 {
        panel.fill(&w[8 * g * per_row..][..8 * per_row], per_row);
        for r0 in (0..t).step_by(X_ROWS) {
            let dst = Out {
                // SAFETY: forwarded from the caller.
                ptr: unsafe { out.add(8 * g) },
                stride,
            };
            match (t - r0).min(X_ROWS) {
                4 => rows_times_q4_0::<4>(&panel, x, r0, &dst),
                3 => rows_times_q4_0::<3>(&panel, x, r0, &dst),
                2 => rows_times_q4_0::<2>(&panel, x, r0, &dst),
                _ => rows_times_q4_0::<1>(&panel, x, r0, &dst),
            }
        }
    }
}

/// Rows `r0 .. r0 + R` of `x` times a Q4_0 panel's eight weight rows, into `dst`: per block,
/// `vpmaddubsw` pairs of nibbles and activations (a lane sums eight pairs of at most
/// 2 * 15 * 127: 30480), widened by `vpmaddwd`, less `8 * sum(x)` for the offset.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_times_q4_0<const R: usize>(panel: &PanelQ4_0, x: &Rows8, r0: usize, dst: &Out) {
    let k = x.k;
    let per_row = k / QK;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..per_row {
        let xq: [&[i8]; R] = std::array::from_fn(|r| &x.q[(r0 + r) * k + b * QK..][..QK]);
        let mut pairs = [_mm256_setzero_si256(); R];
        for c in 0..COLUMNS {
            let q = panel.q[b * COLUMNS + c];
            for r in 0..R {
                let word: &[i8; 4] = xq[r][4 * c..][..4].try_into().expect("4");
                let xb = _mm256_set1_epi32(i32::from_le_bytes(word.map(|v| v as u8)));
                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(q, xb));
            }
        }
        for r in 0..R {
            let at = ((r0 + r) * k + b * QK) / 16;
            let sum = i32::from(x.sums[at]) + i32::from(x.sums[at + 1]);
            let dots = _mm256_sub_epi32(
                _mm256_madd_epi16(pairs[r], ones),
                _mm256_set1_epi32(BlockQ4_0::OFFSET * sum),
            );
            let dx = _mm256_set1_ps(x.d[(r0 + r) * per_row + b]);
            acc[r] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dots),
                _mm256_mul_ps(panel.d[b], dx),
                acc[r],
            );
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: `groups_q4_0`'s caller made `dst` valid for row `r0 + r`'s eight values.
        unsafe { _mm256_storeu_ps(dst.ptr.add((r0 + r) * dst.stride), *acc) };
    }
}

/// Where a group's results go: value `(r, o)` (row `r` of `x`, weight row `o` of the group)
/// at `ptr + r * stride + o`.
struct Out {
    ptr: *mut f32,
    stride: usize,
}

/// Rows `r0 .. r0 + R` of `x` times the panel's eight weight rows, into `dst`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_times_panel<const R: usize>(panel: &Panel, x: &Rows8, r0: usize, dst: &Out) {
    let k = x.k;
    let per_row = k / QK_K;
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..per_row {
        let xq: [&[i8]; R] = std::array::from_fn(|r| &x.q[(r0 + r) * k + b * QK_K..][..QK_K]);
        let mut sums = [_mm256_setzero_si256(); R];
        for j in 0..SUBS {
            // A lane sums eight pairs of at most 2 * 15 * 127: 30480.
            let mut pairs = [_mm256_setzero_si256(); R];
            for c in 0..COLUMNS {
                let q = panel.q[(b * SUBS + j) * COLUMNS + c];
                for r in 0..R {
                    let word: &[i8; 4] = xq[r][QK * j + 4 * c..][..4].try_into().expect("4");
                    let xb = _mm256_set1_epi32(i32::from_le_bytes(word.map(|v| v as u8)));
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(q, xb));
                }
            }
            // At most 63 * 2 * 30480 per sub-block, eight sub-blocks: under 2^25.
            let sc = panel.sc[b * SUBS + j];
            for r in 0..R {
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], sc));
            }
        }
        for r in 0..R {
            let dx = _mm256_set1_ps(x.d[(r0 + r) * per_row + b]);
            // `sum_j m_j sum(x)_j` over the eight sub-blocks, for each weight row (lane):
            // at most 8 * 63 * 32 * 127.
            let xs = &x.sums[((r0 + r) * k + b * QK_K) / 16..][..QK_K / 16];
            let mut minima = _mm256_setzero_si256();
            for i in 0..SUBS / 2 {
                let sub = |j: usize| i32::from(xs[2 * j]) + i32::from(xs[2 * j + 1]);
                let pair = (sub(2 * i) & 0xFFFF) | (sub(2 * i + 1) << 16);
                let m = panel.m[b * SUBS / 2 + i];
                minima = _mm256_add_epi32(minima, _mm256_madd_epi16(m, _mm256_set1_epi32(pair)));
            }
            acc[r] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(sums[r]),
                _mm256_mul_ps(panel.d[b], dx),
                acc[r],
            );
            acc[r] = _mm256_fnmadd_ps(
                _mm256_cvtepi32_ps(minima),
                _mm256_mul_ps(panel.dmin[b], dx),
                acc[r],
            );
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: `groups`' caller made `dst` valid for row `r0 + r`'s eight values.
        unsafe { _mm256_storeu_ps(dst.ptr.add((r0 + r) * dst.stride), *acc) };
    }
}
