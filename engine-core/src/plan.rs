//! The plan of a session: what runs where and why, and what it costs on the link, made once
//! from the model, the host's KV budget, the helper's offer and the link (DESIGN.md, "Modes").
//! `tether plan` prints it; the same numbers drive `split::prefill` and `State::offload`.

use std::fmt::Write;

use crate::config::{LayerKind, ModelConfig};
use crate::split::minimum;

/// What the plan is made from.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub context: usize,
    pub prompt: usize,
    pub page_size: usize,
    /// KV positions per layer the host keeps (`None`: all of them).
    pub host_kv_tokens: Option<usize>,
    /// Bytes each tethered helper offers, in the order they attached (the first runs the
    /// split prefill); empty without helpers.
    pub helpers: Vec<u64>,
    pub split_layer: usize,
    pub split_min: usize,
    pub split_ubatch: usize,
    pub interleave_from: usize,
    /// Link bandwidth in bits/s and one-way latency in seconds, if known.
    pub link: Option<(f64, f64)>,
}

pub struct Plan {
    pub text: String,
}

fn count(c: &ModelConfig, layers: std::ops::Range<usize>, kind: LayerKind) -> usize {
    c.layer_types[layers].iter().filter(|&&k| k == kind).count()
}

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / (1u64 << 20) as f64)
}

impl Plan {
    pub fn new(c: &ModelConfig, p: &PlanInput) -> Plan {
        let n = c.num_hidden_layers;
        let full = count(c, 0..n, LayerKind::FullAttention);
        let row = (2 * c.num_key_value_heads * c.head_dim * 4) as f64;
        let kv_per_token = full as f64 * row;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "model: {n} layers ({full} full attention, {} Gated DeltaNet); KV {:.1} KiB per token (f32)",
            n - full,
            kv_per_token / 1024.0
        );
        let helper = !p.helpers.is_empty();
        // Prefill.
        let tail = p.split_layer.min(n)..n;
        if !helper {
            let _ = writeln!(t, "prefill: host alone (no helper tethered)");
        } else if tail.is_empty() {
            let _ = writeln!(
                t,
                "prefill: host alone (--split-layer {n} gives the helper no layers)"
            );
        } else if p.prompt <= p.split_min {
            let _ = writeln!(
                t,
                "prefill: host alone for this {}-token prompt (at most {} tokens: the link would cost more than it saves)",
                p.prompt, p.split_min
            );
        } else {
            let ubatches = p.prompt.div_ceil(p.split_ubatch.max(1));
            let sent = (ubatches - 1) * p.split_ubatch;
            let bytes = minimum::prefill(c, tail.clone(), sent, 0, false) as f64;
            let _ = writeln!(
                t,
                "prefill: {ubatches} ubatches of {} stream through host layers 0..{} then helper layers {}..{n} \
                 (on a 4-layer cycle boundary: DeltaNet state never splits); the last ubatch runs on the host, \
                 so logits never cross",
                p.split_ubatch, tail.start, tail.start
            );
            let _ = writeln!(
                t,
                "  link: {:.0} bytes per prompt token (residual rows out, the helper's new KV rows and, once, its DeltaNet states back){}",
                bytes / p.prompt as f64,
                link_time(p.link, bytes, ubatches)
            );
            let mirror =
                count(c, tail.clone(), LayerKind::FullAttention) as f64 * row * p.context as f64;
            let _ = writeln!(
                t,
                "  the helper mirrors its layers' KV ({} at {} tokens) and state across turns; later turns push only what is new",
                mib(mirror),
                p.context
            );
        }
        // Decode and KV placement.
        let budget = p.host_kv_tokens.unwrap_or(usize::MAX);
        if p.context <= budget {
            let _ = writeln!(
                t,
                "decode: host alone; the KV of {} tokens ({}) fits the host's budget",
                p.context,
                mib(kv_per_token * p.context as f64)
            );
        } else if helper {
            let remote = (p.context - budget) / p.page_size * p.page_size;
            let pages = remote / p.page_size;
            let _ = writeln!(
                t,
                "KV: positions 0..{remote} ({pages} pages of {}, {}) live on the {}, the newest {} on the host",
                p.page_size,
                mib(kv_per_token * remote as f64),
                match p.helpers.len() {
                    1 => "helper".to_string(),
                    k => format!("{k} helpers"),
                },
                p.context - remote
            );
            placement(&mut t, c, p, pages);
            let step = minimum::attend(c, 0..n, 1, pages) as f64;
            let _ = writeln!(
                t,
                "decode: per full-attention layer the host sends the step's query and merges the helper's {pages} page partials \
                 (o, m, l) in page order: {step:.0} bytes per token{}",
                link_time(p.link, step, 2 * full)
            );
        } else {
            let _ = writeln!(
                t,
                "decode: the context ({}) exceeds the host's KV budget ({budget}) and no helper is tethered",
                p.context
            );
        }
        if helper && p.context > p.interleave_from {
            let pages = p
                .host_kv_tokens
                .map_or(0, |b| p.context.saturating_sub(b) / p.page_size);
            if pages > 0 {
                let bytes = minimum::attend(c, 0..n, 2 * p.split_ubatch, pages) as f64;
                let _ = writeln!(
                    t,
                    "prefill past position {}: ubatches of {} in staggered pairs; while the host runs one, the helper \
                     attends the other's queries over the up to {pages} pages it holds: about {:.0} bytes per prompt token{}",
                    p.interleave_from,
                    p.split_ubatch,
                    bytes / (2 * p.split_ubatch) as f64,
                    link_time(p.link, bytes, 2 * full)
                );
            } else {
                let _ = writeln!(
                    t,
                    "prefill past position {}: no pages on the helper to attend, so ubatches run one after another on the host",
                    p.interleave_from
                );
            }
        }
        Plan { text: t }
    }
}

