//! What a helper may hold and send: its memory budget (KV pages, DeltaNet state, a prefill
//! chunk's working memory) and the frame limit, checked before anything is allocated.

use std::collections::BTreeMap;

use super::requests::kv_len;
use super::{Held, Helper, Refusal};
use crate::kv::PagedKv;
use crate::model::LayerState;
use crate::protocol::Configure;
use crate::{LayerKind, ModelConfig, State};

/// Bytes a reply's header and metadata may take beside its tensors.
pub(super) const REPLY_SLACK: usize = 4096;

/// Memory held between requests: KV pages, counted whole since a page is allocated at its full
/// size with its first row (`PagedKv::append`), and DeltaNet states.
pub(super) fn held_bytes(seqs: &BTreeMap<u64, State>) -> u64 {
    seqs.values()
        .map(|s| {
            let pages: usize = s
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Attention(kv) => kv.pages().len() * page_bytes(kv),
                    LayerState::DeltaNet(_) | LayerState::Elsewhere => 0,
                })
                .sum();
            (pages + s.delta_bytes()) as u64
        })
        .sum()
}

fn page_bytes(kv: &PagedKv) -> usize {
    kv.page_size() * kv.types().position_bytes(kv.row_width())
}

pub(super) const F32: usize = std::mem::size_of::<f32>();

/// What a request would add to the memory this helper holds, checked against the budget before
/// anything is allocated.
pub(super) struct Cost {
    /// New KV pages, kept after the reply.
    pub(super) pages: u64,
    /// A prefill chunk's activations and reply, freed once it is sent.
    pub(super) work: u64,
}

impl Helper<'_> {
    /// Refuses `what` when its `cost`, with a new sequence's DeltaNet state, does not fit the
    /// budget beside what the session holds.
    pub(super) fn check_budget(
        &self,
        s: &Held,
        seq: u64,
        cfg: &Configure,
        what: &str,
        cost: Cost,
    ) -> Result<(), Refusal> {
        let (used, budget) = (held_bytes(&s.seqs), self.opts.mem_budget);
        let runs = cfg.first_layer as usize..cfg.end_layer as usize;
        let state = match s.seqs.contains_key(&seq) {
            true => 0,
            false => State::delta_bytes_for(&self.model().config, runs.clone()) as u64,
        };
        let need = [state, cost.pages, cost.work]
            .into_iter()
            .fold(used, u64::saturating_add);
        if need <= budget {
            return Ok(());
        }
        let new = match state {
            0 => String::new(),
            _ => format!(
                " (sequence {seq} is new here and needs {state} bytes of DeltaNet state for \
                 layers {runs:?})"
            ),
        };
        Err(Refusal(
            "memory",
            format!(
                "{what}{new} needs {} bytes of new KV pages and {} bytes of working memory; \
                 {used} of this helper's budget of {budget} bytes are in use",
                cost.pages, cost.work
            ),
        ))
    }

    /// Bytes of one KV page of one layer.
    pub(super) fn page_bytes(&self, cfg: &Configure) -> u64 {
        let c = &self.model().config;
        u64::from(cfg.page_size) * c.kv_row_bytes(cfg.kv_types) as u64
    }

    /// Bytes of the KV pages that `layers` of `seq` must add to hold positions up to `end`
    /// after the rows each holds (a mirror's rows, contiguous).
    pub(super) fn page_growth(
        &self,
        s: &Held,
        cfg: &Configure,
        seq: u64,
        layers: &[u32],
        end: u64,
    ) -> u64 {
        let page = u64::from(cfg.page_size);
        layers
            .iter()
            .map(|&l| {
                let held = s.seqs.get(&seq).map_or(0, |st| kv_len(st, l)) as u64;
                let new = end.div_ceil(page).saturating_sub(held.div_ceil(page));
                new.saturating_mul(self.page_bytes(cfg))
            })
            .fold(0, u64::saturating_add)
    }
}

/// What a prefill chunk of `rows` rows at `pos` through `cfg`'s layers costs besides the KV
/// pages it adds: (the bytes of its reply, its working memory). The working memory is
/// estimated from above from the config, in f32: per row the residual and its per-layer
/// copies, a full-attention layer's projections, a DeltaNet layer's inputs and output and
/// the MLP's intermediate vectors (all counted although layers run one at a time); the
/// attention partials of every page the rows see, held together until they merge; and the
/// reply twice, read back from the backend and then encoded.
pub fn prefill_bytes(
    c: &ModelConfig,
    cfg: &Configure,
    pos: u64,
    rows: usize,
    want_state: bool,
) -> (u64, u64) {
    let (nh, hd) = (c.num_attention_heads, c.head_dim);
    let kv_width = c.num_key_value_heads * hd;
    let attention = 5 * nh * hd + 2 * kv_width;
    let deltanet = 3 * c.conv_dim() + 2 * c.linear_value_dim() + 2 * c.linear_num_value_heads;
    let per_row = 4 * c.hidden_size + attention + deltanet + 3 * c.intermediate_size;
    let rows = rows as u64;
    let pages_seen = (pos + rows).div_ceil(u64::from(cfg.page_size.max(1)));
    let partials = rows * (nh * (hd + 2)) as u64 * (pages_seen + 1);
    let count = |kind| {
        (cfg.first_layer..cfg.end_layer)
            .filter(|&l| c.layer_types.get(l as usize) == Some(&kind))
            .count() as u64
    };
    let (s_len, conv_len) = c.delta_state_len();
    let states = match want_state {
        true => count(LayerKind::LinearAttention) * ((s_len + conv_len) * F32) as u64,
        false => 0,
    };
    let kv_rows = rows * count(LayerKind::FullAttention) * c.kv_row_bytes(cfg.kv_types) as u64;
    let reply = kv_rows + states + REPLY_SLACK as u64;
    let work = (rows * per_row as u64 + partials) * F32 as u64 + 2 * reply;
    (reply, work)
}

/// A reply of `bytes` must fit the frame limit; nothing is computed for one that would not.
pub(super) fn check_reply(
    s: &Held,
    bytes: u64,
    what: impl FnOnce() -> String,
) -> Result<(), Refusal> {
    if bytes > s.max_frame as u64 {
        return Err(Refusal(
            "size",
            format!(
                "{} take {bytes} bytes, past the frame limit of {}",
                what(),
                s.max_frame
            ),
        ));
    }
    Ok(())
}
