//! Synthetic Qwen3.5 models: any config with seeded random weights, built in memory. Weights
//! follow ../shared/oracle/make_fixture.py's scales (unit-variance embeddings, 1/sqrt(fan_in)
//! Linear weights, decay parameters in the ranges real checkpoints use) so activations stay
//! healthy through every layer and benchmarks exercise realistic numbers.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;

use crate::config::{LayerKind, ModelConfig, WeightLayout, MAX_LAYERS};
use crate::error::{Error, Result};
use crate::tensor::{DType, Data, Elems, Tensor};
use crate::weights::TensorMap;

/// Named shapes: `tiny` (the fixtures' shape), `qwen35-0.8b` (the real 0.8B shape) and
/// `qwen35-27b` (the target's shape, ../shared/MODEL.md: for `tether plan --weights-type`; its
/// synthetic weights, 54 GB at bf16, are made only where they fit: [`check_room`]).
pub const PRESETS: &[&str] = &["tiny", "tiny256", "qwen35-0.8b", "qwen35-27b"];

pub fn preset(name: &str) -> Result<ModelConfig> {
    let base = |vocab, hidden, inter, layers, heads, kv, hd, lk, lv, ld, tie| ModelConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim: hd,
        linear_num_key_heads: lk,
        linear_num_value_heads: lv,
        linear_key_head_dim: ld,
        linear_value_head_dim: ld,
        linear_conv_kernel_dim: 4,
        rms_norm_eps: 1e-6,
        rope_theta: 1e7,
        partial_rotary_factor: 0.25,
        max_position_embeddings: 262_144,
        tie_word_embeddings: tie,
        layer_types: ModelConfig::interval_layer_types(layers, 4),
        eos_token_ids: Vec::new(),
        layout: WeightLayout::HuggingFace,
        mtp_layers: 0,
    };
    match name {
        "tiny" => Ok(ModelConfig {
            max_position_embeddings: 4096,
            ..base(256, 64, 128, 8, 4, 2, 16, 2, 4, 16, false)
        }),
        // Every matrix's rows a whole number of 256-weight super-blocks, so that llama.cpp's
        // quantiser gives it k-quants (on "tiny" it falls back to the 32-weight types); fewer
        // key heads than value heads, as the real model has, and a separate output matrix.
        "tiny256" => Ok(ModelConfig {
            max_position_embeddings: 4096,
            ..base(1024, 256, 512, 4, 4, 2, 64, 2, 4, 64, false)
        }),
        "qwen35-0.8b" => Ok(ModelConfig {
            eos_token_ids: vec![248_046],
            ..base(248_320, 1024, 3584, 24, 8, 2, 256, 16, 16, 128, true)
        }),
        "qwen35-27b" => Ok(ModelConfig {
            eos_token_ids: vec![248_046],
            ..base(248_320, 5120, 17408, 64, 24, 4, 256, 16, 48, 128, false)
        }),
        other => Err(Error::Invalid(format!(
            "unknown preset `{other}` (known: {})",
            PRESETS.join(", ")
        ))),
    }
}

/// Change the layer count, keeping the L L L F pattern.
pub fn with_layers(mut c: ModelConfig, layers: usize) -> Result<ModelConfig> {
    if layers == 0 {
        return Err(Error::Invalid("a model needs at least one layer".into()));
    }
    // Before the layer list of this length is built.
    if layers > MAX_LAYERS {
        return Err(Error::Invalid(format!(
            "--layers {layers}: at most {MAX_LAYERS}"
        )));
    }
    c.num_hidden_layers = layers;
    c.layer_types = ModelConfig::interval_layer_types(layers, 4);
    Ok(c)
}

enum Init {
    Normal { mean: f32, std: f32 },
    Uniform { lo: f32, hi: f32 },
}

/// Values per RNG stream: each chunk has its own seed, so the weights do not depend on the
/// number of threads.
const CHUNK: usize = 1 << 20;

