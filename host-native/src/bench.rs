//! `tether bench`: prefill and decode throughput and peak resident memory, on a checkpoint or a
//! synthetic preset. Timings come from wall-clock around whole forward passes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use engine_core::backend::KvType;
use engine_core::batch::{Batch, Event, Request};
use engine_core::draft::{Replay, MAX_DRAFT};
use engine_core::generate::{Generation, Sampler, SamplingParams};
use engine_core::host::minimum;
use engine_core::host::plan;
use engine_core::host::split::SplitPlan;
use engine_core::host::telemetry::Telemetry;
use engine_core::host::Sequence;
use engine_core::{Backend, Logits, Model, State};

use crate::attach::stats_json;
use crate::load::{DraftArgs, EngineArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    gen: usize,
    /// Context already in the cache before the timed prompt (not timed).
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// Prompt tokens per forward pass on the host alone (default: the plan's, 512).
    #[arg(long)]
    ubatch: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Emit the live view's events during the timed passes and serialise each to JSON, as
    /// `tether serve` does for a watcher of /v1/telemetry: what watching a run costs.
    #[arg(long)]
    telemetry: bool,
    #[command(flatten)]
    draft: DraftArgs,
    /// The prompt as text (its tokens, repeated or cut to --prompt-tokens) instead of
    /// pseudo-random tokens: a workload whose continuation repeats its input, for --draft.
    #[arg(long)]
    prompt: Option<String>,
    /// After the decode, time a verify pass of 1 + k rows for k = 1..K against one decode step
    /// at the context reached (what checking k drafted tokens costs): medians of 9 rounds that
    /// each time every size once.
    #[arg(long, default_value_t = 0)]
    verify_rows: usize,
    /// After the decode, decode the same tokens again on the host alone with drafts that replay
    /// them (every draft kept, --draft-max a step): the most drafting can buy.
    #[arg(long)]
    draft_ceiling: bool,
    /// Instead of one sequence, decode N sequences together in one batch (as `tether serve
    /// --parallel` steps them), for each N listed (e.g. 1,4,8,16): each prefills its own
    /// --prompt-tokens (untimed), then --gen steps are timed in which every one decodes.
    /// Prints the aggregate decode tok/s against N = 1 (when 1 comes first in the list).
    #[arg(long, value_delimiter = ',')]
    parallel: Vec<usize>,
}

/// Peak resident set size of this process (Linux's VmHWM), if the platform reports it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Events and JSON bytes a watcher of the run was sent.
#[derive(Default)]
struct Watched {
    events: AtomicU64,
    bytes: AtomicU64,
}

/// Serialise every event of `seq` from now on, counting them, as a watcher costs.
fn watch(seq: &mut Sequence) -> Arc<Watched> {
    let (epoch, watched) = (Instant::now(), Arc::new(Watched::default()));
    let counts = watched.clone();
    seq.placement.telemetry = Telemetry::new(
        move || epoch.elapsed().as_secs_f64() * 1e3,
        move |e| {
            let text = serde_json::to_string(&e).unwrap_or_default();
            counts.events.fetch_add(1, Ordering::Relaxed);
            counts.bytes.fetch_add(text.len() as u64, Ordering::Relaxed);
        },
    );
    watched
}

