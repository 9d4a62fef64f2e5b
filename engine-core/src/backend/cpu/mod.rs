//! The reference backend: plain Rust, multi-threaded with rayon (the caller's pool decides how
//! many threads), inner loops over contiguous memory so the compiler can vectorise them.
//!
//! Each op is a function on host slices (the reference every other backend is tested against,
//! op by op); `CpuBackend` runs them in place on the vector inside [`Act::Host`], so handing
//! values around as `Act` costs the CPU no copies.

pub mod attention;
pub mod delta;
pub mod frozen;
mod gemm;
#[cfg(target_arch = "x86_64")]
mod interleaved_dots;
pub mod matmul;
#[cfg(target_arch = "x86_64")]
mod quant_dots;
#[cfg(target_arch = "aarch64")]
mod quant_neon;
#[cfg(target_arch = "x86_64")]
mod quant_panels;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod quant_rows;
#[cfg(not(target_arch = "wasm32"))]
mod team;
#[cfg(target_arch = "x86_64")]
mod vnni_dots;
#[cfg(target_arch = "x86_64")]
mod vnni_panels;

use std::ops::Range;

use rayon::prelude::*;

use super::{Act, ActPartials, AttnShape, Backend, DeltaInputs, DeltaShape, Param};
use crate::backend::{KvPage, Merger, Partials};
use crate::tensor::Matrix;

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// Rows per task for cheap row-wise ops: enough work per task to pay for the split.
const ROWS_PER_TASK: usize = 16;

/// Elements per task for element-wise ops.
const ELEMS_PER_TASK: usize = 4096;

/// `f(i, chunk i)` for the chunks of `len` elements of `out`, in parallel: on the spinning
/// [`team`] where it is free (decode's ops are short and many, and a hand-off to rayon's
/// sleeping workers costs tens of microseconds), else on rayon's pool. A single chunk runs on
/// the caller; an empty `out` runs nothing (as on the team), whichever path it takes.
pub(super) fn spread<T: Send>(out: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if out.is_empty() {
        return;
    }
    #[cfg(not(target_arch = "wasm32"))]
    if team::Team::global().chunks_mut(out, len, &f).is_some() {
        return;
    }
    if out.len() <= len {
        return f(0, out);
    }
    out.par_chunks_mut(len)
        .enumerate()
        .for_each(|(i, o)| f(i, o));
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `e^x` within 2 ulp, in plain f32 multiplies and adds: no libm call and no fused
/// multiply-add, so it rounds alike on every target and at every vector width, and a loop of
/// it vectorises (libm's `expf` is a scalar call: SiLU in the MLP took 6% of a 512-token
/// prefill through it). Arguments are clamped to [-87, 88]: below, the result is about 1.6e-38
/// where `expf` gives something smaller still or 0; above, it stays at e^88 (about 1.7e38)
/// where `expf` overflows to infinity later. NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // x = n ln 2 + r, |r| <= ln 2 / 2, with ln 2 in two parts (Cody and Waite): `n * LN2_HI`
    // is exact for |n| < 2^15, since LN2_HI has 9 significant bits.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    // e^r by its Taylor series to r^7 (the next term is below 7e-9 of it).
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    // 2^n from its exponent bits (n in -126..=127 after the clamp; NaN casts to 0).
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// torch's softplus (threshold 20: above it, the identity).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn sum_squares(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum()
}

/// The host values of `a`. A device value here means a state made on another backend.
pub fn host(a: &Act) -> &[f32] {
    match a {
        Act::Host(v) => v,
        #[cfg(feature = "gpu")]
        Act::Device(_) => panic!("the CPU backend was handed a device value"),
    }
}

fn host_mut(a: &mut Act) -> &mut Vec<f32> {
    match a {
        Act::Host(v) => v,
        #[cfg(feature = "gpu")]
        Act::Device(_) => panic!("the CPU backend was handed a device value"),
    }
}

/// Each row of `x` (row length `scale.len()`) becomes `x * rsqrt(mean(x^2) + eps) * scale`.
pub fn rms_norm(x: &mut [f32], scale: &[f32], eps: f32) {
    let d = scale.len();
    spread(x, d * ROWS_PER_TASK, |_, rows| {
        for row in rows.chunks_mut(d) {
            let inv = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
            for (v, s) in row.iter_mut().zip(scale) {
                *v = *v * inv * s;
            }
        }
    });
}

