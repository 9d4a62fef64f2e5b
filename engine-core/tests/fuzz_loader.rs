//! Fuzzing the checkpoint loader: a checkpoint is files from anywhere (a download, a hand
//! edit), so `config.json`, `model.safetensors.index.json` and the safetensors files must load
//! or fail with an error, never panic, and never make the loader allocate by a size the files
//! merely announce. What loads must be what the files hold.
//!
//! Models are loaded as `Model::load_dir` does, minus the checkpoint digest: that one hashes
//! the files into the user's digest cache, which a fuzz run must not fill with scratch paths.
//!
//! `scripts/fuzz` runs these with many more cases.

mod common;

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use engine_core::config::{WeightLayout, MAX_ELEMS, MAX_LAYERS};
use engine_core::tensor::DType;
use engine_core::{synth, weights, LayerKind, Model, ModelConfig};
use proptest::prelude::*;
use serde_json::{json, Value};

use common::{cases, mutation, Mutation};

/// The smallest model with one layer of each kind. One key head per value head, so no two
/// shape fields can change together and still describe the same tensors.
fn config() -> ModelConfig {
    ModelConfig {
        vocab_size: 8,
        hidden_size: 4,
        intermediate_size: 6,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        linear_num_key_heads: 1,
        linear_num_value_heads: 1,
        linear_key_head_dim: 2,
        linear_value_head_dim: 3,
        linear_conv_kernel_dim: 2,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        partial_rotary_factor: 0.5,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        layer_types: vec![LayerKind::LinearAttention, LayerKind::FullAttention],
        eos_token_ids: vec![1],
        layout: WeightLayout::HuggingFace,
        mtp_layers: 0,
    }
}

/// The fields that fix tensor shapes: in [`config`], changing any of them alone makes some
/// tensor's shape wrong. (`num_hidden_layers` is not one: with `layer_types` changed to
/// match, fewer layers load.)
const SHAPE_FIELDS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
];

/// A scratch checkpoint directory for one test, with the valid files written.
struct Checkpoint {
    dir: PathBuf,
    config: Value,
    weights: Vec<u8>,
}

impl Checkpoint {
    fn new(test: &str) -> Checkpoint {
        let dir = std::env::temp_dir().join(format!("tether-fuzz-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tensors = synth::random_weights(&config(), DType::F32, 7).unwrap();
        let path = dir.join("model.safetensors");
        weights::save_safetensors(&tensors, &path).unwrap();
        let c = Checkpoint {
            weights: std::fs::read(&path).unwrap(),
            config: config().to_hf_json(),
            dir,
        };
        c.write_config(&c.config.to_string());
        let model = load(&c.dir).expect("the valid checkpoint loads");
        assert_eq!(model.config, config());
        c
    }

    fn write_config(&self, text: &str) {
        std::fs::write(self.dir.join("config.json"), text).unwrap();
    }

    fn write_weights(&self, bytes: &[u8]) {
        std::fs::write(self.dir.join("model.safetensors"), bytes).unwrap();
    }

    /// The valid file's header: its JSON and where the data starts.
    fn header(&self) -> (BTreeMap<String, Value>, usize) {
        let n = u64::from_le_bytes(self.weights[..8].try_into().unwrap()) as usize;
        let header = serde_json::from_slice(&self.weights[8..8 + n]).unwrap();
        (header, 8 + n)
    }
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `Model::load_dir` without the checkpoint digest (see the module doc). What the tools that
/// build no model check (`Model::check_tensors`: `tether quantize`, a helper at startup)
/// refuses the same checkpoints with the same message.
fn load(dir: &Path) -> engine_core::Result<Model> {
    let config = Model::read_config(dir)?;
    let tensors = weights::load_dir(dir)?;
    let checked = Model::check_tensors(&config, &tensors).map_err(|e| e.to_string());
    let model = Model::from_tensors(config, &tensors);
    let built = model.as_ref().map(drop).map_err(ToString::to_string);
    assert_eq!(checked, built, "check_tensors and loading disagree");
    model
}

/// A tensor stored with its shape swapped, and a config whose `hidden_size` disagrees with the
/// tensors: refused by the check, naming the tensor and both shapes.
#[test]
fn a_swapped_shape_or_another_hidden_size_is_refused_by_name() {
    let mut tensors = synth::random_weights(&config(), DType::F32, 7).unwrap();
    Model::check_tensors(&config(), &tensors).unwrap();
    let wider = ModelConfig {
        hidden_size: 8,
        ..config()
    };
    let e = Model::check_tensors(&wider, &tensors)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`model.embed_tokens.weight`: expected shape [8, 8], found [8, 4]"),
        "{e}"
    );
    let down = "model.layers.1.mlp.down_proj.weight";
    tensors.get_mut(down).unwrap().shape.reverse();
    let e = Model::check_tensors(&config(), &tensors)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("`{down}`: expected shape [4, 6], found [6, 4]")),
        "{e}"
    );
}

