//! Checkpoints that `tether eval` refuses, for the tools that must refuse them too (`tether
//! quantize`, `tether-helper`): the tiny fixture with one tensor's shape swapped, and with a
//! `config.json` whose `hidden_size` disagrees with its tensors.

use std::path::{Path, PathBuf};

use engine_core::weights;
use tests::fixtures_dir;

/// Each broken copy of the tiny fixture, written under `root`, with what its refusal must say.
/// The swapped tensor is in the last layer, which a helper assigned the first layers would
/// never build.
pub fn checkpoints(root: &Path) -> Vec<(PathBuf, &'static str)> {
    let fixture = fixtures_dir().join("tiny_fp32");
    let text = std::fs::read_to_string(fixture.join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let swapped = root.join("swapped");
    let mut tensors = weights::load_dir(&fixture).unwrap();
    let down = tensors
        .get_mut("model.layers.7.mlp.down_proj.weight")
        .unwrap();
    down.shape.reverse();
    write(&swapped, &config, |p| {
        weights::save_safetensors(&tensors, p).unwrap();
    });
    let narrow = root.join("narrow");
    let mut config = config;
    config["hidden_size"] = 32.into();
    write(&narrow, &config, |p| {
        std::fs::copy(fixture.join("model.safetensors"), p).unwrap();
    });
    vec![
        (
            swapped,
            "tensor `model.layers.7.mlp.down_proj.weight`: expected shape [64, 128], found [128, 64]",
        ),
        (
            narrow,
            "tensor `model.embed_tokens.weight`: expected shape [256, 32], found [256, 64]",
        ),
    ]
}

/// A checkpoint directory of `config` and the weights `weights` writes to the path it is given.
fn write(dir: &Path, config: &serde_json::Value, weights: impl FnOnce(&Path)) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    weights(&dir.join("model.safetensors"));
}
