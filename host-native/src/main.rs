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
use engine_core::gguf::quantize as gguf_types;
use engine_core::host::plan::WeightBytes;

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
    /// Plan for the model's shapes as this llama.cpp file type would hold its weights (q4_k_m,
    /// q8_0, ... as `tether quantize` names them), without reading or making the weights: a
    /// checkpoint directory's config or a preset (`qwen35-27b`).
    #[arg(long, value_name = "TYPE")]
    weights_type: Option<String>,
    /// Plan for a helper that offers this much memory for KV pages and state (e.g. 12G),
    /// without connecting to one. Repeat it for several.
    #[arg(long, value_name = "SIZE", value_parser = engine_core::host::plan::parse_size)]
    helper_memory: Vec<u64>,
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

/// `tether plan`: the plan for a loaded model and the helpers that attach, or, with
/// `--weights-type` / `--helper-memory`, for a shape and offers that need neither.
fn plan(a: PlanArgs) -> anyhow::Result<()> {
    let h = &a.helper;
    let fixed = attach::Fixed {
        page_size: a.page_size,
        ubatch: a.ubatch,
        kv_types: a.cache.types_or(engine_core::backend::KvType::F16),
        ..attach::Fixed::default()
    };
    let (context, prompt) = (a.context, a.prompt_tokens);
    if !a.helper_memory.is_empty() && h.has_helper() {
        anyhow::bail!("--helper-memory plans for helpers without connecting: not with --helper or --accept-helpers");
    }
    let plan = match &a.weights_type {
        Some(ty) => {
            if h.has_helper() {
                anyhow::bail!("--weights-type plans without loading the model: give the helpers as --helper-memory");
            }
            let file_type = quantize::file_type("--weights-type", ty)?;
            let config = engine_core::source::load_config(&a.model, &a.synth)?;
            let layout = gguf_types::layout(&config, file_type)?;
            let weights = WeightBytes::of_layout(config.num_hidden_layers, &layout)?;
            let offers = (a.helper_memory.clone(), None);
            h.plan_shape((&config, weights), offers, fixed, context, prompt)
        }
        None => {
            let model = engine_core::source::load_model(&a.model, &a.synth)?;
            let (be, _) = a.backend.make()?;
            model.check_backend(&*be)?;
            let offers = match a.helper_memory.is_empty() {
                true => {
                    attach::HelperArgs::offers(&h.session(&model, &*be, fixed, context, prompt)?.1)
                }
                false => (a.helper_memory.clone(), None),
            };
            h.plan_for(&model, offers, fixed, context, prompt)
        }
    };
    print!("{}", plan.text);
    Ok(())
}
