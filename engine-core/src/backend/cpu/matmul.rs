//! `out[t, o] = sum_i x[t, i] * w[o, i]`: every Linear layer of the model.
//!
//! Two regimes. Few rows of `x` (decode) is a matrix-vector product bound by reading the weights:
//! each weight row is streamed once, widened to f32 in registers and multiplied into up to four
//! rows of `x` at a time. Many rows (prefill) is compute bound: each rayon task widens a block of
//! weight rows to f32 and hands it to `gemm`'s packed, register-tiled kernels. wasm has no `gemm`
//! and always takes the first path.
//!
//! The dot-product kernel is written with AVX2/FMA/F16C intrinsics on x86_64, selected at run
//! time: LLVM's SLP vectoriser turned the portable fixed-array form into 2-lane code for most
//! accumulator shapes (7-8 G weights/s per core, a fraction of the memory bandwidth). The portable
//! form serves other targets and older CPUs. Where the CPU has AVX-512, the float types take a
//! tiled AVX-512 kernel (`avx512`) whose every product is bit for bit the AVX2 kernel's.

use half::{bf16, f16};

#[cfg(target_arch = "aarch64")]
use super::quant_neon;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use super::quant_rows::Rows8;
use super::spread;
#[cfg(target_arch = "x86_64")]
use super::{interleaved_dots, quant_dots, quant_panels};
use crate::convert;
use crate::interleaved::BlockQ8_0x8;
#[cfg(target_arch = "x86_64")]
use crate::tensor::DType;
use crate::tensor::{match_quant, Data, Matrix, QuantBlock, QK_K};

/// Rows of `x` from which `gemm` takes over: below it every row's products are those of a
/// one-row step ([`crate::backend::STEP_ROWS`]). Measured on Zen 4 (2 threads) with bf16
/// weights, 1024x3584 and 3584x1024: the dot kernel is faster up to t = 12, the two are even at
/// t = 16, and from t = 24 `gemm` is 25-30% faster: the weights' f32 copy and packing have paid
/// off.
#[cfg(not(target_arch = "wasm32"))]
const GEMM_MIN_T: usize = crate::backend::STEP_ROWS;

/// How far ahead of the weights being multiplied the decode kernels prefetch (on x86_64; a
/// prefetch past the end of the weights is harmless: it does not fault). The hardware
/// prefetcher alone left decode waiting on weight loads: with this, Q4_K_M decode of the 0.8B
/// shape went from 18.9 to 24.4 tok/s on 2 threads of a Xeon (the same at 1 KiB and 4 KiB).
#[cfg(target_arch = "x86_64")]
pub(super) const PREFETCH_BYTES: usize = 2048;

/// Prefetches the cache lines [`PREFETCH_BYTES`] past `block`, a block the kernel is about to
/// multiply: a kernel that calls this for each block of a row in turn keeps the weights coming.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_ahead<B>(block: &B) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = (block as *const B)
        .cast::<i8>()
        .wrapping_add(PREFETCH_BYTES);
    for line in (0..size_of::<B>()).step_by(64) {
        // SAFETY: SSE is part of x86_64; a prefetch of any address does not fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line)) };
    }
}

/// Rows of `x` whose dot products with one weight row are taken together, so that each weight
/// element loaded feeds several FMAs. Two, so that one and two rows take the same
/// accumulators (four AVX2 registers a row): a row's sum never depends on how many rows share
/// its pass.
const X_GROUP: usize = 2;

/// How far rounding the activations can move a product of quantised weights: the integer
/// kernels (`quant_dots`, decode on AVX2) round a row of `x` to 8 bits per block of the weight
/// type (32 or 256 values), each value by at most half a step, `max |x| / 127 / 2` of its
/// block, so the dot product of row `x` with weight row `w` (its values as f32) moves by at
/// most this, beyond f32 rounding. Zero for the float types, whose activations stay f32.
pub fn activation_rounding(x: &[f32], w: &[f32], dtype: crate::tensor::DType) -> f64 {
    let block = dtype.block().0;
    if block == 1 {
        return 0.0;
    }
    x.chunks(block)
        .zip(w.chunks(block))
        .map(|(x, w)| {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            let step = amax / 127.0;
            step / 2.0 * w.iter().map(|&v| (v as f64).abs()).sum::<f64>() * (1.0 + 1e-6)
        })
        .sum()
}

/// `x` is `[t, w.cols]`, `out` is `[t, w.rows]`, both row-major f32.
pub fn matmul(x: &[f32], w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert!(k > 0, "matmul with an empty input dimension");
    assert_eq!(w.data.len(), n * k);
    assert_eq!(x.len() % k, 0);
    let t = x.len() / k;
    assert_eq!(out.len(), t * n);
    if out.is_empty() {
        return;
    }
    #[cfg(not(target_arch = "wasm32"))]
    if t >= GEMM_MIN_T {
        #[cfg(target_arch = "x86_64")]
        if quant_panels::matmul(x, t, &w.data, n, out) {
            return;
        }
        return blocked::matmul_gemm(x, t, w, out);
    }
    match &w.data {
        Data::F32(e) => matmul_dots(t, e, n, |w, o| dots_task(x, k, w, o), out),
        Data::BF16(e) => matmul_dots(t, e, n, |w, o| dots_task(x, k, w, o), out),
        Data::F16(e) => matmul_dots(t, e, n, |w, o| dots_task(x, k, w, o), out),
        Data::Q8_0x8 { blocks, per_row } => matmul_interleaved(x, t, blocks, *per_row, w, out),
        quant => match_quant!(quant, e => matmul_quant(x, t, k, e, n, out),
            _ => unreachable!("matched above"),
        ),
    }
}

/// Whether prefill (16 or more rows of `x`) with `dtype` weights multiplies in integers on this
/// CPU, its activations rounded to 8 bits as decode's are (`activation_rounding`), rather than
/// in f32 through gemm: Q4_K and Q4_0 where the CPU has AVX2 but not AVX-512; Q8_0, Q4_0, Q4_K
/// and Q6_K where it has AVX-512 VNNI (`quant_panels::takes`).
pub fn integer_prefill(dtype: crate::tensor::DType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return quant_panels::takes(dtype);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dtype;
        false
    }
}

/// What a quantised type needs for decode: its integer kernel where there is one (x86_64,
/// aarch64).
#[cfg(target_arch = "x86_64")]
use quant_dots::Dot8 as QuantKernel;
#[cfg(target_arch = "aarch64")]
use quant_neon::Levels as QuantKernel;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
use QuantBlock as QuantKernel;

