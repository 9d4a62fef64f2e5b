//! The plan of a session: what runs where and why, and what it costs on the link, made once
//! from the model, the host's KV budget, the helper's offer and the link (DESIGN.md, "Modes").
//! `tether plan` prints it; the same numbers drive `split::prefill` and `Sequence::offload`.

use std::fmt::Write;
use std::mem::size_of;
use std::ops::Range;

use crate::cache_types::CacheTypes;
use crate::config::{LayerKind, ModelConfig};
use crate::host::minimum;
use crate::model::State;
use crate::protocol::Configure;
use crate::tensor::DType;
use crate::Model;

/// DESIGN.md's page of KV storage: what the plan takes unless a small host budget needs finer
/// moves.
pub const STORAGE_PAGE: usize = 4096;

/// The smallest page the plan chooses: below it, a decode step's per-page partials and
/// messages grow faster than the host budget's slack shrinks.
const MIN_PAGE: usize = 256;

/// Tokens per prefill ubatch: DESIGN.md's 256 where a helper runs a pipeline stage (small
/// enough that the two stages overlap over most of a prompt), 512 on the host alone (each
/// weight read serves more tokens; larger ones gain little more on the CPU).
pub const SPLIT_UBATCH: usize = 256;
pub const HOST_UBATCH: usize = 512;

/// The share of the host's free memory the plan leaves to the rest of the machine (an eighth).
const RESERVE_SHARE: u64 = 8;

/// What one sequence costs in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Bytes per position of context: the K and V rows of every full-attention layer.
    pub per_token: u64,
    /// The types those rows are stored as.
    pub types: CacheTypes,
    /// Bytes however long the context: the DeltaNet states of the live sequence, of the empty
    /// origin and of each conversation checkpoint, and each checkpoint's saved logits.
    pub fixed: u64,
}

impl Footprint {
    /// A sequence's, with KV stored as `types`.
    pub fn of(c: &ModelConfig, types: CacheTypes, checkpoints: usize) -> Footprint {
        let per_token = c.kv_bytes(types, 0..c.num_hidden_layers, 1);
        let states = (2 + checkpoints) * State::delta_bytes_for(c, 0..c.num_hidden_layers);
        let logits = checkpoints * c.vocab_size * size_of::<f32>();
        Footprint {
            per_token: per_token as u64,
            types,
            fixed: (states + logits) as u64,
        }
    }

    /// Bytes a context of `ctx` positions takes: KV is allocated a page of `page_size`
    /// positions at a time.
    pub fn bytes(&self, ctx: usize, page_size: usize) -> u64 {
        self.fixed + self.per_token * (ctx.div_ceil(page_size) * page_size) as u64
    }
}

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / (1u64 << 20) as f64)
}

/// Bytes of a model's weights as stored: each layer's, and the embedding and head's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightBytes {
    pub layers: Vec<u64>,
    pub ends: u64,
}

impl WeightBytes {
    pub fn of(model: &Model) -> WeightBytes {
        let (layers, ends) = model.weight_bytes_by_layer();
        WeightBytes {
            layers: layers.into_iter().map(|b| b as u64).collect(),
            ends: ends as u64,
        }
    }

    /// The bytes of `layout`'s tensors (GGUF names, shapes and types, as
    /// [`crate::gguf::quantize::layout`] gives them for a file type), by layer (`blk.N.`) and
    /// the rest: a model planned as a file type would hold it, without its weights.
    pub fn of_layout(
        layers: usize,
        layout: &[(String, Vec<usize>, DType)],
    ) -> crate::Result<WeightBytes> {
        let mut out = WeightBytes {
            layers: vec![0; layers],
            ends: 0,
        };
        for (name, shape, dtype) in layout {
            let bytes = dtype.bytes_for(shape.iter().product()).ok_or_else(|| {
                crate::Error::Invalid(format!(
                    "{name} {shape:?} is not whole blocks of {}",
                    dtype.name()
                ))
            })? as u64;
            let layer = name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok());
            match layer.and_then(|l| out.layers.get_mut(l)) {
                Some(l) => *l += bytes,
                None => out.ends += bytes,
            }
        }
        Ok(out)
    }

    fn of_layers(&self, r: Range<usize>) -> u64 {
        self.layers.get(r).map_or(0, |l| l.iter().sum())
    }
}

/// Bytes a forward pass of `u` tokens holds at once, about: the residual, its normed copy and
/// the layer's output, the widest of the MLP's (gate, up and their product) and the mixers'
/// projections, and the last position's logits.
pub fn activation_bytes(c: &ModelConfig, u: usize) -> u64 {
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let attention = 3 * q + 2 * kv;
    let deltanet = 2 * c.linear_key_dim() + 2 * c.linear_value_dim() + 2 * c.linear_num_value_heads;
    let widest = (3 * c.intermediate_size).max(attention).max(deltanet);
    ((u * (3 * c.hidden_size + widest) + c.vocab_size) * size_of::<f32>()) as u64
}

