//! `tether run`: prompt in, streamed text out, speed on stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use engine_core::backend::KvType;
use engine_core::generate::{Generation, Sampler, SamplingParams};
use engine_core::tokenizer::{ChatMessage, StreamDecoder};

use crate::load::{DraftArgs, EngineArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    draft: DraftArgs,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Send the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Prompt tokens per forward pass on the host alone (default: the plan's, 512).
    #[arg(long)]
    ubatch: Option<usize>,
    /// A tokenizer.json to use instead of the model's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    a.engine.start(false)?;
    a.draft.drafts().validate()?;
    let l = a.engine.load(a.tokenizer.as_deref())?;
    // A vocabulary without chat markers (the presets' byte-level one) gets the prompt as is.
    let chat = !a.raw && l.tokenizer.token_id("<|im_start|>").is_some();
    let text = if !chat {
        a.prompt.clone()
    } else {
        let msg = ChatMessage {
            role: "user".into(),
            content: a.prompt.clone(),
        };
        l.tokenizer.apply_chat_template(&[msg], true)?
    };
    let prompt = l.tokenizer.encode(&text)?;
    let mut stop = l.model.config.eos_token_ids.clone();
    stop.extend(
        ["<|im_end|>", "<|endoftext|>"]
            .iter()
            .filter_map(|t| l.tokenizer.token_id(t)),
    );
    let mut sampler = Sampler::new(SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
    })?;
    let (be, what) = a.engine.backend_for(&l.model)?;
    let be = &*be;
    eprintln!("backend: {what}; weights: {}", crate::load::residence());
    let context = prompt.len() + a.max_tokens;
    let types = a.engine.cache.types_or(KvType::F16);
    let (plan, mut seq, link_stats) =
        a.engine
            .session(&l.model, be, (context, prompt.len()), a.ubatch, types)?;
    let mut generation = Generation::new(&l.model, be, &mut seq, &mut sampler, stop)
        .with_drafts(a.draft.drafts())?;
    generation.limit(a.max_tokens);
    let t0 = Instant::now();
    let split = generation.prefill(&prompt, &a.engine.helper.split_plan(&plan))?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut decoder = StreamDecoder::new(&l.tokenizer);
    let mut out = std::io::stdout().lock();
    let t1 = Instant::now();
    let mut n = 0;
    while n < a.max_tokens {
        let Some(tok) = generation.next_token()? else {
            break;
        };
        n += 1;
        write!(out, "{}", decoder.push(tok)?)?;
        out.flush()?;
    }
    writeln!(out, "{}", decoder.finish()?)?;
    let decode_s = t1.elapsed().as_secs_f64();
    eprintln!(
        "[{}] prompt {} tokens in {:.2}s ({:.1} tok/s); generated {} tokens in {:.2}s ({:.1} tok/s)",
        l.source,
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s,
        n,
        decode_s,
        n as f64 / decode_s.max(1e-9)
    );
    let d = generation.stats;
    if d.steps > 0 {
        eprintln!(
            "drafts: {} of {} drafted tokens kept over {} checking passes ({} fed again after a mismatch)",
            d.accepted, d.drafted, d.steps, d.replays
        );
    }
    if split.on_helper > 0 || split.fallback.is_some() {
        eprintln!(
            "split prefill: {} of {} ubatches ran their tail layers on the helper{}",
            split.on_helper,
            split.ubatches,
            split.fallback.map_or(String::new(), |f| format!(
                "; the helper failed ({f}) and the host redid them"
            ))
        );
    }
    if let Some(why) = &generation.seq.placement.helper_set_aside {
        eprintln!("a helper was set aside: {why}");
    }
    if let Some(why) = &generation.seq.placement.helper_lost {
        eprintln!(
            "a helper was lost ({why}); the pages it held were attended from the page file, so \
             the tokens are the host-alone ones"
        );
    }
    for helper in &link_stats {
        let s = helper.stats.snapshot();
        let pages = generation.seq.placement.pages_on(helper.id);
        eprintln!(
            "link to helper {} ({}, {pages} pages held now): sent {} bytes in {} messages, \
             received {} bytes in {} messages",
            helper.id,
            helper.source,
            s.sent_total.bytes,
            s.sent_total.messages,
            s.received_total.bytes,
            s.received_total.messages
        );
    }
    Ok(())
}
