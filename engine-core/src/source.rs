//! Where a model comes from: `--model DIR|PRESET` as both binaries (`tether`, `tether-helper`)
//! accept it. With the `cli` feature the options derive `clap::Args`, so the two command lines
//! cannot drift apart.

use crate::error::{Error, Result};
use crate::identity::ModelIdentity;
#[cfg(not(target_arch = "wasm32"))]
use crate::model::Model;
use crate::synth;
use crate::tensor::DType;
use crate::weights::TensorMap;
use crate::ModelConfig;

/// Where the model's ops run.
#[derive(Clone, Debug)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct BackendOptions {
    /// cpu, gpu (wgpu: Metal, Vulkan or DX12; a software Vulkan adapter such as lavapipe
    /// counts, and is far slower than the CPU backend), or metal (the same kernels on Metal
    /// itself, without wgpu: macOS and iOS builds only).
    #[cfg_attr(feature = "cli", arg(long, default_value = "cpu"))]
    pub backend: String,
}

impl BackendOptions {
    /// The backend, and a line saying what it runs on.
    pub fn make(&self) -> Result<(Box<dyn crate::Backend>, String)> {
        crate::backend::select(&self.backend)
    }
}

/// How `--model` is loaded: a synthetic model's options (when it names a preset), and whether
/// a file's weights stay mapped.
#[derive(Clone, Debug)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct LoadOptions {
    /// Override the preset's layer count (the L L L F pattern is kept).
    #[cfg_attr(feature = "cli", arg(long))]
    pub layers: Option<usize>,
    /// Storage dtype of synthetic weights: f32, bf16 or f16.
    #[cfg_attr(feature = "cli", arg(long = "dtype", default_value = "bf16"))]
    pub weight_dtype: String,
    /// Seed of synthetic weights.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub weight_seed: u64,
    /// Keep a checkpoint's or GGUF's weights memory-mapped from the file instead of copying
    /// them into memory with huge pages (Linux; done only when they fit in the memory
    /// available): less resident memory, slower decode (see `resident`).
    #[cfg_attr(feature = "cli", arg(long))]
    pub mmap: bool,
    /// Give a preset a multi-token-prediction head, as Qwen3.5 checkpoints have one (one
    /// layer, `mtp.*`, seeded like the rest).
    #[cfg_attr(feature = "cli", arg(long))]
    pub mtp: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            layers: None,
            weight_dtype: "bf16".into(),
            weight_seed: 0,
            mmap: false,
            mtp: false,
        }
    }
}

impl LoadOptions {
    pub fn dtype(&self) -> Result<DType> {
        let dtype = DType::parse(&self.weight_dtype).filter(|d| !d.is_quantised());
        dtype.ok_or_else(|| {
            Error::Invalid(format!(
                "--dtype {}: expected f32, bf16 or f16",
                self.weight_dtype
            ))
        })
    }

    /// The preset's config, with the layer override and the MTP head if asked for.
    pub fn config(&self, preset: &str) -> Result<ModelConfig> {
        let mut config = synth::preset(preset)?;
        config.mtp_layers = usize::from(self.mtp);
        match self.layers {
            Some(l) => synth::with_layers(config, l),
            None => Ok(config),
        }
    }

    /// The preset's config (with the layer override) and its seeded weights.
    pub fn tensors(&self, preset: &str) -> Result<(ModelConfig, TensorMap)> {
        let config = self.config(preset)?;
        let tensors = synth::random_weights(&config, self.dtype()?, self.weight_seed)?;
        Ok((config, tensors))
    }

    /// Copies the mapped weights `wanted` names into huge pages ([`crate::resident`]) unless
    /// `--mmap` keeps them mapped.
    #[cfg(not(target_arch = "wasm32"))]
    fn settle(&self, tensors: &mut TensorMap, wanted: impl Fn(&str) -> bool) -> Result<()> {
        if !self.mmap {
            crate::resident::settle(tensors, wanted)?;
        }
        Ok(())
    }

    /// The preset's identity: its shape, dtype and seed.
    pub fn identity(&self, preset: &str, config: &ModelConfig) -> Result<ModelIdentity> {
        Ok(ModelIdentity::of_preset(
            preset,
            config,
            self.dtype()?,
            self.weight_seed,
        ))
    }
}

/// `spec` is a checkpoint directory, or a preset name when no such directory exists.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_model(spec: &str, o: &LoadOptions) -> Result<Model> {
    let source = Source::parse(spec)?;
    let (config, mut tensors) = source.tensors(spec, o)?;
    o.settle(&mut tensors, |_| true)?;
    let identity = source.identity(spec, o, &config)?;
    Model::with_identity(config, &tensors, identity)
}

/// `spec`'s config and every tensor (memory-mapped from a checkpoint or GGUF; a preset's
/// generated), for a tool that rewrites a model (`tether quantize`): refused wherever
/// [`load_model`] would refuse them, so that no such tool writes a model the engine cannot run.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_tensors(spec: &str, o: &LoadOptions) -> Result<(ModelConfig, TensorMap)> {
    Source::parse(spec)?.checked_tensors(spec, o)
}

