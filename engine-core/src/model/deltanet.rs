//! Gated DeltaNet: projections, causal depthwise conv + SiLU over `[q | k | v]`, l2-normalised
//! q/k, per-head decay `g = -exp(A_log) softplus(a + dt_bias)` and write strength
//! `beta = sigmoid(b)`, the gated delta rule, then a gated RMSNorm and the output projection.

use super::{join_rows, span_rows, Loader, Span};
use crate::backend::{Act, Backend, DeltaInputs, DeltaShape, Param, STEP_ROWS};
use crate::config::{ModelConfig, WeightLayout};
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
    conv: Param,
    /// `[neg_a | dt_bias]` for `Backend::delta_gates`, with `neg_a = -exp(A_log)` the per-head
    /// decay rate.
    gates: Param,
    norm: Param,
    out_proj: Matrix,
    shape: DeltaShape,
}

impl DeltaNet {
    pub(super) fn load(c: &ModelConfig, ld: &Loader, p: &str) -> Result<Self> {
        let (h, hv, kern) = (
            c.hidden_size,
            c.linear_num_value_heads,
            c.linear_conv_kernel_dim,
        );
        let (cd, vd) = (c.conv_dim(), c.linear_value_dim());
        let neg_a = match c.layout {
            WeightLayout::HuggingFace => ld
                .vector(&format!("{p}A_log"), &[hv])?
                .into_iter()
                .map(|a| -a.exp())
                .collect(),
            // The converter wrote -exp(A_log) itself.
            WeightLayout::Gguf => ld.vector(&format!("{p}ssm_a"), &[hv])?,
        };
        let dt_bias = ld.vector(&format!("{p}dt_bias"), &[hv])?;
        Ok(DeltaNet {
            in_proj_qkv: ld.matrix(&format!("{p}in_proj_qkv.weight"), cd, h)?,
            in_proj_z: ld.matrix(&format!("{p}in_proj_z.weight"), vd, h)?,
            in_proj_b: ld.matrix(&format!("{p}in_proj_b.weight"), hv, h)?,
            in_proj_a: ld.matrix(&format!("{p}in_proj_a.weight"), hv, h)?,
            conv: ld
                .vector(&format!("{p}conv1d.weight"), &[cd, 1, kern])?
                .into(),
            gates: neg_a
                .into_iter()
                .chain(dt_bias)
                .collect::<Vec<f32>>()
                .into(),
            norm: ld
                .vector(&format!("{p}norm.weight"), &[c.linear_value_head_dim])?
                .into(),
            out_proj: ld.matrix(&format!("{p}out_proj.weight"), h, vd)?,
            shape: DeltaShape {
                k_heads: c.linear_num_key_heads,
                v_heads: hv,
                dk: c.linear_key_head_dim,
                dv: c.linear_value_head_dim,
                value_heads_tiled: c.layout == WeightLayout::Gguf,
            },
        })
    }

    pub(super) fn matrices(&self) -> [&Matrix; 5] {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
    }

    /// The layer over every span's rows: the projections, norms and gates take all rows at
    /// once; the conv and the delta rule run span by span on each sequence's state of layer
    /// `layer` (a span of a few rows, such as a decode step, in the recurrent form row by row,
    /// so each row's output is its decode step's).
    pub(super) fn forward(
        &self,
        be: &dyn Backend,
        c: &ModelConfig,
        x: &Act,
        layer: usize,
        spans: &mut [Span],
    ) -> Result<Act> {
        let s = self.shape;
        let (kd, vd, cd) = (c.linear_key_dim(), c.linear_value_dim(), c.conv_dim());
        // Every span's state first, so that a span without one changes no other's.
        for span in spans.iter_mut() {
            span.state.delta_mut(layer)?;
        }
        let mut qkv = be.matmul(x, &self.in_proj_qkv);
        let z = be.matmul(x, &self.in_proj_z);
        let mut b = be.matmul(x, &self.in_proj_b);
        let mut a = be.matmul(x, &self.in_proj_a);
        let (kern, whole) = (c.linear_conv_kernel_dim, spans.len() == 1);
        let mut convolved = Vec::with_capacity(spans.len());
        let mut r0 = 0;
        for span in spans.iter_mut() {
            let st = span.state.delta_mut(layer)?;
            let mut part = match whole {
                true => std::mem::replace(&mut qkv, Act::Host(Vec::new())),
                false => span_rows(be, &qkv, cd, r0, span.rows),
            };
            be.causal_conv_silu(&mut part, &mut st.conv, &self.conv, kern);
            convolved.push(part);
            r0 += span.rows;
        }
        let qkv = join_rows(be, convolved);
        // The conv output's rows are [q | k | v].
        let mut q = be.copy_cols(&qkv, cd, 0, kd);
        let mut k = be.copy_cols(&qkv, cd, kd, kd);
        let v = be.copy_cols(&qkv, cd, 2 * kd, vd);
        be.l2_norm(&mut q, s.dk, L2_EPS, 1.0 / (s.dk as f32).sqrt());
        be.l2_norm(&mut k, s.dk, L2_EPS, 1.0);
        // a becomes the log decay g, b the write strength beta.
        be.delta_gates(&mut a, &mut b, &self.gates);
        let mut outputs = Vec::with_capacity(spans.len());
        let mut r0 = 0;
        for span in spans.iter_mut() {
            let st = span.state.delta_mut(layer)?;
            let part = |x: &Act, width| span_rows(be, x, width, r0, span.rows);
            let own;
            let inputs = match whole {
                true => DeltaInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    g: &a,
                    beta: &b,
                },
                false => {
                    own = [
                        part(&q, kd),
                        part(&k, kd),
                        part(&v, vd),
                        part(&a, s.v_heads),
                        part(&b, s.v_heads),
                    ];
                    DeltaInputs {
                        q: &own[0],
                        k: &own[1],
                        v: &own[2],
                        g: &own[3],
                        beta: &own[4],
                    }
                }
            };
            // A few rows (a decode step, a speculative verify) take the recurrent form, row
            // by row as decode does, so each row's output is its decode step's.
            outputs.push(if span.rows < STEP_ROWS {
                be.delta_rule_recurrent(s, inputs, &mut st.s)
            } else {
                be.delta_rule_chunked(s, inputs, &mut st.s)
            });
            r0 += span.rows;
        }
        let mut o = join_rows(be, outputs);
        be.gated_rms_norm(&mut o, &z, &self.norm, c.rms_norm_eps);
        Ok(be.matmul(&o, &self.out_proj))
    }
}
