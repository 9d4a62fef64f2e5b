//! Writing a `qwen35` GGUF as llama.cpp's converter writes it (`tether quantize`): its names,
//! its metadata, its forms of the norms (`1 + w`), of `A_log` (`ssm_a = -exp(A_log)`), of the
//! conv kernel (squeezed), and its tiled value-head order when there are fewer key heads than
//! value heads; matrices in the chosen type (F32, F16, BF16 or Q8_0, as the converter's
//! `--outtype`), other tensors in F32 as the converter keeps them. A GGUF may be the input
//! too: its tensors are already in those forms and are only re-typed.
//!
//! Tensors are produced one at a time while the file is written, a row at a time where a
//! permutation applies, so the file never has to fit in memory.

use std::io::Write;

use serde_json::Value as Json;

use super::qwen35::gguf_name;
use super::{Value, Writer};
use crate::config::{LayerKind, ModelConfig, WeightLayout};
use crate::error::{Error, Result};
use crate::tensor::{DType, Data, Q8_0_BLOCK};
use crate::weights::TensorMap;

/// The types `tether quantize` writes matrices in.
pub const TARGETS: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::Q8_0];

/// llama.cpp's `general.file_type` (`llama_ftype`) of a file whose matrices are `dtype`, one of
/// the [`TARGETS`].
fn file_type(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q8_0 => 7,
        DType::BF16 => 32,
        other => unreachable!("quantize does not write {}", other.name()),
    }
}

/// The converter's metadata for `c` (the keys `gguf::qwen35::config` reads, and llama.cpp).
fn metadata(w: &mut Writer, c: &ModelConfig, name: &str, dtype: DType) {
    let u = |n: usize| Value::U32(n as u32);
    let a = |key: &str| format!("qwen35.{key}");
    w.meta("general.architecture", Value::Str("qwen35".into()))
        .meta("general.type", Value::Str("model".into()))
        .meta("general.name", Value::Str(name.into()))
        .meta(&a("block_count"), u(c.num_hidden_layers))
        .meta(&a("context_length"), u(c.max_position_embeddings))
        .meta(&a("embedding_length"), u(c.hidden_size))
        .meta(&a("feed_forward_length"), u(c.intermediate_size))
        .meta(&a("attention.head_count"), u(c.num_attention_heads))
        .meta(&a("attention.head_count_kv"), u(c.num_key_value_heads))
        .meta(&a("rope.freq_base"), Value::F32(c.rope_theta))
        .meta(
            &a("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps),
        )
        .meta(&a("attention.key_length"), u(c.head_dim))
        .meta(&a("attention.value_length"), u(c.head_dim))
        .meta("general.file_type", Value::U32(file_type(dtype)))
        .meta(&a("ssm.conv_kernel"), u(c.linear_conv_kernel_dim))
        .meta(&a("ssm.state_size"), u(c.linear_key_head_dim))
        .meta(&a("ssm.group_count"), u(c.linear_num_key_heads))
        .meta(&a("ssm.time_step_rank"), u(c.linear_num_value_heads))
        .meta(&a("ssm.inner_size"), u(c.linear_value_dim()))
        .meta(
            &a("attention.recurrent_layers"),
            Value::Array(
                c.layer_types
                    .iter()
                    .map(|k| Value::Bool(*k == LayerKind::LinearAttention))
                    .collect(),
            ),
        )
        .meta(&a("rope.dimension_count"), u(c.rotary_dim()))
        .meta(&a("full_attention_interval"), u(full_attention_interval(c)))
        .meta("general.quantization_version", Value::U32(2));
    // Qwen3.5 applies interleaved MRoPE; for text every section sees the same position, so
    // the sections (llama.cpp requires them) change nothing. The converter's default.
    w.meta(
        &a("rope.dimension_sections"),
        Value::Array([11, 11, 10, 0].map(Value::I32).to_vec()),
    );
}

/// The interval of full-attention layers (the converter writes the checkpoint's, default 4):
/// the position of the first, when the layers repeat that pattern; else 4, as llama.cpp
/// reads `recurrent_layers` first anyway.
fn full_attention_interval(c: &ModelConfig) -> usize {
    let first = c
        .layer_types
        .iter()
        .position(|k| *k == LayerKind::FullAttention)
        .map_or(4, |i| i + 1);
    if ModelConfig::interval_layer_types(c.num_hidden_layers, first) == c.layer_types {
        first
    } else {
        4
    }
}

/// The converter's tokenizer metadata from a `tokenizer.json` (and the chat template and end
/// token from `tokenizer_config.json`, else the model config's first `eos_token_id`, as the
/// converter falls back to `config.json`), for `vocab_size` ids: every id's token in id order
/// (`[PADn]` where there is none), its type (1 normal, 3 special added, 4 other added, 5
/// unused) and the merges as `"a b"`. The same rules `gguf::vocab` reads back. Without an end
/// token llama.cpp takes id 11 for one (its BPE default), which is `,` in Qwen's vocabulary.
pub fn tokenizer_metadata(
    w: &mut Writer,
    tokenizer_json: &[u8],
    config_json: Option<&str>,
    c: &ModelConfig,
) -> Result<()> {
    let vocab_size = c.vocab_size;
    let bad = |why: &str| Error::Tokenizer(format!("tokenizer.json: {why}"));
    let json: Json = serde_json::from_slice(tokenizer_json).map_err(|e| bad(&e.to_string()))?;
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(bad(
            "not a BPE tokenizer (tether writes byte-level BPE vocabularies)",
        ));
    }
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![5i32; vocab_size];
    let mut place = |id: Option<u64>, text: &str, ty: i32| -> Result<()> {
        let id = id
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < vocab_size)
            .ok_or_else(|| bad(&format!("token `{text}` has an id outside the vocabulary")))?;
        tokens[id] = Some(text.to_string());
        types[id] = ty;
        Ok(())
    };
    let vocab = model["vocab"].as_object().ok_or_else(|| bad("no vocab"))?;
    for (text, id) in vocab {
        place(id.as_u64(), text, 1)?;
    }
    for a in json["added_tokens"].as_array().into_iter().flatten() {
        let ty = if a["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
        place(
            a["id"].as_u64(),
            a["content"].as_str().unwrap_or_default(),
            ty,
        )?;
    }
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| bad("no merges"))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::Str(s.clone())),
            Json::Array(p) => match (
                p.first().and_then(Json::as_str),
                p.get(1).and_then(Json::as_str),
            ) {
                (Some(a), Some(b)) => Ok(Value::Str(format!("{a} {b}"))),
                _ => Err(bad("a merge is not a pair of strings")),
            },
            _ => Err(bad("a merge is not a string or a pair")),
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens: Vec<Value> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| Value::Str(t.unwrap_or_else(|| format!("[PAD{i}]"))))
        .collect();
    let config: Json = config_json
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| bad(&format!("tokenizer_config.json: {e}")))?
        .unwrap_or(Json::Null);
    let id_of = |text: &str| {
        vocab.get(text).and_then(Json::as_u64).or_else(|| {
            json["added_tokens"]
                .as_array()?
                .iter()
                .find(|a| a["content"] == text)?["id"]
                .as_u64()
        })
    };
    w.meta("tokenizer.ggml.model", Value::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::Str("qwen35".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens))
        .meta(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        )
        .meta("tokenizer.ggml.merges", Value::Array(merges))
        .meta("tokenizer.ggml.add_bos_token", Value::Bool(false))
        .meta("tokenizer.ggml.add_eos_token", Value::Bool(false));
    let eos = config["eos_token"]
        .as_str()
        .and_then(id_of)
        .or_else(|| c.eos_token_ids.first().map(|&id| u64::from(id)));
    if let Some(id) = eos {
        w.meta("tokenizer.ggml.eos_token_id", Value::U32(id as u32));
    }
    if let Some(t) = config["chat_template"].as_str() {
        w.meta("tokenizer.chat_template", Value::Str(t.into()));
    }
    Ok(())
}

