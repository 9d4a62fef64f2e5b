//! Decode attention over a frozen page ([`FrozenPage`]): one query row, its scores as
//! broadcast FMAs over transposed key blocks and its weighted sum over value chunks, with the
//! accumulators in registers (AVX-512; a portable form elsewhere). Spans of [`SPAN`] keys are
//! tasks, merged in order, so the result does not depend on the thread count.

use half::f16;

use super::{exp, spread};
use crate::backend::frozen::{FrozenPage, LANES};
use crate::backend::{AttnShape, Merger, Partials};

/// Keys per task: a task's scores (group x SPAN) stay in L1, and its values' chunks in L2.
const SPAN: usize = 1024;

/// Partials of one decode row at `pos` (query heads `q`, scaled, `[q_heads][head_dim]`)
/// over the keys it sees: spans of [`SPAN`] keys, one task each, merged in order (so the
/// result does not depend on the thread count).
pub fn attend(page: &FrozenPage, shape: AttnShape, q: &[f32], pos: usize) -> Partials {
    attend_with(Kernel::best(), page, shape, q, pos)
}

/// [`attend`] for each row of `q` (`[rows][q_heads][head_dim]`) at `q_pos`, the partials one
/// after the other: each row's are its decode step's.
pub fn attend_rows(page: &FrozenPage, shape: AttnShape, q: &[f32], q_pos: &[usize]) -> Partials {
    let mut all = Partials::empty(0, page.head_dim);
    let per_row = shape.q_heads * shape.head_dim;
    for (q, &pos) in q.chunks_exact(per_row).zip(q_pos) {
        let p = attend(page, shape, q, pos);
        all.o.extend(p.o);
        all.m.extend(p.m);
        all.l.extend(p.l);
    }
    all
}

/// The instructions the kernels run: the widest this CPU has (`TETHER_ISA=avx2` caps it, as
/// for the matrix products).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            use super::quant_dots::Isa;
            match Isa::best() {
                None => Kernel::Portable,
                Some(Isa::Avx2) => Kernel::Avx2,
                Some(Isa::Avx512 | Isa::Vnni) => Kernel::Avx512,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Portable
    }
}

fn attend_with(
    kernel: Kernel,
    page: &FrozenPage,
    shape: AttnShape,
    q: &[f32],
    pos: usize,
) -> Partials {
    assert_eq!(
        (shape.kv_heads, shape.head_dim),
        (page.kv_heads, page.head_dim)
    );
    assert_eq!(q.len(), shape.q_heads * shape.head_dim);
    let seen = pos
        .saturating_add(1)
        .saturating_sub(page.start)
        .min(page.len);
    let spans: Vec<usize> = (0..seen).step_by(SPAN).collect();
    if spans.is_empty() {
        return Partials::empty(shape.q_heads, page.head_dim);
    }
    let mut parts: Vec<Partials> = spans.iter().map(|_| Partials::empty(0, 0)).collect();
    spread(&mut parts, 1, |i, p| {
        let to = (spans[i] + SPAN).min(seen);
        p[0] = span(kernel, page, shape, q, spans[i], to)
    });
    if parts.len() == 1 {
        return parts.pop().expect("one span");
    }
    let mut merger = Merger::new(shape.q_heads, page.head_dim);
    parts.iter().for_each(|p| merger.add(p));
    merger.finish()
}

/// Partials of every query head over keys `from..to` (`from` a multiple of [`LANES`]).
fn span(
    kernel: Kernel,
    page: &FrozenPage,
    shape: AttnShape,
    q: &[f32],
    from: usize,
    to: usize,
) -> Partials {
    let (d, group) = (page.head_dim, shape.q_heads / page.kv_heads);
    let n = to - from;
    let mut p = Partials::empty(shape.q_heads, d);
    let mut scores = vec![0.0f32; group * n.next_multiple_of(LANES)];
    for h in 0..page.kv_heads {
        let qh = &q[h * group * d..][..group * d];
        let blocks = page.len.div_ceil(LANES);
        let keys =
            &page.keys[h * blocks * d * LANES..][from * d..][..n.div_ceil(LANES) * d * LANES];
        scores_of(kernel, qh, keys, d, &mut scores);
        let stride = n.next_multiple_of(LANES);
        for g in 0..group {
            let s = &mut scores[g * stride..][..n];
            let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            s.iter_mut().for_each(|x| *x = exp(*x - mx));
            p.m[h * group + g] = mx;
            p.l[h * group + g] = s.iter().sum();
        }
        let values = &page.values[h * d * page.len..][..d * page.len];
        let o = &mut p.o[h * group * d..][..group * d];
        weighted_values(kernel, &scores, (stride, n), values, (page.len, from), d, o);
        for (o, &l) in o.chunks_exact_mut(d).zip(&p.l[h * group..]) {
            let inv = 1.0 / l;
            o.iter_mut().for_each(|a| *a *= inv);
        }
    }
    p
}

