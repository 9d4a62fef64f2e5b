//! The gated delta rule, per value head, state `S [dk, dv]` in f32:
//! `S = S e^g; delta = beta (v - S^T k); S += k (outer) delta; o = S^T q`.
//!
//! `recurrent` is that recurrence token by token (decode). `chunked` is the same function over
//! chunks of 64 tokens in the WY form (prefill): within a chunk the dependence of each token on
//! the ones before it is a unit lower-triangular system solved by forward substitution, so the
//! state is read and written once per chunk instead of once per token.

use super::gemm::{product, Mat};
use crate::backend::{DeltaInputs, DeltaShape};

pub const CHUNK: usize = 64;

/// Views of one value head's inputs: row `i` of q/k is `[dk]`, of v is `[dv]`.
struct Head<'a> {
    s: DeltaShape,
    x: &'a DeltaInputs<'a>,
    h: usize,
    kh: usize,
}

impl Head<'_> {
    /// Rows `i0 .. i0 + n` of q, `[n, dk]`, as a view into the inputs.
    fn q_rows(&self, i0: usize, n: usize) -> Mat<'_> {
        head_rows(self.x.q, (i0, n), self.kh, self.s.k_heads, self.s.dk)
    }
    fn k_rows(&self, i0: usize, n: usize) -> Mat<'_> {
        head_rows(self.x.k, (i0, n), self.kh, self.s.k_heads, self.s.dk)
    }
    fn v_rows(&self, i0: usize, n: usize) -> Mat<'_> {
        head_rows(self.x.v, (i0, n), self.h, self.s.v_heads, self.s.dv)
    }
    fn q(&self, i: usize) -> &[f32] {
        let o = (i * self.s.k_heads + self.kh) * self.s.dk;
        &self.x.q[o..o + self.s.dk]
    }
    fn k(&self, i: usize) -> &[f32] {
        let o = (i * self.s.k_heads + self.kh) * self.s.dk;
        &self.x.k[o..o + self.s.dk]
    }
    fn v(&self, i: usize) -> &[f32] {
        let o = (i * self.s.v_heads + self.h) * self.s.dv;
        &self.x.v[o..o + self.s.dv]
    }
    fn g(&self, i: usize) -> f32 {
        self.x.g[i * self.s.v_heads + self.h]
    }
    fn beta(&self, i: usize) -> f32 {
        self.x.beta[i * self.s.v_heads + self.h]
    }
}

/// `acc += a * row` over dv.
fn axpy(acc: &mut [f32], a: f32, row: &[f32]) {
    for (x, y) in acc.iter_mut().zip(row) {
        *x += a * y;
    }
}

/// `out[c] = sum_r vec[r] * s[r, c]` for `s` `[dk, dv]`: `S^T vec`.
fn state_t_mul(s: &[f32], dv: usize, vec: &[f32], out: &mut [f32]) {
    out.iter_mut().for_each(|x| *x = 0.0);
    for (r, &a) in vec.iter().enumerate() {
        axpy(out, a, &s[r * dv..(r + 1) * dv]);
    }
}

/// Rows `i0 .. i0 + n` of head `head` in `all` (`[t, heads, width]`), `[n, width]`.
fn head_rows(
    all: &[f32],
    (i0, n): (usize, usize),
    head: usize,
    heads: usize,
    width: usize,
) -> Mat<'_> {
    let stride = heads * width;
    let o = i0 * stride + head * width;
    Mat::rows(&all[o..o + (n - 1) * stride + width], n, width, stride)
}

/// Run `f(head, state_of_head, out_columns)` for every value head in parallel, then scatter
/// per-head outputs `[t, dv]` into `out` `[t, v_heads, dv]`.
fn per_head(
    s: DeltaShape,
    x: &DeltaInputs,
    state: &mut [f32],
    out: &mut [f32],
    f: impl Fn(&Head, &mut [f32], &mut [f32]) + Sync,
) {
    let t = x.g.len() / s.v_heads;
    // Each head's state and output, so that a task owns both.
    let mut heads: Vec<(&mut [f32], Vec<f32>)> = state
        .chunks_mut(s.dk * s.dv)
        .map(|st| (st, vec![0.0; t * s.dv]))
        .collect();
    super::spread(&mut heads, 1, |h, head| {
        let (st, o) = &mut head[0];
        let head = Head {
            s,
            x,
            h,
            kh: s.key_head(h),
        };
        f(&head, st, o);
    });
    for (h, (_, o)) in heads.iter().enumerate() {
        for i in 0..t {
            out[(i * s.v_heads + h) * s.dv..(i * s.v_heads + h + 1) * s.dv]
                .copy_from_slice(&o[i * s.dv..(i + 1) * s.dv]);
        }
    }
}

pub fn recurrent(s: DeltaShape, x: DeltaInputs, state: &mut [f32], out: &mut [f32]) {
    let t = x.g.len() / s.v_heads;
    let dv = s.dv;
    per_head(s, &x, state, out, |hd, st, o| {
        let mut kv = vec![0.0; dv];
        for i in 0..t {
            let decay = hd.g(i).exp();
            st.iter_mut().for_each(|v| *v *= decay);
            state_t_mul(st, dv, hd.k(i), &mut kv);
            let beta = hd.beta(i);
            let delta: Vec<f32> = hd
                .v(i)
                .iter()
                .zip(&kv)
                .map(|(v, m)| (v - m) * beta)
                .collect();
            for (r, &kr) in hd.k(i).iter().enumerate() {
                axpy(&mut st[r * dv..(r + 1) * dv], kr, &delta);
            }
            state_t_mul(st, dv, hd.q(i), &mut o[i * dv..(i + 1) * dv]);
        }
    });
}