/// How one tensor is written: its source, GGUF name and shape, type, and what is done to it.
struct Plan {
    source: String,
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    form: Form,
}

#[derive(Clone, Copy)]
enum Form {
    /// As it is.
    Same,
    /// An RMSNorm offset `w` written as the scale `1 + w`.
    Scale,
    /// `A_log` written as `-exp(A_log)`, value heads tiled.
    NegExp,
    /// Rows (or elements) in groups of `width` per value head, tiled, from row `from` on.
    TileRows { from: usize, width: usize },
    /// Columns in groups of `width` per value head, tiled.
    TileCols { width: usize },
}

/// Value head `h` of the tiled order is head `(h % k) * (v / k) + h / k` of the grouped one.
fn grouped_head(h: usize, k_heads: usize, v_heads: usize) -> usize {
    (h % k_heads) * (v_heads / k_heads) + h / k_heads
}

/// What the converter does to tensor `suffix` (its name after `model.layers.N.`, or the whole
/// name), given that the input is in Hugging Face's layout (`convert`) and has fewer key heads
/// than value heads (`tile`).
fn form_of(suffix: &str, convert: bool, tile: bool, c: &ModelConfig) -> Form {
    let (dv, qk) = (c.linear_value_head_dim, 2 * c.linear_key_dim());
    let is = |end: &str| suffix.ends_with(end);
    if !convert {
        Form::Same
    } else if is("norm.weight") && !is("linear_attn.norm.weight") {
        Form::Scale
    } else if is("A_log") {
        Form::NegExp
    } else if !tile {
        Form::Same
    } else if is("dt_bias") || is("in_proj_a.weight") || is("in_proj_b.weight") {
        Form::TileRows { from: 0, width: 1 }
    } else if is("in_proj_z.weight") {
        Form::TileRows { from: 0, width: dv }
    } else if is("in_proj_qkv.weight") || is("conv1d.weight") {
        Form::TileRows {
            from: qk,
            width: dv,
        }
    } else if is("out_proj.weight") {
        Form::TileCols { width: dv }
    } else {
        Form::Same
    }
}

