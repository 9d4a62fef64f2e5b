//! Frozen KV pages as Core ML programs for the Neural Engine (feature `coreml`).
//!
//! In long-context decode the oldest KV pages are read for every token and never written
//! again. On an Apple device such a page can become a program of its own whose constant
//! weights are the page's K and V in fp16: the Neural Engine then runs the page's attention
//! beside the GPU, and its partials (`o`, normalised; `m`; `l`) merge with the others' in page
//! order like any helper's. This module writes that program as an `.mlpackage` in pure Rust,
//! on any OS: the Core ML protobuf types ([`proto`], generated once from Apple's schema by
//! `scripts/coreml-proto`), the MIL program ([`program`]) and the weight file ([`blob`]).
//! `scripts/check-coreml.sh` loads and type-checks what it writes with coremltools and runs
//! it through an interpreter of the ops against exact attention; compiling and running a
//! package needs Apple's Core ML, which this machine lacks.
//!
//! `m` and `l` come out as they are, not folded into an fp16 log-sum-exp: fp16 holds the
//! log-sum-exp of a long page with about six times the error of `m` and `l` apart.

pub mod blob;
pub mod program;
#[allow(clippy::all, missing_docs, rustdoc::all)]
pub mod proto;

use std::path::Path;

use half::f16;
use prost::Message;

use crate::error::{Error, Result};
use proto::feature_type::Type as FeatureKind;
use proto::{array_feature_type::ArrayDataType, model};

/// The Core ML specification version of iOS 18 / macOS 15, whose opset the program uses.
pub const SPEC_VERSION: i32 = 9;
/// Keys in a frozen page unless asked otherwise: four 4096-key storage pages.
pub const DEFAULT_KEYS: usize = 16384;
/// A package's weight file is capped here (K and V of one layer's page): a page this large
/// is a configuration error, not a page.
pub const MAX_WEIGHT_BYTES: usize = 1 << 30;

/// What one frozen page's program attends: `keys` positions of one layer, `kv_heads` heads of
/// `head_dim`, for `rows` query rows per KV head (tokens times the query heads of one GQA
/// group), scores scaled by `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PageShape {
    pub keys: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rows: usize,
    pub scale: f32,
}

impl PageShape {
    /// A page of `keys` positions of `c`'s full-attention layers, queried by `tokens` tokens.
    pub fn for_model(c: &crate::config::ModelConfig, keys: usize, tokens: usize) -> PageShape {
        PageShape {
            keys,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            rows: tokens * (c.num_attention_heads / c.num_key_value_heads),
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        }
    }

    /// Elements of K (and of V): `keys * kv_heads * head_dim`.
    pub fn elements(&self) -> usize {
        self.keys * self.kv_heads * self.head_dim
    }

    fn check(&self) -> Result<()> {
        let dims = [self.keys, self.kv_heads, self.head_dim, self.rows];
        if dims.contains(&0) || !self.scale.is_finite() || self.scale <= 0.0 {
            return Err(Error::Invalid(format!(
                "a frozen page needs no empty dimension and a positive scale: {self:?}"
            )));
        }
        let bytes = dims[..3]
            .iter()
            .try_fold(4usize, |acc, &d| acc.checked_mul(d))
            .filter(|&b| b <= MAX_WEIGHT_BYTES);
        if bytes.is_none() {
            return Err(Error::Invalid(format!(
                "a frozen page of {} keys x {} heads x {} is over {} MiB of K and V",
                self.keys,
                self.kv_heads,
                self.head_dim,
                MAX_WEIGHT_BYTES >> 20
            )));
        }
        Ok(())
    }
}

/// A page's package in memory: the model specification and its weight file.
#[derive(Debug)]
pub struct Package {
    /// `model.mlmodel`: a serialized `CoreML.Specification.Model`.
    pub model: Vec<u8>,
    /// `weights/weight.bin`.
    pub weights: Vec<u8>,
}

