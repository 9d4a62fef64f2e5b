//! A real Qwen3.5 checkpoint is multimodal: nested `text_config`, tensors under
//! `model.language_model.`, a vision tower to skip, shards listed in an index. The same weights
//! in that layout must give the same logits as the text-only fixture.

use engine_core::tensor::DType;
use engine_core::weights::{load_dir, save_raw, RawTensor};
use engine_core::{CpuBackend, Logits, Model};
use safetensors::Dtype;
use tests::fixtures_dir;

#[test]
fn sharded_multimodal_layout_loads_the_same_model() {
    let src = fixtures_dir().join("tiny_fp32");
    let dir = std::env::temp_dir().join(format!("tether-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tensors = load_dir(&src).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let fake_vision = [0u8; 16];
    let mut shards: [Vec<(String, RawTensor)>; 2] = [Vec::new(), Vec::new()];
    let mut weight_map = serde_json::Map::new();
    for (i, name) in names.iter().enumerate() {
        let t = &tensors[*name];
        assert_eq!(t.dtype(), DType::F32);
        let renamed = match name.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => name.to_string(),
        };
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        weight_map.insert(renamed.clone(), file.into());
        shards[i % 2].push((
            renamed,
            RawTensor {
                dtype: Dtype::F32,
                shape: t.shape.clone(),
                bytes: t.data.stored(),
            },
        ));
    }
    shards[0].push((
        "model.visual.blocks.0.attn.qkv.weight".into(),
        RawTensor {
            dtype: Dtype::F32,
            shape: vec![2, 2],
            bytes: &fake_vision,
        },
    ));
    weight_map.insert(
        "model.visual.blocks.0.attn.qkv.weight".into(),
        "model-00001-of-00002.safetensors".into(),
    );
    for (i, shard) in shards.iter().enumerate() {
        save_raw(
            shard,
            &dir.join(format!("model-0000{}-of-00002.safetensors", i + 1)),
        )
        .unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    // Nested config with rope parameters at the text level instead of in rope_parameters.
    let mut text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let rope = text
        .as_object_mut()
        .unwrap()
        .remove("rope_parameters")
        .unwrap();
    text["rope_theta"] = rope["rope_theta"].clone();
    text["partial_rotary_factor"] = rope["partial_rotary_factor"].clone();
    text.as_object_mut().unwrap().remove("layer_types"); // the interval rule gives the same pattern
    let cfg =
        serde_json::json!({"model_type": "qwen3_5", "text_config": text, "vision_config": {}});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();

    let prompt = [5u32, 17, 99, 250, 3, 3, 42];
    let run = |m: &Model| {
        let mut st = m.new_state(4);
        m.forward(&CpuBackend, &mut st, &prompt, Logits::All, None)
            .unwrap()
    };
    let a = run(&Model::load_dir(&src).unwrap());
    let b = run(&Model::load_dir(&dir).unwrap());
    assert_eq!(a, b);
}
