//! A helper builds only the layers a host assigns: from a checkpoint directory or a preset, the
//! partial model has the whole model's identity, runs its layers to the same bits as the whole
//! model, and refuses clearly to run anything else.

use engine_core::backend::{cpu::host, Act};
use engine_core::kv::NoPagesAway;
use engine_core::source::{load_identity, load_layers, load_model, LoadOptions};
use engine_core::synth;
use engine_core::tensor::DType;
use engine_core::CpuBackend;
use tests::fixtures_dir;

#[test]
fn a_subset_of_a_preset_is_the_same_tensors() {
    let c = synth::preset("tiny").unwrap();
    let whole = synth::random_weights(&c, DType::BF16, 3).unwrap();
    let keep = |n: &str| n.starts_with("model.layers.5.");
    let part = synth::random_weights_where(&c, DType::BF16, 3, &keep).unwrap();
    assert!(!part.is_empty() && part.keys().all(|n| keep(n)));
    for (name, t) in &part {
        assert_eq!(t.data.as_bytes(), whole[name].data.as_bytes(), "{name}");
    }
}

#[test]
fn assigned_layers_run_like_the_whole_model_and_nothing_else() {
    let dir = fixtures_dir().join("tiny_fp32_T150");
    let dir = dir.to_str().unwrap();
    let o = LoadOptions::default();
    for spec in [dir, "tiny"] {
        let whole = load_model(spec, &o).unwrap();
        let identity = load_identity(spec, &o).unwrap();
        assert_eq!(identity.identity, whole.identity, "{spec}");
        let part = load_layers(spec, &o, 4..8, &identity.identity).unwrap();
        assert_eq!(part.loaded_layers(), 4..8);
        assert!(part.weight_bytes() < whole.weight_bytes() / 2, "{spec}");
        // The same residual rows through layers 4..8, from the same state.
        let h = whole.config.hidden_size;
        let x0: Vec<f32> = (0..5 * h)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let (mut a, mut b) = (Act::Host(x0.clone()), Act::Host(x0));
        let (mut sa, mut sb) = (whole.new_state(4), part.new_state(4));
        whole
            .run_layers(
                &CpuBackend,
                &mut sa,
                &mut NoPagesAway,
                &mut a,
                0,
                4..8,
                None,
            )
            .unwrap();
        part.run_layers(
            &CpuBackend,
            &mut sb,
            &mut NoPagesAway,
            &mut b,
            0,
            4..8,
            None,
        )
        .unwrap();
        assert!(host(&a) == host(&b), "{spec}: layers 4..8 differ");
        let err = part
            .run_layers(
                &CpuBackend,
                &mut sb,
                &mut NoPagesAway,
                &mut b,
                5,
                3..4,
                None,
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("layer 3 is not loaded"), "{err}");
        let err = part.embed(&CpuBackend, &[1, 2]).unwrap_err().to_string();
        assert!(err.contains("no embedding"), "{err}");
    }
}