/// `n` seeded values stored as `dtype`. The generator is named, not `SmallRng`: that one is
/// another algorithm on 32-bit targets (wasm32), where a browser tab that helps generates the
/// same preset as its host and must get the same weights (Xoshiro256++ is what `SmallRng` is
/// on 64-bit targets, so native weights did not change). Generated a chunk at a time so no f32
/// copy of a large tensor is ever held (the 0.8B embedding alone would be 1 GB in f32).
fn fill(name: &str, n: usize, init: &Init, seed: u64, dtype: DType) -> Data {
    // FNV-1a of the name separates the tensors' streams.
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let chunk_values = |i: usize, chunk: &mut [f32]| {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(
            seed ^ name_hash ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        match *init {
            Init::Uniform { lo, hi } => chunk
                .iter_mut()
                .for_each(|v| *v = lo + (hi - lo) * rng.random::<f32>()),
            Init::Normal { mean, std } => {
                // Box-Muller: two normals per two uniforms.
                for pair in chunk.chunks_mut(2) {
                    let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
                    let u2: f32 = rng.random();
                    let r = (-2.0 * u1.ln()).sqrt();
                    let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
                    pair[0] = mean + std * r * c;
                    if let Some(v) = pair.get_mut(1) {
                        *v = mean + std * r * s;
                    }
                }
            }
        }
    };
    fn build<T: bytemuck::Pod + Send>(
        n: usize,
        conv: impl Fn(f32) -> T + Sync,
        gen: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Vec<T> {
        let mut out = vec![T::zeroed(); n];
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, dst)| {
            let mut buf = vec![0.0f32; dst.len()];
            gen(i, &mut buf);
            dst.iter_mut().zip(&buf).for_each(|(d, &v)| *d = conv(v));
        });
        out
    }
    match dtype {
        DType::F32 => Data::F32(Elems::Owned(build(n, |v| v, chunk_values).into())),
        DType::BF16 => Data::BF16(Elems::Owned(
            build(n, half::bf16::from_f32, chunk_values).into(),
        )),
        DType::F16 => Data::F16(Elems::Owned(
            build(n, half::f16::from_f32, chunk_values).into(),
        )),
        _ => {
            unreachable!("random_weights_where refuses quantised dtypes")
        }
    }
}

/// Where the memory available is not known (no `/proc/meminfo`: macOS; a browser tab, whose
/// wasm32 memory ends at 4 GiB), synthetic weights up to this many bytes are made.
const UNKNOWN_ROOM: u64 = if cfg!(target_arch = "wasm32") {
    2 << 30
} else {
    16 << 30
};

/// The memory available, if known, and the bytes synthetic weights may take of it.
fn weight_room() -> (Option<u64>, u64) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let available = crate::resident::available_memory();
        (
            available,
            available.map_or(UNKNOWN_ROOM, crate::resident::room),
        )
    }
    #[cfg(target_arch = "wasm32")]
    (None, UNKNOWN_ROOM)
}

/// Refuses synthetic weights of `bytes` that would not fit, before any is made: a preset as
/// large as the 27B (54 GB at bf16) is a shape to plan for, and generating it would swap, or
/// abort a tab. They must fit in seven eighths of the memory available (as weights copied into
/// huge pages must, `resident::fits`), or in [`UNKNOWN_ROOM`] where that is not known.
fn check_room(bytes: u64, dtype: DType) -> Result<()> {
    let (available, room) = weight_room();
    if bytes <= room {
        return Ok(());
    }
    let of = match available {
        Some(a) => format!("seven eighths of the {:.1} GB available", a as f64 / 1e9),
        None => format!(
            "the {:.1} GB made where the memory available is unknown",
            room as f64 / 1e9
        ),
    };
    Err(Error::Invalid(format!(
        "these synthetic weights take {:.1} GB at {}, more than {of}: plan for the shape with \
         `tether plan --weights-type TYPE`, or give fewer --layers",
        bytes as f64 / 1e9,
        dtype.name()
    )))
}

/// Every tensor of a Qwen3.5 text model with `config`'s shapes, seeded and stored as `dtype`.
pub fn random_weights(c: &ModelConfig, dtype: DType, seed: u64) -> Result<TensorMap> {
    random_weights_where(c, dtype, seed, &|_| true)
}

