//! A `qwen35` GGUF as llama.cpp's converter (`convert_hf_to_gguf.py`, `Qwen3_5TextModel`)
//! writes it, read into tether's config and tensor names. The converter renames every tensor,
//! adds 1 to RMSNorm weights (not the DeltaNet output norm's), stores `-exp(A_log)` as
//! `ssm_a`, squeezes the conv kernel, and, when there are fewer key heads than value heads,
//! permutes every value-head-indexed weight from grouped to tiled order. Tensors keep their
//! bytes here (mapped, not copied): the model reads the last three in their GGUF form
//! ([`WeightLayout::Gguf`]), so nothing is undone and no row or column is moved.
//!
//! Checked against files the converter itself wrote from the fixtures
//! (`scripts/gguf-from-fixture.py`, `tests/tests/gguf.rs`).

use super::{Gguf, TensorInfo, Value};
use crate::config::{LayerKind, ModelConfig, WeightLayout, MAX_LAYERS};
use crate::error::{Error, Result};
use crate::tensor::{Data, SharedBytes, Tensor};
use crate::weights::TensorMap;

const ARCH: &str = "qwen35";

fn meta<'a>(g: &'a Gguf, key: &str) -> Result<&'a Value> {
    g.get(&format!("{ARCH}.{key}"))
        .ok_or_else(|| Error::Config(format!("GGUF: no `{ARCH}.{key}`")))
}

fn count(g: &Gguf, key: &str) -> Result<usize> {
    let v = meta(g, key)?;
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Error::Config(format!("GGUF: `{ARCH}.{key}` = {v:?} is not a count")))
}

fn number(g: &Gguf, key: &str) -> Result<f32> {
    let v = meta(g, key)?;
    v.as_f64()
        .map(|x| x as f32)
        .ok_or_else(|| Error::Config(format!("GGUF: `{ARCH}.{key}` = {v:?} is not a number")))
}

/// The model's config from the file's metadata (and, for the vocabulary and tied embeddings,
/// its tensors).
pub fn config(g: &Gguf) -> Result<ModelConfig> {
    match g.get("general.architecture").and_then(Value::as_str) {
        Some(ARCH) => {}
        other => {
            return Err(Error::Config(format!(
                "GGUF architecture {other:?}: tether runs `{ARCH}` (Qwen3.5 dense)"
            )))
        }
    }
    let blocks = count(g, "block_count")?;
    // Multi-token-prediction layers (`nextn`) follow the model's own in block numbering.
    let nextn = g
        .get(&format!("{ARCH}.nextn_predict_layers"))
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    let layers = blocks
        .checked_sub(nextn)
        .ok_or_else(|| Error::Config("GGUF: more nextn layers than blocks".into()))?;
    if layers > MAX_LAYERS {
        return Err(Error::Config(format!(
            "GGUF: {layers} layers; tether reads at most {MAX_LAYERS}"
        )));
    }
    let layer_types = layer_types(g, layers)?;
    let embed = find(g, "token_embd.weight")?;
    let [vocab_size, _] = embed.shape[..] else {
        return Err(Error::Config(
            "GGUF: token_embd.weight is not a matrix".into(),
        ));
    };
    let hidden_size = count(g, "embedding_length")?;
    let heads = count(g, "attention.head_count")?;
    // llama.cpp's defaults where the converter wrote nothing.
    let head_dim = match g.get(&format!("{ARCH}.attention.key_length")) {
        Some(_) => count(g, "attention.key_length")?,
        None => hidden_size / heads.max(1),
    };
    let rope_theta = match g.get(&format!("{ARCH}.rope.freq_base")) {
        Some(_) => number(g, "rope.freq_base")?,
        None => 10_000.0,
    };
    let rope_dims = count(g, "rope.dimension_count")?;
    let v_heads = count(g, "ssm.time_step_rank")?;
    let eos = g
        .get("tokenizer.ggml.eos_token_id")
        .and_then(Value::as_u64)
        .and_then(|id| u32::try_from(id).ok());
    let cfg = ModelConfig {
        vocab_size,
        hidden_size,
        intermediate_size: count(g, "feed_forward_length")?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: count(g, "attention.head_count_kv")?,
        head_dim,
        linear_num_key_heads: count(g, "ssm.group_count")?,
        linear_num_value_heads: v_heads,
        linear_key_head_dim: count(g, "ssm.state_size")?,
        linear_value_head_dim: count(g, "ssm.inner_size")? / v_heads.max(1),
        linear_conv_kernel_dim: count(g, "ssm.conv_kernel")?,
        rms_norm_eps: number(g, "attention.layer_norm_rms_epsilon")?,
        rope_theta,
        partial_rotary_factor: rope_dims as f32 / head_dim.max(1) as f32,
        max_position_embeddings: count(g, "context_length")?,
        tie_word_embeddings: !g.tensors.iter().any(|t| t.name == "output.weight"),
        layer_types,
        eos_token_ids: eos.into_iter().collect(),
        layout: WeightLayout::Gguf,
        mtp_layers: nextn,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Each layer's kind: from `attention.recurrent_layers`, which the converter writes when the
/// checkpoint lists `layer_types`; otherwise, as llama.cpp does, every
/// `full_attention_interval`-th layer (default 4) is full attention.
fn layer_types(g: &Gguf, layers: usize) -> Result<Vec<LayerKind>> {
    let Some(recurrent) = g.get(&format!("{ARCH}.attention.recurrent_layers")) else {
        let interval = match g.get(&format!("{ARCH}.full_attention_interval")) {
            Some(_) => count(g, "full_attention_interval")?,
            None => 4,
        };
        if interval == 0 {
            return Err(Error::Config("GGUF: full_attention_interval is 0".into()));
        }
        return Ok(ModelConfig::interval_layer_types(layers, interval));
    };
    let recurrent = recurrent
        .as_array()
        .ok_or_else(|| Error::Config("GGUF: recurrent_layers is not an array".into()))?;
    if recurrent.len() < layers {
        return Err(Error::Config(format!(
            "GGUF: recurrent_layers lists {} layers of {layers}",
            recurrent.len()
        )));
    }
    recurrent[..layers]
        .iter()
        .map(|v| match v {
            Value::Bool(true) => Ok(LayerKind::LinearAttention),
            Value::Bool(false) => Ok(LayerKind::FullAttention),
            other => Err(Error::Config(format!(
                "GGUF: recurrent_layers holds {other:?}"
            ))),
        })
        .collect()
}

fn find<'a>(g: &'a Gguf, name: &str) -> Result<&'a TensorInfo> {
    g.tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| Error::MissingTensor(name.to_string()))
}