pub fn chunked(s: DeltaShape, x: DeltaInputs, state: &mut [f32], out: &mut [f32]) {
    let t = x.g.len() / s.v_heads;
    per_head(s, &x, state, out, |hd, st, o| {
        for c0 in (0..t).step_by(CHUNK) {
            let n = CHUNK.min(t - c0);
            chunk(hd, c0, n, st, &mut o[c0 * s.dv..(c0 + n) * s.dv]);
        }
    });
}

/// Tokens `c0 .. c0 + n` of one head: their outputs `o` (`[n, dv]`) from the state carried
/// in, and the state carried out. Every product of two matrices goes through `gemm`.
fn chunk(hd: &Head, c0: usize, n: usize, st: &mut [f32], o: &mut [f32]) {
    let (dk, dv) = (hd.s.dk, hd.s.dv);
    let (q, k) = (hd.q_rows(c0, n), hd.k_rows(c0, n));
    // Cumulative log-decay within the chunk.
    let gc: Vec<f32> = (0..n)
        .scan(0.0f32, |acc, i| {
            *acc += hd.g(c0 + i);
            Some(*acc)
        })
        .collect();
    // A[i][j] = -beta_i (k_i . k_j) e^(gc_i - gc_j) for j < i, then forward substitution turns
    // it into T = (I - A)^-1 - I's strictly lower part (row i reads solved rows < i).
    let mut a = vec![0.0f32; n * n];
    product(&mut a, k, k.t(), false);
    causal_decay(&mut a, &gc, false, |i| -hd.beta(c0 + i));
    for i in 1..n {
        let row: Vec<f32> = a[i * n..i * n + i].to_vec();
        for j in 0..i {
            let mut sum = row[j];
            for m in j + 1..i {
                sum += row[m] * a[m * n + j];
            }
            a[i * n + j] = sum;
        }
    }
    // T = I + a (unit lower triangular); u = T (beta v), w = T (beta k e^gc).
    for i in 0..n {
        a[i * n + i] = 1.0;
    }
    let tri = Mat::rows(&a, n, n, n);
    let bv = scaled_rows(hd.v_rows(c0, n), |j| hd.beta(c0 + j));
    let bk = scaled_rows(k, |j| hd.beta(c0 + j) * gc[j].exp());
    let mut u = vec![0.0f32; n * dv];
    product(&mut u, tri, Mat::rows(&bv, n, dv, dv), false);
    let mut w = vec![0.0f32; n * dk];
    product(&mut w, tri, Mat::rows(&bk, n, dk, dk), false);
    // v_new = u - w S: what each token writes after the state carried into the chunk.
    let state = Mat::rows(st, dk, dv, dv);
    let mut ws = vec![0.0f32; n * dv];
    product(&mut ws, Mat::rows(&w, n, dk, dk), state, false);
    u.iter_mut().zip(&ws).for_each(|(x, y)| *x -= y);
    let v_new = Mat::rows(&u, n, dv, dv);
    // o_i = e^gc_i (S^T q_i) + sum_{j<=i} (q_i . k_j) e^(gc_i - gc_j) v_new_j
    product(o, q, state, false);
    for (oi, g) in o.chunks_exact_mut(dv).zip(&gc) {
        let e = g.exp();
        oi.iter_mut().for_each(|x| *x *= e);
    }
    let mut qk = vec![0.0f32; n * n];
    product(&mut qk, q, k.t(), false);
    causal_decay(&mut qk, &gc, true, |_| 1.0);
    product(o, Mat::rows(&qk, n, n, n), v_new, true);
    // S = S e^gc_last + sum_j k_j (outer) v_new_j e^(gc_last - gc_j)
    let last = gc[n - 1];
    let kd = scaled_rows(k, |j| (last - gc[j]).exp());
    let decay = last.exp();
    st.iter_mut().for_each(|v| *v *= decay);
    let kd = Mat::rows(&kd, n, dk, dk).t();
    product(st, kd, Mat::rows(&u, n, dv, dv), true);
}

/// `m[i][j] *= f(i) e^(gc_i - gc_j)` where token `j` comes before token `i` (or is it, with
/// `diagonal`), and 0 elsewhere: `m` is `[n, n]` over one chunk's tokens.
fn causal_decay(m: &mut [f32], gc: &[f32], diagonal: bool, f: impl Fn(usize) -> f32) {
    let n = gc.len();
    for (i, row) in m.chunks_exact_mut(n).enumerate() {
        let fi = f(i);
        for (j, v) in row.iter_mut().enumerate() {
            let seen = j < i || (diagonal && j == i);
            *v = if seen {
                *v * fi * (gc[i] - gc[j]).exp()
            } else {
                0.0
            };
        }
    }
}

/// The rows of `m` each times `f(row)`, `[m.rows, m.cols]` row-major.
fn scaled_rows(m: Mat, f: impl Fn(usize) -> f32) -> Vec<f32> {
    let mut out = vec![0.0f32; m.rows * m.cols];
    for (j, r) in out.chunks_exact_mut(m.cols).enumerate() {
        let (fj, row) = (f(j), &m.data[j * m.rs..]);
        r.iter_mut()
            .enumerate()
            .for_each(|(c, d)| *d = fj * row[c * m.cs]);
    }
    out
}