/// The tensors `keep` selects. Each tensor has its own seeded stream, so any subset comes out
/// the same as in the whole model: a helper generates only its layers' weights.
pub fn random_weights_where(
    c: &ModelConfig,
    dtype: DType,
    seed: u64,
    keep: &dyn Fn(&str) -> bool,
) -> Result<TensorMap> {
    if dtype.is_quantised() {
        return Err(Error::Invalid(format!(
            "synthetic weights are f32, bf16 or f16, not {}",
            dtype.name()
        )));
    }
    let specs = tensor_specs(c)?;
    let bytes = specs
        .iter()
        .filter(|(name, _, _)| keep(name))
        .map(|(_, s, _)| dtype.bytes_for(s.iter().product()).unwrap_or(usize::MAX) as u64)
        .fold(0u64, u64::saturating_add);
    check_room(bytes, dtype)?;
    let mut out = TensorMap::new();
    for (name, shape, init) in specs {
        if keep(&name) {
            let data = fill(&name, shape.iter().product(), &init, seed, dtype);
            out.insert(name, Tensor { shape, data });
        }
    }
    Ok(out)
}

/// Name (Hugging Face's) and shape of every tensor of a model with `c`'s shapes.
pub fn tensor_shapes(c: &ModelConfig) -> Result<Vec<(String, Vec<usize>)>> {
    Ok(tensor_specs(c)?
        .into_iter()
        .map(|(name, shape, _)| (name, shape))
        .collect())
}

/// A tensor's name, shape and initialisation.
type Spec = (String, Vec<usize>, Init);

/// A projection from `inp` to `out`, scaled so that its outputs keep the inputs' magnitude.
fn linear(name: String, out: usize, inp: usize) -> Spec {
    let std = 1.0 / (inp as f32).sqrt();
    (name, vec![out, inp], Init::Normal { mean: 0.0, std })
}

/// An RMSNorm's offset `w` (the scale is `1 + w`).
fn offset_norm(name: String, d: usize) -> Spec {
    (
        name,
        vec![d],
        Init::Normal {
            mean: 0.0,
            std: 0.1,
        },
    )
}

/// Name, shape and initialisation of every tensor of a model with `c`'s shapes.
fn tensor_specs(c: &ModelConfig) -> Result<Vec<Spec>> {
    c.validate()?;
    let (h, v) = (c.hidden_size, c.vocab_size);
    let mut specs: Vec<Spec> = Vec::new();
    specs.push((
        "model.embed_tokens.weight".into(),
        vec![v, h],
        Init::Normal {
            mean: 0.0,
            std: 1.0,
        },
    ));
    if !c.tie_word_embeddings {
        specs.push((
            "lm_head.weight".into(),
            vec![v, h],
            Init::Normal {
                mean: 0.0,
                std: 2.0 / (h as f32).sqrt(),
            },
        ));
    }
    specs.push(offset_norm("model.norm.weight".into(), h));
    for (l, kind) in c.layer_types.iter().enumerate() {
        layer_specs(c, &format!("model.layers.{l}."), *kind, &mut specs);
    }
    if c.mtp_layers > 0 {
        // The multi-token-prediction head: its input norms, the projection of [embedding;
        // hidden], one full-attention layer and its output norm.
        specs.push(offset_norm("mtp.pre_fc_norm_embedding.weight".into(), h));
        specs.push(offset_norm("mtp.pre_fc_norm_hidden.weight".into(), h));
        specs.push(linear("mtp.fc.weight".into(), h, 2 * h));
        layer_specs(c, "mtp.layers.0.", LayerKind::FullAttention, &mut specs);
        specs.push(offset_norm("mtp.norm.weight".into(), h));
    }
    Ok(specs)
}