pub fn run(a: Args) -> Result<()> {
    if a.prompt_tokens == 0 {
        bail!("--prompt-tokens must be at least 1");
    }
    if a.json && (a.verify_rows > 0 || a.draft_ceiling) {
        bail!("--verify-rows and --draft-ceiling print tables: not with --json");
    }
    a.engine.start(false)?;
    a.draft.drafts().validate()?;
    let loaded = a.engine.load(None)?;
    let model = loaded.model;
    let (be, what) = a.engine.backend_for(&model)?;
    let be = &*be;
    eprintln!("backend: {what}");
    if !a.parallel.is_empty() {
        return parallel_decode(&a, &model, be);
    }
    let v = model.config.vocab_size as u64;
    // A fixed pseudo-random token stream (an LCG), the same on every run.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next_id = || {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((x >> 33) % v) as u32
    };
    let depth: Vec<u32> = (0..a.depth).map(|_| next_id()).collect();
    let prompt: Vec<u32> = match &a.prompt {
        Some(text) => {
            let ids = loaded.tokenizer.encode(text)?;
            if ids.is_empty() {
                bail!("--prompt: no tokens");
            }
            ids.iter().cycle().take(a.prompt_tokens).copied().collect()
        }
        None => (0..a.prompt_tokens).map(|_| next_id()).collect(),
    };
    let context = a.depth + a.prompt_tokens + a.gen;
    let types = a.engine.cache.types_or(KvType::F16);
    let (session, mut seq, helpers) =
        a.engine
            .session(&model, be, (context, a.prompt_tokens), a.ubatch, types)?;
    let page_size = session.page_size;
    // The link figures are the first helper's (the one that runs the split prefill).
    let link = helpers.first().map(|h| &h.stats);
    for chunk in depth.chunks(a.ubatch.unwrap_or(plan::HOST_UBATCH)) {
        seq.forward(&model, be, chunk, Logits::None, None)?;
    }
    for h in &helpers {
        h.stats.reset();
    }
    let watched = a.telemetry.then(|| watch(&mut seq));
    let c = &model.config;
    let (moved_before, pos_before) = (seq.state.remote_kv_len(), seq.state.pos);
    let plan = a.engine.helper.split_plan(&session);
    let split_ubatch = plan.ubatch.max(1);
    let mut greedy = Sampler::new(SamplingParams::greedy())?;
    let mut g = Generation::new(&model, be, &mut seq, &mut greedy, Vec::new())
        .with_drafts(a.draft.drafts())?;
    let t0 = Instant::now();
    let split = g.prefill(&prompt, &plan)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let seq = &mut g.seq;
    let prefill_link = link.map(|l| l.snapshot());
    for h in &helpers {
        h.stats.reset();
    }
    // During the prefill the remote pages are those moved before it; the host's layers attend
    // over them for every row, the tail's only for the rows it ran itself.
    let n = c.num_hidden_layers;
    let types = seq.state.kv_types();
    let prefill_min = seq.placement.prefill_helper().map_or(0, |r| {
        let tail = r.prefill_layers.clone();
        let moves = minimum::prefill(
            c,
            types,
            tail.clone(),
            split.rows_on_helper,
            split.synced_rows,
            split.mirror_synced,
        ) + minimum::offload(c, types, seq.state.remote_kv_len() - moved_before);
        let pages = moved_before / page_size;
        if split.on_helper > 0 {
            // A split prefill moves pages only at its end: every ubatch sees the pages moved
            // before it, the host's layers for every row, the tail's for the rows it ran.
            moves
                + minimum::attend(c, 0..tail.start, a.prompt_tokens, pages)
                + minimum::attend(
                    c,
                    tail.start..n,
                    a.prompt_tokens - split.rows_on_helper,
                    pages,
                )
        } else {
            // Ubatch by ubatch on the host (in pairs past interleave_from), pages moving after
            // each step as the budget demands.
            let budget = seq.placement.host_kv_tokens.unwrap_or(usize::MAX);
            let (mut remote, mut pos, mut attend) = (moved_before, pos_before, 0);
            let chunks: Vec<usize> = prompt.chunks(split_ubatch).map(|c| c.len()).collect();
            let mut i = 0;
            while i < chunks.len() {
                let step = if pos >= plan.interleave_from { 2 } else { 1 };
                let rows: usize = chunks[i..(i + step).min(chunks.len())].iter().sum();
                attend += minimum::attend(c, 0..n, rows, remote / page_size);
                pos += rows;
                while pos - remote > budget && remote + page_size <= pos {
                    remote += page_size;
                }
                i += step;
            }
            moves + attend
        }
    });
    let mut decode_min = 0;
    let (tokens, decode_s) = decode(&mut g, a.gen, |state, (before, pos)| {
        decode_min += minimum::attend(c, 0..n, state.pos - pos, before / page_size)
            + minimum::offload(c, types, state.remote_kv_len() - before);
    })?;
    let drafts = g.stats;
    let seq = &mut *g.seq;
    let decode_link = link.map(|l| l.snapshot());
    // Every helper's share of the decode: its pages and its link's traffic.
    let per_helper: Vec<serde_json::Value> = helpers
        .iter()
        .map(|h| {
            let s = h.stats.snapshot();
            let client = seq.placement.helpers.iter().find(|c| c.id == h.id);
            serde_json::json!({
                "id": h.id,
                "pages": seq.placement.pages_on(h.id),
                // Query to reply, link included: what the host waits for, prefill and decode.
                "attend_pages_per_s": client.and_then(|c| c.pages_per_sec()),
                "decode_bytes": s.sent_total.bytes + s.received_total.bytes,
                "decode_messages": s.sent_total.messages + s.received_total.messages,
            })
        })
        .collect();
    let prefill_tok_s = a.prompt_tokens as f64 / prefill_s;
    let decode_tok_s = if a.gen > 0 {
        a.gen as f64 / decode_s
    } else {
        0.0
    };
    let weight_bytes = model.weight_bytes() as f64;
    let threads = rayon::current_num_threads();
    let peak = peak_rss_bytes();
    if a.json {
        let obj = serde_json::json!({
            "model": a.engine.model,
            "weight_dtype": model.weight_dtype().map_or("none", |d| d.name()),
            "weight_bytes": weight_bytes as u64,
            "threads": threads,
            "depth": a.depth,
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen,
            "prefill_tok_s": prefill_tok_s,
            "decode_tok_s": decode_tok_s,
            "decode_weight_gb_s": weight_bytes * decode_tok_s / 1e9,
            "weights_in_huge_pages_bytes": engine_core::resident::copied(),
            "peak_rss_bytes": peak,
            "kv_cache_bytes": seq.state.kv_bytes(),
            "split_ubatches_on_helper": split.on_helper,
            "split_ubatches_interleaved": split.interleaved,
            "split_fallback": split.fallback,
            "link_prefill": prefill_link.as_ref().map(stats_json),
            "link_decode": decode_link.as_ref().map(stats_json),
            "link_bytes_per_prefill_token": prefill_link.as_ref().map(|s| s.sent_total.bytes + s.received_total.bytes).map(|b| b as f64 / a.prompt_tokens as f64),
            "link_min_bytes_per_prefill_token": link.as_ref().map(|_| prefill_min as f64 / a.prompt_tokens as f64),
            "link_bytes_per_decode_token": decode_link.as_ref().filter(|_| a.gen > 0).map(|s| (s.sent_total.bytes + s.received_total.bytes) as f64 / a.gen as f64),
            "link_min_bytes_per_decode_token": link.as_ref().filter(|_| a.gen > 0).map(|_| decode_min as f64 / a.gen as f64),
            "helpers": per_helper,
            "telemetry_events": watched.as_ref().map(|w| w.events.load(Ordering::Relaxed)),
            "telemetry_bytes": watched.as_ref().map(|w| w.bytes.load(Ordering::Relaxed)),
            "drafted": drafts.drafted,
            "drafts_kept": drafts.accepted,
            "draft_passes": drafts.steps,
            "draft_replays": drafts.replays,
        });
        println!("{obj}");
    } else {
        println!(
            "model {} ({} weights, {:.0} MB), {} threads, depth {}",
            a.engine.model,
            model.weight_dtype().map_or("none", |d| d.name()),
            weight_bytes / 1e6,
            threads,
            a.depth
        );
        println!("| test | tokens | seconds | tok/s |");
        println!("|---|---|---|---|");
        println!(
            "| prefill | {} | {:.3} | {:.2} |",
            a.prompt_tokens, prefill_s, prefill_tok_s
        );
        println!(
            "| decode | {} | {:.3} | {:.2} |",
            a.gen, decode_s, decode_tok_s
        );
        println!(
            "decode reads {:.1} GB/s of weights ({}); KV cache {:.1} MB; peak RSS {}",
            weight_bytes * decode_tok_s / 1e9,
            crate::load::residence(),
            seq.state.kv_bytes() as f64 / 1e6,
            peak.map_or("unknown".to_string(), |b| format!(
                "{:.2} GB",
                b as f64 / 1e9
            ))
        );
        if drafts.steps > 0 {
            println!(
                "drafts: {} of {} kept over {} checking passes ({} fed again after a mismatch)",
                drafts.accepted, drafts.drafted, drafts.steps, drafts.replays
            );
        }
        if let Some(w) = &watched {
            println!(
                "telemetry: {} events, {} bytes of JSON",
                w.events.load(Ordering::Relaxed),
                w.bytes.load(Ordering::Relaxed)
            );
        }
    }
    if a.verify_rows > 0 {
        verify_cost(&model, be, g.seq, a.verify_rows)?;
    }
    if a.draft_ceiling {
        let prompt_len = prompt.len();
        let replay = Replay {
            prompt: prompt_len,
            tokens,
            max: a.draft.draft_max,
            wrong_at: None,
        };
        let freeze = a.engine.freeze_pages;
        let mut fresh = crate::load::fresh_sequence(c, page_size, types, freeze, be)?;
        let mut greedy = Sampler::new(SamplingParams::greedy())?;
        let mut g = Generation::new(&model, be, &mut fresh, &mut greedy, Vec::new())
            .with_drafter(Some(Box::new(replay)));
        g.prefill(&prompt, &SplitPlan::default())?;
        let (_, s) = decode(&mut g, a.gen, |_, _| {})?;
        println!(
            "ceiling (the same tokens, every draft kept, {} a pass): {:.2} tok/s over {} passes, {:.2}x the decode above",
            a.draft.draft_max,
            a.gen as f64 / s,
            g.stats.steps,
            decode_s / s
        );
    }
    Ok(())
}