/// The converter's names of the model's ends: (GGUF, tether's).
const TOP: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// The converter's names within a layer (after `blk.N.` and `model.layers.N.`): (GGUF,
/// tether's). `ssm_a` keeps its GGUF name in tether, being `-exp(A_log)`, not `A_log`.
const LAYER: [(&str, &str); 20] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
    ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
    ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
    ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
    ("ssm_a", "linear_attn.ssm_a"),
    ("ssm_dt.bias", "linear_attn.dt_bias"),
    ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    ("ssm_norm.weight", "linear_attn.norm.weight"),
    ("ssm_out.weight", "linear_attn.out_proj.weight"),
];

/// The converter's names of the multi-token-prediction head's own tensors, in the block after
/// the model's layers (after `blk.N.`): (GGUF, tether's). Its decoder layer's tensors there
/// take [`LAYER`]'s names.
const NEXTN: [(&str, &str); 4] = [
    ("nextn.eh_proj.weight", "mtp.fc.weight"),
    ("nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
    ("nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
    ("nextn.shared_head_norm.weight", "mtp.norm.weight"),
];

/// tether's (Hugging Face's text-only) name for a GGUF tensor of a model of `layers` layers,
/// or `None` for one it does not use. Block `layers` is the multi-token-prediction head's.
fn hf_name(name: &str, layers: usize) -> Option<String> {
    if let Some((_, hf)) = TOP.iter().find(|(g, _)| *g == name) {
        return Some(hf.to_string());
    }
    let (layer, tensor) = name.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|&l| l <= layers)?;
    if layer == layers {
        if let Some((_, hf)) = NEXTN.iter().find(|(g, _)| *g == tensor) {
            return Some(hf.to_string());
        }
    }
    let (_, hf) = LAYER.iter().find(|(g, _)| *g == tensor)?;
    Some(match layer < layers {
        true => format!("model.layers.{layer}.{hf}"),
        false => format!("mtp.layers.0.{hf}"),
    })
}

/// The GGUF name of one of tether's tensor names in a model of `layers` layers (`A_log` maps
/// to `ssm_a`, which the writer computes from it; the multi-token-prediction head's tensors
/// to block `layers`).
pub(super) fn gguf_name(name: &str, layers: usize) -> Option<String> {
    if let Some((g, _)) = TOP.iter().find(|(_, hf)| *hf == name) {
        return Some(g.to_string());
    }
    if let Some((g, _)) = NEXTN.iter().find(|(_, hf)| *hf == name) {
        return Some(format!("blk.{layers}.{g}"));
    }
    let (layer, tensor) = match name.strip_prefix("mtp.layers.0.") {
        Some(tensor) => (layers, tensor),
        None => {
            let (layer, tensor) = name.strip_prefix("model.layers.")?.split_once('.')?;
            (layer.parse().ok()?, tensor)
        }
    };
    let tensor = if tensor == "linear_attn.A_log" {
        "linear_attn.ssm_a"
    } else {
        tensor
    };
    let (g, _) = LAYER.iter().find(|(_, hf)| *hf == tensor)?;
    Some(format!("blk.{layer}.{g}"))
}

/// The tensors tether uses, under its names, sharing `bytes` (the mapped file).
pub fn tensors(g: &Gguf, bytes: &SharedBytes, layers: usize) -> Result<TensorMap> {
    let mut out = TensorMap::new();
    for t in &g.tensors {
        let Some(name) = hf_name(&t.name, layers) else {
            continue;
        };
        let data = Data::from_bytes(t.dtype, bytes, t.range.clone());
        // The converter squeezed the conv kernel's middle axis of 1.
        let shape = match (name.ends_with("conv1d.weight"), &t.shape[..]) {
            (true, &[channels, kernel]) => vec![channels, 1, kernel],
            _ => t.shape.clone(),
        };
        out.insert(name, Tensor { shape, data });
    }
    Ok(out)
}

/// A GGUF file's config and tensors (memory-mapped: no weight is copied).
#[cfg(not(target_arch = "wasm32"))]
pub fn load(path: &std::path::Path) -> Result<(ModelConfig, TensorMap)> {
    let (g, bytes) = super::open(path)?;
    let config = config(&g).map_err(|e| in_file(path, e))?;
    let tensors = tensors(&g, &bytes, config.num_hidden_layers)?;
    Ok((config, tensors))
}

#[cfg(not(target_arch = "wasm32"))]
fn in_file(path: &std::path::Path, e: Error) -> Error {
    match e {
        Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
        other => other,
    }
}