/// The tensors of one layer of `kind` whose names start with `p`.
fn layer_specs(c: &ModelConfig, p: &str, kind: LayerKind, specs: &mut Vec<Spec>) {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    specs.push(offset_norm(format!("{p}input_layernorm.weight"), h));
    specs.push(offset_norm(
        format!("{p}post_attention_layernorm.weight"),
        h,
    ));
    specs.push(linear(format!("{p}mlp.gate_proj.weight"), i, h));
    specs.push(linear(format!("{p}mlp.up_proj.weight"), i, h));
    specs.push(linear(format!("{p}mlp.down_proj.weight"), h, i));
    match kind {
        LayerKind::FullAttention => {
            let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let a = format!("{p}self_attn.");
            specs.push(linear(format!("{a}q_proj.weight"), nh * hd * 2, h));
            specs.push(linear(format!("{a}k_proj.weight"), nkv * hd, h));
            specs.push(linear(format!("{a}v_proj.weight"), nkv * hd, h));
            specs.push(linear(format!("{a}o_proj.weight"), h, nh * hd));
            specs.push(offset_norm(format!("{a}q_norm.weight"), hd));
            specs.push(offset_norm(format!("{a}k_norm.weight"), hd));
        }
        LayerKind::LinearAttention => {
            let a = format!("{p}linear_attn.");
            let (hv, k, vd) = (
                c.linear_num_value_heads,
                c.linear_conv_kernel_dim,
                c.linear_value_dim(),
            );
            specs.push(linear(format!("{a}in_proj_qkv.weight"), c.conv_dim(), h));
            specs.push(linear(format!("{a}in_proj_z.weight"), vd, h));
            specs.push(linear(format!("{a}in_proj_b.weight"), hv, h));
            specs.push(linear(format!("{a}in_proj_a.weight"), hv, h));
            specs.push(linear(format!("{a}out_proj.weight"), h, vd));
            specs.push((
                format!("{a}conv1d.weight"),
                vec![c.conv_dim(), 1, k],
                Init::Normal {
                    mean: 0.0,
                    std: 1.0 / (k as f32).sqrt(),
                },
            ));
            specs.push((
                format!("{a}A_log"),
                vec![hv],
                Init::Uniform {
                    lo: 0.02f32.ln(),
                    hi: 2.0f32.ln(),
                },
            ));
            specs.push((
                format!("{a}dt_bias"),
                vec![hv],
                Init::Uniform { lo: -1.0, hi: 1.0 },
            ));
            // The gated norm's weight is used as is (not 1 + w): centre it on 1.
            specs.push((
                format!("{a}norm.weight"),
                vec![c.linear_value_head_dim],
                Init::Normal {
                    mean: 1.0,
                    std: 0.1,
                },
            ));
        }
    }
}

/// Write `config.json` and `model.safetensors` so HF transformers and other engines can load
/// the model.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_hf_dir(
    dir: &std::path::Path,
    c: &ModelConfig,
    tensors: &TensorMap,
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut cfg = c.to_hf_json();
    cfg["dtype"] = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => {
            return Err(Error::Invalid(format!(
                "a safetensors checkpoint cannot hold {} weights (write a GGUF)",
                dtype.name()
            )))
        }
    }
    .into();
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&cfg).expect("a JSON value serialises");
    std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
    crate::weights::save_safetensors(tensors, &dir.join("model.safetensors"))
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use rand_xoshiro::Xoshiro256PlusPlus;

    /// The named generator is `SmallRng` as it was on 64-bit targets: presets' weights (and
    /// whatever was measured or compared with them) are unchanged there.
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn the_weights_generator_is_small_rng_of_64_bit_targets() {
        for seed in [0u64, 1, 0x9e37_79b9_7f4a_7c15, u64::MAX] {
            let mut named = Xoshiro256PlusPlus::seed_from_u64(seed);
            let mut small = SmallRng::seed_from_u64(seed);
            for _ in 0..1000 {
                assert_eq!(named.random::<f32>(), small.random::<f32>());
                assert_eq!(named.random::<u64>(), small.random::<u64>());
            }
        }
    }

    /// The 27B's synthetic weights are refused before anything is made where they do not fit
    /// (54 GB at bf16, more than the machines CI runs on); a few of its tensors are made.
    #[test]
    fn weights_that_do_not_fit_are_refused_before_any_is_made() {
        use super::*;
        let c = preset("qwen35-27b").unwrap();
        let (_, room) = weight_room();
        let bytes: u64 = tensor_shapes(&c)
            .unwrap()
            .iter()
            .map(|(_, s)| 2 * s.iter().product::<usize>() as u64)
            .sum();
        if bytes > room {
            let err = random_weights(&c, DType::BF16, 0)
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains("tether plan --weights-type"), "{err}");
        }
        // Only its final norm: a few KB, made.
        let none = random_weights_where(&c, DType::BF16, 0, &|n: &str| {
            n.ends_with("norm.weight") && !n.contains("layers")
        });
        assert!(none.is_ok());
        assert!(check_room(u64::MAX, DType::BF16).is_err());
    }
}