/// Quantised weights on the integer kernel (`quant_dots`, `quant_neon`: `x` rounded to 8 bits
/// per block of the type) where the CPU has one for the type (AVX2, NEON) and `x` is finite,
/// else on the portable kernel (infinite or
/// NaN activations cannot be scaled to integers; f32 products carry them to the output as the
/// dequantised weights' product would).
fn matmul_quant<B: QuantKernel>(x: &[f32], t: usize, k: usize, w: &[B], n: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = quant_dots::Isa::best() {
        if let Some(rows) = Rows8::quantise(x, k, B::LEN) {
            // SAFETY: the CPU has the instructions of `isa`.
            let task = |w: &[B], o: &mut [f32]| unsafe { quant_dots::dots_task(isa, &rows, w, o) };
            return matmul_dots(t, w, n, task, out);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if B::INTEGER {
        if let Some(rows) = Rows8::quantise(x, k, B::LEN) {
            let task = |w: &[B], o: &mut [f32]| quant_neon::dots_task(&rows, w, o);
            return matmul_dots(t, w, n, task, out);
        }
    }
    matmul_dots(t, w, n, |w, o| dots_task_quant(x, k, w, o), out);
}

/// Whether this CPU's decode takes Q8_0 weights interleaved by eight rows
/// ([`crate::interleaved`], made by [`crate::resident`]): where it has AVX2 but not AVX-512.
/// On an AVX2-only AMD EPYC (Zen 1) the interleaved kernel made Q8_0 decode memory bound,
/// where the one-row kernel was bound by its per-block work (docs/PERFORMANCE.md); on the
/// AVX-512 CPUs measured, the one-row kernel already reads at 80-90% of the bandwidth.
pub fn interleaves_q8_0() -> bool {
    #[cfg(target_arch = "x86_64")]
    return quant_dots::Isa::best() == Some(quant_dots::Isa::Avx2);
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Interleaved Q8_0 weights (`per_row` blocks a row): the interleaved kernel where this CPU
/// has it and `x` is finite, one row of `x` at a time (the kernel takes one), so that each row
/// gets its one-row products while the task's weights stay in cache; otherwise (infinite or
/// NaN activations) each task widens its weight rows to f32 one at a time and multiplies them
/// in f32, as the portable kernel does a block at a time.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn matmul_interleaved(
    x: &[f32],
    t: usize,
    blocks: &[BlockQ8_0x8],
    per_row: usize,
    w: &Matrix,
    out: &mut [f32],
) {
    let (n, k) = (w.rows, w.cols);
    // Tasks own whole groups: `rows_per_task` is a multiple of 16, `n` of 8.
    let ids: Vec<usize> = (0..n).collect();
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        if let Some(rows) = Rows8::quantise(x, k, crate::quant::QK) {
            use crate::interleaved::ROWS;
            let task = |ids: &[usize], o: &mut [f32]| {
                let w = &blocks[ids[0] / ROWS * per_row..][..ids.len() / ROWS * per_row];
                if t == 1 {
                    // SAFETY: the CPU has AVX2, FMA and F16C.
                    return unsafe { interleaved_dots::task(&rows, w, o) };
                }
                let mut one = vec![0.0f32; ids.len()];
                for (r, single) in rows.each_row().iter().enumerate() {
                    // SAFETY: as above.
                    unsafe { interleaved_dots::task(single, w, &mut one) };
                    for (j, &v) in one.iter().enumerate() {
                        o[j * t + r] = v;
                    }
                }
            };
            return matmul_dots(t, &ids, n, task, out);
        }
    }
    let task = |ids: &[usize], o: &mut [f32]| {
        let mut row = vec![0.0f32; k];
        for (&r, o) in ids.iter().zip(o.chunks_exact_mut(t)) {
            w.row_f32(r, &mut row);
            for (o, x) in o.iter_mut().zip(x.chunks_exact(k)) {
                *o = dot(x, &row);
            }
        }
    };
    matmul_dots(t, &ids, n, task, out);
}

/// Output rows per rayon task: several tasks per thread so that a thread slowed by other work on
/// the machine does not hold up the rest, but never so few rows that task overhead shows. A
/// multiple of sixteen, so that the groups of eight or sixteen rows a kernel may take at once
/// (`quant_dots`'s `row_groups`) are the same whatever the thread count.
pub(super) fn rows_per_task(n: usize) -> usize {
    n.div_ceil(rayon::current_num_threads() * 8)
        .max(16)
        .next_multiple_of(16)
}

/// `task(o0, cols, out_ptr)` in parallel on rayon's pool for each block of `block` columns (the
/// last may be shorter) among the first `cols` of `out` (`[t, n]`, row-major): the prefill
/// paths, whose tasks each own a block of weight rows, which are columns of `out`. `out_ptr`
/// is `out`'s base; the task for `o0` may write columns `o0 .. o0 + cols` of it only.
#[cfg(not(target_arch = "wasm32"))]
pub(super) fn column_blocks(
    out: &mut [f32],
    cols: usize,
    block: usize,
    task: impl Fn(usize, usize, *mut f32) + Sync,
) {
    use rayon::prelude::*;

    /// `out`'s base pointer, shared by the tasks.
    struct OutPtr(*mut f32);

    // SAFETY: the tasks sharing it write disjoint columns of `out`, which outlives them.
    unsafe impl Sync for OutPtr {}

    impl OutPtr {
        fn get(&self) -> *mut f32 {
            self.0
        }
    }

    let base = OutPtr(out.as_mut_ptr());
    (0..cols.div_ceil(block)).into_par_iter().for_each(|b| {
        let o0 = b * block;
        task(o0, block.min(cols - o0), base.get())
    });
}

/// The dot-product path over the `n` weight rows in `w` (elements, or blocks of a quantised
/// type) for `t` rows of `x`: `task(rows of w, out)` computes one task's rows into its part of
/// `out` (`[rows, t]`).
fn matmul_dots<T: Sync>(
    t: usize,
    w: &[T],
    n: usize,
    task: impl Fn(&[T], &mut [f32]) + Sync,
    out: &mut [f32],
) {
    let per_row = w.len() / n;
    let task_rows = rows_per_task(n);
    if t == 1 {
        return spread(out, task_rows, |i, o| {
            task(&w[i * task_rows * per_row..][..o.len() * per_row], o)
        });
    }
    // Tasks own disjoint output rows `o`, which are columns of `out`: fill `[n, t]` and transpose
    // (t * n floats, a few percent of the weight bytes).
    let mut out_t = vec![0.0f32; n * t];
    spread(&mut out_t, task_rows * t, |i, o| {
        task(&w[i * task_rows * per_row..][..o.len() / t * per_row], o)
    });
    for (r, row) in out.chunks_exact_mut(n).enumerate() {
        for (o, v) in row.iter_mut().enumerate() {
            *v = out_t[o * t + r];
        }
    }
}

/// Weight rows `w` (`[rows, k]`) into `out` (`[rows, t]`, the rows of `x` contiguous per output).
/// Attention calls it too, with one key row as `w` and a task's queries as `x`. Several rows of
/// `x` take the tiled kernel where the CPU has AVX-512, else AVX2's, else the portable one; the
/// first two give the same bits. One row (decode) stays on AVX2's kernel: it is bound by memory,
/// and in alternating `bench` runs (Zen 4, 2 threads, the 0.8B model in bf16) decode on the tiled
/// kernel was no faster (its median 0.5-8% slower in each of four sets of runs).
pub(super) fn dots_task<T: Widen>(x: &[f32], k: usize, w: &[T], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x.len() > k && avx512::available() {
        // SAFETY: the CPU has the features the kernel is compiled for.
        return unsafe { avx512::dots_task(x, k, w, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has the features the kernel is compiled for.
        return unsafe { avx2::dots_task(x, k, w, out) };
    }
    dots_task_portable(x, k, w, out);
}

fn dots_task_portable<T: Widen>(x: &[f32], k: usize, w: &[T], out: &mut [f32]) {
    // 32 lanes (4 AVX2 registers) per row of `x`, the same for one row or two.
    for_each_group(x, k, w, k, out, |wr, xg, dst| match dst.len() {
        2 => dst.copy_from_slice(&dots::<T, 2, 32>(wr, xg)),
        _ => dst.copy_from_slice(&dots::<T, 1, 32>(wr, xg)),
    });
}

/// Calls `group(weight row, rows of x, outputs)` for every weight row (`per_row` storage units)
/// and every group of up to `X_GROUP` rows of `x`, so that one weight row, read once from
/// memory, serves all of `x` from L1.
#[inline(always)]
fn for_each_group<T>(
    x: &[f32],
    k: usize,
    w: &[T],
    per_row: usize,
    out: &mut [f32],
    mut group: impl FnMut(&[T], &[f32], &mut [f32]),
) {
    let t = x.len() / k;
    for (wr, out_r) in w.chunks_exact(per_row).zip(out.chunks_exact_mut(t)) {
        for (xg, dst) in x.chunks(X_GROUP * k).zip(out_r.chunks_mut(X_GROUP)) {
            group(wr, xg, dst);
        }
    }
}

/// Quantised weight rows (`k / B::LEN` blocks each) into `out`, each block dequantised on the
/// stack (one block at a time, never a row) and multiplied into the rows of `x`: the portable
/// kernel of every quantised type, and the only one of those without their own.
fn dots_task_quant<B: QuantBlock>(x: &[f32], k: usize, w: &[B], out: &mut [f32]) {
    for_each_group(x, k, w, k / B::LEN, out, |wr, xg, dst| match dst.len() {
        2 => dst.copy_from_slice(&dots_quant::<B, 2>(wr, xg)),
        _ => dst.copy_from_slice(&dots_quant::<B, 1>(wr, xg)),
    });
}

/// Dot products of one quantised weight row with the `R` rows of `xs`, 32 lanes per row.
#[inline(always)]
fn dots_quant<B: QuantBlock, const R: usize>(w: &[B], xs: &[f32]) -> [f32; R] {
    let k = w.len() * B::LEN;
    assert_eq!(xs.len(), R * k);
    let mut acc = [[0.0f32; 32]; R];
    let mut buf = [0.0f32; QK_K];
    let wv = &mut buf[..B::LEN];
    for (b, block) in w.iter().enumerate() {
        block.dequantise_into(wv);
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let xb = &xs[r * k + b * B::LEN..][..B::LEN];
            for (wc, xc) in wv.chunks_exact(32).zip(xb.chunks_exact(32)) {
                for ((a, &wv), &xv) in acc_r.iter_mut().zip(wc).zip(xc) {
                    *a = fmadd(wv, xv, *a);
                }
            }
        }
    }
    std::array::from_fn(|r| sum_lanes(&acc[r]))
}

/// A weight storage type, widened to f32 by the dot-product kernels.
pub(super) trait Widen: Copy + Default + Send + Sync {
    /// Picks the AVX2 kernel's load.
    #[cfg(target_arch = "x86_64")]
    const DTYPE: DType;
    fn widen<const L: usize>(chunk: &[Self; L]) -> [f32; L];
}

impl Widen for f32 {
    #[cfg(target_arch = "x86_64")]
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn widen<const L: usize>(chunk: &[f32; L]) -> [f32; L] {
        *chunk
    }
}

impl Widen for bf16 {
    #[cfg(target_arch = "x86_64")]
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn widen<const L: usize>(chunk: &[bf16; L]) -> [f32; L] {
        chunk.map(|v| f32::from_bits((v.to_bits() as u32) << 16))
    }
}

impl Widen for f16 {
    #[cfg(target_arch = "x86_64")]
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn widen<const L: usize>(chunk: &[f16; L]) -> [f32; L] {
        let mut out = [0.0; L];
        convert::f16_to_f32(chunk, &mut out);
        out
    }
}

/// `a * b + c`, fused where the target has FMA; elsewhere `mul_add` would be a slow libm call.
#[inline(always)]
fn fmadd(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_feature = "fma")]
    {
        a.mul_add(b, c)
    }
    #[cfg(not(target_feature = "fma"))]
    {
        a * b + c
    }
}