/// What the plan is made from. The four choices it makes (page size, host KV budget, split
/// layer, ubatch) are `None` to be decided, or a flag's value, which it takes as is.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub context: usize,
    pub prompt: usize,
    /// The model's weights (empty: not counted, as in a simulation).
    pub weights: WeightBytes,
    /// Memory the host can give now (`None`: unknown).
    pub host_memory: Option<u64>,
    /// Bytes each tethered helper offers for KV and state, in the order they attached (the
    /// first runs the split prefill); 0 for one expected but not attached yet (its offer is
    /// not known); empty without helpers.
    pub helpers: Vec<u64>,
    pub page_size: Option<usize>,
    /// KV positions per layer the host keeps.
    pub host_kv_tokens: Option<usize>,
    pub split_layer: Option<usize>,
    pub ubatch: Option<usize>,
    pub split_min: usize,
    pub interleave_from: usize,
    /// Link bandwidth in bits/s and one-way latency in seconds, if known.
    pub link: Option<(f64, f64)>,
    /// The prefill helper's speed against the host's, measured when it connected.
    pub speeds: Option<Speeds>,
    /// How the host's KV cache stores keys and values.
    pub kv_types: CacheTypes,
    /// Conversation checkpoints the host keeps beside the live sequence (`Some(k)`: `serve`,
    /// which also keeps the empty origin; each is a copy of every DeltaNet state and, the
    /// saved turns, their logits: [`Footprint::of`]); `None` for one run.
    pub checkpoints: Option<usize>,
}

/// Prefill speeds measured at connect (`calibrate`): the seconds the host and the prefill
/// helper take for one 4-layer cycle (three DeltaNet layers and an attention layer) over the
/// same `rows` rows, the helper's counting its link's round trip. The split that balances
/// the two pipeline stages follows from their ratio.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speeds {
    pub rows: usize,
    pub host_cycle_s: f64,
    pub helper_cycle_s: f64,
}

impl Speeds {
    /// The first helper layer, on a cycle boundary, that makes the slower of the two stages
    /// fastest: the host's `s / 4` cycles against the helper's `(n - s) / 4`. Never `n`
    /// (a helper that runs nothing is no pipeline) unless the model has no whole cycle.
    pub fn balanced_split(&self, n: usize) -> usize {
        let slower = |s: usize| {
            let (host, helper) = self.stage_seconds(n, s);
            host.max(helper)
        };
        (4..n)
            .step_by(4)
            .min_by(|&a, &b| slower(a).total_cmp(&slower(b)))
            .unwrap_or(n)
    }

    /// Seconds the host and the helper each take for `rows` rows of an `n`-layer model split
    /// at layer `s`.
    pub fn stage_seconds(&self, n: usize, s: usize) -> (f64, f64) {
        let (host, helper) = ((s / 4) as f64, ((n - s) / 4) as f64);
        (host * self.host_cycle_s, helper * self.helper_cycle_s)
    }
}

/// The plan: its choices, and the text that explains them.
pub struct Plan {
    pub page_size: usize,
    /// KV positions per layer the host keeps (`None`: all of them).
    pub host_kv_tokens: Option<usize>,
    pub split_layer: usize,
    pub ubatch: usize,
    /// How the host's KV pages store keys and values (as given: `--cache-type-k/-v`).
    pub kv_types: CacheTypes,
    /// The context that fits this host (`None`: its free memory or weights are unknown).
    pub room: Option<Room>,
    pub text: String,
}

/// Positions of context whose KV, at the plan's types, fits beside everything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Room {
    /// On the host alone (not rounded to pages).
    pub host: usize,
    /// With the helpers' offers too, the host keeping `host` in whole pages (`None` without
    /// helpers, or while an offer is not known).
    pub with_helpers: Option<usize>,
    /// On the helpers' offers alone, the host keeping none (`None` as for `with_helpers`).
    pub on_helpers: Option<usize>,
}

