//! Writing a `qwen35` GGUF as llama.cpp's converter writes it (`tether quantize`): its names,
//! its metadata, its forms of the norms (`1 + w`), of `A_log` (`ssm_a = -exp(A_log)`), of the
//! conv kernel (squeezed), and its tiled value-head order when there are fewer key heads than
//! value heads; matrices in the types `llama-quantize` gives them for the chosen file type
//! ([`FILE_TYPES`]: F32, F16, BF16 and Q8_0 as the converter's `--outtype`, the 32-weight
//! types, and the k-quant mixes with their per-tensor rules), other tensors in F32 as the
//! converter keeps them. A GGUF may be the input too: its tensors are already in those forms
//! and are only re-typed.
//!
//! Tensors are produced one at a time while the file is written, a row at a time where a
//! permutation applies, so the file never has to fit in memory.

use std::io::Write;

use serde_json::Value as Json;

use super::qwen35::gguf_name;
use super::{Value, Writer};
use crate::config::{LayerKind, ModelConfig, WeightLayout};
use crate::error::{Error, Result};
use crate::tensor::{DType, Data};
use crate::weights::TensorMap;

/// A file type `tether quantize --type` writes: llama.cpp's `llama_ftype` of that name (its id
/// is the file's `general.file_type`) and its matrices' default type, which [`tensor_type`]
/// raises for the tensors that lose most to quantisation, as `llama-quantize` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileType {
    pub name: &'static str,
    id: u32,
    pub default: DType,
    mix: Mix,
}

/// The per-tensor rules of a file type (llama.cpp's `llama_tensor_get_type_impl`, for the
/// types tether writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mix {
    /// Every matrix in the default type but the output (Q6_K when quantised).
    Uniform,
    /// Q4_K_S: the first four value projections and the first eighth of `ffn_down` in Q5_K.
    Q4KSmall,
    /// Q4_K_M and Q5_K_M: value projections and `ffn_down` of the first and last eighth of the
    /// layers and of every third between them in Q6_K.
    KMedium,
    /// Q2_K: value projections in Q4_K (Q3_K where fewer than 4 query heads share a KV head),
    /// `ffn_down` and the attention output in Q3_K.
    Q2K,
    /// Q3_K_M: the first two value projections in Q5_K, the rest in Q4_K; `ffn_down` of the
    /// first sixteenth of the layers in Q5_K, the rest in Q4_K; the attention output in Q4_K.
    Q3KMedium,
    /// Q3_K_L: value projections, `ffn_down` and the attention output in Q5_K.
    Q3KLarge,
    /// IQ4_NL and IQ4_XS: value projections in Q5_K where 4 or more query heads share a KV
    /// head; `ffn_down` of the first eighth of the layers in Q5_K.
    Iq4,
}

const fn ft(name: &'static str, id: u32, default: DType, mix: Mix) -> FileType {
    FileType {
        name,
        id,
        default,
        mix,
    }
}

/// The file types tether writes; `q3_k`, `q4_k` and `q5_k` name the `_m` mixes, as in
/// `llama-quantize`.
pub const FILE_TYPES: [FileType; 19] = [
    ft("f32", 0, DType::F32, Mix::Uniform),
    ft("f16", 1, DType::F16, Mix::Uniform),
    ft("bf16", 32, DType::BF16, Mix::Uniform),
    ft("q8_0", 7, DType::Q8_0, Mix::Uniform),
    ft("q4_0", 2, DType::Q4_0, Mix::Uniform),
    ft("q4_1", 3, DType::Q4_1, Mix::Uniform),
    ft("q5_0", 8, DType::Q5_0, Mix::Uniform),
    ft("q5_1", 9, DType::Q5_1, Mix::Uniform),
    ft("q4_k_s", 14, DType::Q4K, Mix::Q4KSmall),
    ft("q4_k_m", 15, DType::Q4K, Mix::KMedium),
    ft("q5_k_s", 16, DType::Q5K, Mix::Uniform),
    ft("q5_k_m", 17, DType::Q5K, Mix::KMedium),
    ft("q6_k", 18, DType::Q6K, Mix::Uniform),
    ft("q2_k", 10, DType::Q2K, Mix::Q2K),
    ft("q3_k_s", 11, DType::Q3K, Mix::Uniform),
    ft("q3_k_m", 12, DType::Q3K, Mix::Q3KMedium),
    ft("q3_k_l", 13, DType::Q3K, Mix::Q3KLarge),
    ft("iq4_nl", 25, DType::Iq4Nl, Mix::Iq4),
    ft("iq4_xs", 30, DType::Iq4Xs, Mix::Iq4),
];