/// Pairwise sum of the accumulator lanes (fewer rounding steps than a running sum).
#[inline(always)]
pub(super) fn sum_lanes<const N: usize>(acc: &[f32; N]) -> f32 {
    let mut v = *acc;
    let mut width = N;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            v[i] += v[i + width];
        }
    }
    v[0]
}

/// Dot products of one weight row `w` with the `R` rows of `xs` (`[R, w.len()]`), with `L`
/// accumulator lanes per row.
#[inline(always)]
fn dots<T: Widen, const R: usize, const L: usize>(w: &[T], xs: &[f32]) -> [f32; R] {
    let k = w.len();
    assert_eq!(xs.len(), R * k);
    let rows: [&[f32]; R] = std::array::from_fn(|r| &xs[r * k..(r + 1) * k]);
    let mut acc = [[0.0f32; L]; R];
    let step = |acc: &mut [[f32; L]; R], wv: &[f32; L], c: usize, len: usize| {
        for (acc_r, row) in acc.iter_mut().zip(&rows) {
            // A full chunk, or the tail zero-padded so that it takes the same vector code.
            let mut xc = [0.0f32; L];
            xc[..len].copy_from_slice(&row[c..c + len]);
            for ((a, &wv), &xv) in acc_r.iter_mut().zip(wv).zip(&xc) {
                *a = fmadd(wv, xv, *a);
            }
        }
    };
    let chunks = w.chunks_exact(L);
    let tail = chunks.remainder();
    for (i, wc) in chunks.enumerate() {
        let wc: &[T; L] = wc.try_into().expect("chunks_exact yields L elements");
        step(&mut acc, &T::widen(wc), i * L, L);
    }
    if !tail.is_empty() {
        let mut wc = [T::default(); L];
        wc[..tail.len()].copy_from_slice(tail);
        step(&mut acc, &T::widen(&wc), k - tail.len(), tail.len());
    }
    std::array::from_fn(|r| sum_lanes(&acc[r]))
}

/// Attention scores: one short dot product per call, so the AVX2 kernel (four accumulator
/// registers, enough to hide FMA latency) is worth its run-time dispatch.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has the features the kernel is compiled for.
        return unsafe { avx2::dot(a, b) };
    }
    dots::<f32, 1, 32>(a, b)[0]
}

/// `y += a * x`: attention's value rows, one row into each query's output.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has the features the kernel is compiled for.
        return unsafe { avx2::axpy(a, x, y) };
    }
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// `y_i += a_i[j] * x_j` for `j` in order, for each row `y_i` of `y` (`[m, n]`) with its
/// weights `a_i` (row `i` of `a`, `[m, keys]`), `x_j` being `x[j * stride..][..n]`: the bits
/// of `axpy(a_i[j], x_j, y_i)` called for each `j` in turn (attention's value rows, for a
/// speculative verify that must give each row its decode step's bits). On AVX2 chunks of the
/// rows of `y` stay in registers across all the keys, taking the same fused multiply-add per
/// key that `axpy` takes, where `axpy` loads and stores `y` again for every key, and each
/// chunk of `x` loaded serves four rows of `y`; elsewhere it is `axpy` itself.
pub fn axpys(a: &[f32], x: &[f32], stride: usize, y: &mut [f32], n: usize) {
    assert!(n > 0 && y.len().is_multiple_of(n));
    let m = y.len() / n;
    if m == 0 || a.is_empty() {
        return;
    }
    assert!(a.len().is_multiple_of(m));
    let keys = a.len() / m;
    assert!(x.len() >= (keys - 1) * stride + n);
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has the features the kernel is compiled for.
        return unsafe { avx2::axpys(a, keys, x, stride, y, n) };
    }
    for (a, y) in a.chunks_exact(keys).zip(y.chunks_exact_mut(n)) {
        for (j, &aj) in a.iter().enumerate() {
            axpy(aj, &x[j * stride..][..n], y);
        }
    }
}

