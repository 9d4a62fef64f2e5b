//! Resolving `--model DIR|PRESET` into a model and its tokenizer, and the thread pool.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use engine_core::tensor::DType;
use engine_core::tokenizer::Tokenizer;
use engine_core::weights::TensorMap;
use engine_core::{synth, Model, ModelConfig};

/// Options of a synthetic model (used when `--model` names a preset).
#[derive(clap::Args, Clone, Debug)]
pub struct SynthOptions {
    /// Override the preset's layer count (the L L L F pattern is kept).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Storage dtype of synthetic weights: f32, bf16 or f16.
    #[arg(long = "dtype", default_value = "bf16")]
    pub weight_dtype: String,
    /// Seed of synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub weight_seed: u64,
}

impl SynthOptions {
    pub fn dtype(&self) -> Result<DType> {
        DType::parse(&self.weight_dtype)
            .with_context(|| format!("--dtype {}: expected f32, bf16 or f16", self.weight_dtype))
    }
}

pub fn synth_tensors(preset: &str, o: &SynthOptions) -> Result<(ModelConfig, TensorMap)> {
    let mut config = synth::preset(preset)?;
    if let Some(l) = o.layers {
        config = synth::with_layers(config, l)?;
    }
    let tensors = synth::random_weights(&config, o.dtype()?, o.weight_seed)?;
    Ok((config, tensors))
}

pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// Where the model came from, for messages.
    pub source: String,
}

/// `spec` is a checkpoint directory, or a preset name when no such directory exists.
/// `tokenizer` overrides the directory's tokenizer.json (or the presets' byte-level one).
pub fn load(spec: &str, o: &SynthOptions, tokenizer: Option<&Path>) -> Result<Loaded> {
    let dir = PathBuf::from(spec);
    let (model, dir_tok) = if dir.is_dir() {
        let model = Model::load_dir(&dir)
            .with_context(|| format!("loading model from {}", dir.display()))?;
        let tok = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::from_dir(&dir)?)
        } else {
            None
        };
        (model, tok)
    } else if synth::PRESETS.contains(&spec) {
        let (config, tensors) = synth_tensors(spec, o)?;
        (Model::from_tensors(config, &tensors)?, None)
    } else {
        bail!(
            "--model {spec}: not a directory, nor a preset ({})",
            synth::PRESETS.join(", ")
        );
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