impl FileType {
    /// The file type named `s` (any case; `q3_k`, `q4_k`, `q5_k` are the `_m` mixes).
    pub fn parse(s: &str) -> Option<FileType> {
        let s = s.to_ascii_lowercase();
        let s = match s.as_str() {
            "q3_k" => "q3_k_m",
            "q4_k" => "q4_k_m",
            "q5_k" => "q5_k_m",
            other => other,
        };
        FILE_TYPES.iter().copied().find(|f| f.name == s)
    }

    /// The names, for messages.
    pub fn names() -> String {
        FILE_TYPES.map(|f| f.name).join(", ")
    }
}

/// What a tensor is to llama.cpp's rules (`tensor_get_category`, the categories they use).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The output matrix, or the token embedding when it is tied to it.
    Output,
    /// A value projection: `attn_v`, or the fused `attn_qkv` of a DeltaNet layer.
    Value,
    AttnOutput,
    FfnDown,
    Other,
}

fn role(name: &str, tied: bool) -> Role {
    if name == "output.weight" || (tied && name == "token_embd.weight") {
        Role::Output
    } else if name.contains("attn_qkv.weight") || name.contains("attn_v.weight") {
        Role::Value
    } else if name.contains("attn_output.weight") {
        Role::AttnOutput
    } else if name.contains("ffn_down") {
        Role::FfnDown
    } else {
        Role::Other
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of `n`, and every third between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// Whether `llama-quantize` quantises tensor `name` of `dims` dimensions
/// (`tensor_allows_quantization`, the rules that apply to `qwen35`): matrices named `*weight`,
/// not norms, not the conv kernel.
fn quantisable(name: &str, dims: usize) -> bool {
    dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ssm_conv1d")
}

/// The type `llama-quantize` (no imatrix, no overrides) gives matrix `role` with rows of `cols`,
/// the `i`-th of `n` of its role in the file's order (layer order), in a model whose KV heads
/// each serve `gqa` query heads.
fn tensor_type(f: FileType, role: Role, cols: usize, (i, n): (usize, usize), gqa: usize) -> DType {
    use DType::{Q3K, Q4K, Q5K, Q6K};
    let d = f.default;
    if !d.is_quantised() {
        return d;
    }
    let t = match (role, f.mix) {
        (Role::Output, _) if !cols.is_multiple_of(d.block().0) => DType::Q8_0,
        (Role::Output, _) if d != DType::Q8_0 => Q6K,
        (Role::Value | Role::FfnDown, Mix::KMedium) if use_more_bits(i, n) => Q6K,
        (Role::Value, Mix::Q4KSmall) if i < 4 => Q5K,
        (Role::FfnDown, Mix::Q4KSmall | Mix::Iq4) if i < n / 8 => Q5K,
        (Role::Value, Mix::Q2K) => match gqa >= 4 {
            true => Q4K,
            false => Q3K,
        },
        (Role::FfnDown | Role::AttnOutput, Mix::Q2K) => Q3K,
        (Role::Value, Mix::Q3KMedium) if i < 2 => Q5K,
        (Role::FfnDown, Mix::Q3KMedium) if i < n / 16 => Q5K,
        (Role::Value | Role::FfnDown | Role::AttnOutput, Mix::Q3KMedium) => Q4K,
        (Role::Value | Role::FfnDown | Role::AttnOutput, Mix::Q3KLarge) => Q5K,
        (Role::Value, Mix::Iq4) if gqa >= 4 => Q5K,
        _ => d,
    };
    fallback(t, cols)
}

/// llama.cpp's `tensor_type_fallback`: a k-quant on rows that are not whole super-blocks
/// becomes the 32-weight type of about its size; rows not whole 32-blocks stay F16.
fn fallback(t: DType, cols: usize) -> DType {
    if cols.is_multiple_of(t.block().0) {
        return t;
    }
    let r = match t {
        DType::Q2K | DType::Q3K => DType::Q4_0,
        DType::Iq4Xs => DType::Iq4Nl,
        DType::Q4K => DType::Q5_0,
        DType::Q5K => DType::Q5_1,
        DType::Q6K => DType::Q8_0,
        other => other,
    };
    if cols.is_multiple_of(r.block().0) {
        r
    } else {
        DType::F16
    }
}

/// The converter's metadata for `c` (the keys `gguf::qwen35::config` reads, and llama.cpp).
pub fn metadata(w: &mut Writer, c: &ModelConfig, name: &str, file_type: FileType) {
    let u = |n: usize| Value::U32(n as u32);
    let a = |key: &str| format!("qwen35.{key}");
    w.meta("general.architecture", Value::Str("qwen35".into()))
        .meta("general.type", Value::Str("model".into()))
        .meta("general.name", Value::Str(name.into()))
        .meta(&a("block_count"), u(c.num_hidden_layers + c.mtp_layers))
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
        .meta("general.file_type", Value::U32(file_type.id))
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
                    // The head's block is a full-attention one.
                    .chain((0..c.mtp_layers).map(|_| Value::Bool(false)))
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
    if c.mtp_layers > 0 {
        w.meta(&a("nextn_predict_layers"), u(c.mtp_layers));
    }
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
/// The multi-token-prediction head's two input norms, whose names do not end in `norm.weight`
/// (their GGUF names do, and the converter stores `1 + w` for them as for every other).
fn is_mtp_input_norm(name: &str) -> bool {
    name.starts_with("mtp.pre_fc_norm_")
}

fn form_of(suffix: &str, convert: bool, tile: bool, c: &ModelConfig) -> Form {
    let (dv, qk) = (c.linear_value_head_dim, 2 * c.linear_key_dim());
    let is = |end: &str| suffix.ends_with(end);
    if !convert {
        Form::Same
    } else if (is("norm.weight") && !is("linear_attn.norm.weight")) || is_mtp_input_norm(suffix) {
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

/// Each tensor's plan, in llama.cpp's order (tensors outside the layers, then layer by layer,
/// by name within each), which its per-tensor rules count in.
fn plans<'a>(
    c: &ModelConfig,
    shapes: impl Iterator<Item = (&'a String, &'a Vec<usize>)>,
    f: FileType,
) -> Result<Vec<Plan>> {
    let convert = c.layout == WeightLayout::HuggingFace;
    let tile = convert && c.linear_num_key_heads != c.linear_num_value_heads;
    let mut out = Vec::new();
    for (source, shape) in shapes {
        if c.tie_word_embeddings && source == "lm_head.weight" {
            continue;
        }
        let Some(name) = gguf_name(source, c.num_hidden_layers) else {
            return Err(Error::Weights(format!(
                "{source}: not a tensor of the qwen35 layout"
            )));
        };
        let mut shape = shape.clone();
        let suffix = source
            .rsplit_once("layers.")
            .map_or(source.as_str(), |(_, s)| s);
        let form = form_of(suffix, convert, tile, c);
        if name.ends_with("ssm_conv1d.weight") {
            shape = vec![shape[0], *shape.last().expect("a conv kernel shape")];
        }
        out.push(Plan {
            source: source.clone(),
            name,
            shape,
            dtype: DType::F32,
            form,
        });
    }
    out.sort_by_cached_key(|p| (block_of(&p.name), p.name.clone()));
    choose_types(&mut out, f, c);
    Ok(out)
}

/// The block a GGUF tensor belongs to (`blk.N.`): the multi-token-prediction head's block
/// comes after the model's layers, as the converter writes it.
fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Each plan's type by llama.cpp's rules; what is not quantised stays f32, as the converter
/// writes norms, gates and the conv kernel.
fn choose_types(plans: &mut [Plan], f: FileType, c: &ModelConfig) {
    let gqa = c.num_attention_heads / c.num_key_value_heads.max(1);
    let tied = !plans.iter().any(|p| p.name == "output.weight");
    let count = |role_: Role| {
        plans
            .iter()
            .filter(|p| role(&p.name, tied) == role_)
            .count()
    };
    // llama-quantize counts every block's, the multi-token-prediction head's too.
    let (values, downs) = (count(Role::Value), count(Role::FfnDown));
    let (mut value, mut down) = (0, 0);
    for p in plans.iter_mut() {
        if !quantisable(&p.name, p.shape.len()) {
            continue;
        }
        let r = role(&p.name, tied);
        let (i, n) = match r {
            Role::Value => (value, values),
            Role::FfnDown => (down, downs),
            Role::Output | Role::AttnOutput | Role::Other => (0, 0),
        };
        value += usize::from(r == Role::Value);
        down += usize::from(r == Role::FfnDown);
        p.dtype = tensor_type(f, r, p.shape[p.shape.len() - 1], (i, n), gqa);
    }
}

/// The GGUF name, shape and type of each tensor of a Hugging Face checkpoint of `c`'s shapes
/// written as file type `f`, in the file's order: what [`write`] would write, without the
/// weights.
pub fn layout(c: &ModelConfig, f: FileType) -> Result<Vec<(String, Vec<usize>, DType)>> {
    let shapes = crate::synth::tensor_shapes(c)?;
    let plans = plans(c, shapes.iter().map(|(n, s)| (n, s)), f)?;
    Ok(plans
        .into_iter()
        .map(|p| (p.name, p.shape, p.dtype))
        .collect())
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

/// Writes `tensors` of model `c` (named `name`) as a GGUF of file type `f` to `out`, with the
/// metadata `add_tokenizer` adds; `progress(done, total)` after each tensor.
pub fn write(
    c: &ModelConfig,
    tensors: &TensorMap,
    name: &str,
    f: FileType,
    add_tokenizer: impl FnOnce(&mut Writer) -> Result<()>,
    out: &mut impl Write,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let plans = plans(c, tensors.iter().map(|(n, t)| (n, &t.shape)), f)?;
    let mut w = Writer::new();
    metadata(&mut w, c, name, f);
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