/// `spec`'s config and whole-model identity, with no layers built: what a helper shows in the
/// handshake before a host assigns it layers. A file's tensors are checked against its config
/// as [`load_model`] checks them, so that a helper refuses at startup what its host would
/// refuse, not when a host assigns it a broken layer; they are mapped, not read (see
/// [`Model::check_tensors`]). A checkpoint's weight files are hashed once and cached
/// ([`ModelIdentity::of_checkpoint`]); a preset, whose tensors its config makes, generates
/// nothing.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_identity(spec: &str, o: &LoadOptions) -> Result<Model> {
    let source = Source::parse(spec)?;
    let config = match source {
        Source::Preset => o.config(spec)?,
        Source::Dir(_) | Source::Gguf(_) => source.checked_tensors(spec, o)?.0,
    };
    let identity = source.identity(spec, o, &config)?;
    Model::layers_only(config, &TensorMap::new(), 0..0, identity)
}

/// `spec`'s shapes alone, no weights read or made: a checkpoint directory's config or a
/// preset's (with the layer override), for planning a model as another file type would hold it
/// (`tether plan --weights-type`). A GGUF's weights already have their types: it is refused.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_config(spec: &str, o: &LoadOptions) -> Result<ModelConfig> {
    match Source::parse(spec)? {
        Source::Dir(dir) => Model::read_config(dir),
        Source::Preset => o.config(spec),
        Source::Gguf(_) => Err(Error::Invalid(format!(
            "{spec} is a GGUF: its weights already have their types (plan it as it is)"
        ))),
    }
}

/// Only `layers` of `spec` (no embedding, no head): a helper's assignment. `identity` is the
/// whole model's, from [`load_identity`]. Other layers' weights are never read (a checkpoint
/// is memory-mapped) or generated (a preset).
#[cfg(not(target_arch = "wasm32"))]
pub fn load_layers(
    spec: &str,
    o: &LoadOptions,
    layers: std::ops::Range<usize>,
    identity: &ModelIdentity,
) -> Result<Model> {
    let keep = |name: &str| crate::weights::layer_of(name).is_some_and(|l| layers.contains(&l));
    let (config, mut tensors) = match Source::parse(spec)? {
        Source::Preset => {
            let config = o.config(spec)?;
            let tensors = synth::random_weights_where(&config, o.dtype()?, o.weight_seed, &keep)?;
            (config, tensors)
        }
        file => file.tensors(spec, o)?,
    };
    o.settle(&mut tensors, keep)?;
    Model::layers_only(config, &tensors, layers, identity.clone())
}

#[cfg(not(target_arch = "wasm32"))]
enum Source<'a> {
    Dir(&'a std::path::Path),
    /// A GGUF file (llama.cpp's `qwen35`).
    Gguf(&'a std::path::Path),
    Preset,
}

#[cfg(not(target_arch = "wasm32"))]
impl<'a> Source<'a> {
    fn parse(spec: &'a str) -> Result<Self> {
        let dir = std::path::Path::new(spec);
        if dir.is_dir() {
            Ok(Source::Dir(dir))
        } else if dir.is_file() {
            Ok(Source::Gguf(dir))
        } else if synth::PRESETS.contains(&spec) {
            Ok(Source::Preset)
        } else {
            Err(Error::Invalid(format!(
                "--model {spec}: not a directory, nor a GGUF file, nor a preset ({})",
                synth::PRESETS.join(", ")
            )))
        }
    }

    /// The config and every tensor (mapped from a file; a preset's generated).
    fn tensors(&self, spec: &str, o: &LoadOptions) -> Result<(ModelConfig, TensorMap)> {
        match self {
            Source::Dir(dir) => Ok((Model::read_config(dir)?, crate::weights::load_dir(dir)?)),
            Source::Gguf(path) => crate::gguf::qwen35::load(path),
            Source::Preset => o.tensors(spec),
        }
    }

    /// [`Self::tensors`], refused wherever building the whole model from them would be
    /// ([`Model::check_tensors`]).
    fn checked_tensors(&self, spec: &str, o: &LoadOptions) -> Result<(ModelConfig, TensorMap)> {
        let (config, tensors) = self.tensors(spec, o)?;
        Model::check_tensors(&config, &tensors)?;
        Ok((config, tensors))
    }

    /// The whole model's identity: a checkpoint's hashed files (cached), a GGUF file's, or a
    /// preset's shape, dtype and seed.
    fn identity(&self, spec: &str, o: &LoadOptions, config: &ModelConfig) -> Result<ModelIdentity> {
        match self {
            Source::Dir(dir) => ModelIdentity::of_checkpoint(dir, config),
            Source::Gguf(path) => ModelIdentity::of_file(path, config),
            Source::Preset => o.identity(spec, config),
        }
    }
}