/// Whether the CPU has the AVX2, FMA and F16C that every x86_64 kernel here needs.
#[cfg(target_arch = "x86_64")]
pub(super) use avx2::available as avx2_available;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{for_each_group, sum_lanes, DType, Widen, PREFETCH_BYTES};

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots_task<T: Widen>(x: &[f32], k: usize, w: &[T], out: &mut [f32]) {
        // Four accumulator registers per row of `x` (4 chains in flight for one row, 8 for
        // two, which covers FMA latency without spilling), the same for one row or two, so a
        // row's sum is the one its one-row step computes.
        for_each_group(x, k, w, k, out, |wr, xg, dst| {
            // SAFETY: this closure runs only inside `dots_task`, whose caller checked the CPU.
            unsafe {
                match dst.len() {
                    2 => dst.copy_from_slice(&dots::<T, 2, 4>(wr, xg)),
                    _ => dst.copy_from_slice(&dots::<T, 1, 4>(wr, xg)),
                }
            }
        });
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: the caller checked the CPU.
        unsafe { dots::<f32, 1, 4>(a, b)[0] }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let av = _mm256_set1_ps(a);
        let (mut xc, mut yc) = (x.chunks_exact(8), y.chunks_exact_mut(8));
        for (xv, yv) in xc.by_ref().zip(yc.by_ref()) {
            // SAFETY: eight floats read from each chunk and written to `yv`.
            unsafe {
                let sum = _mm256_fmadd_ps(
                    av,
                    _mm256_loadu_ps(xv.as_ptr()),
                    _mm256_loadu_ps(yv.as_ptr()),
                );
                _mm256_storeu_ps(yv.as_mut_ptr(), sum);
            }
        }
        for (y, &x) in yc.into_remainder().iter_mut().zip(xc.remainder()) {
            *y = a.mul_add(x, *y);
        }
    }

    /// `super::axpys` (`a` `[m, keys]`, `y` `[m, n]`, `x` holding `(keys - 1) * stride + n`
    /// values, none of them empty): per element of `y`, `axpy`'s operations (`_mm256_fmadd_ps`
    /// in its whole chunks of eight, `mul_add` in the rest) for each key in order, with `y` in
    /// registers between them. Four rows of `y` by three chunks at a time (twelve independent
    /// chains of FMAs to cover their latency, with the three chunks of `x` and a weight within
    /// the sixteen registers), a row left over by eight chunks.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpys(a: &[f32], keys: usize, x: &[f32], stride: usize, y: &mut [f32], n: usize) {
        /// Rows `y[..M]` (`n` apart, their weights `keys` apart in `a`), elements `c .. c + 8 *
        /// C`, through every key.
        ///
        /// # Safety
        /// The CPU must support AVX2 and FMA; `a` holds `M * keys` weights, `y` `M` rows of
        /// `n`, `x` `(keys - 1) * stride + n` values, and `c + 8 * C <= n`.
        #[inline(always)]
        unsafe fn tile<const M: usize, const C: usize>(
            (a, keys): (&[f32], usize),
            (x, stride): (&[f32], usize),
            (y, n): (&mut [f32], usize),
            c: usize,
        ) {
            // SAFETY: the caller has the features; the loads of `x` are within
            // `(keys - 1) * stride + c + 8 * C <= x.len()`, those of `y` within its rows, those
            // of `a` within `M * keys`.
            unsafe {
                let (ap, xp, yp) = (a.as_ptr(), x.as_ptr().add(c), y.as_mut_ptr().add(c));
                let mut acc = [[_mm256_setzero_ps(); C]; M];
                for (i, acc) in acc.iter_mut().enumerate() {
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_loadu_ps(yp.add(i * n + 8 * v));
                    }
                }
                for j in 0..keys {
                    let mut xv = [_mm256_setzero_ps(); C];
                    for (v, xv) in xv.iter_mut().enumerate() {
                        *xv = _mm256_loadu_ps(xp.add(j * stride + 8 * v));
                    }
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let av = _mm256_set1_ps(*ap.add(i * keys + j));
                        for (acc, &xv) in acc.iter_mut().zip(&xv) {
                            *acc = _mm256_fmadd_ps(av, xv, *acc);
                        }
                    }
                }
                for (i, acc) in acc.iter().enumerate() {
                    for (v, acc) in acc.iter().enumerate() {
                        _mm256_storeu_ps(yp.add(i * n + 8 * v), *acc);
                    }
                }
            }
        }
        /// Rows `y[..M]`, every element.
        ///
        /// # Safety
        /// As `tile`, without `c`.
        #[inline(always)]
        unsafe fn rows<const M: usize, const C: usize>(
            a: &[f32],
            keys: usize,
            x: (&[f32], usize),
            y: &mut [f32],
            n: usize,
        ) {
            let mut c = 0;
            // SAFETY: the caller's conditions, each tile within the rows.
            unsafe {
                while c + 8 * C <= n {
                    tile::<M, C>((a, keys), x, (y, n), c);
                    c += 8 * C;
                }
                while c + 8 <= n {
                    tile::<M, 1>((a, keys), x, (y, n), c);
                    c += 8;
                }
            }
            let (x, stride) = x;
            for (a, y) in a.chunks_exact(keys).zip(y.chunks_exact_mut(n)) {
                for (e, y) in y.iter_mut().enumerate().skip(c) {
                    for (j, &aj) in a.iter().enumerate() {
                        *y = aj.mul_add(x[j * stride + e], *y);
                    }
                }
            }
        }
        let (a4, a1) = a.split_at(a.len() / (4 * keys) * 4 * keys);
        let (y4, y1) = y.split_at_mut(a4.len() / keys * n);
        // SAFETY: the caller checked the CPU and the lengths.
        unsafe {
            for (a, y) in a4.chunks_exact(4 * keys).zip(y4.chunks_exact_mut(4 * n)) {
                rows::<4, 3>(a, keys, (x, stride), y, n);
            }
            for (a, y) in a1.chunks_exact(keys).zip(y1.chunks_exact_mut(n)) {
                rows::<1, 8>(a, keys, (x, stride), y, n);
            }
        }
    }

    /// Eight elements widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load8<T: Widen>(c: &[T; 8]) -> __m256 {
        let p = c.as_ptr();
        // SAFETY: each arm reads exactly the 8 elements of `c` (the arm matching T's size: 32
        // bytes for f32, 16 for bf16/f16), with unaligned loads.
        unsafe {
            match T::DTYPE {
                DType::F32 => _mm256_loadu_ps(p.cast()),
                DType::BF16 => {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                }
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _ => unreachable!("quantised types have their own kernels"),
            }
        }
    }

    /// Dot products of weight row `w` with the `R` rows of `xs` (`[R, w.len()]`), `V`
    /// accumulator registers per row.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots<T: Widen, const R: usize, const V: usize>(w: &[T], xs: &[f32]) -> [f32; R] {
        let k = w.len();
        assert_eq!(xs.len(), R * k);
        let rows: [&[f32]; R] = std::array::from_fn(|r| &xs[r * k..(r + 1) * k]);
        // SAFETY: the caller guarantees the CPU features; every load goes through `load8` on a
        // bounds-checked 8-element array reference.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            let mut wc = w.chunks_exact(8);
            let mut i = 0;
            while wc.len() >= V {
                let ahead = w[i..].as_ptr().cast::<i8>().wrapping_add(PREFETCH_BYTES);
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                for v in 0..V {
                    let wv = load8(wc.next().and_then(|c| c.try_into().ok()).unwrap());
                    for (acc_r, row) in acc.iter_mut().zip(&rows) {
                        let xv = load8::<f32>(row[i..i + 8].try_into().unwrap());
                        acc_r[v] = _mm256_fmadd_ps(wv, xv, acc_r[v]);
                    }
                    i += 8;
                }
            }
            for c in wc.by_ref() {
                let wv = load8(c.try_into().unwrap());
                for (acc_r, row) in acc.iter_mut().zip(&rows) {
                    let xv = load8::<f32>(row[i..i + 8].try_into().unwrap());
                    acc_r[0] = _mm256_fmadd_ps(wv, xv, acc_r[0]);
                }
                i += 8;
            }
            let tail = wc.remainder();
            std::array::from_fn(|r| {
                let mut sum = acc[r][0];
                for &a in &acc[r][1..] {
                    sum = _mm256_add_ps(sum, a);
                }
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
                let tail = tail
                    .iter()
                    .zip(&rows[r][i..])
                    .fold(0.0f32, |s, (&wv, &xv)| T::widen(&[wv])[0].mul_add(xv, s));
                sum_lanes(&lanes) + tail
            })
        }
    }
}

