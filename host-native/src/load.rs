//! The options every command that runs the model shares, resolving `--model DIR|PRESET` into a
//! model and its tokenizer, and the thread pool.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use engine_core::backend::{CacheTypes, KvType};
use engine_core::draft::{DraftKind, Drafts};
use engine_core::host::plan::Plan;
use engine_core::host::Sequence;
use engine_core::source::load_model;
pub use engine_core::source::{BackendOptions, LoadOptions};
use engine_core::tokenizer::Tokenizer;
use engine_core::{Backend, Model};

use crate::attach::{Attached, Fixed, HelperArgs};

/// What `run`, `eval`, `bench` and `serve` all take: the model, how its cache is paged, where
/// its math runs, and its helper.
#[derive(clap::Args)]
pub struct EngineArgs {
    /// A Qwen3.5 checkpoint directory, or a preset (tiny, qwen35-0.8b).
    #[arg(long)]
    pub model: String,
    /// KV cache page size in positions (default: the plan's, 4096 unless this host's KV
    /// budget is small).
    #[arg(long)]
    pub page_size: Option<usize>,
    /// Threads for the model's math (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Pack each KV page held here into fp16 as it fills, for the frozen-page decode kernel
    /// (CPU backend; the GPU keeps its paged kernel; heads of whole 16-value chunks): decode
    /// attention at depth reads it at near memory speed. Opt-in: it keeps a second, fp16 copy
    /// of each full page (the plan does not count it yet), and its sums run in another order
    /// (docs/FROZEN_PAGES.md).
    #[arg(long)]
    pub freeze_pages: bool,
    #[command(flatten)]
    pub synth: LoadOptions,
    #[command(flatten)]
    pub backend: BackendOptions,
    #[command(flatten)]
    pub helper: HelperArgs,
}

impl EngineArgs {
    /// What comes before the model loads: the thread pool, and the helpers' listener, so a
    /// helper may join (and pair) while the weights are read. `own_port`: the command serves
    /// HTTP, where helpers may dial /helper (`--accept-helpers` with no address).
    pub fn start(&self, own_port: bool) -> Result<()> {
        init_threads(self.threads)?;
        self.helper.listen(own_port)
    }
}

impl EngineArgs {
    /// The session for a `context`-token context and a `prompt`-token prompt (`ubatch`: the
    /// command's --ubatch) on `be` with KV pages of `kv_types`: [`HelperArgs::session`] with
    /// this command's page size.
    pub fn session(
        &self,
        model: &Model,
        be: &dyn Backend,
        (context, prompt): (usize, usize),
        ubatch: Option<usize>,
        kv_types: CacheTypes,
    ) -> Result<(Plan, Sequence, Vec<Attached>)> {
        let fixed = Fixed {
            page_size: self.page_size,
            ubatch,
            kv_types,
            ..Fixed::default()
        };
        let (plan, mut seq, attached) = self.helper.session(model, be, fixed, context, prompt)?;
        if self.freeze_pages {
            seq.state.freeze_pages();
        }
        Ok((plan, seq, attached))
    }

    /// The `--backend`, and a line saying what it runs on, once it is known to compute with
    /// `model`'s weights.
    pub fn backend_for(&self, model: &Model) -> Result<(Box<dyn Backend>, String)> {
        let (be, what) = self.backend.make()?;
        model.check_backend(&*be)?;
        Ok((be, what))
    }

    /// `--model`, with `tokenizer` overriding its tokenizer; lent to browser tabs that join
    /// (their weights over HTTP) when helpers may dial in.
    pub fn load(&self, tokenizer: Option<&Path>) -> Result<Loaded> {
        let loaded = load(&self.model, &self.synth, tokenizer)?;
        self.helper.lend(&self.model, &self.synth, &loaded.model);
        Ok(loaded)
    }
}

/// How the KV cache stores keys and values, as llama.cpp's flags name them.
#[derive(clap::Args)]
pub struct CacheArgs {
    /// How the KV cache stores keys: f32 (exact), f16, q8_0 or q4_0 (llama.cpp's block
    /// layouts, on every backend); pages keep the type on helpers, over the link and in the
    /// page file. Default: f16 (`tether eval`: f32).
    #[arg(long, value_parser = KvType::parse)]
    pub cache_type_k: Option<KvType>,
    /// How the KV cache stores values (as --cache-type-k).
    #[arg(long, value_parser = KvType::parse)]
    pub cache_type_v: Option<KvType>,
}

