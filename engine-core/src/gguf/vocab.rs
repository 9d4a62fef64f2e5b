//! The tokenizer a GGUF carries (`tokenizer.ggml.*`, `tokenizer.chat_template`), rebuilt as
//! the Hugging Face tokenizer it was converted from, so that text encodes as the original
//! checkpoint's `tokenizer.json` encodes it.
//!
//! The converter writes a byte-level BPE (`model = gpt2`) as: every id's token text in id
//! order (ids the tokenizer has no token for as `[PADn]`, type unused), each id's type (normal,
//! or control for the tokenizer's added special tokens), and the merges as `"a b"`. The
//! pre-tokenizer is named (`pre`), not stored: its split pattern is the one that name stands
//! for in llama.cpp (`llama-vocab.cpp`), which is the original `tokenizer.json`'s.

use serde_json::{json, Value as Json};

use super::{Gguf, Value};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// llama.cpp's token types (`llama_token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const BYTE: i64 = 6;

/// The split pattern of a `pre` name: Qwen3.5's (`qwen35`), as in its `tokenizer.json`. The
/// rest of the rebuilt tokenizer (NFC, `ignore_merges`, byte-level decoding) is Qwen3.5's too,
/// so other names are refused rather than guessed.
fn split_pattern(pre: &str) -> Option<&'static str> {
    match pre {
        "qwen35" => Some(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        _ => None,
    }
}

fn strings<'a>(g: &'a Gguf, key: &str) -> Result<Vec<&'a str>> {
    g.get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| Error::Tokenizer(format!("GGUF: no `{key}` array")))?
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| Error::Tokenizer(format!("GGUF: `{key}` holds a non-string")))
        })
        .collect()
}

fn text(g: &Gguf, key: &str) -> Option<String> {
    g.get(key).and_then(Value::as_str).map(str::to_string)
}

/// The tokenizer of the GGUF file at `path` ([`tokenizer`]).
#[cfg(not(target_arch = "wasm32"))]
pub fn read(path: &std::path::Path) -> Result<Option<Tokenizer>> {
    tokenizer(&super::open(path)?.0)
}

/// The file's tokenizer; `None` when it has no real vocabulary (a BPE without merges, as the
/// fixtures' converted files have: those models take byte-level ids, like synthetic ones).
/// A tokenizer tether cannot rebuild is an error that says to pass one.
pub fn tokenizer(g: &Gguf) -> Result<Option<Tokenizer>> {
    let model = text(g, "tokenizer.ggml.model");
    let pre = text(g, "tokenizer.ggml.pre").unwrap_or_default();
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => strings(g, "tokenizer.ggml.merges")?,
        None => Vec::new(),
    };
    match model.as_deref() {
        None => return Ok(None),
        Some("gpt2") if merges.is_empty() => return Ok(None),
        Some("gpt2") => {}
        Some(other) => {
            return Err(Error::Tokenizer(format!(
                "GGUF tokenizer model `{other}` is not one tether rebuilds (it reads gpt2, \
                 byte-level BPE): pass --tokenizer tokenizer.json"
            )))
        }
    }
    let pattern = split_pattern(&pre).ok_or_else(|| {
        Error::Tokenizer(format!(
            "GGUF pre-tokenizer `{pre}` is not one tether knows (qwen35): pass \
             --tokenizer tokenizer.json"
        ))
    })?;
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let types = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::Tokenizer("GGUF: no `tokenizer.ggml.token_type`".into()))?;
    if types.len() != tokens.len() {
        return Err(Error::Tokenizer(format!(
            "GGUF: {} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, (token, ty)) in tokens.iter().zip(types).enumerate() {
        let ty = match ty {
            Value::I32(t) => i64::from(*t),
            other => other.as_u64().map_or(-1, |t| t as i64),
        };
        match ty {
            NORMAL | BYTE => {
                vocab.insert((*token).to_string(), json!(id));
            }
            CONTROL | USER_DEFINED => added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL,
            })),
            // Unused ([PADn]) and unknown ids: no text encodes to them.
            _ => {}
        }
    }
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| Error::Tokenizer(format!("GGUF: merge `{m}` is not `a b`")))
        })
        .collect::<Result<_>>()?;
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
            "vocab": vocab, "merges": merges,
        },
    });
    let token_text = |key: &str| {
        g.get(key)
            .and_then(Value::as_u64)
            .and_then(|id| tokens.get(usize::try_from(id).ok()?))
            .map(|t| t.to_string())
    };
    let config = json!({
        "chat_template": text(g, "tokenizer.chat_template"),
        "eos_token": token_text("tokenizer.ggml.eos_token_id"),
        "bos_token": token_text("tokenizer.ggml.bos_token_id"),
    });
    let bytes = serde_json::to_vec(&tokenizer_json).expect("JSON serialises");
    Tokenizer::from_bytes(&bytes, Some(&config.to_string())).map(Some)
}
