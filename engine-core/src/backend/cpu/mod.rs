//! The reference backend: plain Rust, multi-threaded with rayon (the caller's pool decides how
//! many threads), inner loops over contiguous memory so the compiler can vectorise them.

pub mod attention;
pub mod convert;
pub mod delta;
#[cfg(not(target_arch = "wasm32"))]
mod gemm;
pub mod matmul;

use rayon::prelude::*;

use super::{AttnShape, Backend, DeltaInputs, DeltaShape};
use crate::kv::{KvPage, Partials};
use crate::tensor::Matrix;

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// Rows per rayon task for cheap row-wise ops: enough work per task to pay for the split.
const ROWS_PER_TASK: usize = 16;

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn sum_squares(x: &[f32]) -> f32 {
    x.iter().map(|v| v * v).sum()
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, x: &[f32], w: &Matrix, out: &mut [f32]) {
        matmul::matmul(x, w, out);
    }

    fn rms_norm(&self, x: &mut [f32], scale: &[f32], eps: f32) {
        let d = scale.len();
        x.par_chunks_mut(d * ROWS_PER_TASK).for_each(|rows| {
            for row in rows.chunks_mut(d) {
                let inv = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
                for (v, s) in row.iter_mut().zip(scale) {
                    *v = *v * inv * s;
                }
            }
        });
    }

    fn l2_norm(&self, x: &mut [f32], dim: usize, eps: f32, scale: f32) {
        for row in x.chunks_mut(dim) {
            let inv = 1.0 / (sum_squares(row) + eps).sqrt();
            for v in row.iter_mut() {
                *v = *v * inv * scale;
            }
        }
    }

    fn rope(&self, x: &mut [f32], head_dim: usize, positions: &[usize], inv_freq: &[f32]) {
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

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) {
        gate.par_chunks_mut(4096)
            .zip(up.par_chunks(4096))
            .for_each(|(g, u)| {
                for (g, u) in g.iter_mut().zip(u) {
                    *g = silu(*g) * u;
                }
            });
    }

    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]) {
        for (v, g) in x.iter_mut().zip(gate) {
            *v *= sigmoid(*g);
        }
    }

    fn causal_conv_silu(&self, u: &mut [f32], history: &mut [f32], weight: &[f32], kernel: usize) {
        let c = weight.len() / kernel;
        let t = u.len() / c;
        let h = kernel - 1;
        // window = history rows followed by the input rows; output row i reads window rows i..=i+h.
        let mut window = Vec::with_capacity((h + t) * c);
        window.extend_from_slice(history);
        window.extend_from_slice(u);
        for (i, out) in u.chunks_mut(c).enumerate() {
            for (ch, o) in out.iter_mut().enumerate() {
                let taps = &weight[ch * kernel..(ch + 1) * kernel];
                let mut acc = 0.0;
                for (j, w) in taps.iter().enumerate() {
                    acc += w * window[(i + j) * c + ch];
                }
                *o = silu(acc);
            }
        }
        history.copy_from_slice(&window[t * c..]);
    }

    fn attend_page(&self, shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials {
        attention::attend_page(shape, q, q_pos, page)
    }

    fn delta_rule_chunked(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
    ) {
        delta::chunked(shape, x, state, out);
    }

    fn delta_rule_recurrent(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
    ) {
        delta::recurrent(shape, x, state, out);
    }

    fn gated_rms_norm(&self, o: &mut [f32], z: &[f32], weight: &[f32], eps: f32) {
        let d = weight.len();
        for (row, zr) in o.chunks_mut(d).zip(z.chunks(d)) {
            let inv = 1.0 / (sum_squares(row) / d as f32 + eps).sqrt();
            for ((v, w), z) in row.iter_mut().zip(weight).zip(zr) {
                *v = w * (*v * inv) * silu(*z);
            }
        }
    }
}