/// A loaded tensor map as comparable values: name, shape, dtype and bytes.
fn contents(map: &weights::TensorMap) -> BTreeMap<String, (Vec<usize>, DType, Vec<u8>)> {
    map.iter()
        .map(|(n, t)| {
            let v = (t.shape.clone(), t.dtype(), t.data.as_bytes().to_vec());
            (n.clone(), v)
        })
        .collect()
}

/// What `ModelConfig` promises of a config it accepts: `validate` passes, and every size the
/// engine derives from it fits the limits (so none overflows or allocates past them).
fn sane(c: &ModelConfig) -> Result<(), String> {
    c.validate().map_err(|e| e.to_string())?;
    let mul = |xs: &[usize]| {
        xs.iter()
            .try_fold(1u64, |n, &x| n.checked_mul(x as u64))
            .filter(|&n| n <= MAX_ELEMS)
    };
    let conv = mul(&[2, c.linear_num_key_heads, c.linear_key_head_dim])
        .zip(mul(&[c.linear_num_value_heads, c.linear_value_head_dim]))
        .and_then(|(a, b)| a.checked_add(b))
        .filter(|&n| n <= MAX_ELEMS)
        .map(|n| n as usize);
    let sizes = [
        mul(&[c.vocab_size, c.hidden_size]),
        mul(&[c.intermediate_size, c.hidden_size]),
        mul(&[2, c.num_attention_heads, c.head_dim, c.hidden_size]),
        mul(&[c.num_key_value_heads, c.head_dim, c.hidden_size]),
        conv.and_then(|cd| mul(&[cd, c.hidden_size])),
        conv.and_then(|cd| mul(&[cd, c.linear_conv_kernel_dim])),
        mul(&[
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        ]),
    ];
    if sizes.iter().any(Option::is_none) || c.num_hidden_layers > MAX_LAYERS {
        return Err(format!("accepted a config past the limits: {c:?}"));
    }
    Ok(())
}

