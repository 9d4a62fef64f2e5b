//! The Qwen3.5 text config, read from a HF `config.json` in either layout: flat
//! (`model_type: qwen3_5_text`) or multimodal with the text part under `text_config`. Rope
//! parameters may sit in `rope_parameters` or at the level of the text config.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cache_types::CacheTypes;
use crate::error::{Error, Result};

/// Most layers a config may have: far past any real model's, and few enough that the layer
/// list `num_hidden_layers` sizes (before any weight is read) is never a large allocation.
pub const MAX_LAYERS: usize = 1 << 12;

/// Most elements of any tensor or per-sequence state the engine sizes from a config: 2^32
/// (16 GiB as f32), past the largest tensor of any real checkpoint (Qwen3.5's embeddings are
/// under 2^31). With every such product within it, the model code multiplies config fields
/// without overflow checks, and a config cannot announce a size that weights never back (a
/// helper builds state from the config alone).
pub const MAX_ELEMS: u64 = 1 << 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention` in HF configs).
    LinearAttention,
    /// Gated full attention over the paged KV cache.
    FullAttention,
}

/// How a checkpoint stores the weights whose form differs between the two formats tether
/// reads. The model's math is the same on both; this says which form to expect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightLayout {
    /// Hugging Face safetensors: RMSNorm weights as offsets `w` (scale `1 + w`), `A_log`, and
    /// value heads grouped by the key head they read.
    #[default]
    HuggingFace,
    /// llama.cpp's GGUF (its converter's choices): RMSNorm scales `1 + w` as stored,
    /// `ssm_a = -exp(A_log)`, and value heads tiled (`DeltaShape::value_heads_tiled`).
    Gguf,
}

impl WeightLayout {
    fn is_hugging_face(&self) -> bool {
        *self == WeightLayout::HuggingFace
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub partial_rotary_factor: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub layer_types: Vec<LayerKind>,
    /// Token ids that end generation, from `eos_token_id` (a number or a list).
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's form of norms, decay rates and value-head order. Left out of the JSON
    /// when it is the default, so that configs (and the identities hashed from them) of
    /// safetensors checkpoints read as they did before GGUF.
    #[serde(default, skip_serializing_if = "WeightLayout::is_hugging_face")]
    pub layout: WeightLayout,
    /// Multi-token-prediction layers after the model's own (`mtp_num_hidden_layers`; a GGUF's
    /// `nextn_predict_layers`): the checkpoint's draft head (`model::mtp`). Left out of the
    /// JSON when 0, so that identities of configs without one read as before.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn field<'a>(obj: &'a Value, name: &str) -> Result<&'a Value> {
    obj.get(name)
        .filter(|v| !v.is_null())
        .ok_or_else(|| Error::Config(format!("missing field `{name}`")))
}

fn usize_field(obj: &Value, name: &str) -> Result<usize> {
    field(obj, name)?
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| Error::Config(format!("field `{name}` must be a non-negative integer")))
}

fn f32_field(obj: &Value, name: &str) -> Result<f32> {
    field(obj, name)?
        .as_f64()
        .map(|v| v as f32)
        .ok_or_else(|| Error::Config(format!("field `{name}` must be a number")))
}

/// A field that may live in `rope_parameters` (or the older `rope_scaling`) or at the top level.
fn rope_field(obj: &Value, name: &str, default: Option<f32>) -> Result<f32> {
    for nested in ["rope_parameters", "rope_scaling"] {
        if let Some(v) = obj
            .get(nested)
            .and_then(|p| p.get(name))
            .and_then(Value::as_f64)
        {
            return Ok(v as f32);
        }
    }
    match (obj.get(name).and_then(Value::as_f64), default) {
        (Some(v), _) => Ok(v as f32),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(Error::Config(format!(
            "missing field `{name}` (looked in rope_parameters and at the top level)"
        ))),
    }
}

impl ModelConfig {
    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("config.json is not valid JSON: {e}")))?;
        let c = root.get("text_config").unwrap_or(&root);
        let num_hidden_layers = usize_field(c, "num_hidden_layers")?;
        // Checked here too, before the interval rule builds a list of this length.
        check_layers(num_hidden_layers)?;
        let layer_types = match c.get("layer_types").filter(|v| !v.is_null()) {
            Some(list) => {
                let list = list
                    .as_array()
                    .ok_or_else(|| Error::Config("field `layer_types` must be a list".into()))?;
                list.iter()
                    .enumerate()
                    .map(|(i, v)| match v.as_str() {
                        Some("linear_attention") => Ok(LayerKind::LinearAttention),
                        Some("full_attention") => Ok(LayerKind::FullAttention),
                        other => Err(Error::Config(format!(
                            "layer_types[{i}]: unknown layer type {other:?}"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                let interval = match c.get("full_attention_interval") {
                    Some(v) => v.as_u64().filter(|&v| v > 0).ok_or_else(|| {
                        Error::Config(
                            "field `full_attention_interval` must be a positive integer".into(),
                        )
                    })? as usize,
                    None => 4,
                };
                Self::interval_layer_types(num_hidden_layers, interval)
            }
        };
        let eos = c.get("eos_token_id").or_else(|| root.get("eos_token_id"));
        let eos_token_ids = match eos {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|v| v as u32)
                .collect(),
            _ => Vec::new(),
        };
        let tie = c
            .get("tie_word_embeddings")
            .or_else(|| root.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let cfg = ModelConfig {
            vocab_size: usize_field(c, "vocab_size")?,
            hidden_size: usize_field(c, "hidden_size")?,
            intermediate_size: usize_field(c, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads: usize_field(c, "num_attention_heads")?,
            num_key_value_heads: usize_field(c, "num_key_value_heads")?,
            head_dim: usize_field(c, "head_dim")?,
            linear_num_key_heads: usize_field(c, "linear_num_key_heads")?,
            linear_num_value_heads: usize_field(c, "linear_num_value_heads")?,
            linear_key_head_dim: usize_field(c, "linear_key_head_dim")?,
            linear_value_head_dim: usize_field(c, "linear_value_head_dim")?,
            linear_conv_kernel_dim: usize_field(c, "linear_conv_kernel_dim")?,
            rms_norm_eps: f32_field(c, "rms_norm_eps")?,
            rope_theta: rope_field(c, "rope_theta", None)?,
            partial_rotary_factor: rope_field(c, "partial_rotary_factor", Some(1.0))?,
            max_position_embeddings: c
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(262_144) as usize,
            tie_word_embeddings: tie,
            layer_types,
            eos_token_ids,
            layout: WeightLayout::HuggingFace,
            mtp_layers: c
                .get("mtp_num_hidden_layers")
                .or_else(|| c.get("num_nextn_predict_layers"))
                .and_then(Value::as_u64)
                .map_or(0, |n| n as usize),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// How many of `layers` are of `kind`: the one place layers are counted by kind.
    pub fn count_layers(&self, layers: std::ops::Range<usize>, kind: LayerKind) -> usize {
        self.layer_types[layers]
            .iter()
            .filter(|&&k| k == kind)
            .count()
    }

    /// Bytes of one position's K and V rows in one full-attention layer, stored as `types`.
    pub fn kv_row_bytes(&self, types: CacheTypes) -> usize {
        types.position_bytes(self.num_key_value_heads * self.head_dim)
    }

    /// Bytes of the K and V rows, stored as `types`, of `positions` positions in the
    /// full-attention layers among `layers`.
    pub fn kv_bytes(
        &self,
        types: CacheTypes,
        layers: std::ops::Range<usize>,
        positions: usize,
    ) -> usize {
        self.count_layers(layers, LayerKind::FullAttention) * self.kv_row_bytes(types) * positions
    }

    /// Layer i is full attention iff (i + 1) % interval == 0: L L L F, repeated.
    pub fn interval_layer_types(layers: usize, interval: usize) -> Vec<LayerKind> {
        (0..layers)
            .map(|i| {
                if (i + 1) % interval == 0 {
                    LayerKind::FullAttention
                } else {
                    LayerKind::LinearAttention
                }
            })
            .collect()
    }

    /// Reject shapes the math cannot run with, so later code can index without checks, and
    /// sizes past [`MAX_LAYERS`] and [`MAX_ELEMS`], so later code can multiply without checks.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(Error::Config(m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ] {
            if v == 0 {
                return err(format!("field `{name}` must be positive"));
            }
        }
        check_layers(self.num_hidden_layers)?;
        if self.mtp_layers > 1 {
            return err(format!(
                "{} multi-token-prediction layers: tether reads a head of one (as every \
                 Qwen3.5 checkpoint has)",
                self.mtp_layers
            ));
        }
        self.check_sizes()?;
        if self.layer_types.len() != self.num_hidden_layers {
            return err(format!(
                "layer_types has {} entries but num_hidden_layers is {}",
                self.layer_types.len(),
                self.num_hidden_layers
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return err("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return err("linear_num_value_heads must be a multiple of linear_num_key_heads".into());
        }
        let rot = self.rotary_dim();
        if !rot.is_multiple_of(2) || rot > self.head_dim {
            return err(format!(
                "rotary dim {rot} (head_dim x partial_rotary_factor) must be even and <= head_dim"
            ));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return err("rope_theta must be positive".into());
        }
        Ok(())
    }

    /// Every tensor and per-sequence state size the model derives from this config, within
    /// [`MAX_ELEMS`]. Each product covers the smaller ones inside it (fields are positive).
    fn check_sizes(&self) -> Result<()> {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let conv_dim = elems(&[2, self.linear_num_key_heads, self.linear_key_head_dim])
            .zip(elems(&[
                self.linear_num_value_heads,
                self.linear_value_head_dim,
            ]))
            .and_then(|(qk, v)| qk.checked_add(v))
            .filter(|&n| n as u64 <= MAX_ELEMS);
        let sizes = [
            ("embeddings", elems(&[self.vocab_size, h])),
            ("MLP", elems(&[self.intermediate_size, h])),
            ("attention q", elems(&[2, self.num_attention_heads, hd, h])),
            ("attention k, v", elems(&[self.num_key_value_heads, hd, h])),
            (
                "DeltaNet in_proj_qkv",
                conv_dim.and_then(|cd| elems(&[cd, h])),
            ),
            (
                "DeltaNet conv",
                conv_dim.and_then(|cd| elems(&[cd, self.linear_conv_kernel_dim])),
            ),
            (
                "DeltaNet z, out",
                elems(&[self.linear_num_value_heads, self.linear_value_head_dim, h]),
            ),
            (
                "DeltaNet state",
                elems(&[
                    self.linear_num_value_heads,
                    self.linear_key_head_dim,
                    self.linear_value_head_dim,
                ]),
            ),
        ];
        match sizes.iter().find(|(_, n)| n.is_none()) {
            Some((what, _)) => Err(Error::Config(format!(
                "the {what} tensors of this config would exceed {MAX_ELEMS} elements"
            ))),
            None => Ok(()),
        }
    }

    /// `int(head_dim * partial_rotary_factor)` as Hugging Face computes it, a product within
    /// f32 rounding of a whole number taken as that number (a GGUF stores the dimension count,
    /// and its ratio to the head width does not always survive f32).
    pub fn rotary_dim(&self) -> usize {
        let exact = self.head_dim as f32 * self.partial_rotary_factor;
        let nearest = exact.round();
        if (exact - nearest).abs() < 1e-3 {
            nearest as usize
        } else {
            exact as usize
        }
    }

    /// Values of one DeltaNet layer's state for one sequence: the recurrent state
    /// `[v_heads, dk, dv]` and the conv history `[kernel - 1, conv_dim]`.
    pub fn delta_state_len(&self) -> (usize, usize) {
        (
            self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim,
            (self.linear_conv_kernel_dim - 1) * self.conv_dim(),
        )
    }

    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the DeltaNet causal conv: `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// A flat `qwen3_5_text` config.json that HF transformers and other engines load.
    pub fn to_hf_json(&self) -> Value {
        let mut json = serde_json::json!({
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": false,
            "tie_word_embeddings": self.tie_word_embeddings,
            "layer_types": self.layer_types,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => Value::from(*one),
                many => Value::from(many.to_vec()),
            },
        });
        if self.mtp_layers > 0 {
            json["mtp_num_hidden_layers"] = self.mtp_layers.into();
        }
        json
    }
}