/// The package of one frozen page: `k` and `v` hold its rows, `[keys][kv_heads][head_dim]`.
pub fn page_package(shape: &PageShape, k: &[f16], v: &[f16]) -> Result<Package> {
    shape.check()?;
    if k.len() != shape.elements() || v.len() != shape.elements() {
        return Err(Error::Invalid(format!(
            "a frozen page of {:?} holds {} K and V values, not {} and {}",
            shape,
            shape.elements(),
            k.len(),
            v.len()
        )));
    }
    let built = program::page_attention(shape, k, v);
    let q = [1, shape.kv_heads * shape.head_dim, 1, shape.rows];
    let per_head = [1, shape.kv_heads, 1, shape.rows];
    let description = proto::ModelDescription {
        input: vec![feature("q", &q, ArrayDataType::Float16)],
        output: vec![
            feature("o", &q, ArrayDataType::Float32),
            feature("m", &per_head, ArrayDataType::Float32),
            feature("l", &per_head, ArrayDataType::Float32),
        ],
        metadata: Some(proto::Metadata {
            short_description: format!(
                "tether frozen KV page: attention of {} query rows over {} keys x {} KV heads",
                shape.rows, shape.keys, shape.kv_heads
            ),
            author: "tether".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let spec = proto::Model {
        specification_version: SPEC_VERSION,
        description: Some(description),
        is_updatable: false,
        r#type: Some(model::Type::MlProgram(built.program)),
    };
    Ok(Package {
        model: spec.encode_to_vec(),
        weights: built.weights,
    })
}

fn feature(name: &str, shape: &[usize], dtype: ArrayDataType) -> proto::FeatureDescription {
    proto::FeatureDescription {
        name: name.into(),
        short_description: String::new(),
        r#type: Some(proto::FeatureType {
            is_optional: false,
            r#type: Some(FeatureKind::MultiArrayType(proto::ArrayFeatureType {
                shape: shape.iter().map(|&n| n as i64).collect(),
                data_type: dtype as i32,
                ..Default::default()
            })),
        }),
    }
}

impl Package {
    /// Write the package as the directory `dir` (`….mlpackage`): `Manifest.json` and
    /// `Data/com.apple.CoreML/{model.mlmodel, weights/weight.bin}`. An existing `dir` is
    /// replaced.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |e| Error::io(p, e)
        };
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(io(dir))?;
        }
        let data = dir.join("Data/com.apple.CoreML");
        let weights = data.join("weights");
        std::fs::create_dir_all(&weights).map_err(io(&weights))?;
        let files = [
            (data.join("model.mlmodel"), &self.model),
            (weights.join("weight.bin"), &self.weights),
        ];
        for (path, bytes) in files {
            std::fs::write(&path, bytes).map_err(io(&path))?;
        }
        let manifest = dir.join("Manifest.json");
        std::fs::write(&manifest, self.manifest()).map_err(io(&manifest))
    }

    /// The package's manifest: its two items under identifiers made from the contents (the
    /// same page gives the same package, byte for byte).
    fn manifest(&self) -> String {
        let model_id = uuid_of(&[b"model", &self.model[..]]);
        let weights_id = uuid_of(&[b"weights", &self.weights[..]]);
        let item = |name: &str, path: &str, description: &str| {
            serde_json::json!({
                "author": "com.apple.CoreML",
                "description": description,
                "name": name,
                "path": path,
            })
        };
        let manifest = serde_json::json!({
            "fileFormatVersion": "1.0.0",
            "itemInfoEntries": {
                model_id.clone(): item("model.mlmodel", "com.apple.CoreML/model.mlmodel", "CoreML Model Specification"),
                weights_id: item("weights", "com.apple.CoreML/weights", "CoreML Model Weights"),
            },
            "rootModelIdentifier": model_id,
        });
        serde_json::to_string_pretty(&manifest).expect("a JSON value serializes")
    }
}

/// A UUID-shaped name (8-4-4-4-12 upper-case hex) from a hash of `parts`.
fn uuid_of(parts: &[&[u8]]) -> String {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(p);
    }
    let hex: String = h.finalize().as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}