/// The decode the bench times: the first token is drawn from the prefill's logits (untimed),
/// then each of `gen` more feeds one (with drafts, several a pass or none); `each` sees the
/// state after each draw and its (remote KV length, position) before. The tokens, and the
/// seconds of the `gen`.
fn decode(
    g: &mut Generation,
    gen: usize,
    mut each: impl FnMut(&State, (usize, usize)),
) -> Result<(Vec<u32>, f64)> {
    // The bench has no stop tokens.
    let drawn = |g: &mut Generation| {
        g.next_token()?
            .ok_or_else(|| anyhow::anyhow!("a stop token with none set"))
    };
    g.limit(gen + 1);
    let mut tokens = vec![drawn(g)?];
    let t = Instant::now();
    for _ in 0..gen {
        let before = (g.seq.state.remote_kv_len(), g.seq.state.pos);
        tokens.push(drawn(g)?);
        each(&g.seq.state, before);
    }
    Ok((tokens, t.elapsed().as_secs_f64()))
}

/// Milliseconds of a verify pass of `1 + k` rows (the median of [`VERIFY_ROUNDS`], each
/// rewound), for k = 0..=`most`, against k = 0 (one decode step), at the sequence's context;
/// then one copy of the recurrent states, the two ways of rolling a refused draft back:
/// tether snapshots before a pass and replays the kept rows after a refusal (a pass of
/// kept + 1 rows, the table's own rows), where keeping each row's states instead would copy
/// them once per row of every pass.
fn verify_cost(model: &Model, be: &dyn Backend, seq: &mut Sequence, most: usize) -> Result<()> {
    let most = most.min(MAX_DRAFT);
    let before = seq.state.checkpoint(be);
    println!(
        "| verify rows (at context {}) | ms | x one step |",
        seq.state.pos
    );
    println!("|---|---|---|");
    let passes: Vec<Vec<u32>> = (0..=most as u32)
        .map(|k| (0..=k).map(|i| (i * 31 + 7) % 200).collect())
        .collect();
    // Every size once a round, rounds after rounds: a machine whose speed drifts (a shared
    // VM) slows every size of a round alike, so each size is set against one step of its
    // own round and the medians over rounds are compared.
    let mut ms = vec![Vec::with_capacity(VERIFY_ROUNDS); passes.len()];
    let mut copies = Vec::with_capacity(VERIFY_ROUNDS);
    for _ in 0..VERIFY_ROUNDS {
        for (rows, times) in passes.iter().zip(&mut ms) {
            let t = Instant::now();
            seq.forward(model, be, rows, Logits::All, None)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            seq.rewind(be, &before)?;
        }
        let t = Instant::now();
        drop(seq.state.checkpoint(be));
        copies.push(t.elapsed().as_secs_f64() * 1e3);
    }
    for (k, times) in ms.iter().enumerate() {
        let ratios = times.iter().zip(&ms[0]).map(|(t, one)| t / one).collect();
        println!(
            "| 1 + {k} | {:.2} | {:.2} |",
            median(times.clone()),
            median(ratios)
        );
    }
    let ratios = copies.iter().zip(&ms[0]).map(|(t, one)| t / one).collect();
    println!(
        "| a copy of the recurrent states ({:.1} MB) | {:.2} | {:.2} |",
        seq.state.delta_bytes() as f64 / 1e6,
        median(copies),
        median(ratios)
    );
    Ok(())
}