/// `scores[g][j]` (rows of `stride` = the blocks' keys) for the group's queries `q`
/// (`[group][d]`) against `keys` (`[blocks][d][LANES]`).
fn scores_of(kernel: Kernel, q: &[f32], keys: &[f16], d: usize, scores: &mut [f32]) {
    let group = q.len() / d;
    let stride = keys.len() / d;
    match kernel {
        // SAFETY: `Kernel::best` (or a test) chose it on a CPU that has its instructions.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => return unsafe { avx512::scores_of(q, keys, d, group, stride, scores) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => return unsafe { avx2::scores_of(q, keys, d, group, stride, scores) },
        Kernel::Portable => {}
    }
    for (b, block) in keys.chunks_exact(d * LANES).enumerate() {
        for g in 0..group {
            let mut acc = [0.0f32; LANES];
            for (i, k) in block.chunks_exact(LANES).enumerate() {
                let qd = q[g * d + i];
                for (a, k) in acc.iter_mut().zip(k) {
                    *a += qd * k.to_f32();
                }
            }
            scores[g * stride + b * LANES..][..LANES].copy_from_slice(&acc);
        }
    }
}

/// `o[g] += sum_j weights[g][j] * values[j]` over keys `from..from + n` of a head's values
/// (`[d / LANES][len][LANES]`), for the group's rows of `o` (`[group][d]`).
fn weighted_values(
    kernel: Kernel,
    weights: &[f32],
    (stride, n): (usize, usize),
    values: &[f16],
    (len, from): (usize, usize),
    d: usize,
    o: &mut [f32],
) {
    let group = o.len() / d;
    match kernel {
        // SAFETY: `Kernel::best` (or a test) chose it on a CPU that has its instructions.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => {
            return unsafe { avx512::weighted_values(weights, stride, n, values, len, from, d, o) }
        }
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            return unsafe { avx2::weighted_values(weights, stride, n, values, len, from, d, o) }
        }
        Kernel::Portable => {}
    }
    for c in 0..d / LANES {
        let chunk = &values[c * len * LANES..][from * LANES..][..n * LANES];
        for g in 0..group {
            let mut acc = [0.0f32; LANES];
            for (j, v) in chunk.chunks_exact(LANES).enumerate() {
                let w = weights[g * stride + j];
                for (a, v) in acc.iter_mut().zip(v) {
                    *a += w * v.to_f32();
                }
            }
            o[g * d + c * LANES..][..LANES].copy_from_slice(&acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The kernels with their accumulators in registers: the tile sizes are constants (query
    //! heads `G`, output chunks `C`), so every loop over a tile unrolls and no accumulator
    //! lives in memory.
    use std::arch::x86_64::*;

    use half::f16;

    use super::LANES;

    /// Query heads a pass takes at once (Qwen3.5's groups are 4 or 6; larger ones take
    /// several passes).
    const GROUP_TILE: usize = 8;

    /// Sixteen fp16 values at `p`, widened.
    ///
    /// # Safety
    /// `p` must point at 16 readable fp16 values, and the CPU must have AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen(p: *const f16) -> __m512 {
        // SAFETY: the caller's.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_of(
        q: &[f32],
        keys: &[f16],
        d: usize,
        group: usize,
        stride: usize,
        scores: &mut [f32],
    ) {
        for g0 in (0..group).step_by(GROUP_TILE) {
            let q = &q[g0 * d..];
            let scores = &mut scores[g0 * stride..];
            // SAFETY: AVX-512F is the caller's; the tiles index within `q`, `keys`, `scores`.
            unsafe {
                match (group - g0).min(GROUP_TILE) {
                    1 => scores_tile::<1>(q, keys, d, stride, scores),
                    2 => scores_tile::<2>(q, keys, d, stride, scores),
                    3 => scores_tile::<3>(q, keys, d, stride, scores),
                    4 => scores_tile::<4>(q, keys, d, stride, scores),
                    5 => scores_tile::<5>(q, keys, d, stride, scores),
                    6 => scores_tile::<6>(q, keys, d, stride, scores),
                    7 => scores_tile::<7>(q, keys, d, stride, scores),
                    _ => scores_tile::<8>(q, keys, d, stride, scores),
                }
            }
        }
    }

    /// Scores of `G` query heads (`q`'s first `G` rows of `d`) for every key block.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_tile<const G: usize>(
        q: &[f32],
        keys: &[f16],
        d: usize,
        stride: usize,
        scores: &mut [f32],
    ) {
        assert!(q.len() >= G * d && scores.len() >= (G - 1) * stride + keys.len() / d);
        for (b, block) in keys.chunks_exact(d * LANES).enumerate() {
            let mut acc = [_mm512_setzero_ps(); G];
            for i in 0..d {
                // SAFETY: `block` holds `d * LANES` values, so `i * LANES + 16` of them.
                let k = unsafe { widen(block.as_ptr().add(i * LANES)) };
                for (g, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `g * d + i < G * d <= q.len()`, asserted above.
                    let qv = unsafe { *q.get_unchecked(g * d + i) };
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(qv), k, *a);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                let out = &mut scores[g * stride + b * LANES..][..LANES];
                // SAFETY: `out` holds 16 f32.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *a) };
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_values(
        weights: &[f32],
        stride: usize,
        n: usize,
        values: &[f16],
        len: usize,
        from: usize,
        d: usize,
        o: &mut [f32],
    ) {
        let group = o.len() / d;
        let chunks = d / LANES;
        let mut c0 = 0;
        while c0 < chunks {
            let cn = if chunks - c0 >= 4 { 4 } else { 1 };
            for g0 in (0..group).step_by(4) {
                let t = Tile {
                    weights: &weights[g0 * stride..],
                    stride,
                    n,
                    values: &values[c0 * len * LANES + from * LANES..],
                    len,
                };
                let o = &mut o[g0 * d + c0 * LANES..];
                // SAFETY: AVX-512F is the caller's; the tiles index within their slices.
                unsafe {
                    match ((group - g0).min(4), cn) {
                        (1, 1) => values_tile::<1, 1>(&t, d, o),
                        (2, 1) => values_tile::<2, 1>(&t, d, o),
                        (3, 1) => values_tile::<3, 1>(&t, d, o),
                        (_, 1) => values_tile::<4, 1>(&t, d, o),
                        (1, _) => values_tile::<1, 4>(&t, d, o),
                        (2, _) => values_tile::<2, 4>(&t, d, o),
                        (3, _) => values_tile::<3, 4>(&t, d, o),
                        _ => values_tile::<4, 4>(&t, d, o),
                    }
                }
            }
            c0 += cn;
        }
    }

    /// What a tile of [`values_tile`] reads: weights rows (`stride` apart) from its first query
    /// head, and values from its first chunk at the span's first key (chunks `len` keys apart).
    struct Tile<'a> {
        weights: &'a [f32],
        stride: usize,
        n: usize,
        values: &'a [f16],
        len: usize,
    }

    /// `G` query heads' outputs, `C` chunks of 16 dimensions each, over the span's keys.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn values_tile<const G: usize, const C: usize>(t: &Tile, d: usize, o: &mut [f32]) {
        assert!(t.weights.len() >= (G - 1) * t.stride + t.n);
        assert!(t.values.len() >= (C - 1) * t.len * LANES + t.n * LANES);
        assert!(o.len() >= (G - 1) * d + C * LANES);
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for j in 0..t.n {
            let mut v = [_mm512_setzero_ps(); C];
            for (c, v) in v.iter_mut().enumerate() {
                // SAFETY: within `t.values`, asserted above.
                *v = unsafe { widen(t.values.as_ptr().add(c * t.len * LANES + j * LANES)) };
            }
            for (g, a) in acc.iter_mut().enumerate() {
                // SAFETY: within `t.weights`, asserted above.
                let w = _mm512_set1_ps(unsafe { *t.weights.get_unchecked(g * t.stride + j) });
                for (a, v) in a.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(w, *v, *a);
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            for (c, a) in a.iter().enumerate() {
                let out = &mut o[g * d + c * LANES..][..LANES];
                // SAFETY: `out` holds 16 f32.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *a) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! [`super::avx512`]'s kernels in 256-bit registers: a block of 16 keys (or a chunk of 16
    //! dimensions) is two registers, so the tiles are smaller (4 query heads by one chunk) to
    //! fit AVX2's sixteen.
    use std::arch::x86_64::*;

    use half::f16;

    use super::LANES;

    const GROUP_TILE: usize = 4;

    /// Sixteen fp16 values at `p`, widened into two registers.
    ///
    /// # Safety
    /// `p` must point at 16 readable fp16 values, and the CPU must have AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen(p: *const f16) -> [__m256; 2] {
        // SAFETY: the caller's.
        unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
            ]
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores_of(
        q: &[f32],
        keys: &[f16],
        d: usize,
        group: usize,
        stride: usize,
        scores: &mut [f32],
    ) {
        for g0 in (0..group).step_by(GROUP_TILE) {
            let q = &q[g0 * d..];
            let scores = &mut scores[g0 * stride..];
            // SAFETY: AVX2 is the caller's; the tiles index within `q`, `keys`, `scores`.
            unsafe {
                match (group - g0).min(GROUP_TILE) {
                    1 => scores_tile::<1>(q, keys, d, stride, scores),
                    2 => scores_tile::<2>(q, keys, d, stride, scores),
                    3 => scores_tile::<3>(q, keys, d, stride, scores),
                    _ => scores_tile::<4>(q, keys, d, stride, scores),
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_tile<const G: usize>(
        q: &[f32],
        keys: &[f16],
        d: usize,
        stride: usize,
        scores: &mut [f32],
    ) {
        assert!(q.len() >= G * d && scores.len() >= (G - 1) * stride + keys.len() / d);
        for (b, block) in keys.chunks_exact(d * LANES).enumerate() {
            let mut acc = [[_mm256_setzero_ps(); 2]; G];
            for i in 0..d {
                // SAFETY: `block` holds `d * LANES` values, so `i * LANES + 16` of them.
                let k = unsafe { widen(block.as_ptr().add(i * LANES)) };
                for (g, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `g * d + i < G * d <= q.len()`, asserted above.
                    let qv = _mm256_set1_ps(unsafe { *q.get_unchecked(g * d + i) });
                    a[0] = _mm256_fmadd_ps(qv, k[0], a[0]);
                    a[1] = _mm256_fmadd_ps(qv, k[1], a[1]);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                let out = &mut scores[g * stride + b * LANES..][..LANES];
                // SAFETY: `out` holds 16 f32.
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(out.as_mut_ptr().add(8), a[1]);
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_values(
        weights: &[f32],
        stride: usize,
        n: usize,
        values: &[f16],
        len: usize,
        from: usize,
        d: usize,
        o: &mut [f32],
    ) {
        let group = o.len() / d;
        for c in 0..d / LANES {
            let values = &values[c * len * LANES + from * LANES..][..n * LANES];
            for g0 in (0..group).step_by(GROUP_TILE) {
                let weights = &weights[g0 * stride..];
                let o = &mut o[g0 * d + c * LANES..];
                // SAFETY: AVX2 is the caller's; the tiles index within their slices.
                unsafe {
                    match (group - g0).min(GROUP_TILE) {
                        1 => values_tile::<1>(weights, stride, values, d, o),
                        2 => values_tile::<2>(weights, stride, values, d, o),
                        3 => values_tile::<3>(weights, stride, values, d, o),
                        _ => values_tile::<4>(weights, stride, values, d, o),
                    }
                }
            }
        }
    }

    /// `G` query heads' outputs for one chunk of 16 dimensions over the span's keys (`values`
    /// holds the chunk's rows of the span, 16 values each).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_tile<const G: usize>(
        weights: &[f32],
        stride: usize,
        values: &[f16],
        d: usize,
        o: &mut [f32],
    ) {
        let n = values.len() / LANES;
        assert!(weights.len() >= (G - 1) * stride + n && o.len() >= (G - 1) * d + LANES);
        let mut acc = [[_mm256_setzero_ps(); 2]; G];
        for j in 0..n {
            // SAFETY: `values` holds `n` rows of 16.
            let v = unsafe { widen(values.as_ptr().add(j * LANES)) };
            for (g, a) in acc.iter_mut().enumerate() {
                // SAFETY: within `weights`, asserted above.
                let w = _mm256_set1_ps(unsafe { *weights.get_unchecked(g * stride + j) });
                a[0] = _mm256_fmadd_ps(w, v[0], a[0]);
                a[1] = _mm256_fmadd_ps(w, v[1], a[1]);
            }
        }
        for (g, a) in acc.iter().enumerate() {
            let out = &mut o[g * d..][..LANES];
            // SAFETY: `out` holds 16 f32.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(out.as_mut_ptr().add(8), a[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{KvPage, KvType, PageRows};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(0x85EB_CA6B);
                (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Every kernel this CPU runs.
    fn kernels() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut all = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use crate::backend::cpu::quant_dots::Isa;
            if let Some(isa) = Isa::best() {
                all.push(Kernel::Avx2);
                if isa != Isa::Avx2 {
                    all.push(Kernel::Avx512);
                }
            }
        }
        all
    }

    /// Attention in f64 over the page's fp16-rounded keys and values, per query head.
    fn reference(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], seen: usize) -> Vec<Vec<f64>> {
        let (d, group) = (shape.head_dim, shape.q_heads / shape.kv_heads);
        let row = shape.kv_heads * d;
        let r = |x: f32| f16::from_f32(x).to_f64();
        (0..shape.q_heads)
            .map(|h| {
                let kvh = h / group;
                let s: Vec<f64> = (0..seen)
                    .map(|j| {
                        (0..d)
                            .map(|i| q[h * d + i] as f64 * r(k[j * row + kvh * d + i]))
                            .sum()
                    })
                    .collect();
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let l: f64 = w.iter().sum();
                (0..d)
                    .map(|i| {
                        (0..seen)
                            .map(|j| w[j] * r(v[j * row + kvh * d + i]))
                            .sum::<f64>()
                            / l
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_frozen_page_attends_as_f64_attention_over_its_fp16_rows() {
        // Groups of 3 and of 10 (more than a register tile), heads of 32 and 48, pages that
        // end mid-block and rows that see part of a page, spans of several tasks.
        for (q_heads, kv_heads, d, len, pos) in [
            (6, 2, 32, 37, 36),
            (20, 2, 48, 2500, 2100),
            (8, 2, 64, 16, 40),
            (4, 1, 32, 3000, 5),
        ] {
            let shape = AttnShape {
                q_heads,
                kv_heads,
                head_dim: d,
            };
            let row = kv_heads * d;
            let (k, v) = (values(len * row, 1), values(len * row, 2));
            let q: Vec<f32> = values(q_heads * d, 3).iter().map(|x| 4.0 * x).collect();
            let start = 0;
            let page = KvPage {
                start,
                len,
                k: PageRows::host(KvType::F32, k.clone()),
                v: PageRows::host(KvType::F32, v.clone()),
                frozen: None,
            };
            let frozen = FrozenPage::pack(shape.kv_heads, shape.head_dim, &page);
            let want = reference(shape, &q, &k, &v, (pos + 1).min(len));
            for kernel in kernels() {
                let got = attend_with(kernel, &frozen, shape, &q, pos);
                for (h, want) in want.iter().enumerate() {
                    for (i, w) in want.iter().enumerate() {
                        let g = got.o[h * d + i] as f64;
                        let case = format!("{kernel:?} {q_heads}/{kv_heads}/{d}/{len}");
                        assert!((g - w).abs() < 2e-5, "{case}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_before_the_page_sees_nothing() {
        let shape = AttnShape {
            q_heads: 2,
            kv_heads: 1,
            head_dim: 16,
        };
        let page = KvPage {
            start: 100,
            len: 20,
            k: PageRows::host(KvType::F16, values(20 * 16, 1)),
            v: PageRows::host(KvType::F16, values(20 * 16, 2)),
            frozen: None,
        };
        let frozen = FrozenPage::pack(shape.kv_heads, shape.head_dim, &page);
        let p = attend(&frozen, shape, &values(32, 3), 50);
        assert_eq!(p, Partials::empty(2, 16));
    }
}