/// Each row of `dim` values becomes `x * rsqrt(sum(x^2) + eps) * scale`.
pub fn l2_norm(x: &mut [f32], dim: usize, eps: f32, scale: f32) {
    for row in x.chunks_mut(dim) {
        let inv = 1.0 / (sum_squares(row) + eps).sqrt();
        for v in row.iter_mut() {
            *v = *v * inv * scale;
        }
    }
}

/// NeoX rotate-half RoPE (see [`Backend::rope`]).
pub fn rope(x: &mut [f32], head_dim: usize, positions: &[usize], inv_freq: &[f32]) {
    let half = inv_freq.len();
    let row = x.len() / positions.len();
    for (t, &pos) in positions.iter().enumerate() {
        let (sin, cos): (Vec<f32>, Vec<f32>) =
            inv_freq.iter().map(|f| (pos as f32 * f).sin_cos()).unzip();
        for head in x[t * row..(t + 1) * row].chunks_mut(head_dim) {
            for i in 0..half {
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * cos[i] - x2 * sin[i];
                head[i + half] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

/// `gate = silu(gate) * up`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    spread(gate, ELEMS_PER_TASK, |i, g| {
        for (g, u) in g.iter_mut().zip(&up[i * ELEMS_PER_TASK..]) {
            *g = silu(*g) * u;
        }
    });
}

/// `x = x * sigmoid(gate)`.
pub fn sigmoid_mul(x: &mut [f32], gate: &[f32]) {
    spread(x, ELEMS_PER_TASK, |i, x| {
        for (v, g) in x.iter_mut().zip(&gate[i * ELEMS_PER_TASK..]) {
            *v *= sigmoid(*g);
        }
    });
}

/// `x = x + y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Columns `col0 .. col0 + width` of every row of `src` (rows of `stride` values).
pub fn copy_cols(src: &[f32], stride: usize, col0: usize, width: usize) -> Vec<f32> {
    assert!(col0 + width <= stride && src.len().is_multiple_of(stride));
    let mut out = Vec::with_capacity(src.len() / stride * width);
    for row in src.chunks(stride) {
        out.extend_from_slice(&row[col0..col0 + width]);
    }
    out
}

/// DeltaNet's gates (see [`Backend::delta_gates`]): `a` becomes `g`, `b` becomes `beta`.
pub fn delta_gates(a: &mut [f32], b: &mut [f32], params: &[f32]) {
    let (neg_a, dt_bias) = params.split_at(params.len() / 2);
    for v in b.iter_mut() {
        *v = sigmoid(*v);
    }
    for row in a.chunks_mut(neg_a.len()) {
        for ((a, dt), na) in row.iter_mut().zip(dt_bias).zip(neg_a) {
            *a = na * softplus(*a + dt);
        }
    }
}

/// Depthwise causal conv then SiLU, in place on `u` (see [`Backend::causal_conv_silu`]).
pub fn causal_conv_silu(u: &mut [f32], history: &mut [f32], weight: &[f32], kernel: usize) {
    let c = weight.len() / kernel;
    let t = u.len() / c;
    let h = kernel - 1;
    // window = history rows followed by the input rows; output row i reads window rows i..=i+h.
    let mut window = Vec::with_capacity((h + t) * c);
    window.extend_from_slice(history);
    window.extend_from_slice(u);
    // Tap j of every channel together (`weight` holds each channel's taps together), so that
    // a row's channels are one loop of multiply-adds in the same order as tap by tap.
    // (Written as a plain loop: an iterator of strided iterators took 2-3% of a decode step.)
    let mut taps = vec![0.0f32; weight.len()];
    for (ch, channel) in weight.chunks_exact(kernel).enumerate() {
        for (j, &w) in channel.iter().enumerate() {
            taps[j * c + ch] = w;
        }
    }
    spread(u, c * ROWS_PER_TASK, |b, rows| {
        for (r, out) in rows.chunks_mut(c).enumerate() {
            let i = b * ROWS_PER_TASK + r;
            out.fill(0.0);
            for (tap, x) in taps.chunks_exact(c).zip(window[i * c..].chunks_exact(c)) {
                for ((o, w), x) in out.iter_mut().zip(tap).zip(x) {
                    *o += w * x;
                }
            }
            out.iter_mut().for_each(|o| *o = silu(*o));
        }
    });
    history.copy_from_slice(&window[t * c..]);
}

/// Per row of `weight.len()` values: `weight * (o * rsqrt(mean(o^2) + eps)) * silu(z)`.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for (row, zr) in o.chunks_mut(d).zip(z.chunks(d)) {
        let inv = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
        for ((v, w), z) in row.iter_mut().zip(weight).zip(zr) {
            *v = w * (*v * inv) * silu(*z);
        }
    }
}

