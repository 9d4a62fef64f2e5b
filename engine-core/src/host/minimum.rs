//! The least a link can carry, in tensor bytes (values in f32, KV rows in the cache's types),
//! for the traffic a split causes: the plan estimates link time with these, and the benchmark
//! compares what crossed with them.

use crate::cache_types::CacheTypes;
use crate::config::{LayerKind, ModelConfig};

fn delta_state(c: &ModelConfig) -> usize {
    let (s, conv) = c.delta_state_len();
    (s + conv) * 4
}

/// A split prefill: residual rows to the helper, their new KV rows of the tail's full
/// layers back, the tail's DeltaNet states once back and (if the mirror was behind) once
/// out, and the mirror sync's KV rows.
pub fn prefill(
    c: &ModelConfig,
    types: CacheTypes,
    tail: std::ops::Range<usize>,
    sent_rows: usize,
    synced_rows: usize,
    synced: bool,
) -> u64 {
    let full = c.count_layers(tail.clone(), LayerKind::FullAttention);
    let delta = c.count_layers(tail, LayerKind::LinearAttention);
    let states = if sent_rows > 0 { 1 } else { 0 } + usize::from(synced);
    (sent_rows * c.hidden_size * 4
        + (sent_rows + synced_rows) * full * c.kv_row_bytes(types)
        + states * delta * delta_state(c)) as u64
}

/// Attention of `tokens` queries over remote pages in `layers`: the queries out and one
/// (o, m, l) per page back, for each full-attention layer (nothing without remote pages).
pub fn attend(
    c: &ModelConfig,
    layers: std::ops::Range<usize>,
    tokens: usize,
    remote_pages: usize,
) -> u64 {
    if remote_pages == 0 {
        return 0;
    }
    let full = c.count_layers(layers, LayerKind::FullAttention);
    let rows = tokens * c.num_attention_heads;
    (full * (rows * c.head_dim * 4 + remote_pages * rows * (c.head_dim + 2) * 4)) as u64
}

/// Moving `rows` positions of every full-attention layer to the helper.
pub fn offload(c: &ModelConfig, types: CacheTypes, rows: usize) -> u64 {
    (c.kv_bytes(types, 0..c.num_hidden_layers, rows)) as u64
}
