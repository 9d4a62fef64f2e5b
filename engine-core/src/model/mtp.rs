//! The checkpoint's multi-token-prediction (MTP) head: a draft of the token after next from
//! the main model's last hidden row and the token drawn from it (Qwen3.5's `mtp.*` tensors;
//! llama.cpp's `blk.N.nextn.*`). One row, for the pair (hidden `h` at position `p`, token `x`
//! that follows it):
//!
//! ```text
//! u = fc [ norm_embed(embed[x]) ; norm_hidden(h) ]      (the embedding first)
//! u = u + attention(norm_in(u))  at position p, over the head's own KV cache
//! u = u + mlp(norm_post(u))
//! g = norm(u);  logits = lm_head(g)
//! ```
//!
//! The decoder layer is a full-attention layer of the main model's form (`Layer`), and the
//! embedding and head are the main model's. The position is the hidden row's, as vLLM runs it
//! (llama.cpp runs the pair at the token's position, one later: the same attention, since
//! RoPE sees only differences, once every entry follows one rule). Chained drafts feed `g` back
//! as the next row's hidden. Written from vLLM's `qwen3_5_mtp.py` and llama.cpp's
//! `qwen35.cpp`; checked against `scripts/mtp-reference.py`, an independent numpy version.

use super::{Layer, Loader, Mixer};
use crate::backend::{Act, Backend, Param};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::{NoPagesAway, PagedKv};
use crate::tensor::Matrix;

pub(super) struct Mtp {
    norm_embed: Param,
    norm_hidden: Param,
    /// `[H, 2H]`: the normed embedding's columns, then the normed hidden row's.
    fc: Matrix,
    layer: Layer,
    norm: Param,
}

impl Mtp {
    /// The head, where the config declares one and the checkpoint holds it (some conversions
    /// drop its tensors and keep the config's count: then there is none).
    pub(super) fn load(c: &ModelConfig, ld: &Loader) -> Result<Option<Mtp>> {
        if c.mtp_layers == 0 || !ld.has("mtp.fc.weight") {
            return Ok(None);
        }
        let h = c.hidden_size;
        Ok(Some(Mtp {
            norm_embed: ld.offset_norm("mtp.pre_fc_norm_embedding.weight", h)?,
            norm_hidden: ld.offset_norm("mtp.pre_fc_norm_hidden.weight", h)?,
            fc: ld.matrix("mtp.fc.weight", h, 2 * h)?,
            layer: Layer::load(c, ld, "mtp.layers.0.", LayerKind::FullAttention)?,
            norm: ld.offset_norm("mtp.norm.weight", h)?,
        }))
    }

    pub(super) fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        std::iter::once(&self.fc).chain(self.layer.matrices())
    }

    /// The head over `n` pairs: `embedded` `[n, H]` (the tokens' embedding rows) and `hidden`
    /// `[n, H]`, at positions `pos ..`, appending to `kv`; returns the rows `g` (after the
    /// head's norm: what the LM head multiplies and the next chained row takes as hidden).
    pub(super) fn forward(
        &self,
        be: &dyn Backend,
        c: &ModelConfig,
        (embedded, hidden): (Act, &Act),
        kv: &mut PagedKv,
        pos: usize,
    ) -> Result<Act> {
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let n = embedded.len() / h;
        if hidden.len() != n * h {
            return Err(Error::Invalid(format!(
                "MTP head: {} hidden values for {n} tokens of width {h}",
                hidden.len()
            )));
        }
        let mut e = embedded;
        be.rms_norm(&mut e, &self.norm_embed, eps);
        let mut hn = be.duplicate(hidden);
        be.rms_norm(&mut hn, &self.norm_hidden, eps);
        let mut both = be.alloc(n * 2 * h);
        for r in 0..n {
            be.write(&mut both, r * 2 * h, &e, r * h, h);
            be.write(&mut both, r * 2 * h + h, &hn, r * h, h);
        }
        let mut x = be.matmul(&both, &self.fc);
        let positions: Vec<usize> = (pos..pos + n).collect();
        let Mixer::Attention(a) = &self.layer.mixer else {
            unreachable!("the head's layer is loaded as full attention")
        };
        let mut normed = be.duplicate(&x);
        be.rms_norm(&mut normed, &self.layer.norm_in, eps);
        // The layer index names the cache to a page source; the head's pages never leave.
        let (rows, gate) = a.project(be, &normed, &positions);
        let attention = a.attend(be, &rows, &positions, (0, kv), &mut NoPagesAway)?;
        let y = a.finish(be, attention.finish(be, &mut NoPagesAway)?, &gate);
        be.add(&mut x, &y);
        self.layer.mlp_residual(be, &mut x, eps);
        be.rms_norm(&mut x, &self.norm, eps);
        Ok(x)
    }
}