fn check_layers(layers: usize) -> Result<()> {
    if layers > MAX_LAYERS {
        return Err(Error::Config(format!(
            "num_hidden_layers is {layers}; tether reads at most {MAX_LAYERS}"
        )));
    }
    Ok(())
}

/// The product of `dims` if it is at most [`MAX_ELEMS`] (and fits `usize`).
fn elems(dims: &[usize]) -> Option<usize> {
    dims.iter()
        .try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?))
        .filter(|&n| n <= MAX_ELEMS)
        .and_then(|n| usize::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAT: &str = r#"{"model_type":"qwen3_5_text","vocab_size":256,"hidden_size":64,"intermediate_size":128,
      "num_hidden_layers":8,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
      "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,"linear_value_head_dim":16,
      "linear_conv_kernel_dim":4,"rms_norm_eps":1e-6,"rope_theta":10000000.0,"partial_rotary_factor":0.25}"#;

    #[test]
    fn flat_config_with_top_level_rope_and_interval_rule() {
        let c = ModelConfig::from_json_str(FLAT).unwrap();
        assert_eq!(c.rotary_dim(), 4);
        assert_eq!(c.rope_theta, 1e7);
        let full: Vec<usize> = (0..8)
            .filter(|&i| c.layer_types[i] == LayerKind::FullAttention)
            .collect();
        assert_eq!(full, vec![3, 7]);
    }

    #[test]
    fn nested_text_config_roundtrips_through_hf_json() {
        let flat: Value = serde_json::from_str(FLAT).unwrap();
        let nested = serde_json::json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": flat});
        let c = ModelConfig::from_json_str(&nested.to_string()).unwrap();
        assert!(c.tie_word_embeddings);
        let again = ModelConfig::from_json_str(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(c, again);
    }

    #[test]
    fn missing_field_is_named() {
        let mut v: Value = serde_json::from_str(FLAT).unwrap();
        v.as_object_mut().unwrap().remove("head_dim");
        let e = ModelConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("head_dim"), "{e}");
    }
}
