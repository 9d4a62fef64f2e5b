//! `tether demo`: the whole idea in one command. A helper starts on loopback (in this process,
//! over a real WebSocket, paired with a fresh code and encrypted as any helper), a prompt long
//! enough for a split prefill and KV-page offload runs
//! with a small host budget, the output streams, and the same request then runs on the host
//! alone to check that the split changed nothing.

use std::io::Write;
use std::time::Instant;

use anyhow::{ensure, Result};
use engine_core::cache_types::CacheTypes;
use engine_core::generate::argmax;
use std::sync::Mutex;

use engine_core::helper::{Helper, HelperOptions};
use engine_core::host::plan::{Plan, PlanInput};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::split::{prefill, SplitPlan};
use engine_core::host::Sequence;
use engine_core::link::keys::{Keypair, PairingCode, PublicKey};
use engine_core::link::secure::{self, wire_limit, Dial, Gate, Pairing};
use engine_core::link::{ws, ShapedLink};
use engine_core::source::{load_model, LoadOptions};
use engine_core::tokenizer::{StreamDecoder, Tokenizer};
use engine_core::{CpuBackend, Logits, Model};

use crate::load;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or preset.
    #[arg(long, default_value = "qwen35-0.8b")]
    model: String,
    /// Prompt length in tokens (long enough to split).
    #[arg(long, default_value_t = 1200)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    gen: usize,
    /// KV positions per layer the host keeps; older pages go to the helper.
    #[arg(long, default_value_t = 512)]
    host_kv_tokens: usize,
    #[arg(long, default_value_t = 256)]
    page_size: usize,
    /// Shape the loopback link like a real one: usb-c-10g, usb2, wifi, unlimited.
    #[arg(long, default_value = "usb-c-10g")]
    link: String,
    #[arg(long)]
    threads: Option<usize>,
    #[command(flatten)]
    synth: LoadOptions,
}

/// The memory the demo's helper offers.
const HELPER_OFFER: u64 = 8 << 30;

struct Run {
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    prefill_s: f64,
    decode_s: f64,
}

/// Greedy generation after a prefill through `split::prefill`, streaming text if `show`.
fn generate(
    m: &Model,
    seq: &mut Sequence,
    prompt: &[u32],
    gen: usize,
    plan: &SplitPlan,
    tok: Option<&Tokenizer>,
) -> Result<(Run, engine_core::host::split::SplitReport)> {
    let be = CpuBackend;
    let t0 = Instant::now();
    let (mut logits, report) = prefill(m, &be, seq, prompt, plan)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut decoder = tok.map(StreamDecoder::new);
    let mut out = std::io::stdout().lock();
    let t1 = Instant::now();
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for _ in 0..gen {
        let next = argmax(&logits);
        ids.push(next);
        all.push(logits);
        if let Some(d) = decoder.as_mut() {
            write!(out, "{}", d.push(next)?)?;
            out.flush()?;
        }
        logits = seq.forward(m, &be, &[next], Logits::Last, None)?;
    }
    if let Some(d) = decoder.as_mut() {
        writeln!(out, "{}", d.finish()?)?;
    }
    all.push(logits);
    let run = Run {
        ids,
        logits: all,
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
    };
    Ok((run, report))
}