/// The float kernel on AVX-512 (bf16, f16 and f32 weights): tiles of [`avx512::W_TILE`] weight
/// rows by up to [`avx512::X_TILE`] rows of `x`, each weight chunk loaded and widened once per
/// tile and each chunk of `x` once for all the tile's weight rows. Every (weight row, row of
/// `x`) product is, bit for bit, the one the AVX2 kernel's one-row pass computes
/// (`avx2::dots::<T, 1, 4>`), whatever the tile: a verify pass of several rows gives each row
/// its decode step's products, and a host with AVX-512 computes what a helper with AVX2 alone
/// does. With the AVX2 kernel's two rows a pass, a verify pass of 1 + 4 rows cost about 2.1
/// decode steps and 1 + 8 rows 3.6 (Zen 4, 2 threads, `bench` on the 0.8B model in bf16):
/// every pass widened the weights again and each weight register fed only two FMAs. With this
/// one, about 1.3 and 2.0-2.3.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{avx2, DType, Widen};

    /// Weight rows a tile multiplies at once. With [`X_TILE`], 2 x 4 x 3 = 24 accumulator
    /// registers (two a product), three of `x` and one of weights: within the 32 without
    /// spilling, and each loaded vector feeds three or four FMAs. Measured on Zen 4 (bf16,
    /// k = 1024, in cache, one thread) against 3 x 4, 2 x 4 .. 2 x 6, 3 x 3 and 4 x 2 tiles,
    /// for 1 to 15 rows of `x`: within a few percent of the best at every row count, and
    /// 40-45 G FMA lanes/s (75% of the core's peak) from 3 rows up.
    pub const W_TILE: usize = 4;

    /// Rows of `x` a tile takes at most; more rows are split into groups as even as possible
    /// (five rows: three and two), each taking the tile's weights from L1.
    pub const X_TILE: usize = 3;

    /// How far ahead of each weight row's chunk the kernel prefetches, into L2 (`T1`): the
    /// rows of a tile are read from L1 once per group of `x`, and prefetches into L1 evicted
    /// them (and `x`) before their last use. Measured on Zen 4 (2 threads, weights from
    /// memory): against `T0` at 2 KiB, 10-25% faster for 3 to 5 rows of `x` and the same for
    /// 1 and 9; 2 to 8 KiB ahead within noise of each other.
    const AHEAD_BYTES: usize = 4096;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f") && avx2::available()
    }

    /// Weight rows `w` (`[rows, k]`) into `out` (`[rows, t]`), as `super::dots_task`.
    ///
    /// The rows are taken as [`W_TILE`] bands of consecutive rows, a tile holding row `o` of
    /// each band, with the few left over one at a time: each band is then read in order, a
    /// stream the hardware prefetcher follows. Tiles of adjacent rows (four streams 2 KiB
    /// apart, jumping 8 KiB per tile) made one row of `x` 1.5 times slower from memory.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dots_task<T: Widen>(x: &[f32], k: usize, w: &[T], out: &mut [f32]) {
        let (t, n) = (x.len() / k, w.len() / k);
        assert_eq!(out.len(), n * t);
        let band = n / W_TILE;
        for o in 0..band {
            let rows: [usize; W_TILE] = std::array::from_fn(|j| o + j * band);
            // SAFETY: the caller checked the CPU.
            unsafe { tile(rows, x, k, w, out) };
        }
        for o in W_TILE * band..n {
            // SAFETY: as above.
            unsafe { tile([o], x, k, w, out) };
        }
    }

    /// Weight rows `rows` of `w` against every row of `x`, in groups of up to [`X_TILE`] rows,
    /// into their rows of `out` (`[rows of w, t]`).
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn tile<T: Widen, const W: usize>(
        rows: [usize; W],
        x: &[f32],
        k: usize,
        w: &[T],
        out: &mut [f32],
    ) {
        let t = x.len() / k;
        let wr = rows.map(|o| &w[o * k..][..k]);
        let groups = t.div_ceil(X_TILE);
        let mut r0 = 0;
        for g in 0..groups {
            let len = t / groups + usize::from(g < t % groups);
            let xg = &x[r0 * k..(r0 + len) * k];
            macro_rules! group {
                ($R:literal) => {{
                    // SAFETY: the caller checked the CPU.
                    let d = unsafe { dots::<T, W, $R>(wr, xg) };
                    for (&o, d) in rows.iter().zip(&d) {
                        out[o * t + r0..][..$R].copy_from_slice(d);
                    }
                }};
            }
            match len {
                1 => group!(1),
                2 => group!(2),
                _ => group!(3),
            }
            r0 += len;
        }
    }

    /// Sixteen elements from `p` widened to f32: the same values as two of `avx2::load8`.
    ///
    /// Not a `target_feature` function, so that it is always inlined into its caller.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `p` must be valid for reading 16 elements.
    #[inline(always)]
    unsafe fn load16<T: Widen>(p: *const T) -> __m512 {
        // SAFETY: each arm reads the 16 elements at `p` (64 bytes for f32, 32 for bf16/f16),
        // with unaligned loads; the caller has the features.
        unsafe {
            match T::DTYPE {
                DType::F32 => _mm512_loadu_ps(p.cast()),
                DType::BF16 => {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
                }
                DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => unreachable!("quantised types have their own kernels"),
            }
        }
    }

    /// The sums of two products' 32 accumulator lanes, `a` and `b` (lanes 0..16 and 16..32),
    /// each in `avx2::dots`'s order: its accumulators 0 to 3 (eight lanes each) added in turn,
    /// then `super::sum_lanes` of the eight lanes (the upper four added to the lower four,
    /// lanes 2 and 3 to 0 and 1, lane 1 to lane 0), every addition with the same operands in
    /// the same order. `a`'s sum is lane 0 of the result, `b`'s lane 8: the two share each
    /// instruction.
    ///
    /// Not a `target_feature` function, so that it is always inlined into its caller.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[inline(always)]
    unsafe fn sum2(a: [__m512; 2], b: [__m512; 2]) -> __m512 {
        // SAFETY: the caller has the features.
        unsafe {
            // Accumulator 0 of `a` in lanes 0..8 and of `b` in lanes 8..16, and so on.
            let acc0 = _mm512_shuffle_f32x4::<0x44>(a[0], b[0]);
            let acc1 = _mm512_shuffle_f32x4::<0xee>(a[0], b[0]);
            let acc2 = _mm512_shuffle_f32x4::<0x44>(a[1], b[1]);
            let acc3 = _mm512_shuffle_f32x4::<0xee>(a[1], b[1]);
            let sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), acc2), acc3);
            // Lanes 4..8 onto 0..4 (and 12..16 onto 8..12).
            let s4 = _mm512_add_ps(sum, _mm512_shuffle_f32x4::<0xb1>(sum, sum));
            // Lanes 2 and 3 onto 0 and 1.
            let s2 = _mm512_add_ps(s4, _mm512_permute_ps::<0x0e>(s4));
            // Lane 1 onto lane 0.
            _mm512_add_ps(s2, _mm512_movehdup_ps(s2))
        }
    }

    /// Dot products of the `W` weight rows `w` (each of length `k`) with the `R` rows of `xs`
    /// (`[R, k]`), each as `avx2::dots::<T, 1, 4>` computes it for that pair alone. That
    /// kernel's four 8-lane accumulators are two 16-lane ones here (accumulators 0 and 1,
    /// then 2 and 3): chunk `c` of 8 weights of its main loop goes to accumulator `c % 4`, so
    /// a step of 32 weights takes the same per-lane FMAs as two 512-bit FMAs. The whole chunks
    /// left after the last step (fewer than four) go to accumulator 0, the last `k % 8`
    /// weights to a scalar chain from zero added after the lanes' sum, as there.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn dots<T: Widen, const W: usize, const R: usize>(
        w: [&[T]; W],
        xs: &[f32],
    ) -> [[f32; R]; W] {
        let k = xs.len() / R;
        assert_eq!(xs.len(), R * k);
        assert!(w.iter().all(|w| w.len() == k));
        let (wp, xp) = (w.map(|w| w.as_ptr()), xs.as_ptr());
        // SAFETY: the caller guarantees the CPU features. The main loop reads elements
        // `i .. i + 32` of each weight row and of each row `r` of `xs` (at `r * k`) only while
        // `i + 32 <= k`; a prefetch of any address does not fault; the rest goes through
        // bounds-checked slices.
        unsafe {
            let mut acc = [[[_mm512_setzero_ps(); 2]; R]; W];
            let mut i = 0;
            while i + 32 <= k {
                for p in wp {
                    let ahead = p.wrapping_add(i).cast::<i8>().wrapping_add(AHEAD_BYTES);
                    for line in (0..32 * size_of::<T>()).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line));
                    }
                }
                for h in 0..2 {
                    let mut xv = [_mm512_setzero_ps(); R];
                    for (r, xv) in xv.iter_mut().enumerate() {
                        *xv = _mm512_loadu_ps(xp.add(r * k + i + 16 * h));
                    }
                    for (p, acc) in wp.iter().zip(acc.iter_mut()) {
                        let wv = load16(p.add(i + 16 * h));
                        for (acc, &xv) in acc.iter_mut().zip(&xv) {
                            acc[h] = _mm512_fmadd_ps(wv, xv, acc[h]);
                        }
                    }
                }
                i += 32;
            }
            // The whole chunks after the last step: accumulator 0, lanes 0..8.
            while i + 8 <= k {
                for (w, acc) in w.iter().zip(&mut acc) {
                    let wv = _mm512_zextps256_ps512(avx2::load8(w[i..i + 8].try_into().unwrap()));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let x = xs[r * k + i..][..8].try_into().unwrap();
                        let xv = _mm512_zextps256_ps512(avx2::load8::<f32>(x));
                        acc[0] = _mm512_mask3_fmadd_ps(wv, xv, acc[0], 0x00ff);
                    }
                }
                i += 8;
            }
            let mut tail = [[0.0f32; R]; W];
            if i < k {
                for (w, tail) in w.iter().zip(&mut tail) {
                    for (r, tail) in tail.iter_mut().enumerate() {
                        *tail = w[i..]
                            .iter()
                            .zip(&xs[r * k + i..(r + 1) * k])
                            .fold(0.0f32, |s, (&wv, &xv)| T::widen(&[wv])[0].mul_add(xv, s));
                    }
                }
            }
            // The products two at a time, in order (the last with itself where they are odd).
            let mut out = [[0.0f32; R]; W];
            let mut held: Option<(usize, usize)> = None;
            for j in 0..W {
                for r in 0..R {
                    let Some((hj, hr)) = held.take() else {
                        held = Some((j, r));
                        continue;
                    };
                    let v = sum2(acc[hj][hr], acc[j][r]);
                    out[hj][hr] = _mm_cvtss_f32(_mm512_castps512_ps128(v)) + tail[hj][hr];
                    out[j][r] = _mm_cvtss_f32(_mm512_extractf32x4_ps::<2>(v)) + tail[j][r];
                }
            }
            if let Some((hj, hr)) = held {
                let v = sum2(acc[hj][hr], acc[hj][hr]);
                out[hj][hr] = _mm_cvtss_f32(_mm512_castps512_ps128(v)) + tail[hj][hr];
            }
            out
        }
    }
}