impl Plan {
    pub fn new(c: &ModelConfig, p: &PlanInput) -> Plan {
        let n = c.num_hidden_layers;
        let full = c.count_layers(0..n, LayerKind::FullAttention);
        let kv_per_token = c.kv_bytes(p.kv_types, 0..n, 1) as f64;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "model: {n} layers ({full} full attention, {} Gated DeltaNet); KV {:.1} KiB per token ({})",
            n - full,
            kv_per_token / 1024.0,
            p.kv_types
        );
        let choices = Choices::new(c, p);
        choices.explain(&mut t, c, p);
        let Choices {
            page_size,
            host_kv_tokens,
            split_layer,
            ubatch,
            ..
        } = choices;
        let helper = !p.helpers.is_empty();
        // Prefill.
        let tail = split_layer.min(n)..n;
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
            let ubatches = p.prompt.div_ceil(ubatch.max(1));
            let sent = (ubatches - 1) * ubatch;
            let bytes = minimum::prefill(c, p.kv_types, tail.clone(), sent, 0, false) as f64;
            let _ = writeln!(
                t,
                "prefill: {ubatches} ubatches of {} stream through host layers 0..{} then helper layers {}..{n} \
                 (on a 4-layer cycle boundary: DeltaNet state never splits); the last ubatch runs on the host, \
                 so logits never cross",
                ubatch, tail.start, tail.start
            );
            let _ = writeln!(
                t,
                "  link: {:.0} bytes per prompt token (residual rows out, the helper's new KV rows and, once, its DeltaNet states back){}",
                bytes / p.prompt as f64,
                link_time(p.link, bytes, ubatches)
            );
            let mirror = c.kv_bytes(p.kv_types, tail.clone(), p.context) as f64;
            let _ = writeln!(
                t,
                "  the helper mirrors its layers' KV ({} at {} tokens) and state across turns; later turns push only what is new",
                mib(mirror),
                p.context
            );
        }
        // Decode and KV placement.
        let budget = host_kv_tokens.unwrap_or(usize::MAX);
        if p.context <= budget {
            let _ = writeln!(
                t,
                "decode: host alone; the KV of {} tokens ({}) stays on the host",
                p.context,
                mib(kv_per_token * p.context as f64)
            );
        } else if helper {
            let remote = (p.context - budget) / page_size * page_size;
            let pages = remote / page_size;
            let _ = writeln!(
                t,
                "KV: positions 0..{remote} ({pages} pages of {}, {}) live on the {}, the newest {} on the host",
                page_size,
                mib(kv_per_token * remote as f64),
                match p.helpers.len() {
                    1 => "helper".to_string(),
                    k => format!("{k} helpers"),
                },
                p.context - remote
            );
            placement(&mut t, c, p, split_layer, page_size, pages);
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
            let pages = host_kv_tokens.map_or(0, |b| p.context.saturating_sub(b) / page_size);
            if pages > 0 {
                let bytes = minimum::attend(c, 0..n, 2 * ubatch, pages) as f64;
                let _ = writeln!(
                    t,
                    "prefill past position {}: ubatches of {} in staggered pairs; while the host runs one, the helper \
                     attends the other's queries over the up to {pages} pages it holds: about {:.0} bytes per prompt token{}",
                    p.interleave_from,
                    ubatch,
                    bytes / (2 * ubatch) as f64,
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
        Plan {
            page_size,
            host_kv_tokens,
            split_layer,
            ubatch,
            kv_types: p.kv_types,
            room: choices.room,
            text: t,
        }
    }
}

impl Plan {
    /// What a helper is configured with: this plan's page size and cache types and, for the
    /// prefill helper
    /// (`prefills`), its split layer (the helper runs layers `split_layer..n`); a helper that
    /// only holds pages runs none. The split a plan prints and the one a helper is given are
    /// this one number.
    pub fn configure_helper(&self, c: &ModelConfig, prefills: bool) -> Configure {
        let n = c.num_hidden_layers;
        let first = if prefills { self.split_layer.min(n) } else { n };
        Configure {
            first_layer: first as u32,
            end_layer: n as u32,
            page_size: u32::try_from(self.page_size).unwrap_or(u32::MAX),
            kv_types: self.kv_types,
        }
    }
}

/// The plan's four choices and the reason for each.
struct Choices {
    page_size: usize,
    host_kv_tokens: Option<usize>,
    split_layer: usize,
    ubatch: usize,
    room: Option<Room>,
    why: [String; 4],
}

impl Choices {
    /// Ubatch first (the activations it needs come off the host's room), then the host's KV
    /// budget, the page that budget is counted in, and the split its helper can hold.
    fn new(c: &ModelConfig, p: &PlanInput) -> Choices {
        let (ubatch, why_ubatch) = choose_ubatch(c, p);
        let (budget, why_budget) = choose_host_kv(c, p, ubatch);
        let (page_size, why_page) = choose_page(p, budget);
        let host_kv_tokens = match p.host_kv_tokens {
            Some(t) => Some(t),
            None => budget.map(|b| b / page_size * page_size),
        };
        let (split_layer, why_split) = choose_split(c, p, ubatch);
        Choices {
            page_size,
            host_kv_tokens,
            split_layer,
            ubatch,
            room: room(c, p, (page_size, split_layer, ubatch)),
            why: [why_page, why_budget, why_split, why_ubatch],
        }
    }

    /// The choices, then what each device holds with them.
    fn explain(&self, t: &mut String, c: &ModelConfig, p: &PlanInput) {
        let [page, budget, split, ubatch] = &self.why;
        let budget_value = self
            .host_kv_tokens
            .map_or("all".to_string(), |b| b.to_string());
        let _ = writeln!(t, "chosen (a flag overrides each):");
        let _ = writeln!(t, "  page size {}: {page}", self.page_size);
        let _ = writeln!(t, "  host KV tokens {budget_value}: {budget}");
        let _ = writeln!(t, "  split layer {}: {split}", self.split_layer);
        let _ = writeln!(t, "  ubatch {}: {ubatch}", self.ubatch);
        if p.weights.layers.is_empty() {
            return;
        }
        let n = c.num_hidden_layers;
        self.context_that_fits(t, c, p);
        let host_kv = self.host_kv_tokens.unwrap_or(p.context).min(p.context);
        let host = host_needs(c, p, host_kv, self.ubatch);
        let _ = writeln!(t, "memory at {} tokens of context:", p.context);
        let _ = writeln!(
            t,
            "  host: {} (weights: all {n} layers, the embedding and head; KV: {host_kv} tokens); {}",
            host.line(self.ubatch),
            match p.host_memory {
                Some(m) if host.total() > m => format!("MORE than the {} free", gib(m)),
                Some(m) => format!("of {} free", gib(m)),
                None => "free memory unknown".into(),
            }
        );
        let tail = self.split_layer.min(n)..n;
        if let (Some(&offer), false) = (p.helpers.first(), tail.is_empty()) {
            let helper = Held {
                weights: p.weights.of_layers(tail.clone()),
                ..helper_needs(c, p, tail.clone(), self.ubatch)
            };
            let _ = writeln!(
                t,
                "  helper 0: {} (weights: layers {}..{n}, outside its offer; KV: its layers' mirror); {} of its {} offer",
                helper.line(self.ubatch),
                tail.start,
                gib(helper.total() - helper.weights),
                gib(offer)
            );
        }
    }
}

impl Choices {
    /// "context that fits at K/V: N on the host alone[, M with the helpers' X offered]";
    /// never past the positions the model was trained for.
    fn context_that_fits(&self, t: &mut String, c: &ModelConfig, p: &PlanInput) {
        let Some(room) = self.room else { return };
        let limit = c.max_position_embeddings;
        let tokens = |n: usize| match n >= limit {
            true => format!("{limit} tokens (the model's limit; room for {n})"),
            false => format!("{n} tokens"),
        };
        let helpers = match room.with_helpers {
            Some(all) => {
                let offers = p.helpers.iter().fold(0u64, |a, &o| a.saturating_add(o));
                format!(
                    ", {} with the helpers' {} offered",
                    tokens(all),
                    gib(offers)
                )
            }
            None => String::new(),
        };
        let _ = writeln!(
            t,
            "context that fits at {}: {} on the host alone{helpers}",
            p.kv_types,
            tokens(room.host)
        );
    }
}

/// The context that fits a host with `p.host_memory` bytes, if known, and the weights' bytes
/// (a simulation counts none, so it has no room to say), with pages of `page`, the helper
/// running layers from `split` and prefill in `ubatch`es.
fn room(
    c: &ModelConfig,
    p: &PlanInput,
    (page, split, ubatch): (usize, usize, usize),
) -> Option<Room> {
    let m = p.host_memory.filter(|_| !p.weights.layers.is_empty())?;
    let host = host_room(c, p, m, ubatch);
    let n = c.num_hidden_layers;
    let tail = split.min(n)..n;
    let with_host = |kept| room_with_helpers(c, p, (kept, page), tail.clone(), ubatch);
    Some(Room {
        host,
        with_helpers: with_host(host),
        on_helpers: with_host(0),
    })
}

/// What a device holds, by kind.
struct Held {
    weights: u64,
    kv: u64,
    state: u64,
    activations: u64,
}

impl Held {
    fn total(&self) -> u64 {
        self.weights + self.kv + self.state + self.activations
    }

    /// "X in all: weights, KV, state, activations (ubatch U)".
    fn line(&self, ubatch: usize) -> String {
        format!(
            "{} in all: weights {}, KV {}, DeltaNet state {}, activations about {} (ubatch {ubatch})",
            gib(self.total()),
            gib(self.weights),
            gib(self.kv),
            gib(self.state),
            gib(self.activations)
        )
    }
}

/// A size as the memory flags take it (`--host-memory`, `--mem-budget`, `--max-frame`): bytes,
/// or a number with K, M or G (powers of 1024; KB, KiB and the like too, in any case).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        other => return Err(format!("`{s}`: unknown unit `{other}` (use K, M or G)")),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{s}`: expected a size like 512M"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("`{s}`: too large"))
}

fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        mib(b as f64)
    }
}

/// What the host holds: every weight, the KV of `host_kv` positions, every DeltaNet state (and
/// `serve`'s conversation checkpoints) and a ubatch's activations.
fn host_needs(c: &ModelConfig, p: &PlanInput, host_kv: usize, ubatch: usize) -> Held {
    let n = c.num_hidden_layers;
    Held {
        weights: p.weights.of_layers(0..n) + p.weights.ends,
        kv: c.kv_bytes(p.kv_types, 0..n, host_kv) as u64,
        state: match p.checkpoints {
            None => State::delta_bytes_for(c, 0..n) as u64,
            Some(k) => Footprint::of(c, p.kv_types, k).fixed,
        },
        activations: activation_bytes(c, ubatch),
    }
}

/// What the prefill helper holds from its offer when it runs layers `tail`: their KV mirrored
/// over the whole context, their DeltaNet states and a ubatch's activations (its weights are
/// its own, outside the offer), at the plan's cache types.
fn helper_needs(c: &ModelConfig, p: &PlanInput, tail: Range<usize>, ubatch: usize) -> Held {
    Held {
        weights: 0,
        kv: c.kv_bytes(p.kv_types, tail.clone(), p.context) as u64,
        state: State::delta_bytes_for(c, tail) as u64,
        activations: activation_bytes(c, ubatch),
    }
}

fn choose_ubatch(c: &ModelConfig, p: &PlanInput) -> (usize, String) {
    if let Some(u) = p.ubatch {
        return (u.max(1), "as given".into());
    }
    let (mut u, mut why) = if p.helpers.is_empty() {
        (
            HOST_UBATCH,
            "host alone: each weight read serves 512 prompt tokens".to_string(),
        )
    } else {
        (
            SPLIT_UBATCH,
            "DESIGN.md's ubatch for the two-stage pipeline (host and helper overlap on most of a prompt)".to_string(),
        )
    };
    if let Some(m) = p.host_memory {
        let first = u;
        while u > 16 && activation_bytes(c, u) > m / RESERVE_SHARE {
            u /= 2;
        }
        if u < first {
            why = format!(
                "{first} would need {} of activations, more than an eighth of the {} free",
                gib(activation_bytes(c, first)),
                gib(m)
            );
        }
    }
    (u, why)
}

