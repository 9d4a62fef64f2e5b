//! Causal attention of query rows over one KV page, as `(o, m, l)` partials.

use rayon::prelude::*;

use super::matmul::dot;
use crate::backend::AttnShape;
use crate::kv::{KvPage, Partials};

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
    let mut p = Partials::empty(t * q_heads, d);
    p.o.par_chunks_mut(q_heads * d)
        .zip(p.m.par_chunks_mut(q_heads))
        .zip(p.l.par_chunks_mut(q_heads))
        .enumerate()
        .for_each(|(row, ((o, m), l))| {
            // Keys at positions start..start+n are visible to this query.
            let n = (q_pos[row] + 1).saturating_sub(page.start).min(page.len);
            if n == 0 {
                return;
            }
            let mut scores = vec![0.0f32; n];
            for h in 0..q_heads {
                let kvh = h / group;
                let qh = &q[(row * q_heads + h) * d..(row * q_heads + h + 1) * d];
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = dot(
                        qh,
                        &page.k[j * kv_row + kvh * d..j * kv_row + (kvh + 1) * d],
                    );
                }
                let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let oh = &mut o[h * d..(h + 1) * d];
                let mut sum = 0.0;
                for (j, s) in scores.iter().enumerate() {
                    let e = (s - mx).exp();
                    sum += e;
                    let v = &page.v[j * kv_row + kvh * d..j * kv_row + (kvh + 1) * d];
                    for (a, b) in oh.iter_mut().zip(v) {
                        *a += e * b;
                    }
                }
                let inv = 1.0 / sum;
                oh.iter_mut().for_each(|a| *a *= inv);
                m[h] = mx;
                l[h] = sum;
            }
        });
    p
}