/// Any JSON value, with numbers that are zero, small, huge, negative or fractional.
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![
            0..10u64,
            Just(1 << 31),
            Just(1 << 32),
            Just(1 << 40),
            Just(1 << 62),
            Just(u64::MAX),
            any::<u64>()
        ]
        .prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![
            Just("linear_attention".to_string()),
            Just("full_attention".to_string()),
            any::<String>()
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(config_key(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A key of `config.json`: one the parser reads, most of the time.
fn config_key() -> impl Strategy<Value = String> {
    const OTHERS: &[&str] = &[
        "num_hidden_layers",
        "layer_types",
        "full_attention_interval",
        "rms_norm_eps",
        "rope_theta",
        "partial_rotary_factor",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "eos_token_id",
        "text_config",
    ];
    prop_oneof![
        2 => proptest::sample::select(SHAPE_FIELDS).prop_map(str::to_string),
        2 => proptest::sample::select(OTHERS).prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

#[derive(Clone, Debug)]
enum ConfigEdit {
    Set(String, Value),
    Remove(String),
}

fn config_edit() -> impl Strategy<Value = ConfigEdit> {
    prop_oneof![
        3 => (config_key(), arb_json()).prop_map(|(k, v)| ConfigEdit::Set(k, v)),
        1 => config_key().prop_map(ConfigEdit::Remove),
    ]
}

/// A change to the valid safetensors header, which is then written back with its length.
#[derive(Clone, Debug)]
enum HeaderEdit {
    /// Tensor `i` (modulo their number) gets other data offsets.
    Offsets(usize, Value),
    Shape(usize, Value),
    Dtype(usize, Value),
    Remove(usize),
    /// Any key set to any value (a new tensor, `__metadata__`, ...).
    Set(String, Value),
    /// Every tensor becomes U8 bytes, `total` of them together, in order: a file that
    /// announces far more data than it has (up to the end of `u64`).
    Claim(u64),
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let offset = prop_oneof![0..64u64, Just(u64::MAX), Just(1 << 63), any::<u64>()];
    let offsets = prop_oneof![
        (offset.clone(), offset).prop_map(|(a, b)| json!([a, b])),
        arb_json(),
    ];
    let dim = prop_oneof![0..9u64, Just(1 << 32), Just(1 << 62), any::<u64>()];
    let shape = prop_oneof![
        proptest::collection::vec(dim, 0..4).prop_map(Value::from),
        arb_json(),
    ];
    let dtype = prop_oneof![
        proptest::sample::select(&["F32", "F16", "BF16", "U8", "I64", "F64", "BOOL", "F4"][..])
            .prop_map(Value::from),
        arb_json(),
    ];
    let total = prop_oneof![
        (0..4096u64).prop_map(|d| u64::MAX - d),
        any::<u64>(),
        0..100_000u64
    ];
    prop_oneof![
        (any::<usize>(), offsets).prop_map(|(i, v)| HeaderEdit::Offsets(i, v)),
        (any::<usize>(), shape).prop_map(|(i, v)| HeaderEdit::Shape(i, v)),
        (any::<usize>(), dtype).prop_map(|(i, v)| HeaderEdit::Dtype(i, v)),
        any::<usize>().prop_map(HeaderEdit::Remove),
        (
            prop_oneof![Just("__metadata__".to_string()), any::<String>()],
            arb_json()
        )
            .prop_map(|(k, v)| HeaderEdit::Set(k, v)),
        total.prop_map(HeaderEdit::Claim),
    ]
}

impl HeaderEdit {
    fn apply(&self, header: &mut BTreeMap<String, Value>) {
        let names: Vec<String> = header
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect();
        let pick = |i: usize| names.get(i % names.len().max(1)).cloned();
        let mut set = |i: usize, field: &str, v: &Value| {
            if let Some(Value::Object(t)) = pick(i).and_then(|n| header.get_mut(&n)) {
                t.insert(field.to_string(), v.clone());
            }
        };
        match self {
            HeaderEdit::Offsets(i, v) => set(*i, "data_offsets", v),
            HeaderEdit::Shape(i, v) => set(*i, "shape", v),
            HeaderEdit::Dtype(i, v) => set(*i, "dtype", v),
            HeaderEdit::Remove(i) => {
                if let Some(n) = pick(*i) {
                    header.remove(&n);
                }
            }
            HeaderEdit::Set(k, v) => {
                header.insert(k.clone(), v.clone());
            }
            HeaderEdit::Claim(total) => {
                let n = names.len() as u64;
                if n == 0 {
                    return;
                }
                let mut start = 0u64;
                for (i, name) in names.iter().enumerate() {
                    let len = if i as u64 + 1 == n {
                        total - start
                    } else {
                        total / n
                    };
                    header.insert(
                        name.clone(),
                        json!({
                            "dtype": "U8",
                            "shape": [len],
                            "data_offsets": [start, start + len],
                        }),
                    );
                    start += len;
                }
            }
        }
    }
}

/// A safetensors file of `header` and `data`, its header length right.
fn safetensors_file(header: &BTreeMap<String, Value>, data: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(header).unwrap();
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    out
}

/// Loads the checkpoint: an error, or (when `same_data`: the tensor bytes were not touched)
/// a model of exactly the valid file's tensors.
fn refused_or_unchanged(c: &Checkpoint, same_data: bool) -> Result<(), TestCaseError> {
    if load(&c.dir).is_ok() && same_data {
        let got = weights::load_dir(&c.dir).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let want = synth::random_weights(&config(), DType::F32, 7).unwrap();
        prop_assert!(
            contents(&got) == contents(&want),
            "the weights loaded changed"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(512))]

    /// Any text as `config.json`: an error, or a config within every limit.
    #[test]
    fn any_config_text_is_refused_or_sane(
        text in prop_oneof![
            any::<String>(),
            arb_json().prop_map(|v| v.to_string()),
            (any::<usize>(), any::<String>()).prop_map(|(at, s)| {
                let valid = config().to_hf_json().to_string();
                let at = (0..=at % valid.len()).rev().find(|&i| valid.is_char_boundary(i)).unwrap();
                format!("{}{s}", &valid[..at])
            }),
        ],
    ) {
        if let Ok(c) = ModelConfig::from_json_str(&text) {
            sane(&c).map_err(TestCaseError::fail)?;
        }
    }

    /// The valid config with fields changed, removed or added, flat or under `text_config`,
    /// beside valid weights: a shape field changed is always refused; nothing panics, and what
    /// loads is within every limit.
    #[test]
    fn edited_configs_load_only_when_they_fit_the_weights(
        edits in proptest::collection::vec(config_edit(), 1..5),
        nested in any::<bool>(),
    ) {
        thread_local!(static CKPT: Checkpoint = Checkpoint::new("config"));
        let mut flat = config().to_hf_json();
        for e in &edits {
            match e {
                ConfigEdit::Set(k, v) => flat[k] = v.clone(),
                ConfigEdit::Remove(k) => {
                    flat.as_object_mut().unwrap().remove(k);
                }
            }
        }
        let changed = SHAPE_FIELDS.iter().find(|f| {
            let was = config().to_hf_json()[**f].as_u64();
            flat.get(**f).and_then(Value::as_u64) != was
        });
        let text = if nested {
            json!({"model_type": "qwen3_5", "text_config": flat}).to_string()
        } else {
            flat.to_string()
        };
        let res = CKPT.with(|c| {
            c.write_config(&text);
            load(&c.dir)
        });
        if let Ok(model) = res {
            prop_assert!(changed.is_none(), "loaded with {:?} changed: {}", changed, text);
            sane(&model.config).map_err(TestCaseError::fail)?;
        }
    }

    /// Without `layer_types`, the layer count alone sizes the layer list (as `--layers` does
    /// a synthetic model's): a count past the limit is refused before anything is allocated
    /// for it.
    #[test]
    fn a_huge_layer_count_is_refused(
        layers in prop_oneof![
            0..64u64,
            Just(MAX_LAYERS as u64 + 1),
            Just(1 << 40),
            Just(u64::MAX),
            any::<u64>(),
        ],
        interval in prop_oneof![Just(None), (0..8u64).prop_map(Some)],
    ) {
        let mut c = config().to_hf_json();
        let obj = c.as_object_mut().unwrap();
        obj.remove("layer_types");
        obj.insert("num_hidden_layers".into(), layers.into());
        if let Some(i) = interval {
            obj.insert("full_attention_interval".into(), i.into());
        }
        let res = ModelConfig::from_json_str(&c.to_string());
        let fits = (1..=MAX_LAYERS as u64).contains(&layers) && interval != Some(0);
        prop_assert_eq!(
            res.is_ok(),
            fits,
            "{} layers, interval {:?}: {:?}",
            layers,
            interval,
            res.err()
        );
        if let Ok(c) = res {
            prop_assert_eq!(c.layer_types.len() as u64, layers);
        }
        // `--layers` of a synthetic model sizes the same list.
        let fits = (1..=MAX_LAYERS as u64).contains(&layers);
        prop_assert_eq!(synth::with_layers(config(), layers as usize).is_ok(), fits);
    }

    /// The valid safetensors file with bytes flipped, cut or added anywhere: a file of another
    /// length is refused; a file whose data bytes are intact loads unchanged or not at all.
    #[test]
    fn mutated_safetensors_are_refused_or_unchanged(
        edits in proptest::collection::vec(mutation(), 1..4),
        in_header in any::<bool>(),
    ) {
        thread_local!(static CKPT: Checkpoint = Checkpoint::new("bytes"));
        CKPT.with(|c| {
            let (_, data_start) = c.header();
            let mut bytes = c.weights.clone();
            for e in &edits {
                // Half the time, flips land in the length and header (the parsed part).
                match e {
                    Mutation::Flip { at, mask } if in_header && !bytes.is_empty() => {
                        let n = data_start.min(bytes.len());
                        bytes[at % n] ^= mask;
                    }
                    e => e.apply(&mut bytes),
                }
            }
            c.write_weights(&bytes);
            let res = weights::load_dir(&c.dir);
            if bytes.len() != c.weights.len() {
                prop_assert!(
                    res.is_err(),
                    "a file of {} bytes (of {}) loaded",
                    bytes.len(),
                    c.weights.len()
                );
            }
            let same_data = bytes.len() == c.weights.len()
                && bytes[data_start..] == c.weights[data_start..];
            refused_or_unchanged(c, same_data)
        })?;
    }

    /// The valid header with offsets, shapes and dtypes changed (out of range, overlapping,
    /// overflowing, mistyped), tensors dropped or added: refused, or the same tensors.
    #[test]
    fn edited_safetensors_headers_are_refused_or_unchanged(
        edits in proptest::collection::vec(header_edit(), 1..4),
    ) {
        thread_local!(static CKPT: Checkpoint = Checkpoint::new("header"));
        CKPT.with(|c| {
            let (mut header, data_start) = c.header();
            for e in &edits {
                e.apply(&mut header);
            }
            c.write_weights(&safetensors_file(&header, &c.weights[data_start..]));
            refused_or_unchanged(c, true)
        })?;
    }

    /// Any `model.safetensors.index.json`: an error, or shard paths inside the checkpoint
    /// directory (a shard list must not reach other files).
    #[test]
    fn shard_index_names_only_files_inside_the_checkpoint(
        index in prop_oneof![
            arb_json(),
            proptest::collection::btree_map(
                any::<String>(),
                prop_oneof![
                    Just("model.safetensors".to_string()),
                    Just("../model.safetensors".to_string()),
                    Just("/etc/hostname".to_string()),
                    Just("sub/../../x".to_string()),
                    any::<String>(),
                ],
                0..4,
            )
            .prop_map(|m| json!({"weight_map": m})),
        ],
    ) {
        thread_local!(static CKPT: Checkpoint = Checkpoint::new("index"));
        CKPT.with(|c| {
            std::fs::write(c.dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
            if let Ok(files) = weights::checkpoint_files(&c.dir) {
                for f in &files {
                    let inside = f.strip_prefix(&c.dir).is_ok_and(|rel| {
                        rel.components().count() > 0
                            && rel.components().all(|p| matches!(p, Component::Normal(_)))
                    });
                    prop_assert!(inside, "{} is outside {}", f.display(), c.dir.display());
                }
            }
            // Whatever the index says, loading fails cleanly or gives the valid tensors.
            refused_or_unchanged(c, true)
        })?;
    }
}