/// Where the `pages` pages of each full-attention layer that leave the host go: the first
/// helper takes its prefill layers' pages, the others spread over all helpers in proportion to
/// their offers (`State::place`; by measured speed once every helper has answered a query).
fn placement(t: &mut String, c: &ModelConfig, p: &PlanInput, pages: usize) {
    let n = c.num_hidden_layers;
    let tail = p.split_layer.min(n)..n;
    let page = (p.page_size * 2 * c.num_key_value_heads * c.head_dim * 4) as f64;
    let (tail_full, head_full) = (
        count(c, tail.clone(), LayerKind::FullAttention),
        count(c, 0..tail.start, LayerKind::FullAttention),
    );
    let total: f64 = p.helpers.iter().map(|&m| m as f64).sum::<f64>().max(1.0);
    for (i, &mem) in p.helpers.iter().enumerate() {
        let share = mem as f64 / total;
        let own = if i == 0 { tail_full * pages } else { 0 };
        let held = own as f64 + head_full as f64 * pages as f64 * share;
        let _ = writeln!(
            t,
            "  helper {i}: offers {}; holds about {held:.0} pages ({}){}",
            mib(mem as f64),
            mib(held * page),
            if i == 0 && !tail.is_empty() {
                format!(
                    ", among them every page of its prefill layers {}..{n}",
                    tail.start
                )
            } else {
                String::new()
            }
        );
        if held * page > mem as f64 {
            let _ = writeln!(
                t,
                "  WARNING: helper {i} offers only {}; it will refuse pages past that, and they go to the others or the page file",
                mib(mem as f64)
            );
        }
    }
}

/// ", about X ms on the link" for `bytes` in `messages` messages.
fn link_time(link: Option<(f64, f64)>, bytes: f64, messages: usize) -> String {
    match link {
        Some((bps, latency)) => format!(
            ", about {:.2} ms on the link",
            (bytes * 8.0 / bps + latency * messages as f64) * 1e3
        ),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> PlanInput {
        PlanInput {
            context: 100_000,
            prompt: 2048,
            page_size: 4096,
            host_kv_tokens: Some(32_768),
            helpers: vec![8 << 30],
            split_layer: 16,
            split_min: 512,
            split_ubatch: 256,
            interleave_from: 65536,
            link: Some((10e9, 50e-6)),
        }
    }

    #[test]
    fn a_long_context_splits_and_offloads_with_reasons() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let text = Plan::new(&c, &input()).text;
        assert!(
            text.contains(
                "8 ubatches of 256 stream through host layers 0..16 then helper layers 16..24"
            ),
            "{text}"
        );
        // 100000 - 32768 = 67232 -> 16 whole pages of 4096 = 65536 positions on the helper.
        assert!(
            text.contains("positions 0..65536 (16 pages of 4096"),
            "{text}"
        );
        assert!(
            text.contains("prefill past position 65536: ubatches of 256 in staggered pairs"),
            "{text}"
        );
    }

    #[test]
    fn pages_spread_over_helpers_by_their_offers() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let p = PlanInput {
            helpers: vec![8 << 30, 2 << 30, 2 << 30],
            ..input()
        };
        let text = Plan::new(&c, &p).text;
        // 16 pages per layer; layers 16..24 hold 2 full-attention layers (the first helper's),
        // 0..16 hold 4, spread 4:1:1 -> helper 0: 32 + 64 * 2/3, helpers 1, 2: 64 / 6 each.
        assert!(text.contains("16 pages of 4096"), "{text}");
        assert!(text.contains("live on the 3 helpers"), "{text}");
        assert!(
            text.contains("helper 0: offers 8192.0 MiB; holds about 75 pages"),
            "{text}"
        );
        assert!(
            text.contains("helper 1: offers 2048.0 MiB; holds about 11 pages"),
            "{text}"
        );
    }

    #[test]
    fn short_prompts_and_small_contexts_stay_on_the_host() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let p = PlanInput {
            context: 1000,
            prompt: 300,
            ..input()
        };
        let text = Plan::new(&c, &p).text;
        assert!(
            text.contains("host alone for this 300-token prompt"),
            "{text}"
        );
        assert!(text.contains("decode: host alone"), "{text}");
    }
}
