//! Bad input gets a clear error naming what was wrong, never a panic, and leaves state intact.

use std::path::PathBuf;

use engine_core::synth;
use engine_core::tensor::DType;
use engine_core::{CpuBackend, Error, Logits, Model};
use tests::fixtures_dir;

/// A scratch copy of the tiny_fp32 fixture model that a test may damage.
fn scratch_model(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-bad-input-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures_dir().join("tiny_fp32").join(f), dir.join(f)).unwrap();
    }
    dir
}

#[test]
fn truncated_safetensors_is_an_error_naming_the_file() {
    let dir = scratch_model("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = Model::load_dir(&dir)
        .err()
        .expect("a truncated file must not load")
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );
}

#[test]
fn config_without_a_field_is_an_error_naming_it() {
    let dir = scratch_model("config");
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg.as_object_mut()
        .unwrap()
        .remove("linear_num_value_heads");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let err = Model::load_dir(&dir)
        .err()
        .expect("config must be rejected")
        .to_string();
    assert!(
        err.contains("missing field `linear_num_value_heads`"),
        "{err}"
    );
}

#[test]
fn misshaped_and_missing_tensors_are_named_with_shapes() {
    let config = synth::preset("tiny").unwrap();
    let mut tensors = synth::random_weights(&config, DType::F32, 1).unwrap();
    let name = "model.layers.3.self_attn.k_proj.weight";
    let mut t = tensors[name].clone();
    t.shape = vec![16, 128];
    tensors.insert(name.to_string(), t);
    let err = Model::from_tensors(config.clone(), &tensors)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        err,
        format!("tensor `{name}`: expected shape [32, 64], found [16, 128]")
    );
    tensors.remove(name);
    let err = Model::from_tensors(config, &tensors).err().unwrap();
    assert!(
        matches!(&err, Error::MissingTensor(n) if n == name),
        "{err}"
    );
}

#[test]
fn token_outside_vocabulary_is_rejected_and_state_is_untouched() {
    let model = Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap();
    let mut state = model.new_state(16);
    let first = model
        .forward(&CpuBackend, &mut state, &[1, 2, 3], Logits::Last, None)
        .unwrap();
    let err = model
        .forward(&CpuBackend, &mut state, &[4, 256], Logits::Last, None)
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        "token id 256 is outside the vocabulary (size 256)"
    );
    assert_eq!(state.pos, 3);
    // The sequence continues exactly as if the bad request never came.
    let mut fresh = model.new_state(16);
    model
        .forward(&CpuBackend, &mut fresh, &[1, 2, 3], Logits::Last, None)
        .unwrap();
    let a = model
        .forward(&CpuBackend, &mut state, &[4], Logits::Last, None)
        .unwrap();
    let b = model
        .forward(&CpuBackend, &mut fresh, &[4], Logits::Last, None)
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(first.len(), 256);
}
