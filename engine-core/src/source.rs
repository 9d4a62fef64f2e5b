//! Where a model comes from: `--model DIR|PRESET` as both binaries (`tether`, `tether-helper`)
//! accept it. With the `cli` feature the options derive `clap::Args`, so the two command lines
//! cannot drift apart.

use crate::error::{Error, Result};
#[cfg(not(target_arch = "wasm32"))]
use crate::model::Model;
use crate::synth;
use crate::tensor::DType;
use crate::weights::TensorMap;
use crate::ModelConfig;

/// Options of a synthetic model (used when `--model` names a preset).
#[derive(Clone, Debug)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct SynthOptions {
    /// Override the preset's layer count (the L L L F pattern is kept).
    #[cfg_attr(feature = "cli", arg(long))]
    pub layers: Option<usize>,
    /// Storage dtype of synthetic weights: f32, bf16 or f16.
    #[cfg_attr(feature = "cli", arg(long = "dtype", default_value = "bf16"))]
    pub weight_dtype: String,
    /// Seed of synthetic weights.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub weight_seed: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            layers: None,
            weight_dtype: "bf16".into(),
            weight_seed: 0,
        }
    }
}

impl SynthOptions {
    pub fn dtype(&self) -> Result<DType> {
        DType::parse(&self.weight_dtype).ok_or_else(|| {
            Error::Invalid(format!(
                "--dtype {}: expected f32, bf16 or f16",
                self.weight_dtype
            ))
        })
    }

    /// The preset's config (with the layer override) and its seeded weights.
    pub fn tensors(&self, preset: &str) -> Result<(ModelConfig, TensorMap)> {
        let mut config = synth::preset(preset)?;
        if let Some(l) = self.layers {
            config = synth::with_layers(config, l)?;
        }
        let tensors = synth::random_weights(&config, self.dtype()?, self.weight_seed)?;
        Ok((config, tensors))
    }
}

/// `spec` is a checkpoint directory, or a preset name when no such directory exists.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_model(spec: &str, o: &SynthOptions) -> Result<Model> {
    let dir = std::path::Path::new(spec);
    if dir.is_dir() {
        Model::load_dir(dir)
    } else if synth::PRESETS.contains(&spec) {
        let (config, tensors) = o.tensors(spec)?;
        Model::from_tensors(config, &tensors)
    } else {
        Err(Error::Invalid(format!(
            "--model {spec}: not a directory, nor a preset ({})",
            synth::PRESETS.join(", ")
        )))
    }
}