/// The host's KV budget in positions, before it is rounded to whole pages.
fn choose_host_kv(c: &ModelConfig, p: &PlanInput, ubatch: usize) -> (Option<usize>, String) {
    if let Some(b) = p.host_kv_tokens {
        return (Some(b), "as given".into());
    }
    let Some(m) = p.host_memory else {
        return (
            None,
            "the host's free memory is unknown: all KV stays on the host".into(),
        );
    };
    let fits = host_room(c, p, m, ubatch);
    let room = format!(
        "{} free less the weights, DeltaNet state, activations and an eighth for the rest of the machine leaves room for {fits} tokens",
        gib(m)
    );
    if fits >= p.context {
        (None, format!("{room}: all {} fit", p.context))
    } else if p.helpers.is_empty() {
        (
            None,
            format!(
                "WARNING: {room}, fewer than {}; with no helper to take the older pages the host \
                 keeps them all and may swap (tether a helper, or plan a shorter context)",
                p.context
            ),
        )
    } else {
        (
            Some(fits),
            format!("{room}; the older pages go to the helpers"),
        )
    }
}

/// Positions of KV (every layer's, at the plan's types) that fit in `m` bytes of host memory
/// beside the weights, DeltaNet state, a ubatch's activations and an eighth for the rest of
/// the machine.
fn host_room(c: &ModelConfig, p: &PlanInput, m: u64, ubatch: usize) -> usize {
    let others = host_needs(c, p, 0, ubatch).total() + m / RESERVE_SHARE;
    let per_token = c.kv_bytes(p.kv_types, 0..c.num_hidden_layers, 1).max(1) as u64;
    usize::try_from(m.saturating_sub(others) / per_token).unwrap_or(usize::MAX)
}

/// The context that fits with the helpers' offers too: the host keeps its `host` positions in
/// whole pages of `page`, the helpers hold every older page, and the prefill helper (running
/// layers `tail`, the first) also mirrors its layers' KV of every position beside their state
/// and a ubatch's activations, from its own offer. `None` without helpers, or while an offer
/// is not known. Counted in u128: offers are peers' numbers.
fn room_with_helpers(
    c: &ModelConfig,
    p: &PlanInput,
    (host, page): (usize, usize),
    tail: Range<usize>,
    ubatch: usize,
) -> Option<usize> {
    if p.helpers.is_empty() || p.helpers.contains(&0) {
        return None;
    }
    let n = c.num_hidden_layers;
    let host = (host / page.max(1) * page) as u128;
    let prefill = match tail.is_empty() {
        true => 0,
        false => {
            let needs = helper_needs(c, p, tail.clone(), ubatch);
            (needs.state + needs.activations) as u128
        }
    };
    let offers: u128 = p.helpers.iter().map(|&o| u128::from(o)).sum();
    let room = offers.saturating_sub(prefill);
    let (all, mirrored) = (
        c.kv_bytes(p.kv_types, 0..n, 1).max(1) as u128,
        c.kv_bytes(p.kv_types, tail, 1) as u128,
    );
    // The prefill helper's own offer bounds its mirror: t positions of its layers.
    let first = (u128::from(p.helpers[0])).saturating_sub(prefill);
    let mirror_cap = first.checked_div(mirrored).unwrap_or(u128::MAX);
    // Past the host's positions, the helpers hold mirrored * t + (all - mirrored) * (t - host)
    // bytes at context t; short of them, only the mirror.
    let t = match mirrored > 0 && mirrored * host >= room {
        true => mirror_cap,
        false => ((room + (all - mirrored) * host) / all).min(mirror_cap),
    };
    Some(usize::try_from(t).unwrap_or(usize::MAX))
}

/// The page: DESIGN.md's 4096 positions, halved while a page is more than an eighth of the
/// host's budget, so whole-page moves keep the host within an eighth of it.
fn choose_page(p: &PlanInput, budget: Option<usize>) -> (usize, String) {
    if let Some(page) = p.page_size {
        return (page, "as given".into());
    }
    let Some(b) = budget else {
        return (STORAGE_PAGE, "DESIGN.md's storage page".into());
    };
    let mut page = STORAGE_PAGE;
    while page > MIN_PAGE && page * 8 > b {
        page /= 2;
    }
    let why = if page < STORAGE_PAGE {
        format!("at most an eighth of the host's budget of {b} tokens, so whole-page moves keep it near that budget")
    } else {
        "DESIGN.md's storage page (an eighth of the host's budget or less)".into()
    };
    (page, why)
}

/// The helper's share of the layers by default: the last ~3/8, cut on a 4-layer cycle
/// boundary (40 of 64 on the host for the 27B), so DeltaNet state never splits mid-cycle.
fn default_split_layer(layers: usize) -> usize {
    let host = (layers * 5).div_ceil(8);
    (host.div_ceil(4) * 4).min(layers)
}

