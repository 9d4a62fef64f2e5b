//! Causal attention of query rows over one KV page, as `(o, m, l)` partials.

use rayon::prelude::*;

use super::matmul::dot;
use crate::backend::AttnShape;
use crate::kv::{KvPage, Partials};

/// Query rows per task. A task takes every query head of one KV head for these rows, so each
/// key and value row it loads serves `ROWS * group` queries while it is in L1; a decode step
/// (one row) still splits over the KV heads.
const ROWS: usize = 16;

/// The partials of one task: `rows * group` queries, ordered (row, head within the group).
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
    let blocks: Vec<Block> = tasks
        .par_iter()
        .map(|&(kvh, r0)| {
            let rows = ROWS.min(t - r0);
            let nq = rows * group;
            let off = kvh * d;
            let key = |j: usize| &page.k[j * kv_row + off..j * kv_row + off + d];
            let value = |j: usize| &page.v[j * kv_row + off..j * kv_row + off + d];
            let query = |i: usize| {
                let (row, h) = (r0 + i / group, kvh * group + i % group);
                &q[(row * q_heads + h) * d..(row * q_heads + h + 1) * d]
            };
            let n_of: Vec<usize> = (0..nq).map(|i| visible(q_pos[r0 + i / group])).collect();
            let n_max = n_of.iter().copied().max().unwrap_or(0);
            let mut scores = vec![0.0f32; nq * n_max];
            for j in 0..n_max {
                let k = key(j);
                for i in (0..nq).filter(|&i| j < n_of[i]) {
                    scores[i * n_max + j] = dot(query(i), k);
                }
            }
            let mut b = Block {
                o: vec![0.0; nq * d],
                m: vec![f32::NEG_INFINITY; nq],
                l: vec![0.0; nq],
            };
            for i in 0..nq {
                let s = &mut scores[i * n_max..i * n_max + n_of[i]];
                if s.is_empty() {
                    continue;
                }
                let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for x in s.iter_mut() {
                    *x = (*x - mx).exp();
                    sum += *x;
                }
                b.m[i] = mx;
                b.l[i] = sum;
            }
            for j in 0..n_max {
                let v = value(j);
                for i in (0..nq).filter(|&i| j < n_of[i]) {
                    let e = scores[i * n_max + j];
                    for (a, x) in b.o[i * d..(i + 1) * d].iter_mut().zip(v) {
                        *a += e * x;
                    }
                }
            }
            for i in 0..nq {
                if b.l[i] > 0.0 {
                    let inv = 1.0 / b.l[i];
                    b.o[i * d..(i + 1) * d].iter_mut().for_each(|a| *a *= inv);
                }
            }
            b
        })
        .collect();
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