/// The delta rule's inputs as host slices.
fn host_inputs<'a>(x: DeltaInputs<'a, Act>) -> DeltaInputs<'a> {
    DeltaInputs {
        q: host(x.q),
        k: host(x.k),
        v: host(x.v),
        g: host(x.g),
        beta: host(x.beta),
    }
}

type DeltaKernel = fn(DeltaShape, DeltaInputs, &mut [f32], &mut [f32]);

fn run_delta(s: DeltaShape, x: DeltaInputs<'_, Act>, state: &mut Act, f: DeltaKernel) -> Act {
    let mut out = vec![0.0f32; x.v.len()];
    f(s, host_inputs(x), host_mut(state), &mut out);
    Act::Host(out)
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn rows_are_steps(&self) -> bool {
        true
    }

    fn upload(&self, x: Vec<f32>) -> Act {
        Act::Host(x)
    }

    fn download_ranges(&self, parts: &[(&Act, Range<usize>)]) -> Vec<f32> {
        let mut out = Vec::with_capacity(parts.iter().map(|(_, r)| r.len()).sum());
        for (a, r) in parts {
            out.extend_from_slice(&host(a)[r.clone()]);
        }
        out
    }

    fn download(&self, x: &Act) -> Vec<f32> {
        host(x).to_vec()
    }

    fn download_owned(&self, x: Act) -> Vec<f32> {
        match x {
            Act::Host(v) => v,
            #[cfg(feature = "gpu")]
            Act::Device(_) => panic!("the CPU backend was handed a device value"),
        }
    }

    fn duplicate(&self, x: &Act) -> Act {
        Act::Host(host(x).to_vec())
    }

    fn alloc(&self, capacity: usize) -> Act {
        Act::Host(Vec::with_capacity(capacity))
    }

    fn write(&self, dst: &mut Act, at: usize, src: &Act, from: usize, len: usize) {
        let dst = host_mut(dst);
        assert!(at <= dst.len(), "writing at {at} would leave a gap");
        dst.truncate(at);
        dst.extend_from_slice(&host(src)[from..from + len]);
    }

    fn embed(&self, table: &Matrix, ids: &[u32]) -> Act {
        let mut x = vec![0.0f32; ids.len() * table.cols];
        for (row, &id) in x.chunks_mut(table.cols).zip(ids) {
            table.row_f32(id as usize, row);
        }
        Act::Host(x)
    }

    fn matmul(&self, x: &Act, w: &Matrix) -> Act {
        let x = host(x);
        let mut out = vec![0.0f32; x.len() / w.cols * w.rows];
        matmul::matmul(x, w, &mut out);
        Act::Host(out)
    }

    fn rms_norm(&self, x: &mut Act, scale: &Param, eps: f32) {
        rms_norm(host_mut(x), scale, eps);
    }

    fn l2_norm(&self, x: &mut Act, dim: usize, eps: f32, scale: f32) {
        l2_norm(host_mut(x), dim, eps, scale);
    }

    fn rope(&self, x: &mut Act, head_dim: usize, positions: &[usize], inv_freq: &[f32]) {
        rope(host_mut(x), head_dim, positions, inv_freq);
    }

    fn silu_mul(&self, gate: &mut Act, up: &Act) {
        silu_mul(host_mut(gate), host(up));
    }

    fn sigmoid_mul(&self, x: &mut Act, gate: &Act) {
        sigmoid_mul(host_mut(x), host(gate));
    }

    fn add(&self, x: &mut Act, y: &Act) {
        add(host_mut(x), host(y));
    }

    fn scale(&self, x: &mut Act, s: f32) {
        host_mut(x).iter_mut().for_each(|v| *v *= s);
    }

    fn copy_cols(&self, src: &Act, stride: usize, col0: usize, width: usize) -> Act {
        Act::Host(copy_cols(host(src), stride, col0, width))
    }

    fn delta_gates(&self, a: &mut Act, b: &mut Act, params: &Param) {
        delta_gates(host_mut(a), host_mut(b), params);
    }

    fn causal_conv_silu(&self, u: &mut Act, history: &mut Act, weight: &Param, kernel: usize) {
        causal_conv_silu(host_mut(u), host_mut(history), weight, kernel);
    }

    fn attend_pages(
        &self,
        shape: AttnShape,
        q: &Act,
        q_pos: &[usize],
        pages: &[&KvPage],
    ) -> Vec<ActPartials> {
        // Fewer rows than a step's (decode, a speculative verify, a batch's sequence) read a
        // frozen page row by row, each as its decode step does; prefill reads the rows.
        let attend = |page: &KvPage| match &page.frozen {
            Some(frozen) if q_pos.len() < super::STEP_ROWS => {
                frozen::attend_rows(frozen, shape, host(q), q_pos)
            }
            _ => attention::attend_page(shape, host(q), q_pos, page),
        };
        pages.iter().map(|page| attend(page).into()).collect()
    }

    fn freeze_page(
        &self,
        kv_heads: usize,
        head_dim: usize,
        page: &KvPage,
    ) -> Option<crate::backend::frozen::FrozenPage> {
        head_dim
            .is_multiple_of(crate::backend::frozen::LANES)
            .then(|| crate::backend::frozen::FrozenPage::pack(kv_heads, head_dim, page))
    }

    fn merge_partials(&self, rows: usize, head_dim: usize, parts: Vec<ActPartials>) -> Act {
        let mut merger = Merger::new(rows, head_dim);
        for p in parts {
            merger.add(&Partials {
                head_dim: p.head_dim,
                o: self.download_owned(p.o),
                m: self.download_owned(p.m),
                l: self.download_owned(p.l),
            });
        }
        Act::Host(merger.finish().o)
    }

    fn delta_rule_chunked(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
    ) -> Act {
        run_delta(shape, x, state, delta::chunked)
    }

    fn delta_rule_recurrent(
        &self,
        shape: DeltaShape,
        x: DeltaInputs<'_, Act>,
        state: &mut Act,
    ) -> Act {
        run_delta(shape, x, state, delta::recurrent)
    }

    fn gated_rms_norm(&self, o: &mut Act, z: &Act, weight: &Param, eps: f32) {
        gated_rms_norm(host_mut(o), host(z), weight, eps);
    }
}