/// The prefill path: `gemm` on f32 copies of weight-row blocks (native only).
#[cfg(not(target_arch = "wasm32"))]
mod blocked {
    use super::super::gemm::{gemm_f32, View};
    use std::cell::RefCell;

    use super::{column_blocks, rows_per_task};
    use crate::convert;
    use crate::tensor::{Data, Matrix};

    /// Weight rows widened per `gemm` call. Throughput is flat from 64 to 256 rows (measured,
    /// t = 512 on 2 cores); 128 keeps the f32 block (`rows * k * 4` bytes) within L2 for the
    /// model's `k` and leaves several blocks per thread.
    const GEMM_ROWS: usize = 128;

    /// Run `f` with this thread's scratch buffer of `len` floats (reused across calls, so the
    /// widened weight blocks cost no allocation or page faults after warm-up).
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        thread_local! {
            static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < len {
                s.resize(len, 0.0);
            }
            f(&mut s[..len])
        })
    }

    pub fn matmul_gemm(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
        let (n, k) = (w.rows, w.cols);
        let block = GEMM_ROWS.min(rows_per_task(n));
        column_blocks(out, n, block, |o0, rows, dst| {
            let range = o0 * k..(o0 + rows) * k;
            let widened = if let Data::F32(_) = w.data {
                0
            } else {
                rows * k
            };
            with_scratch(widened, |buf| {
                let wb: &[f32] = match &w.data {
                    Data::F32(e) => &e[range],
                    Data::BF16(e) => {
                        convert::bf16_to_f32(&e[range], buf);
                        buf
                    }
                    Data::F16(e) => {
                        convert::f16_to_f32(&e[range], buf);
                        buf
                    }
                    quantised => {
                        quantised.to_f32_into(range, buf);
                        buf
                    }
                };
                // SAFETY: dst is `out[.., o0..o0 + rows]` (t rows of stride n inside `out`, of
                // length t * n), written by this task only; lhs is `x` as [t, k] row-major and
                // rhs is the widened block read as [k, rows] (element (i, c) at c * k + i), both
                // live and in bounds for the whole call.
                unsafe {
                    gemm_f32(
                        (t, rows, k),
                        dst.add(o0),
                        n,
                        View {
                            ptr: x.as_ptr(),
                            rs: k,
                            cs: 1,
                        },
                        View {
                            ptr: wb.as_ptr(),
                            rs: 1,
                            cs: k,
                        },
                        false,
                    );
                }
            })
        });
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::interleaved;
    use crate::tensor::{DType, QK};

    /// Deterministic values in [-1, 1) with a scale spread, so cancellation is exercised
    /// (attention's tests use them too).
    pub(in crate::backend::cpu) fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                u * if i % 5 == 0 { 4.0 } else { 1.0 }
            })
            .collect()
    }

    /// A matrix product under test: `out = x * w^T`.
    type Kernel = fn(&[f32], &Matrix, &mut [f32]);

    /// The portable dot-product kernel over the whole matrix, which `matmul` skips on AVX2 CPUs.
    fn portable(x: &[f32], w: &Matrix, out: &mut [f32]) {
        let (n, k) = (w.rows, w.cols);
        let t = x.len() / k;
        let mut out_t = vec![0.0; n * t];
        match_quant!(&w.data, e => dots_task_quant(x, k, e, &mut out_t),
            Data::Q8_0x8 { .. } => unreachable!("the portable kernel reads the file's layout"),
            Data::F32(e) => dots_task_portable(x, k, e, &mut out_t),
            Data::BF16(e) => dots_task_portable(x, k, e, &mut out_t),
            Data::F16(e) => dots_task_portable(x, k, e, &mut out_t),
        );
        transpose(&out_t, t, n, out);
    }

    /// `out_t` (`[n, t]`, as the tasks fill it) into `out` (`[t, n]`).
    fn transpose(out_t: &[f32], t: usize, n: usize, out: &mut [f32]) {
        for r in 0..t {
            for o in 0..n {
                out[r * n + o] = out_t[o * t + r];
            }
        }
    }

    /// The integer kernels on `isa` over the whole matrix (`matmul` takes the widest the CPU
    /// has).
    #[cfg(target_arch = "x86_64")]
    fn integer_on(isa: quant_dots::Isa, x: &[f32], w: &Matrix, out: &mut [f32]) {
        let (n, k) = (w.rows, w.cols);
        let t = x.len() / k;
        let rows = Rows8::quantise(x, k, w.dtype().block().0).unwrap();
        let mut out_t = vec![0.0; n * t];
        // SAFETY: the callers run only the kernels this CPU has.
        match_quant!(&w.data, e => unsafe { quant_dots::dots_task(isa, &rows, e, &mut out_t) },
            _ => unreachable!("quantised types only"),
        );
        transpose(&out_t, t, n, out);
    }

    #[cfg(target_arch = "x86_64")]
    fn integer_avx2(x: &[f32], w: &Matrix, out: &mut [f32]) {
        integer_on(quant_dots::Isa::Avx2, x, w, out)
    }

    #[cfg(target_arch = "x86_64")]
    fn integer_avx512(x: &[f32], w: &Matrix, out: &mut [f32]) {
        integer_on(quant_dots::Isa::Avx512, x, w, out)
    }

    #[cfg(target_arch = "x86_64")]
    fn integer_vnni(x: &[f32], w: &Matrix, out: &mut [f32]) {
        integer_on(quant_dots::Isa::Vnni, x, w, out)
    }

    /// Prefill's integer kernel for the type, whatever the number of rows of `x`.
    #[cfg(target_arch = "x86_64")]
    fn integer_panels(x: &[f32], w: &Matrix, out: &mut [f32]) {
        assert!(quant_panels::matmul(
            x,
            x.len() / w.cols,
            &w.data,
            w.rows,
            out
        ));
    }

    /// AVX2's panel kernel for the type, which CPUs with AVX-512 VNNI do not take.
    #[cfg(target_arch = "x86_64")]
    fn integer_panels_avx2(x: &[f32], w: &Matrix, out: &mut [f32]) {
        let t = x.len() / w.cols;
        let avx2 = Some(quant_panels::Panels::Avx2);
        assert!(quant_panels::matmul_on(avx2, x, t, &w.data, w.rows, out));
    }

    /// The integer kernels this CPU runs for `dtype`.
    #[cfg(target_arch = "x86_64")]
    fn integer_kernels(dtype: DType) -> Vec<Kernel> {
        let mut kernels: Vec<Kernel> = match quant_dots::Isa::best() {
            None => return vec![],
            Some(quant_dots::Isa::Avx2) => vec![integer_avx2],
            Some(quant_dots::Isa::Avx512) => vec![integer_avx2, integer_avx512],
            Some(quant_dots::Isa::Vnni) => vec![integer_avx2, integer_avx512, integer_vnni],
        };
        if integer_prefill(dtype) {
            kernels.push(integer_panels);
        }
        if quant_panels::takes_on(Some(quant_panels::Panels::Avx2), dtype) {
            kernels.push(integer_panels_avx2);
        }
        kernels
    }

    /// The NEON integer kernel over the whole matrix.
    #[cfg(target_arch = "aarch64")]
    fn integer_neon(x: &[f32], w: &Matrix, out: &mut [f32]) {
        let (n, k) = (w.rows, w.cols);
        let t = x.len() / k;
        let rows = Rows8::quantise(x, k, w.dtype().block().0).unwrap();
        let mut out_t = vec![0.0; n * t];
        match_quant!(&w.data, e => quant_neon::dots_task(&rows, e, &mut out_t),
            _ => unreachable!("quantised types only"),
        );
        transpose(&out_t, t, n, out);
    }

    /// The integer kernels this CPU runs for `dtype`: NEON's, where the type has levels.
    #[cfg(target_arch = "aarch64")]
    fn integer_kernels(dtype: DType) -> Vec<Kernel> {
        fn integer<B: quant_neon::Levels>(_: &[B]) -> bool {
            B::INTEGER
        }
        let w = Data::from_f32(&vec![0.0; dtype.block().0], dtype);
        let has = match_quant!(&w, e => integer(e), _ => false);
        if has {
            vec![integer_neon]
        } else {
            vec![]
        }
    }

    fn check(t: usize, n: usize, k: usize, dtype: DType, f: Kernel) {
        let x = values(t * k, t as u64 + 7);
        let bound = |x: &[f32], w: &[f32]| activation_rounding(x, w, dtype);
        check_against(&x, &x, n, k, dtype, f, bound);
    }

    /// `f(x, w)` against the f64 product of `want_x` (`x`, or `x` as a kernel rounds it) and the
    /// weights' values, within f32 rounding plus `extra(row of want_x, weight row)`.
    fn check_against(
        x: &[f32],
        want_x: &[f32],
        n: usize,
        k: usize,
        dtype: DType,
        f: Kernel,
        extra: impl Fn(&[f32], &[f32]) -> f64,
    ) {
        let t = x.len() / k;
        let w = Matrix {
            rows: n,
            cols: k,
            data: Data::from_f32(&values(n * k, (n * 31 + k) as u64), dtype),
        };
        // The weights' values by ggml's definition, computed here (Q8_0: weight i of a block
        // is d * qs[i]), not by the kernels' own widening.
        let wf: Vec<f32> = match &w.data {
            Data::Q8_0(blocks) => blocks
                .iter()
                .flat_map(|b| b.qs.map(|q| b.d.to_f32() * f32::from(q)))
                .collect(),
            other => other.to_f32_vec(),
        };
        let mut out = vec![f32::NAN; t * n];
        f(x, &w, &mut out);
        for r in 0..t {
            for o in 0..n {
                let (mut want, mut mag) = (0.0f64, 0.0f64);
                for i in 0..k {
                    let p = want_x[r * k + i] as f64 * wf[o * k + i] as f64;
                    want += p;
                    mag += p.abs();
                }
                let got = out[r * n + o] as f64;
                // f32 accumulation in any order: error grows with sqrt(k) * |terms|.
                let tol = 4.0 * f32::EPSILON as f64 * (k as f64).sqrt() * mag
                    + extra(&want_x[r * k..][..k], &wf[o * k..][..k])
                    + 1e-30;
                assert!(
                    (got - want).abs() <= tol,
                    "{dtype:?} t={t} n={n} k={k} [{r},{o}]: {got} vs {want}"
                );
            }
        }
    }

    const SHAPES: [(usize, usize); 6] =
        [(37, 19), (300, 1000), (5, 1), (129, 64), (16, 33), (3, 7)];

    #[test]
    fn matches_f64_reference() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for t in [1, 2, 3, 7, 15, 16, 64, 65, 130] {
                for (n, k) in SHAPES {
                    check(t, n, k, dtype, matmul);
                }
            }
        }
    }

    #[test]
    fn portable_kernel_matches_f64_reference() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for t in [1, 2, 3, 4, 5, 9] {
                for (n, k) in SHAPES {
                    check(t, n, k, dtype, portable);
                }
            }
        }
    }

    /// Q8_0 rows are whole blocks of 32.
    const Q8_SHAPES: [(usize, usize); 4] = [(37, 32), (300, 1024), (5, 64), (129, 96)];

    #[test]
    fn q8_0_matches_f64_reference_on_both_kernels_and_gemm() {
        for t in [1, 2, 3, 4, 5, 9, 16, 40] {
            for (n, k) in Q8_SHAPES {
                check(t, n, k, DType::Q8_0, matmul);
                check(t, n, k, DType::Q8_0, portable);
            }
        }
    }

    /// `w` (Q8_0) with its rows interleaved by eight, as `resident` stores it where the CPU's
    /// decode takes it, through `matmul`.
    fn interleaved(x: &[f32], w: &Matrix, out: &mut [f32]) {
        let Data::Q8_0(blocks) = &w.data else {
            panic!("Q8_0 weights to interleave")
        };
        let per_row = w.cols / QK;
        let mut x8 = vec![bytemuck::Zeroable::zeroed(); blocks.len() / interleaved::ROWS];
        interleaved::interleave_into(blocks, per_row, &mut x8);
        let data = Data::Q8_0x8 {
            blocks: crate::tensor::Elems::Owned(x8.into()),
            per_row,
        };
        matmul(x, &Matrix { data, ..*w }, out);
    }

    /// Interleaved Q8_0: decode on its kernel (where the CPU has AVX2; with activations
    /// rounded as `Rows8` rounds them, within f32 rounding alone) over one task and several,
    /// and several rows of `x` on the widened fallback and gemm. (Non-finite activations:
    /// `non_finite_activations_propagate_through_quantised_weights`.)
    #[test]
    fn interleaved_q8_0_matches_f64_reference() {
        for (n, k) in [(8, 32), (16, 96), (400, 1024), (88, 64)] {
            for t in [1, 2, 3, 16, 17] {
                check(t, n, k, DType::Q8_0, interleaved);
            }
            #[cfg(target_arch = "x86_64")]
            if avx2_available() {
                let x = values(k, 7);
                let rounded = Rows8::quantise(&x, k, QK).unwrap().values();
                check_against(&x, &rounded, n, k, DType::Q8_0, interleaved, |_, _| 0.0);
            }
        }
    }

    /// Every quantised weight type tether reads.
    const QUANTISED: [DType; 12] = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Iq4Nl,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
        DType::Iq4Xs,
    ];

    /// Every quantised type (k-quant rows are whole super-blocks of 256), with weights from
    /// ggml's reference quantisers, against the f64 product of their dequantised values
    /// (bit-exact with ggml's: `quant`'s tests), on `matmul` (the integer kernels on AVX2) and
    /// the portable kernel; and each integer kernel the CPU has (AVX2's, AVX-512's) against the
    /// f64 product with the activations as they round them, within f32 rounding alone (which
    /// the rounding bound of the first check is too wide to pin down).
    #[test]
    fn quantised_types_match_f64_reference_on_both_kernels() {
        for dtype in QUANTISED {
            let block = dtype.block().0;
            let k = if block == 32 { 96 } else { 512 };
            for t in [1, 2, 3, 4, 5, 9, 16, 19] {
                for n in [1, 7, 37] {
                    check(t, n, k, dtype, matmul);
                    check(t, n, k, dtype, portable);
                    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                    for kernel in integer_kernels(dtype) {
                        let x = values(t * k, t as u64 + 7);
                        let rounded = Rows8::quantise(&x, k, block).unwrap().values();
                        check_against(&x, &rounded, n, k, dtype, kernel, |_, _| 0.0);
                    }
                }
            }
        }
    }

    /// Below `STEP_ROWS` rows of `x`, every row gets, bit for bit, the products it gets alone
    /// (a speculative verify's rows are then plain decode steps): every type on `matmul`, on the
    /// portable kernel and on each integer kernel this CPU has, and interleaved Q8_0; over
    /// one task and several, whole groups of weight rows and a remainder.
    #[test]
    fn each_row_gets_its_one_row_products() {
        let mut kernels: Vec<(DType, Kernel)> = vec![(DType::Q8_0, interleaved)];
        for dtype in [DType::F32, DType::BF16, DType::F16]
            .into_iter()
            .chain(QUANTISED)
        {
            kernels.extend([(dtype, matmul as Kernel), (dtype, portable)]);
            #[cfg(target_arch = "x86_64")]
            if dtype.is_quantised() {
                let isas = match quant_dots::Isa::best() {
                    None => vec![],
                    Some(quant_dots::Isa::Avx2) => vec![integer_avx2 as Kernel],
                    Some(quant_dots::Isa::Avx512) => vec![integer_avx2, integer_avx512],
                    Some(quant_dots::Isa::Vnni) => {
                        vec![integer_avx2, integer_avx512, integer_vnni]
                    }
                };
                kernels.extend(isas.into_iter().map(|f| (dtype, f)));
            }
        }
        for (i, (dtype, f)) in kernels.into_iter().enumerate() {
            let k = if dtype.block().0 == QK_K { 512 } else { 96 };
            // Interleaved weights (the first) are whole groups of eight rows.
            let shapes: &[usize] = if i == 0 { &[64, 296] } else { &[37, 64, 296] };
            for &n in shapes {
                let w = Matrix {
                    rows: n,
                    cols: k,
                    data: Data::from_f32(&values(n * k, n as u64), dtype),
                };
                let x = values(15 * k, 3);
                let mut one = vec![0.0f32; n];
                for t in [2, 3, 5, 8, 15] {
                    let mut all = vec![0.0f32; t * n];
                    f(&x[..t * k], &w, &mut all);
                    for (r, got) in all.chunks_exact(n).enumerate() {
                        f(&x[r * k..][..k], &w, &mut one);
                        let same = got
                            .iter()
                            .zip(&one)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{dtype:?} kernel {i} n={n} t={t}: row {r} differs");
                    }
                }
            }
        }
    }

    /// `axpys` over several keys gives each row of `y` the bits of `axpy` called for each key
    /// in turn: lengths below a chunk of eight, whole tiles, chunks left over and a scalar
    /// tail; one row to more than a group of four; from one key to more than a tile's worth.
    #[test]
    fn axpys_is_axpy_key_by_key() {
        for n in [1, 7, 8, 13, 24, 64, 72, 100, 256, 300] {
            let stride = n + 5;
            let x = values(17 * stride, n as u64);
            for m in 1..=6 {
                for keys in 1..=17 {
                    let a = values(m * keys, (m * keys) as u64 + 100);
                    let mut want = values(m * n, 7);
                    for (a, y) in a.chunks_exact(keys).zip(want.chunks_exact_mut(n)) {
                        for (j, &aj) in a.iter().enumerate() {
                            axpy(aj, &x[j * stride..][..n], y);
                        }
                    }
                    let mut got = values(m * n, 7);
                    axpys(&a, &x[..(keys - 1) * stride + n], stride, &mut got, n);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "n={n}, {m} rows, {keys} keys");
                }
            }
        }
    }

    /// The AVX-512 float kernel gives every row of `x`, whatever the rows beside it, the bits
    /// the AVX2 kernel gives that row alone: a host with AVX-512 and a helper with AVX2 alone
    /// compute the same products, and a verify row its decode step's. Rows shorter than a
    /// chunk, whole 32-weight steps, leftover chunks and a scalar tail; weight rows in whole
    /// bands of the tile and left over.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_rows_match_avx2_one_row_bits() {
        /// Every row of `x` (`[t, k]`) through the AVX-512 kernel, as `[t, n]`, and each row
        /// alone through the AVX2 kernel.
        fn both<T: Widen>(x: &[f32], k: usize, w: &[T]) -> (Vec<f32>, Vec<f32>) {
            let (t, n) = (x.len() / k, w.len() / k);
            let (mut all, mut one) = (vec![f32::NAN; n * t], vec![f32::NAN; n]);
            let mut alone = vec![f32::NAN; t * n];
            // SAFETY: the caller checked that the CPU has AVX-512F (and with it AVX2, FMA,
            // F16C).
            unsafe { avx512::dots_task(x, k, w, &mut all) };
            for (r, row) in x.chunks_exact(k).enumerate() {
                // SAFETY: as above.
                unsafe { avx2::dots_task(row, k, w, &mut one) };
                alone[r * n..][..n].copy_from_slice(&one);
            }
            let mut got = vec![0.0; t * n];
            transpose(&all, t, n, &mut got);
            (got, alone)
        }
        if !avx512::available() {
            eprintln!("skipped: this CPU lacks AVX-512F");
            return;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for k in [7, 8, 31, 32, 40, 63, 100, 1000, 1024] {
                for n in [3, 37, 64] {
                    let data = Data::from_f32(&values(n * k, (n * 31 + k) as u64), dtype);
                    let x = values(15 * k, k as u64 + 3);
                    for t in 1..=15 {
                        let x = &x[..t * k];
                        let (got, want) = match &data {
                            Data::F32(e) => both(x, k, e),
                            Data::BF16(e) => both(x, k, e),
                            Data::F16(e) => both(x, k, e),
                            _ => unreachable!("float types"),
                        };
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{dtype:?} k={k} n={n} t={t} row {} output {}: {a} vs {b}",
                                i / n,
                                i % n
                            );
                        }
                    }
                }
            }
        }
    }

    /// ggml's rounding: the largest magnitude becomes +-127, the rest round to nearest.
    #[test]
    fn q8_0_quantises_as_ggml_does() {
        use crate::quant::Quantise;
        let mut x = [0.0f32; 32];
        x[3] = -2.54;
        x[7] = 1.0;
        x[9] = 0.009;
        x[10] = -0.03;
        let b = crate::tensor::BlockQ8_0::quantise(&x);
        assert_eq!(b.d.to_f32(), half::f16::from_f32(2.54 / 127.0).to_f32());
        assert_eq!(
            (b.qs[3], b.qs[7], b.qs[9], b.qs[10], b.qs[0]),
            (-127, 50, 0, -2, 0)
        );
        assert_eq!(crate::tensor::BlockQ8_0::quantise(&[0.0; 32]).qs, [0; 32]);
    }

    /// A NaN or infinite activation reaches the output as it would through f32 products (the
    /// integer kernels cannot scale it), not as a finite number: Q8_0 in the file's layout
    /// (3 rows) and interleaved (8).
    #[test]
    fn non_finite_activations_propagate_through_quantised_weights() {
        let kernels: [(usize, Kernel); 2] = [(3, matmul), (8, interleaved)];
        for (rows, kernel) in kernels {
            let w = Matrix {
                rows,
                cols: 64,
                data: Data::from_f32(&values(rows * 64, 5), DType::Q8_0),
            };
            for bad in [f32::INFINITY, f32::NAN] {
                let mut x = values(64, 9);
                x[10] = bad;
                let mut out = vec![0.0; rows];
                kernel(&x, &w, &mut out);
                assert!(out.iter().all(|v| !v.is_finite()), "{bad}: {out:?}");
            }
        }
    }

    #[test]
    fn many_row_blocks() {
        // More weight rows than one task or one gemm block, with ragged ends.
        for t in [1, 5, 17] {
            check(t, 2049, 40, DType::BF16, matmul);
        }
    }

    #[test]
    fn empty_output() {
        let w = Matrix {
            rows: 0,
            cols: 3,
            data: Data::from_f32(&[], DType::BF16),
        };
        matmul(&[1.0; 6], &w, &mut []);
    }

    #[test]
    fn dot_matches_f64() {
        for len in [0, 1, 7, 8, 31, 32, 33, 64, 100, 256, 1000] {
            let (a, b) = (values(len, 1), values(len, 2));
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let mag: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
            let tol = 4.0 * f32::EPSILON as f64 * mag;
            for got in [dot(&a, &b), dots::<f32, 1, 32>(&a, &b)[0]] {
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "len {len}: {got} vs {want}"
                );
            }
        }
    }
}
