//! The ops the model is written in. `model/` says *what* a layer computes, in this vocabulary;
//! a backend says *how* on its hardware. The CPU backend is the reference every other backend
//! (wgpu, issue 4) is tested against, op by op.
//!
//! Activations are row-major f32 host slices for now; the GPU backend will add device-resident
//! buffers behind the same op list.

pub mod cpu;
#[cfg(feature = "gpu")]
pub mod gpu;

pub use cpu::CpuBackend;

/// The backend called `name` (`cpu`, or `gpu` in builds with the `gpu` feature), and a line
/// saying what it runs on.
pub fn select(name: &str) -> crate::Result<(Box<dyn Backend>, String)> {
    match name {
        "cpu" => Ok((
            Box::new(CpuBackend),
            format!("cpu ({} threads)", rayon::current_num_threads()),
        )),
        #[cfg(feature = "gpu")]
        "gpu" => {
            let be = gpu::GpuBackend::new(&gpu::GpuOptions::default())
                .map_err(|e| crate::Error::Invalid(format!("--backend gpu: {e}")))?;
            let what = format!("gpu ({})", be.adapter_name());
            Ok((Box::new(be), what))
        }
        #[cfg(not(feature = "gpu"))]
        "gpu" => Err(crate::Error::Invalid(
            "--backend gpu: this build has no GPU backend (engine-core's `gpu` feature)".into(),
        )),
        other => Err(crate::Error::Invalid(format!(
            "--backend {other}: expected cpu or gpu"
        ))),
    }
}

use crate::kv::{KvPage, Partials};
use crate::tensor::Matrix;

/// Head layout of a full-attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Head layout of a Gated DeltaNet layer. Value head `j` reads key head `j / (v_heads / k_heads)`.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Inputs of the gated delta rule for `t` tokens: `q, k` `[t, k_heads, dk]` (already
/// l2-normalised, q scaled), `v` `[t, v_heads, dv]`, log-decay `g` and `beta` `[t, v_heads]`.
pub struct DeltaInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// `out[t, o] = sum_i x[t, i] * w[o, i]` (a Linear layer without bias).
    fn matmul(&self, x: &[f32], w: &Matrix, out: &mut [f32]);

    /// Each row of `x` (row length `scale.len()`) becomes `x * rsqrt(mean(x^2) + eps) * scale`.
    fn rms_norm(&self, x: &mut [f32], scale: &[f32], eps: f32);

    /// Each row of `dim` values becomes `x * rsqrt(sum(x^2) + eps) * scale`.
    fn l2_norm(&self, x: &mut [f32], dim: usize, eps: f32, scale: f32);

    /// NeoX rotate-half RoPE on the first `inv_freq.len() * 2` dims of every head of `x`
    /// `[t, heads, head_dim]`; row `t` is at absolute position `positions[t]`.
    fn rope(&self, x: &mut [f32], head_dim: usize, positions: &[usize], inv_freq: &[f32]);

    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]);

    /// `x = x * sigmoid(gate)`.
    fn sigmoid_mul(&self, x: &mut [f32], gate: &[f32]);

    /// Depthwise causal conv then SiLU, in place on `u` `[t, channels]`. `history` holds the
    /// previous `kernel - 1` input rows `[kernel - 1, channels]` and is advanced; `weight` is
    /// `[channels, kernel]` with tap `kernel - 1` on the current token.
    fn causal_conv_silu(&self, u: &mut [f32], history: &mut [f32], weight: &[f32], kernel: usize);

    /// Attention partials of query rows `q` `[t, q_heads, head_dim]` (scaled by the caller)
    /// over one KV page, causal by absolute position: key `p` is visible to query row `t`
    /// iff `p <= q_pos[t]`.
    fn attend_page(&self, shape: AttnShape, q: &[f32], q_pos: &[usize], page: &KvPage) -> Partials;

    /// Gated delta rule over `t` tokens in the chunked (WY) form; `state` `[v_heads, dk, dv]`
    /// is read and advanced; `out` is `[t, v_heads, dv]`.
    fn delta_rule_chunked(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
    );

    /// The same function, one token at a time (the decode form).
    fn delta_rule_recurrent(
        &self,
        shape: DeltaShape,
        x: DeltaInputs,
        state: &mut [f32],
        out: &mut [f32],
    );

    /// Per row of `weight.len()` values: `weight * (o * rsqrt(mean(o^2) + eps)) * silu(z)`.
    fn gated_rms_norm(&self, o: &mut [f32], z: &[f32], weight: &[f32], eps: f32);
}
