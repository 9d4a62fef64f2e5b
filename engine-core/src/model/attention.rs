//! Gated full attention: q (with a per-head output gate), k, v projections; per-head QK RMSNorm;
//! partial RoPE; GQA causal softmax over the paged KV cache, merged page by page; sigmoid gate.

use super::{join_rows, span_rows, Loader, Span};
use crate::backend::{Act, AttnShape, Backend, Param};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::{begin_attention, PageSource, PagedKv, PendingAttention};
use crate::tensor::Matrix;

/// Rows' queries (scaled), keys and values, ready to attend.
pub(super) struct Projected {
    q: Act,
    k: Act,
    v: Act,
}

pub(super) struct Attention {
    /// `[nh * 2 * hd, H]`: per head, hd query rows then hd gate rows.
    q_proj: Matrix,
    k_proj: Matrix,
    v_proj: Matrix,
    o_proj: Matrix,
    q_norm: Param,
    k_norm: Param,
    inv_freq: Vec<f32>,
    eps: f32,
    shape: AttnShape,
}

impl Attention {
    pub(super) fn load(c: &ModelConfig, ld: &Loader, p: &str) -> Result<Self> {
        let (h, nh, nkv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let rot = c.rotary_dim();
        Ok(Attention {
            q_proj: ld.matrix(&format!("{p}q_proj.weight"), nh * hd * 2, h)?,
            k_proj: ld.matrix(&format!("{p}k_proj.weight"), nkv * hd, h)?,
            v_proj: ld.matrix(&format!("{p}v_proj.weight"), nkv * hd, h)?,
            o_proj: ld.matrix(&format!("{p}o_proj.weight"), h, nh * hd)?,
            q_norm: ld.offset_norm(&format!("{p}q_norm.weight"), hd)?,
            k_norm: ld.offset_norm(&format!("{p}k_norm.weight"), hd)?,
            inv_freq: (0..rot / 2)
                .map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / rot as f32))
                .collect(),
            eps: c.rms_norm_eps,
            shape: AttnShape {
                q_heads: nh,
                kv_heads: nkv,
                head_dim: hd,
            },
        })
    }

    pub(super) fn matrices(&self) -> [&Matrix; 4] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }

    /// The layer up to attention, over every span's rows: project, norm and rotate q and k
    /// (all rows at once: [`Self::project`]), then per span append its K and V rows to its
    /// cache of layer `layer` and start attention over it ([`Self::attend`]). Returns each
    /// span's attention, in span order, and the output gate for [`Self::finish`].
    pub(super) fn begin(
        &self,
        be: &dyn Backend,
        x: &Act,
        layer: usize,
        spans: &mut [Span],
    ) -> Result<(Vec<PendingAttention>, Act)> {
        let positions = Span::positions(spans);
        let (p, gate) = self.project(be, x, &positions);
        let hd = self.shape.head_dim;
        let (q_row, kv_row) = (self.shape.q_heads * hd, self.shape.kv_heads * hd);
        let whole = spans.len() == 1;
        let mut pending = Vec::with_capacity(spans.len());
        let mut r0 = 0;
        for s in spans.iter_mut() {
            let part = |a: &Act, width| span_rows(be, a, width, r0, s.rows);
            let own;
            let rows = match whole {
                true => &p,
                false => {
                    own = Projected {
                        q: part(&p.q, q_row),
                        k: part(&p.k, kv_row),
                        v: part(&p.v, kv_row),
                    };
                    &own
                }
            };
            let at = &positions[r0..r0 + s.rows];
            let kv = s.state.kv_mut(layer);
            pending.push(self.attend(be, rows, at, (layer, kv), &mut *s.source)?);
            r0 += s.rows;
        }
        Ok((pending, gate))
    }

    /// The projections of rows `x` at `positions`: q (normed, rotated and scaled), k (normed
    /// and rotated) and v, and the output gate.
    pub(super) fn project(
        &self,
        be: &dyn Backend,
        x: &Act,
        positions: &[usize],
    ) -> (Projected, Act) {
        let hd = self.shape.head_dim;
        let qg = be.matmul(x, &self.q_proj);
        // Per head the projection holds [query | gate]: rows of 2 * hd, split in two.
        let mut q = be.copy_cols(&qg, 2 * hd, 0, hd);
        let gate = be.copy_cols(&qg, 2 * hd, hd, hd);
        let mut k = be.matmul(x, &self.k_proj);
        let v = be.matmul(x, &self.v_proj);
        be.rms_norm(&mut q, &self.q_norm, self.eps);
        be.rms_norm(&mut k, &self.k_norm, self.eps);
        be.rope(&mut q, hd, positions, &self.inv_freq);
        be.rope(&mut k, hd, positions, &self.inv_freq);
        be.scale(&mut q, 1.0 / (hd as f32).sqrt());
        (Projected { q, k, v }, gate)
    }

    /// One sequence's rows `p` at `positions`: append their K and V rows to its cache `kv` of
    /// layer `layer`, and start attention over it (the pages that left asked of `source`,
    /// then the local ones).
    pub(super) fn attend(
        &self,
        be: &dyn Backend,
        p: &Projected,
        positions: &[usize],
        (layer, kv): (usize, &mut PagedKv),
        source: &mut dyn PageSource,
    ) -> Result<PendingAttention> {
        kv.append(be, &p.k, &p.v);
        begin_attention(be, self.shape, &p.q, positions, (layer, kv), source)
    }

    /// Each span's attention merged (its pages under way collected from its source), the
    /// outputs in row order.
    pub(super) fn collect(
        be: &dyn Backend,
        pending: Vec<PendingAttention>,
        spans: &mut [Span],
    ) -> Result<Act> {
        let parts = pending
            .into_iter()
            .zip(spans.iter_mut())
            .map(|(p, s)| p.finish(be, &mut *s.source))
            .collect::<Result<Vec<Act>>>()?;
        Ok(join_rows(be, parts))
    }

    /// The rest of the layer once the attention output `attn` is merged: gate and output
    /// projection.
    pub(super) fn finish(&self, be: &dyn Backend, mut attn: Act, gate: &Act) -> Act {
        be.sigmoid_mul(&mut attn, gate);
        be.matmul(&attn, &self.o_proj)
    }
}
