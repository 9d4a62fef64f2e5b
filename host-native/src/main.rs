//! `tether`: the host command line.

mod accept;
mod attach;
mod bench;
mod demo;
mod eval;
mod lend;
mod load;
mod quantize;
mod run;
mod serve;

use clap::{Parser, Subcommand};

/// See host-native/Cargo.toml: large activation buffers are reused instead of faulted in again.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tether",
    version,
    about = "Run a Qwen3.5 hybrid model exactly, on this machine and (soon) a tethered helper"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tether a helper on loopback, run a long prompt split with it, check against the host alone.
    Demo(demo::Args),
    /// Generate text from a prompt, streamed to stdout.
    Run(run::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and text completions,
    /// streamed or whole), to many clients through one queue.
    Serve(serve::Args),
    /// Write reference-format logits and greedy ids for a list of token ids.
    Eval(eval::Args),
    /// Print the token ids of a text as a JSON array.
    Tokenize(TokenizeArgs),
    /// Measure prefill and decode speed and peak memory.
    Bench(bench::Args),
    /// Write a synthetic model (seeded random weights) as a HF-style directory.
    Synth(SynthArgs),
    /// Choose the page size, host KV budget, split layer and ubatch for a context from this
    /// host's memory (or --host-memory) and the helpers' offers, and explain what each device
    /// holds, what runs where, and what it costs on the link.
    Plan(PlanArgs),
    /// Write a model (checkpoint directory, GGUF or preset) as a GGUF llama.cpp reads, in one
    /// of llama.cpp's file types (f16, q8_0, q4_0, q4_k_m, ...) with its per-tensor choices.
    Quantize(quantize::Args),
    /// Pair with a tether-helper by the code it shows; later commands need no --pair.
    Pair(PairArgs),
}

#[derive(clap::Args)]
struct PairArgs {
    /// The helper: ws://HOST:PORT.
    url: String,
    /// The pairing code it shows (123-456 or 123456).
    code: String,
}

#[derive(clap::Args)]
struct PlanArgs {
    #[arg(long)]
    model: String,
    /// Context length to plan for, in tokens.
    #[arg(long, default_value_t = 32768)]
    context: usize,
    /// Prompt length of the request to plan for.
    #[arg(long, default_value_t = 2048)]
    prompt_tokens: usize,
    /// KV cache page size in positions (default: the plan's).
    #[arg(long)]
    page_size: Option<usize>,
    /// Prompt tokens per forward pass on the host alone (default: the plan's).
    #[arg(long)]
    ubatch: Option<usize>,
    #[command(flatten)]
    cache: load::CacheArgs,
    #[command(flatten)]
    synth: load::LoadOptions,
    /// Where the host's layers run when the prefill helper's speed is measured against it.
    #[command(flatten)]
    backend: load::BackendOptions,
    #[command(flatten)]
    helper: attach::HelperArgs,
}

#[derive(clap::Args)]
struct TokenizeArgs {
    /// A tokenizer.json file.
    #[arg(long)]
    tokenizer: std::path::PathBuf,
    #[arg(long)]
    text: String,
}

#[derive(clap::Args)]
struct SynthArgs {
    /// One of: tiny, qwen35-0.8b.
    #[arg(long)]
    preset: String,
    #[arg(long)]
    out: std::path::PathBuf,
    #[command(flatten)]
    synth: load::LoadOptions,
    /// Copy this tokenizer.json into the directory (otherwise the model uses byte-level ids).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(a) => demo::run(a),
        Command::Run(a) => run::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Tokenize(a) => tokenize(a),
        Command::Bench(a) => bench::run(a),
        Command::Synth(a) => synth(a),
        Command::Plan(a) => plan(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Pair(a) => attach::pair(&a.url, &a.code),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    let tok = load::tokenizer_file(&a.tokenizer)?;
    println!("{}", serde_json::to_string(&tok.encode(&a.text)?)?);
    Ok(())
}

fn synth(a: SynthArgs) -> anyhow::Result<()> {
    let (config, tensors) = a.synth.tensors(&a.preset)?;
    engine_core::synth::write_hf_dir(&a.out, &config, &tensors, a.synth.dtype()?)?;
    if let Some(t) = a.tokenizer {
        let dst = a.out.join("tokenizer.json");
        std::fs::copy(&t, &dst)
            .map_err(|e| anyhow::anyhow!("copying {} to {}: {e}", t.display(), dst.display()))?;
    }
    eprintln!(
        "wrote {} ({} layers, {} weights)",
        a.out.display(),
        config.num_hidden_layers,
        a.synth.dtype()?.name()
    );
    Ok(())
}

/// `tether plan`: the session's plan gives the page size the helpers are configured with; the
/// one printed has their offers (the same choices, and the split their offers allow).
fn plan(a: PlanArgs) -> anyhow::Result<()> {
    let model = engine_core::source::load_model(&a.model, &a.synth)?;
    let h = &a.helper;
    let (be, _) = a.backend.make()?;
    model.check_backend(&*be)?;
    let fixed = attach::Fixed {
        page_size: a.page_size,
        ubatch: a.ubatch,
        kv_types: a.cache.types_or(engine_core::backend::KvType::F16),
        ..attach::Fixed::default()
    };
    let (context, prompt) = (a.context, a.prompt_tokens);
    let (_, seq, _) = h.session(&model, &*be, fixed, context, prompt)?;
    let offers = attach::HelperArgs::offers(&seq);
    print!(
        "{}",
        h.plan_for(&model, offers, fixed, context, prompt).text
    );
    Ok(())
}