#[cfg(test)]
mod tests {
    /// An empty `out` calls nothing on either path: the team's, and rayon's, which a call
    /// takes while the team is busy (here: from inside one of its jobs). A verify pass whose
    /// rows see no key of a page spreads zero spans, and the fallback used to call `f` with an
    /// empty chunk (CI caught it when test threads kept the team busy).
    #[test]
    fn an_empty_spread_calls_nothing_on_either_path() {
        let mut outer = [0u8; 4];
        super::spread(&mut outer, 1, |_, _| {
            super::spread(&mut [] as &mut [u8], 1, |_, p| p[0] = 1);
        });
        super::spread(&mut [] as &mut [u8], 1, |_, p| p[0] = 1);
    }

    /// `exp` against f64's over the range that matters (softmax scores, gates, SiLU
    /// arguments), within 2 ulp of the exact value; the clamped ends and NaN as documented.
    #[test]
    fn exp_within_two_ulp() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = super::exp(x) as f64;
            let ulp = f32::EPSILON as f64 * want;
            assert!(
                (got - want).abs() <= 2.0 * ulp,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.001_37;
        }
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(f32::NAN).is_nan());
        assert!(super::exp(-1000.0) < 2e-38 && super::exp(-1000.0) >= 0.0);
        assert!(super::exp(1000.0).is_finite());
        assert!(super::silu(-1000.0).abs() < 1e-30);
    }
}