impl CacheArgs {
    /// The types asked for, `default` for a side not named.
    pub fn types_or(&self, default: KvType) -> CacheTypes {
        CacheTypes {
            k: self.cache_type_k.unwrap_or(default),
            v: self.cache_type_v.unwrap_or(default),
        }
    }
}

/// Speculative decoding, as llama.cpp's flags name it.
#[derive(clap::Args, Clone)]
pub struct DraftArgs {
    /// Draft tokens and check them in one forward pass of several rows, keeping those that
    /// match what the model draws: `ngram` proposes what followed an earlier occurrence of the
    /// context's last tokens (text that repeats its input); `mtp` chains the checkpoint's
    /// multi-token-prediction head (`run` and `bench`; not `serve` yet). Every token, and
    /// greedy's logits bit for bit, are those of plain decoding.
    #[arg(long, value_enum, default_value = "none")]
    pub draft: DraftKind,
    /// The most tokens drafted a step (at most 14).
    #[arg(long, default_value_t = 8)]
    pub draft_max: usize,
    /// Fewer found than this are not drafted.
    #[arg(long, default_value_t = 1)]
    pub draft_min: usize,
}

impl DraftArgs {
    pub fn drafts(&self) -> Drafts {
        Drafts {
            kind: self.draft,
            max: self.draft_max,
            min: self.draft_min,
        }
    }
}

pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// Where the model came from, for messages.
    pub source: String,
}

/// `spec` is a checkpoint directory, a GGUF file, or a preset name when no such directory
/// exists. `tokenizer` overrides the directory's tokenizer.json or the GGUF's own (or the
/// presets' byte-level one).
pub fn load(spec: &str, o: &LoadOptions, tokenizer: Option<&Path>) -> Result<Loaded> {
    let dir = PathBuf::from(spec);
    let model = load_model(spec, o).with_context(|| format!("loading model {spec}"))?;
    let dir_tok = if dir.join("tokenizer.json").exists() {
        Some(Tokenizer::from_dir(&dir)?)
    } else if dir.is_file() && tokenizer.is_none() {
        // A GGUF's own tokenizer and chat template.
        engine_core::gguf::vocab::read(&dir)?
    } else {
        None
    };
    let tokenizer = match (tokenizer, dir_tok) {
        (Some(path), _) => tokenizer_file(path)?,
        (None, Some(t)) => t,
        (None, None) => Tokenizer::byte_level(model.config.vocab_size),
    };
    Ok(Loaded {
        model,
        tokenizer,
        source: spec.to_string(),
    })
}

/// A fresh sequence on `be` alone: KV pages of `page_size` positions stored as `types`,
/// frozen as they fill where `freeze` (`--freeze-pages`).
pub fn fresh_sequence(
    c: &engine_core::ModelConfig,
    page_size: usize,
    types: CacheTypes,
    freeze: bool,
    be: &dyn Backend,
) -> engine_core::Result<Sequence> {
    let mut seq = Sequence::typed(c, page_size, types, be)?;
    if freeze {
        seq.state.freeze_pages();
    }
    Ok(seq)
}

/// Where this process reads its weights from, for messages: a copy in huge pages, which
/// decodes faster, or the file's mapping (with `--mmap`, or when the copy would not fit in
/// 7/8 of the memory available), so that a user sees why decode is slower than expected.
pub fn residence() -> String {
    match engine_core::resident::copied() {
        0 => "mapped from the file".to_string(),
        b => format!("{:.0} MB in huge pages", b as f64 / 1e6),
    }
}

/// Size rayon's global pool; every parallel op of the CPU backend runs in it.
pub fn init_threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("building the thread pool")?;
    }
    Ok(())
}

/// A lone `tokenizer.json` (no chat template beside it: prompts fall back to ChatML).
pub fn tokenizer_file(path: &Path) -> Result<Tokenizer> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Tokenizer::from_bytes(&bytes, None).with_context(|| format!("loading {}", path.display()))
}