pub fn run(a: Args) -> Result<()> {
    load::init_threads(a.threads)?;
    eprintln!("[demo] loading {} ...", a.model);
    let model = load_model(&a.model, &a.synth)?;
    let c = &model.config;
    let n = c.num_hidden_layers;
    let plan = SplitPlan::default();
    // The plan decides the helper's layers for its offer (the page size and host budget are
    // the demo's flags).
    let decided = Plan::new(
        c,
        &PlanInput {
            context: a.prompt_tokens + a.gen,
            prompt: a.prompt_tokens,
            weights: Default::default(),
            host_memory: None,
            helpers: vec![HELPER_OFFER],
            page_size: Some(a.page_size),
            host_kv_tokens: Some(a.host_kv_tokens),
            split_layer: None,
            ubatch: Some(plan.ubatch),
            split_min: plan.min_tokens,
            interleave_from: plan.interleave_from,
            link: None,
            speeds: None,
            kv_types: CacheTypes::F32,
            checkpoints: None,
        },
    );
    let split = decided.split_layer;
    ensure!(
        split < n,
        "the model has too few layers ({n}) to split on a 4-layer cycle"
    );
    let profile = crate::attach::link_profile(&a.link)?;
    let tokenizer = Tokenizer::byte_level(c.vocab_size);
    // A long prompt from text: the byte-level tokenizer turns each byte into a token.
    let text = "tether lends a small computer a second device's memory and compute. "
        .repeat(a.prompt_tokens / 60 + 1);
    let prompt: Vec<u32> = tokenizer
        .encode(&text)?
        .into_iter()
        .take(a.prompt_tokens)
        .collect();

    let listener = ws::WsListener::bind("127.0.0.1:0", wire_limit(DEFAULT_MAX_FRAME))?;
    let url = format!("ws://{}", listener.local_addr());
    let backend = CpuBackend;
    let helper = Helper::new(
        &model,
        &backend,
        HelperOptions {
            mem_budget: HELPER_OFFER,
            max_frame: DEFAULT_MAX_FRAME,
        },
    );
    // Keys of this run only: the demo leaves nothing in the key stores.
    let (host_keys, helper_keys) = (Keypair::generate(), Keypair::generate());
    let code = Mutex::new(PairingCode::new());
    let shown = code.lock().expect("a fresh lock").shown();
    let (split_run, report, stats, remote_rows) = std::thread::scope(|scope| -> Result<_> {
        scope.spawn(|| {
            let nobody = |_: &PublicKey| false;
            let gate = Gate {
                insecure: false,
                known: &nobody,
                pairing: Pairing::Open(&code),
            };
            let paired = listener
                .accept()
                .and_then(|ws| secure::accept(ws, &helper_keys, &gate));
            if let Ok((mut link, _)) = paired {
                helper.serve(&mut link);
            }
        });
        let ws = ws::connect(&url, wire_limit(DEFAULT_MAX_FRAME))?;
        let (link, _) = secure::connect(ws, &host_keys, Dial::Pair(&shown))?;
        eprintln!("[demo] paired with the helper (code {shown}); the link is encrypted (Noise)");
        let link = ShapedLink::new(link, profile.clone());
        let stats = link.stats_handle();
        let cfg = decided.configure_helper(c, true);
        let mut seq = Sequence::new(&model.config, a.page_size);
        seq.placement.attach(HelperClient::connect(
            Box::new(link),
            &model,
            cfg,
            DEFAULT_MAX_FRAME,
        )?);
        seq.placement.host_kv_tokens = Some(a.host_kv_tokens);
        eprintln!(
            "[demo] helper on {url} ({} link); host layers 0..{split}, helper layers {split}..{n}; host keeps {} KV positions per layer",
            profile.name, a.host_kv_tokens
        );
        eprintln!("[demo] prompt: {} tokens; output:", prompt.len());
        let (run, report) = generate(&model, &mut seq, &prompt, a.gen, &plan, Some(&tokenizer))?;
        let remote_rows = (seq.state.remote_kv_len(), seq.state.pos);
        Ok((run, report, stats.snapshot(), remote_rows))
        // Dropping the sequence closes the link; the helper's session ends and its thread joins.
    })?;

    eprintln!("[demo] the same request on the host alone, for the check ...");
    let (host_run, _) = generate(
        &model,
        &mut Sequence::new(&model.config, a.page_size),
        &prompt,
        a.gen,
        &plan,
        None,
    )?;

    println!();
    println!("what ran where");
    println!(
        "  prefill: {} ubatches of {}; {} had layers {split}..{n} run on the helper, the last ran on the host",
        report.ubatches, plan.ubatch, report.on_helper
    );
    if let Some(f) = &report.fallback {
        println!("  the helper failed during prefill ({f}); the host redid its share");
    }
    println!(
        "  KV: positions 0..{} of every full-attention layer live on the helper, {}..{} on the host",
        remote_rows.0, remote_rows.0, remote_rows.1
    );
    println!("link bytes by type (host -> helper | helper -> host)");
    for (name, t) in &stats.sent {
        println!(
            "  {name:>14} -> {:>12} bytes in {:>5} messages",
            t.bytes, t.messages
        );
    }
    for (name, t) in &stats.received {
        println!(
            "  {name:>14} <- {:>12} bytes in {:>5} messages",
            t.bytes, t.messages
        );
    }
    println!("speed (split | host alone)");
    let tps = |n: usize, s: f64| n as f64 / s.max(1e-9);
    println!(
        "  prefill {:.1} | {:.1} tok/s; decode {:.2} | {:.2} tok/s",
        tps(prompt.len(), split_run.prefill_s),
        tps(prompt.len(), host_run.prefill_s),
        tps(a.gen, split_run.decode_s),
        tps(a.gen, host_run.decode_s)
    );
    let same_ids = split_run.ids == host_run.ids;
    let same_logits = split_run.logits == host_run.logits;
    println!(
        "check: tokens {} ({} generated), logits {}",
        if same_ids { "identical" } else { "DIFFERENT" },
        a.gen,
        if same_logits {
            "bit-identical"
        } else {
            "DIFFERENT"
        }
    );
    ensure!(same_ids && same_logits, "the split changed the result");
    Ok(())
}
