//! The gated delta rule, per value head, state `S [dk, dv]` in f32:
//! `S = S e^g; delta = beta (v - S^T k); S += k (outer) delta; o = S^T q`.
//!
//! `recurrent` is that recurrence token by token (decode). `chunked` is the same function over
//! chunks of 64 tokens in the WY form (prefill): within a chunk the dependence of each token on
//! the ones before it is a unit lower-triangular system solved by forward substitution, so the
//! state is read and written once per chunk instead of once per token.

use rayon::prelude::*;

use super::matmul::dot;
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
    let per_head_out: Vec<Vec<f32>> = state
        .par_chunks_mut(s.dk * s.dv)
        .enumerate()
        .map(|(h, st)| {
            let head = Head {
                s,
                x,
                h,
                kh: s.key_head(h),
            };
            let mut o = vec![0.0; t * s.dv];
            f(&head, st, &mut o);
            o
        })
        .collect();
    for (h, o) in per_head_out.iter().enumerate() {
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
    let (dk, dv) = (s.dk, s.dv);
    per_head(s, &x, state, out, |hd, st, o| {
        for c0 in (0..t).step_by(CHUNK) {
            let n = CHUNK.min(t - c0);
            // Cumulative log-decay within the chunk.
            let mut gc = vec![0.0f32; n];
            let mut acc = 0.0;
            for (i, g) in gc.iter_mut().enumerate() {
                acc += hd.g(c0 + i);
                *g = acc;
            }
            // A[i][j] = -beta_i (k_i . k_j) e^(gc_i - gc_j) for j < i, then forward substitution
            // turns it into T = (I - A)^-1 - I's strictly lower part (row i reads solved rows < i).
            let mut a = vec![0.0f32; n * n];
            for i in 0..n {
                let bi = hd.beta(c0 + i);
                for j in 0..i {
                    a[i * n + j] = -bi * dot(hd.k(c0 + i), hd.k(c0 + j)) * (gc[i] - gc[j]).exp();
                }
            }
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
            // u = T (beta v), w = T (beta k e^gc), with T = I + a (unit lower triangular).
            let mut u = vec![0.0f32; n * dv];
            let mut w = vec![0.0f32; n * dk];
            for i in 0..n {
                for j in 0..=i {
                    let tij = if i == j { 1.0 } else { a[i * n + j] };
                    if tij == 0.0 {
                        continue;
                    }
                    let bj = hd.beta(c0 + j);
                    axpy(&mut u[i * dv..(i + 1) * dv], tij * bj, hd.v(c0 + j));
                    axpy(
                        &mut w[i * dk..(i + 1) * dk],
                        tij * bj * gc[j].exp(),
                        hd.k(c0 + j),
                    );
                }
            }
            // v_new = u - w S: what each token writes after the state carried into the chunk.
            let mut tmp = vec![0.0f32; dv];
            for i in 0..n {
                state_t_mul(st, dv, &w[i * dk..(i + 1) * dk], &mut tmp);
                for (x, y) in u[i * dv..(i + 1) * dv].iter_mut().zip(&tmp) {
                    *x -= y;
                }
            }
            let v_new = u;
            // o_i = e^gc_i (S^T q_i) + sum_{j<=i} (q_i . k_j) e^(gc_i - gc_j) v_new_j
            for i in 0..n {
                let oi = &mut o[(c0 + i) * dv..(c0 + i + 1) * dv];
                state_t_mul(st, dv, hd.q(c0 + i), oi);
                let e = gc[i].exp();
                oi.iter_mut().for_each(|x| *x *= e);
                for j in 0..=i {
                    let c = dot(hd.q(c0 + i), hd.k(c0 + j)) * (gc[i] - gc[j]).exp();
                    axpy(oi, c, &v_new[j * dv..(j + 1) * dv]);
                }
            }
            // S = S e^gc_last + sum_j k_j (outer) v_new_j e^(gc_last - gc_j)
            let last = gc[n - 1];
            let decay = last.exp();
            st.iter_mut().for_each(|v| *v *= decay);
            for j in 0..n {
                let f = (last - gc[j]).exp();
                for (r, &kr) in hd.k(c0 + j).iter().enumerate() {
                    axpy(
                        &mut st[r * dv..(r + 1) * dv],
                        kr * f,
                        &v_new[j * dv..(j + 1) * dv],
                    );
                }
            }
        }
    });
}