fn plans(c: &ModelConfig, tensors: &TensorMap, target: DType) -> Result<Vec<Plan>> {
    let convert = c.layout == WeightLayout::HuggingFace;
    let tile = convert && c.linear_num_key_heads != c.linear_num_value_heads;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut out = Vec::new();
    for source in names {
        if c.tie_word_embeddings && source == "lm_head.weight" {
            continue;
        }
        let Some(name) = gguf_name(source) else {
            return Err(Error::Weights(format!(
                "{source}: not a tensor of the qwen35 layout"
            )));
        };
        let t = &tensors[source];
        let mut shape = t.shape.clone();
        let suffix = source
            .rsplit_once("layers.")
            .map_or(source.as_str(), |(_, s)| s);
        let form = form_of(suffix, convert, tile, c);
        if name.ends_with("ssm_conv1d.weight") {
            shape = vec![shape[0], *shape.last().expect("a conv kernel shape")];
        }
        // Matrices in the target type, the conv kernel and everything 1-D in f32.
        let matrix = shape.len() == 2 && !name.ends_with("ssm_conv1d.weight");
        let dtype = if matrix { target } else { DType::F32 };
        if dtype == DType::Q8_0 && !shape[1].is_multiple_of(Q8_0_BLOCK) {
            return Err(Error::Weights(format!(
                "{source}: rows of {} are not whole Q8_0 blocks of {Q8_0_BLOCK}",
                shape[1]
            )));
        }
        out.push(Plan {
            source: source.clone(),
            name,
            shape,
            dtype,
            form,
        });
    }
    Ok(out)
}

/// The f32 values of a tensor in its GGUF form.
fn values(p: &Plan, c: &ModelConfig, tensors: &TensorMap) -> Vec<f32> {
    let v = tensors[&p.source].data.to_f32_vec();
    let (k, h) = (c.linear_num_key_heads, c.linear_num_value_heads);
    match p.form {
        Form::Same => v,
        Form::Scale => v.iter().map(|w| 1.0 + w).collect(),
        Form::NegExp => {
            let tiled = k != h && c.layout == WeightLayout::HuggingFace;
            (0..v.len())
                .map(|i| {
                    let src = if tiled { grouped_head(i, k, h) } else { i };
                    -v[src].exp()
                })
                .collect()
        }
        Form::TileRows { from, width } => {
            let cols = v.len() / p.shape[0];
            let mut out = Vec::with_capacity(v.len());
            for r in 0..p.shape[0] {
                let src = if r < from {
                    r
                } else {
                    let (head, d) = ((r - from) / width, (r - from) % width);
                    from + grouped_head(head, k, h) * width + d
                };
                out.extend_from_slice(&v[src * cols..(src + 1) * cols]);
            }
            out
        }
        Form::TileCols { width } => {
            let cols = p.shape[1];
            let mut out = Vec::with_capacity(v.len());
            for row in v.chunks_exact(cols) {
                for col in 0..cols {
                    let (head, d) = (col / width, col % width);
                    out.push(row[grouped_head(head, k, h) * width + d]);
                }
            }
            out
        }
    }
}

/// Writes `tensors` of model `c` (named `name`) as a GGUF to `out`, matrices as `target`,
/// with the metadata `add_tokenizer` adds; `progress(done, total)` after each tensor.
pub fn write(
    c: &ModelConfig,
    tensors: &TensorMap,
    name: &str,
    target: DType,
    add_tokenizer: impl FnOnce(&mut Writer) -> Result<()>,
    out: &mut impl Write,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    if !TARGETS.contains(&target) {
        return Err(Error::Invalid(format!(
            "--type {}: tether writes f32, f16, bf16 or q8_0",
            target.name()
        )));
    }
    let plans = plans(c, tensors, target)?;
    let mut w = Writer::new();
    metadata(&mut w, c, name, target);
    add_tokenizer(&mut w)?;
    for p in &plans {
        w.describe(&p.name, &p.shape, p.dtype);
    }
    let total = plans.len();
    w.write(out, |i| {
        let p = &plans[i];
        let bytes = Data::from_f32(&values(p, c, tensors), p.dtype)
            .as_bytes()
            .to_vec();
        progress(i + 1, total);
        Ok(bytes)
    })
    .map_err(|e| Error::Weights(format!("writing the GGUF: {e}")))
}
