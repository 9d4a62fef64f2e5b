//! Op-level exactness: the two forms of the delta rule agree, and paged attention equals a
//! plain softmax over all keys whatever the page size.

use engine_core::backend::cpu::delta;
use engine_core::backend::{Act, AttnShape, Backend, CacheTypes, DeltaInputs, DeltaShape};
use engine_core::kv::{begin_attention, NoPagesAway, PagedKv};
use engine_core::CpuBackend;
use tests::{max_abs_diff, Rng};

fn l2_normalise(x: &mut [f32], d: usize, scale: f32) {
    for row in x.chunks_mut(d) {
        let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        row.iter_mut().for_each(|v| *v = *v / n * scale);
    }
}

#[test]
fn chunked_and_recurrent_delta_rule_agree() {
    let s = DeltaShape {
        k_heads: 2,
        v_heads: 4,
        dk: 32,
        dv: 16,
        value_heads_tiled: false,
    };
    let mut rng = Rng(0x1234_5678);
    for t in [1usize, 40, 64, 65, 130, 200] {
        let mut q = rng.normal_vec(t * s.k_heads * s.dk);
        let mut k = rng.normal_vec(t * s.k_heads * s.dk);
        l2_normalise(&mut q, s.dk, 1.0 / (s.dk as f32).sqrt());
        l2_normalise(&mut k, s.dk, 1.0);
        let v = rng.normal_vec(t * s.v_heads * s.dv);
        let g: Vec<f32> = (0..t * s.v_heads).map(|_| -2.0 * rng.uniform()).collect();
        let beta: Vec<f32> = (0..t * s.v_heads).map(|_| rng.uniform()).collect();
        let s0 = rng.normal_vec(s.v_heads * s.dk * s.dv);
        let x = || DeltaInputs::<[f32]> {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let (mut st_c, mut st_r) = (s0.clone(), s0.clone());
        let (mut o_c, mut o_r) = (
            vec![0.0; t * s.v_heads * s.dv],
            vec![0.0; t * s.v_heads * s.dv],
        );
        delta::chunked(s, x(), &mut st_c, &mut o_c);
        delta::recurrent(s, x(), &mut st_r, &mut o_r);
        let (dout, dstate) = (max_abs_diff(&o_c, &o_r), max_abs_diff(&st_c, &st_r));
        assert!(
            dout < 1e-5 && dstate < 1e-5,
            "t={t}: out diff {dout}, state diff {dstate}"
        );
    }
}

/// Causal softmax attention written directly from the definition, all keys at once.
fn unpaged(shape: AttnShape, q: &[f32], pos: &[usize], k: &[f32], v: &[f32]) -> Vec<f32> {
    let d = shape.head_dim;
    let row = shape.kv_heads * d;
    let mut out = vec![0.0; q.len()];
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..shape.q_heads {
            let kvh = h / (shape.q_heads / shape.kv_heads);
            let qh = &q[(t * shape.q_heads + h) * d..][..d];
            let scores: Vec<f64> = (0..=p)
                .map(|j| {
                    qh.iter()
                        .zip(&k[j * row + kvh * d..][..d])
                        .map(|(a, b)| (a * b) as f64)
                        .sum()
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for (j, wj) in w.iter().enumerate() {
                for (o, vv) in out[(t * shape.q_heads + h) * d..][..d]
                    .iter_mut()
                    .zip(&v[j * row + kvh * d..][..d])
                {
                    *o += (wj / sum * *vv as f64) as f32;
                }
            }
        }
    }
    out
}

#[test]
fn paged_attention_equals_unpaged_for_any_page_size() {
    let shape = AttnShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let mut rng = Rng(42);
    let n = 150;
    let row = shape.kv_heads * shape.head_dim;
    let k = rng.normal_vec(n * row);
    let v = rng.normal_vec(n * row);
    // A prefill batch (all positions) and a decode step (the last position); queries scaled by
    // 1/sqrt(head_dim) as the model scales them.
    let all: Vec<usize> = (0..n).collect();
    let mut q = rng.normal_vec(n * shape.q_heads * shape.head_dim);
    q.iter_mut()
        .for_each(|x| *x /= (shape.head_dim as f32).sqrt());
    let qd = shape.q_heads * shape.head_dim;
    let paged = |page: usize, q: &[f32], pos: &[usize]| {
        let rows = |x: &[f32]| Act::Host(x.to_vec());
        let mut kv = PagedKv::new(page, shape.kv_heads, shape.head_dim, CacheTypes::F32);
        kv.append(&CpuBackend, &rows(&k[..37 * row]), &rows(&v[..37 * row]));
        kv.append(&CpuBackend, &rows(&k[37 * row..]), &rows(&v[37 * row..]));
        begin_attention(
            &CpuBackend,
            shape,
            &rows(q),
            pos,
            (0, &kv),
            &mut NoPagesAway,
        )
        .and_then(|a| a.finish(&CpuBackend, &mut NoPagesAway))
        .map(|o| CpuBackend.download_owned(o))
        .unwrap()
    };
    // One page holding every key is plain attention; it must match the definition (in f64).
    let whole = paged(n, &q, &all);
    let d = max_abs_diff(&whole, &unpaged(shape, &q, &all, &k, &v));
    assert!(
        d < 1e-5,
        "single-page attention differs from the definition by {d}"
    );
    for page in [1, 7, 64, 4096] {
        let d = max_abs_diff(&paged(page, &q, &all), &whole);
        assert!(d < 1e-6, "page size {page}: prefill differs by {d}");
        let d = max_abs_diff(
            &paged(page, &q[(n - 1) * qd..], &[n - 1]),
            &whole[(n - 1) * qd..],
        );
        assert!(d < 1e-6, "page size {page}: decode differs by {d}");
    }
}
