//! Causal attention of query rows over one KV page, as `(o, m, l)` partials.

use rayon::prelude::*;

use super::matmul::dot;
use crate::backend::AttnShape;
use crate::kv::{KvPage, Partials};

/// One task per (query row, head): a decode step (one row) still uses every thread.
pub fn attend_page(shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let group = q_heads / kv_heads;
    let kv_row = kv_heads * d;
    assert_eq!(q.len(), q_pos.len() * q_heads * d);
    let mut p = Partials::empty(q_pos.len() * q_heads, d);
    p.o.par_chunks_mut(d)
        .zip(p.m.par_iter_mut())
        .zip(p.l.par_iter_mut())
        .enumerate()
        .for_each(|(i, ((o, m), l))| {
            let (row, h) = (i / q_heads, i % q_heads);
            // Keys at positions start..start+n are visible to this query.
            let n = (q_pos[row] + 1).saturating_sub(page.start).min(page.len);
            if n == 0 {
                return;
            }
            let off = (h / group) * d;
            let qh = &q[i * d..(i + 1) * d];
            let scores: Vec<f32> = (0..n)
                .map(|j| dot(qh, &page.k[j * kv_row + off..j * kv_row + off + d]))
                .collect();
            let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for (j, s) in scores.iter().enumerate() {
                let e = (s - mx).exp();
                sum += e;
                for (a, b) in o.iter_mut().zip(&page.v[j * kv_row + off..j * kv_row + off + d]) {
                    *a += e * b;
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|a| *a *= inv);
            *m = mx;
            *l = sum;
        });
    p
}