/// `--parallel`: for each N, N sequences of different pseudo-random prompts prefilled in a
/// batch (untimed), then `--gen` steps in which all N decode, timed: aggregate tok/s.
fn parallel_decode(a: &Args, model: &Model, be: &dyn Backend) -> Result<()> {
    if a.gen == 0 || a.parallel.contains(&0) {
        bail!("--parallel needs --gen and sizes of at least 1");
    }
    if a.depth > 0 || a.draft.drafts().kind != engine_core::draft::DraftKind::None {
        bail!("--parallel runs plain decode from a prompt: not with --depth or --draft");
    }
    let c = &model.config;
    let types = a.engine.cache.types_or(KvType::F16);
    let page = a.engine.page_size.unwrap_or(plan::STORAGE_PAGE);
    let ubatch = a.ubatch.unwrap_or(plan::HOST_UBATCH);
    let plan = SplitPlan {
        ubatch,
        ..SplitPlan::default()
    };
    println!(
        "model {} ({} weights), {} threads, prompts of {} tokens, {} decode steps timed",
        a.engine.model,
        model.weight_dtype().map_or("none", |d| d.name()),
        rayon::current_num_threads(),
        a.prompt_tokens,
        a.gen
    );
    println!("| sequences | decode tok/s (all) | per sequence | ms a step | x one sequence |");
    println!("|---|---|---|---|---|");
    let mut one: Option<f64> = None;
    for &n in &a.parallel {
        let mut batch = Batch::new(model, be, plan.clone())?;
        for id in 0..n as u64 {
            let prompt = (0..a.prompt_tokens as u64)
                .map(|j| ((id * 7919 + j * 104_729 + 13) % c.vocab_size as u64) as u32)
                .collect();
            batch.join(Request {
                id,
                seq: crate::load::fresh_sequence(c, page, types, a.engine.freeze_pages, be)?,
                prompt,
                logits: None,
                breaks: Vec::new(),
                fork_at: Vec::new(),
                sampler: Sampler::new(SamplingParams::greedy())?,
                stop: Vec::new(),
                // No end: the first to prefill decode while the others prefill, and every one
                // must still decode in each of the timed steps.
                max_tokens: usize::MAX,
            })?;
        }
        // Until every sequence has drawn its first token, prefill chunks share the steps.
        let mut started = 0;
        while started < n {
            let events = batch.step()?;
            started += events
                .iter()
                .filter(|e| matches!(e, Event::Token { n: 1, .. }))
                .count();
        }
        let t = Instant::now();
        let mut tokens = 0;
        for _ in 0..a.gen {
            let events = batch.step()?;
            tokens += events
                .iter()
                .filter(|e| matches!(e, Event::Token { .. }))
                .count();
        }
        let s = t.elapsed().as_secs_f64();
        let tok_s = tokens as f64 / s;
        if n == 1 {
            one = Some(tok_s);
        }
        let against_one = one.map_or("-".to_string(), |o| format!("{:.2}", tok_s / o));
        println!(
            "| {n} | {tok_s:.2} | {:.2} | {:.1} | {against_one} |",
            tok_s / n as f64,
            s * 1e3 / a.gen as f64,
        );
    }
    Ok(())
}

/// Rounds of [`verify_cost`]: each times every size once.
const VERIFY_ROUNDS: usize = 9;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
