//! Gated DeltaNet: projections, causal depthwise conv + SiLU over `[q | k | v]`, l2-normalised
//! q/k, per-head decay `g = -exp(A_log) softplus(a + dt_bias)` and write strength
//! `beta = sigmoid(b)`, the gated delta rule, then a gated RMSNorm and the output projection.

use super::state::DeltaState;
use super::Loader;
use crate::backend::{Backend, DeltaInputs, DeltaShape};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::tensor::Matrix;

/// l2norm's epsilon is fixed by the reference, independent of `rms_norm_eps`.
const L2_EPS: f32 = 1e-6;

pub(super) struct DeltaNet {
    in_proj_qkv: Matrix,
    in_proj_z: Matrix,
    in_proj_b: Matrix,
    in_proj_a: Matrix,
    /// `[conv_dim, kernel]`.
    conv: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `-exp(A_log)`, the per-head decay rate.
    neg_a: Vec<f32>,
    norm: Vec<f32>,
    out_proj: Matrix,
    shape: DeltaShape,
}

/// torch's softplus (threshold 20: above it, the identity).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl DeltaNet {
    pub(super) fn load(c: &ModelConfig, ld: &Loader, p: &str) -> Result<Self> {
        let (h, hv, kern) = (
            c.hidden_size,
            c.linear_num_value_heads,
            c.linear_conv_kernel_dim,
        );
        let (cd, vd) = (c.conv_dim(), c.linear_value_dim());
        Ok(DeltaNet {
            in_proj_qkv: ld.matrix(&format!("{p}in_proj_qkv.weight"), cd, h)?,
            in_proj_z: ld.matrix(&format!("{p}in_proj_z.weight"), vd, h)?,
            in_proj_b: ld.matrix(&format!("{p}in_proj_b.weight"), hv, h)?,
            in_proj_a: ld.matrix(&format!("{p}in_proj_a.weight"), hv, h)?,
            conv: ld.vector(&format!("{p}conv1d.weight"), &[cd, 1, kern])?,
            dt_bias: ld.vector(&format!("{p}dt_bias"), &[hv])?,
            neg_a: ld
                .vector(&format!("{p}A_log"), &[hv])?
                .iter()
                .map(|a| -a.exp())
                .collect(),
            norm: ld.vector(&format!("{p}norm.weight"), &[c.linear_value_head_dim])?,
            out_proj: ld.matrix(&format!("{p}out_proj.weight"), h, vd)?,
            shape: DeltaShape {
                k_heads: c.linear_num_key_heads,
                v_heads: hv,
                dk: c.linear_key_head_dim,
                dv: c.linear_value_head_dim,
            },
        })
    }

    pub(super) fn weight_bytes(&self) -> usize {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
        .iter()
        .map(|m| m.nbytes())
        .sum()
    }

    pub(super) fn forward(
        &self,
        be: &dyn Backend,
        c: &ModelConfig,
        x: &[f32],
        st: &mut DeltaState,
        out: &mut [f32],
    ) {
        let s = self.shape;
        let t = x.len() / c.hidden_size;
        let (kd, vd, cd) = (c.linear_key_dim(), c.linear_value_dim(), c.conv_dim());
        let mut qkv = vec![0.0f32; t * cd];
        let mut z = vec![0.0f32; t * vd];
        let mut b = vec![0.0f32; t * s.v_heads];
        let mut a = vec![0.0f32; t * s.v_heads];
        be.matmul(x, &self.in_proj_qkv, &mut qkv);
        be.matmul(x, &self.in_proj_z, &mut z);
        be.matmul(x, &self.in_proj_b, &mut b);
        be.matmul(x, &self.in_proj_a, &mut a);
        be.causal_conv_silu(&mut qkv, &mut st.conv, &self.conv, c.linear_conv_kernel_dim);
        let (mut q, mut k, mut v) = (
            Vec::with_capacity(t * kd),
            Vec::with_capacity(t * kd),
            Vec::with_capacity(t * vd),
        );
        for row in qkv.chunks(cd) {
            q.extend_from_slice(&row[..kd]);
            k.extend_from_slice(&row[kd..2 * kd]);
            v.extend_from_slice(&row[2 * kd..]);
        }
        be.l2_norm(&mut q, s.dk, L2_EPS, 1.0 / (s.dk as f32).sqrt());
        be.l2_norm(&mut k, s.dk, L2_EPS, 1.0);
        let beta: Vec<f32> = b.iter().map(|&b| crate::backend::cpu::sigmoid(b)).collect();
        let g: Vec<f32> = a
            .chunks(s.v_heads)
            .flat_map(|row| {
                row.iter()
                    .zip(&self.dt_bias)
                    .zip(&self.neg_a)
                    .map(|((a, dt), na)| na * softplus(a + dt))
            })
            .collect();
        let inputs = DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let mut o = vec![0.0f32; t * vd];
        if t == 1 {
            be.delta_rule_recurrent(s, inputs, &mut st.s, &mut o);
        } else {
            be.delta_rule_chunked(s, inputs, &mut st.s, &mut o);
        }
        be.gated_rms_norm(&mut o, &z, &self.norm, c.rms_norm_eps);
        be.matmul(&o, &self.out_proj, out);
    }
}
