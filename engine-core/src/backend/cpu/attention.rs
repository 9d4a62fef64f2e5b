//! Causal attention of query rows over one KV page, as `(o, m, l)` partials.

#[cfg(not(target_arch = "wasm32"))]
use super::gemm::{product, Mat};
#[cfg(target_arch = "wasm32")]
use super::matmul::dot;
use crate::backend::AttnShape;
use crate::kv::{KvPage, Partials};

/// Query rows per task. A task takes every query head of one KV head for these rows, so each
/// key and value row it loads serves `ROWS * group` queries while it is in L1; a decode step
/// (one row) still splits over the KV heads.
const ROWS: usize = 16;

/// The partials of one task: `rows * group` queries, ordered (row, head within the group).
#[derive(Default)]
struct Block {
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

pub fn attend_page(shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let group = q_heads / kv_heads;
    let kv_row = kv_heads * d;
    let t = q_pos.len();
    assert_eq!(q.len(), t * q_heads * d);
    // Keys at positions start..start+n are visible to a query at `pos`.
    let visible = |pos: usize| {
        pos.saturating_add(1)
            .saturating_sub(page.start)
            .min(page.len)
    };
    let tasks: Vec<(usize, usize)> = (0..kv_heads)
        .flat_map(|kvh| (0..t).step_by(ROWS).map(move |r0| (kvh, r0)))
        .collect();
    // One task: every query head of KV head `kvh` for rows `r0..r0 + ROWS`.
    let one = |(kvh, r0): (usize, usize)| {
        let rows = ROWS.min(t - r0);
        let nq = rows * group;
        let off = kvh * d;
        let query = |i: usize| {
            let (row, h) = (r0 + i / group, kvh * group + i % group);
            &q[(row * q_heads + h) * d..(row * q_heads + h + 1) * d]
        };
        let n_of: Vec<usize> = (0..nq).map(|i| visible(q_pos[r0 + i / group])).collect();
        let n_max = n_of.iter().copied().max().unwrap_or(0);
        let mut b = Block {
            o: vec![0.0; nq * d],
            m: vec![f32::NEG_INFINITY; nq],
            l: vec![0.0; nq],
        };
        if n_max == 0 {
            return b;
        }
        let qb: Vec<f32> = (0..nq).flat_map(query).copied().collect();
        let keys = Strided {
            data: &super::host(&page.k)[off..],
            row: kv_row,
            len: n_max,
            width: d,
        };
        let values = Strided {
            data: &super::host(&page.v)[off..],
            ..keys
        };
        // scores[i, j] = q_i . k_j, then softmax over each query's visible keys; the
        // weights of invisible keys are zero, so P V can run over all n_max keys.
        let mut scores = vec![0.0f32; nq * n_max];
        query_keys(&qb, keys, &mut scores);
        for i in 0..nq {
            let row = &mut scores[i * n_max..(i + 1) * n_max];
            let (seen, hidden) = row.split_at_mut(n_of[i]);
            hidden.iter_mut().for_each(|x| *x = 0.0);
            if seen.is_empty() {
                continue;
            }
            let mx = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            seen.iter_mut().for_each(|x| *x = super::exp(*x - mx));
            b.m[i] = mx;
            b.l[i] = seen.iter().sum();
        }
        weights_values(&scores, values, &mut b.o);
        for i in 0..nq {
            if b.l[i] > 0.0 {
                let inv = 1.0 / b.l[i];
                b.o[i * d..(i + 1) * d].iter_mut().for_each(|a| *a *= inv);
            }
        }
        b
    };
    let mut blocks: Vec<Block> = tasks.iter().map(|_| Block::default()).collect();
    super::spread(&mut blocks, 1, |i, b| b[0] = one(tasks[i]));
    let mut p = Partials::empty(t * q_heads, d);
    for (&(kvh, r0), b) in tasks.iter().zip(&blocks) {
        for (i, ((o, m), l)) in b.o.chunks(d).zip(&b.m).zip(&b.l).enumerate() {
            let idx = (r0 + i / group) * q_heads + kvh * group + i % group;
            p.o[idx * d..(idx + 1) * d].copy_from_slice(o);
            p.m[idx] = *m;
            p.l[idx] = *l;
        }
    }
    p
}

/// `len` rows of `width` values, `row` apart (one KV head of a page's keys or values).
#[derive(Clone, Copy)]
struct Strided<'a> {
    data: &'a [f32],
    row: usize,
    len: usize,
    width: usize,
}

#[cfg(not(target_arch = "wasm32"))]
impl Strided<'_> {
    /// The rows as a `[len, width]` matrix.
    fn mat(&self) -> Mat<'_> {
        Mat::rows(self.data, self.len, self.width, self.row)
    }
}

/// `scores[i, j] = q[i] . keys[j]` for `q` `[nq, width]`.
#[cfg(not(target_arch = "wasm32"))]
fn query_keys(q: &[f32], keys: Strided, scores: &mut [f32]) {
    let nq = q.len() / keys.width;
    product(
        scores,
        Mat::rows(q, nq, keys.width, keys.width),
        keys.mat().t(),
        false,
    );
}

/// `out[i] = sum_j weights[i, j] values[j]` for `weights` `[nq, len]`.
#[cfg(not(target_arch = "wasm32"))]
fn weights_values(weights: &[f32], values: Strided, out: &mut [f32]) {
    let nq = weights.len() / values.len;
    product(
        out,
        Mat::rows(weights, nq, values.len, values.len),
        values.mat(),
        false,
    );
}

/// The portable forms (wasm32 has no `gemm`): one key or value row at a time against every
/// query, so each row is read once.
#[cfg(target_arch = "wasm32")]
fn query_keys(q: &[f32], keys: Strided, scores: &mut [f32]) {
    let d = keys.width;
    for j in 0..keys.len {
        let k = &keys.data[j * keys.row..j * keys.row + d];
        for (i, qi) in q.chunks(d).enumerate() {
            scores[i * keys.len + j] = dot(qi, k);
        }
    }
}

#[cfg(target_arch = "wasm32")]
fn weights_values(weights: &[f32], values: Strided, out: &mut [f32]) {
    let d = values.width;
    for j in 0..values.len {
        let v = &values.data[j * values.row..j * values.row + d];
        for (i, o) in out.chunks_mut(d).enumerate() {
            let w = weights[i * values.len + j];
            if w != 0.0 {
                for (a, x) in o.iter_mut().zip(v) {
                    *a += w * x;
                }
            }
        }
    }
}
