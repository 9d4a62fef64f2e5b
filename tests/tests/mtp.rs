//! The multi-token-prediction head (issue 36, item 1): read from a checkpoint (`mtp.*`) and
//! from a GGUF (`blk.N.nextn.*`), and its forward against `scripts/mtp-reference.py`, an
//! independent numpy version of the model and the head computed in f64
//! (`tests/fixtures/mtp_tiny`: `tether synth --preset tiny --mtp --dtype f32 --weight-seed 7`,
//! then the script on 20 tokens with a chain of 4).

use std::path::PathBuf;

use engine_core::cache_types::CacheTypes;
use engine_core::generate::argmax;
use engine_core::gguf::quantize;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{CpuBackend, Model};
use tests::{max_abs_diff, Reference};

/// The fixtures' bound on fp32 logits.
const TOLERANCE: f32 = 1e-4;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/mtp_tiny")
}

fn reference() -> Reference {
    let bytes = std::fs::read(fixture_dir().join("reference.safetensors")).unwrap();
    Reference::from_bytes(&bytes)
}

/// The rows of `[n, width]` values `a .. b`.
fn rows(v: &[f32], width: usize, a: usize, b: usize) -> &[f32] {
    &v[a * width..b * width]
}

/// The main model's logits and final rows, the head over every (hidden row, next token) pair,
/// then a chain of drafts, each within the fixtures' bound of the reference; returns the
/// head's logits over the pairs and the chain's.
fn check_against_reference(model: &Model, what: &str) -> (Vec<f32>, Vec<f32>) {
    let r = reference();
    let be = &CpuBackend;
    let c = &model.config;
    let (h, v) = (c.hidden_size, c.vocab_size);
    let tokens = r.ids("tokens");
    let t = tokens.len();
    let mut state = model.new_state(16);
    let (hidden, logits) = model.forward_hidden(be, &mut state, &tokens).unwrap();
    let d = max_abs_diff(&logits, &r.f32("logits").1);
    assert!(d <= TOLERANCE, "{what}: main logits differ by {d}");
    let d = max_abs_diff(&hidden, &r.f32("hidden").1);
    assert!(d <= TOLERANCE, "{what}: final rows differ by {d}");

    // Every pair (h_i, x_{i+1}) at position i, in one pass through the head's cache.
    let mut kv = model.new_mtp_cache(16, CacheTypes::F32);
    let pairs = (rows(&hidden, h, 0, t - 1), &tokens[1..]);
    let (_, mtp_logits) = model.mtp(be, &mut kv, pairs, 0).unwrap();
    let d = max_abs_diff(&mtp_logits, &r.f32("mtp_logits").1);
    assert!(d <= TOLERANCE, "{what}: the head's logits differ by {d}");

    // The chain: the last row with the token drawn from it, then each draft with the head's
    // own output as the hidden row.
    let next = argmax(rows(&logits, v, t - 1, t));
    assert_eq!(vec![next], r.ids("next"), "{what}");
    let (mut g, mut token) = (rows(&hidden, h, t - 1, t).to_vec(), next);
    let (mut drafts, mut chain) = (Vec::new(), Vec::new());
    for j in 0..r.ids("chain_tokens").len() {
        let (out, l) = model.mtp(be, &mut kv, (&g, &[token]), t - 1 + j).unwrap();
        token = argmax(&l);
        drafts.push(token);
        chain.extend_from_slice(&l);
        g = out;
    }
    assert_eq!(drafts, r.ids("chain_tokens"), "{what}: chained drafts");
    let d = max_abs_diff(&chain, &r.f32("chain_logits").1);
    assert!(d <= TOLERANCE, "{what}: the chain's logits differ by {d}");
    (mtp_logits, chain)
}

#[test]
fn the_head_matches_the_numpy_reference() {
    let model = Model::load_dir(&fixture_dir()).unwrap();
    assert!(model.has_mtp());
    check_against_reference(&model, "safetensors");
}

/// `tether quantize` writes the head as llama.cpp's converter does (block `layers`,
/// `nextn.*`, its norms as `1 + w`, `nextn_predict_layers`), and the GGUF reader takes it
/// back: an f32 GGUF computes the same head.
#[test]
fn a_gguf_holds_the_head() {
    let (config, tensors) = load_model_tensors();
    let mut bytes = Vec::new();
    let no_tokenizer = |_: &mut engine_core::gguf::Writer| Ok(());
    let f32_file = quantize::FileType::parse("f32").unwrap();
    quantize::write(
        &config,
        &tensors,
        "mtp_tiny",
        f32_file,
        no_tokenizer,
        &mut bytes,
        &mut |_, _| {},
    )
    .unwrap();
    let g = engine_core::gguf::Gguf::parse(&bytes).unwrap();
    let names: Vec<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
    for name in [
        "blk.8.nextn.eh_proj.weight",
        "blk.8.nextn.enorm.weight",
        "blk.8.attn_q.weight",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    assert_eq!(g.get("qwen35.block_count").unwrap().as_u64(), Some(9));
    assert_eq!(
        g.get("qwen35.nextn_predict_layers").unwrap().as_u64(),
        Some(1)
    );

    let path = std::env::temp_dir().join(format!("tether-mtp-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let loaded = engine_core::gguf::qwen35::load(&path);
    std::fs::remove_file(&path).unwrap();
    let (config, tensors) = loaded.unwrap();
    assert_eq!(config.mtp_layers, 1);
    let model = Model::from_tensors(config, &tensors).unwrap();
    check_against_reference(&model, "f32 GGUF");
}

/// The fixture's config and tensors as a checkpoint directory gives them.
fn load_model_tensors() -> (engine_core::ModelConfig, engine_core::weights::TensorMap) {
    let dir = fixture_dir();
    let config = Model::read_config(&dir).unwrap();
    (config, engine_core::weights::load_dir(&dir).unwrap())
}

/// `--mtp` gives a preset the head; without it (or with its tensors gone from a checkpoint
/// whose config still declares one) there is none, and asking it for a draft says so.
#[test]
fn a_model_without_the_head_says_so() {
    let with = LoadOptions {
        mtp: true,
        ..Default::default()
    };
    assert!(load_model("tiny", &with).unwrap().has_mtp());
    let model = load_model("tiny", &LoadOptions::default()).unwrap();
    assert!(!model.has_mtp());
    let (config, mut tensors) = load_model_tensors();
    tensors.retain(|name, _| !name.starts_with("mtp."));
    let stripped = Model::from_tensors(config, &tensors).unwrap();
    assert!(!stripped.has_mtp());
    let mut kv = stripped.new_mtp_cache(16, CacheTypes::F32);
    let err = stripped
        .mtp(&CpuBackend, &mut kv, (&[0.0; 64], &[1]), 0)
        .unwrap_err();
    assert!(
        err.to_string().contains("no multi-token-prediction head"),
        "{err}"
    );
}