/// The prefill helper's first layer before its speed is measured: DESIGN.md's share, except
/// that a helper is given at least the last cycle where the model has two. DESIGN.md's 5/8,
/// rounded up to a cycle, is every layer of an 8-layer model; a helper configured with no
/// layers is never measured (calibrate needs a cycle to time), so it would never prefill.
fn first_guess(n: usize) -> (usize, &'static str) {
    match default_split_layer(n) {
        s if s == n && n >= 8 => (
            n - 4,
            "the last cycle on the helper (DESIGN.md's share, the first 5/8 of the layers on the host, would leave it none)",
        ),
        s => (s, "DESIGN.md's share, the host runs the first 5/8 of the layers"),
    }
}

/// The first layer of the prefill helper: where the measured speeds balance the two stages
/// (before they are measured, DESIGN.md's share: the host runs the first 5/8 of the layers),
/// on a 4-layer cycle boundary, moved back a cycle at a time while the helper's offer cannot
/// hold its layers' mirrored KV, state and activations.
fn choose_split(c: &ModelConfig, p: &PlanInput, ubatch: usize) -> (usize, String) {
    let (given, offer, speeds) = (p.split_layer, p.helpers.first().copied(), p.speeds.as_ref());
    let context = p.context;
    let n = c.num_hidden_layers;
    if let Some(s) = given {
        return (s, "as given".into());
    }
    let (default, guess) = first_guess(n);
    let offer = match offer {
        None => return (n, "no helper: the host prefills alone".into()),
        Some(0) => {
            return (
                default,
                format!("{guess} (the helper's offer is not known yet)"),
            )
        }
        Some(o) => o,
    };
    let (first, share) = match speeds {
        Some(m) => {
            let s = m.balanced_split(n);
            let (host, helper) = m.stage_seconds(n, s);
            let why = format!(
                "measured at connect on {} rows, a cycle of 4 layers takes the host {:.1} ms and the helper {:.1} ms \
                 (with its link): layers {s}..{n} on the helper balance the two stages (host {:.0} ms, helper {:.0} ms per {} rows)",
                m.rows,
                m.host_cycle_s * 1e3,
                m.helper_cycle_s * 1e3,
                host * 1e3,
                helper * 1e3,
                m.rows
            );
            (s, why)
        }
        None => (default, guess.to_string()),
    };
    let mut s = first;
    while s < n && helper_needs(c, p, s..n, ubatch).total() > offer {
        s = (s + 4).min(n);
    }
    let why = if s == first {
        format!(
            "{share}; the helper's {} offer holds its layers' KV and state",
            gib(offer)
        )
    } else if s < n {
        format!(
            "{share}, but the helper's {} offer holds the mirrored KV and state of layers {s}..{n} at {context} tokens, not of {first}..{n}",
            gib(offer)
        )
    } else {
        format!(
            "the helper's {} offer cannot hold even the last cycle's mirrored KV at {context} tokens: the host prefills alone",
            gib(offer)
        )
    };
    (s, why)
}

/// Where the `pages` pages of each full-attention layer that leave the host go: the first
/// helper takes its prefill layers' pages, the others spread over all helpers in proportion to
/// their offers (`Placement::place`; by measured speed once every helper has answered a query).
fn placement(
    t: &mut String,
    c: &ModelConfig,
    p: &PlanInput,
    split_layer: usize,
    page_size: usize,
    pages: usize,
) {
    let n = c.num_hidden_layers;
    let tail = split_layer.min(n)..n;
    let page = (page_size * c.kv_row_bytes(p.kv_types)) as f64;
    let (tail_full, head_full) = (
        c.count_layers(tail.clone(), LayerKind::FullAttention),
        c.count_layers(0..tail.start, LayerKind::FullAttention),
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
        if mem > 0 && held * page > mem as f64 {
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
    #[test]
    fn split_layer_is_on_a_cycle_boundary() {
        assert_eq!(super::default_split_layer(64), 40);
        assert_eq!(super::default_split_layer(24), 16);
        assert_eq!(super::default_split_layer(8), 8);
    }

    #[test]
    fn sizes() {
        use super::parse_size;
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("100K").unwrap(), 100 << 10);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("3GiB").unwrap(), 3 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12X").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999G").is_err());
    }

    use super::*;
    use crate::cache_types::KvType;

    fn input() -> PlanInput {
        PlanInput {
            context: 100_000,
            prompt: 2048,
            weights: WeightBytes::default(),
            host_memory: None,
            helpers: vec![8 << 30],
            page_size: Some(4096),
            host_kv_tokens: Some(32_768),
            split_layer: Some(16),
            ubatch: Some(256),
            split_min: 512,
            interleave_from: 65536,
            link: Some((10e9, 50e-6)),
            speeds: None,
            kv_types: CacheTypes::F32,
            checkpoints: None,
        }
    }

    /// The 0.8B shape deciding for itself: 50 MiB a layer, 500 MiB of embedding.
    fn deciding(host_memory: u64, helpers: Vec<u64>) -> PlanInput {
        PlanInput {
            context: 262_144,
            weights: WeightBytes {
                layers: vec![50 << 20; 24],
                ends: 500 << 20,
            },
            host_memory: Some(host_memory),
            helpers,
            page_size: None,
            host_kv_tokens: None,
            split_layer: None,
            ubatch: None,
            ..input()
        }
    }

    #[test]
    fn the_host_keeps_the_kv_its_memory_leaves_room_for_in_whole_pages() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let m = 4u64 << 30;
        let plan = Plan::new(&c, &deciding(m, vec![8 << 30]));
        assert_eq!(plan.ubatch, SPLIT_UBATCH);
        // 6 full-attention layers x K and V x 2 heads x 256 x 4 bytes = 24 KiB a position.
        let per_token = 6 * 2 * 2 * 256 * 4;
        let others = 24 * (50 << 20)
            + (500 << 20)
            + State::delta_bytes_for(&c, 0..24) as u64
            + activation_bytes(&c, SPLIT_UBATCH)
            + m / 8;
        let fits = ((m - others) / per_token) as usize;
        assert!(fits > 32_768 && fits < 262_144, "{fits}");
        assert_eq!(plan.page_size, STORAGE_PAGE);
        assert_eq!(plan.host_kv_tokens, Some(fits / 4096 * 4096));
        // Past position 65536 the helper attends the pages the chosen budget sent it.
        assert!(plan.text.contains("in staggered pairs"), "{}", plan.text);
        // The same host alone keeps everything, and says it will not fit.
        let alone = Plan::new(&c, &deciding(m, vec![]));
        assert_eq!((alone.host_kv_tokens, alone.ubatch), (None, HOST_UBATCH));
        assert!(alone.text.contains("WARNING"), "{}", alone.text);
        // Enough memory: all of it on the host.
        let big = Plan::new(&c, &deciding(64 << 30, vec![8 << 30]));
        assert_eq!(big.host_kv_tokens, None);
    }

    #[test]
    fn a_small_budget_takes_smaller_pages() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        // 2.5 GiB leaves room for a few thousand positions beside 1.7 GiB of weights and the
        // eighth kept back.
        let plan = Plan::new(&c, &deciding(5 << 29, vec![8 << 30]));
        let b = plan.host_kv_tokens.unwrap();
        assert!(plan.page_size < STORAGE_PAGE, "{}", plan.text);
        assert!(plan.page_size * 8 <= b + plan.page_size, "{}", plan.text);
        assert_eq!(b % plan.page_size, 0);
    }

    #[test]
    fn the_split_moves_back_until_the_helpers_offer_holds_its_mirror() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let m = 64 << 30;
        // At 262144 positions a full-attention layer's KV is 262144 x 4 KiB = 1 GiB; layers
        // 16..24 hold 2 of them, 20..24 one.
        let fits_one = (1u64 << 30) + (300 << 20);
        let plan = Plan::new(&c, &deciding(m, vec![fits_one]));
        assert_eq!(plan.split_layer, 20, "{}", plan.text);
        let roomy = Plan::new(&c, &deciding(m, vec![4 << 30]));
        assert_eq!(roomy.split_layer, default_split_layer(24));
        assert_eq!(roomy.split_layer, 16);
        let tiny = Plan::new(&c, &deciding(m, vec![100 << 20]));
        assert_eq!(tiny.split_layer, 24, "{}", tiny.text);
        assert!(
            tiny.text.contains("the host prefills alone"),
            "{}",
            tiny.text
        );
        // A flag is taken as it is.
        let given = Plan::new(
            &c,
            &PlanInput {
                split_layer: Some(12),
                page_size: Some(512),
                ..deciding(m, vec![100 << 20])
            },
        );
        assert_eq!((given.split_layer, given.page_size), (12, 512));
        assert!(
            given.text.contains("split layer 12: as given"),
            "{}",
            given.text
        );
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

    /// Measured speeds move the split to where the two stages take the same time, on a cycle
    /// boundary; the helper's offer still bounds how many layers it takes.
    #[test]
    fn measured_speeds_balance_the_split_within_the_offer() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let speeds = |host: f64, helper: f64| Speeds {
            rows: 32,
            host_cycle_s: host,
            helper_cycle_s: helper,
        };
        // Equal speeds: half the 24 layers each; a helper three times slower takes a quarter.
        assert_eq!(speeds(1.0, 1.0).balanced_split(24), 12);
        assert_eq!(speeds(1.0, 3.0).balanced_split(24), 20);
        // A helper twice as fast: 2 host cycles (2 s) against 4 helper cycles (2 s).
        assert_eq!(speeds(1.0, 0.5).balanced_split(24), 8);
        // Far slower or faster, it still takes one cycle, or leaves one to the host.
        assert_eq!(speeds(1.0, 100.0).balanced_split(24), 20);
        assert_eq!(speeds(100.0, 1.0).balanced_split(24), 4);
        let plan = |helper: f64, offer: u64| {
            let p = PlanInput {
                speeds: Some(speeds(0.01, helper)),
                ..deciding(64 << 30, vec![offer])
            };
            Plan::new(&c, &p)
        };
        let even = plan(0.01, 64 << 30);
        assert_eq!(even.split_layer, 12);
        assert!(
            even.text
                .contains("takes the host 10.0 ms and the helper 10.0 ms")
                && even
                    .text
                    .contains("layers 12..24 on the helper balance the two stages"),
            "{}",
            even.text
        );
        // An offer too small for layers 12..24's mirrored KV at 262144 tokens moves the split
        // back as it does without speeds.
        let small = plan(0.01, 2 << 30);
        assert!(small.split_layer > 12, "{}", small.text);
        assert!(
            small.text.contains("but the helper's 2.00 GiB offer holds"),
            "{}",
            small.text
        );
    }

    /// The context the plan says fits is the largest whose KV, at the chosen types, fits:
    /// on the host beside everything else it holds, and on the helpers with the prefill
    /// helper's mirror of its layers counted (worked out here from the bytes each holds).
    #[test]
    fn the_context_that_fits_is_the_largest_whose_kv_fits() {
        let c = crate::synth::preset("qwen35-0.8b").unwrap();
        let m = 3u64 << 30;
        let types = CacheTypes {
            k: KvType::Q8_0,
            v: KvType::F16,
        };
        let p = PlanInput {
            kv_types: types,
            ..deciding(m, vec![1 << 30])
        };
        let plan = Plan::new(&c, &p);
        let number = |after: &str| -> usize {
            let at = plan
                .text
                .find(after)
                .unwrap_or_else(|| panic!("{}", plan.text))
                + after.len();
            let rest = &plan.text[at..];
            rest[..rest.find(' ').unwrap()].parse().unwrap()
        };
        let host = number("context that fits at K q8_0 / V f16: ");
        let all = number("tokens on the host alone, ");
        // K q8_0 (34 bytes a block of 32) and V f16, 2 heads x 256, 6 layers.
        let per_token = 6 * (2 * 256 / 32 * 34 + 2 * 256 * 2) as u64;
        let others = 24 * (50 << 20)
            + (500 << 20)
            + State::delta_bytes_for(&c, 0..24) as u64
            + activation_bytes(&c, plan.ubatch)
            + m / 8;
        assert!(others + host as u64 * per_token <= m, "{host}");
        assert!(others + (host as u64 + 1) * per_token > m, "{host}");
        // `serve`'s conversation checkpoints (the origin and 4 saved turns: every DeltaNet
        // state each, the turns' logits) come off the host's room.
        let served = PlanInput {
            checkpoints: Some(4),
            ..p.clone()
        };
        let served = Plan::new(&c, &served).room.unwrap().host as u64;
        let kept =
            others + Footprint::of(&c, types, 4).fixed - State::delta_bytes_for(&c, 0..24) as u64;
        assert!(served < host as u64, "{served}");
        assert!(kept + served * per_token <= m && kept + (served + 1) * per_token > m);
        // The helper mirrors layers split..24 at every position and holds the other
        // layers' pages past the host's.
        let n_tail = c.count_layers(plan.split_layer..24, LayerKind::FullAttention) as u64;
        let tail_token = per_token / 6 * n_tail;
        let fixed = State::delta_bytes_for(&c, plan.split_layer..24) as u64
            + activation_bytes(&c, plan.ubatch);
        // The host keeps whole pages.
        let kept = (host / plan.page_size * plan.page_size) as u64;
        let held = |t: u64| fixed + tail_token * t + (per_token - tail_token) * (t - kept);
        assert!(all as u64 > kept && held(all as u64) <= 1 << 30, "{all}");
        assert!(held(all as u64 + 1) > 1 << 30, "{all}");
        let room = plan.room.unwrap();
        assert_eq!((room.host, room.with_helpers), (host, Some(all)));
        // By themselves the helpers hold what the first can mirror beside its state.
        let alone = (1u64 << 30).saturating_sub(fixed) / per_token;
        assert_eq!(room.on_helpers, Some(alone as usize));
        // Beside a second helper with room for everything, the context is what the first,
        // the prefill helper, can mirror from its own offer; offers near u64::MAX neither
        // overflow nor change that.
        for second in [64u64 << 30, u64::MAX] {
            let two = Plan::new(
                &c,
                &PlanInput {
                    kv_types: types,
                    ..deciding(m, vec![1 << 30, second])
                },
            );
            assert_eq!(two.split_layer, plan.split_layer, "{}", two.text);
            let line = two
                .text
                .lines()
                .find(|l| l.starts_with("context that fits"))
                .unwrap();
            let want = (1u64 << 30).saturating_sub(fixed) / tail_token;
            assert!(
                line.contains(&format!(" room for {want})"))
                    || line.contains(&format!(", {want} tokens")),
                "{line}"
            );
        }
    }

    /// A model planned as a file type counts the bytes that file would hold, by layer.
    #[test]
    fn weights_of_a_file_types_layout_are_counted_by_layer() {
        let c = crate::synth::preset("tiny256").unwrap();
        let f = crate::gguf::quantize::FileType::parse("q4_k_m").unwrap();
        let layout = crate::gguf::quantize::layout(&c, f).unwrap();
        let w = WeightBytes::of_layout(c.num_hidden_layers, &layout).unwrap();
        let bytes = |pick: &dyn Fn(&str) -> bool| -> u64 {
            layout
                .iter()
                .filter(|(name, _, _)| pick(name))
                .map(|(_, s, d)| d.bytes_for(s.iter().product()).unwrap() as u64)
                .sum()
        };
        assert_eq!(w.of_layers(0..1), bytes(&|n| n.starts_with("blk.0.")));
        assert_eq!(w.ends, bytes(&|n| !n.starts_with("blk.")));
        assert_eq!(
            w.of_layers(0..c.num_hidden_layers) + w.ends,
            bytes(&|_| true)
        );
        assert!(w.layers.iter().all(|&b| b > 0));
    }
}
