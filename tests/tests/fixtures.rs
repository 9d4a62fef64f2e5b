//! Exactness against the reference fixtures (../shared/fixtures, made by HF transformers).

use engine_core::{CpuBackend, Logits, Model};
use tests::{fixtures_dir, max_abs_diff, Reference};

const FP32: &[&str] = &["tiny_fp32", "tiny_fp32_T150"];

fn load(fixture: &str) -> (Model, Reference) {
    let model = Model::load_dir(&fixtures_dir().join(fixture)).expect("fixture model loads");
    (model, Reference::load(fixture))
}

/// Greedy decode of `n` tokens after a full prefill; returns the ids and each step's logits.
fn greedy(model: &Model, prompt: &[u32], n: usize, page_size: usize) -> (Vec<u32>, Vec<f32>) {
    let be = CpuBackend;
    let mut st = model.new_state(page_size);
    let mut logits = model
        .forward(&be, &mut st, prompt, Logits::Last, None)
        .unwrap();
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for i in 0..n {
        all.extend_from_slice(&logits);
        let next = argmax(&logits);
        ids.push(next);
        if i + 1 < n {
            logits = model
                .forward(&be, &mut st, &[next], Logits::Last, None)
                .unwrap();
        }
    }
    (ids, all)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv {
                (i, x)
            } else {
                (bi, bv)
            }
        })
        .0 as u32
}

#[test]
fn fp32_prefill_logits_and_layers_match_reference() {
    for &f in FP32 {
        let (model, r) = load(f);
        let prompt = r.ids("prompt_ids");
        let mut trace = Vec::new();
        let mut st = model.new_state(16);
        let logits = model
            .forward(&CpuBackend, &mut st, &prompt, Logits::All, Some(&mut trace))
            .unwrap();
        // Per layer first, so a failure names the first layer that diverges.
        let (shape, layers) = r.f32("prefill_layer_outputs");
        let per_layer = shape[1] * shape[2];
        for (i, ours) in trace.iter().enumerate() {
            let d = max_abs_diff(ours, &layers[i * per_layer..(i + 1) * per_layer]);
            assert!(d < 1e-4, "{f}: layer {i} output differs by {d}");
        }
        let d = max_abs_diff(&logits, &r.f32("prefill_logits").1);
        assert!(d < 1e-4, "{f}: prefill logits differ by {d}");
    }
}

#[test]
fn fp32_greedy_generation_matches_reference() {
    for &f in FP32 {
        let (model, r) = load(f);
        let want = r.ids("gen_ids");
        let (ids, logits) = greedy(&model, &r.ids("prompt_ids"), want.len(), 64);
        assert_eq!(ids, want, "{f}: generated ids");
        let d = max_abs_diff(&logits, &r.f32("gen_logits").1);
        assert!(d < 1e-4, "{f}: generation logits differ by {d}");
    }
}

#[test]
fn fp32_tokenwise_path_matches_reference() {
    for &f in FP32 {
        let (model, r) = load(f);
        let mut st = model.new_state(7);
        let mut logits = Vec::new();
        for &id in &r.ids("prompt_ids") {
            logits.extend(
                model
                    .forward(&CpuBackend, &mut st, &[id], Logits::Last, None)
                    .unwrap(),
            );
        }
        let d = max_abs_diff(&logits, &r.f32("tokenwise_logits").1);
        assert!(d < 1e-4, "{f}: token-by-token logits differ by {d}");
    }
}

/// tether computes in f32 from bf16 weights; the reference ran every op in bf16, so its logits
/// are bf16 values (steps of 0.0625 at their magnitude) and carry ~0.1-0.3 of rounding noise.
/// Tokens must agree wherever the reference's own choice is resolvable: up to the first step
/// whose top-2 margin is a single bf16 step (tiny_bf16: step 8 of 20, margin 0.0625).
#[test]
fn bf16_greedy_tokens_match_reference_while_its_margin_is_resolvable() {
    let (model, r) = load("tiny_bf16");
    assert_eq!(model.weight_dtype(), Some(engine_core::tensor::DType::BF16));
    let want = r.ids("gen_ids");
    let (_, ref_logits) = r.f32("gen_logits");
    let v = model.config.vocab_size;
    let resolvable = ref_logits
        .chunks(v)
        .take_while(|row| {
            let mut s = row.to_vec();
            s.sort_by(|a, b| b.total_cmp(a));
            s[0] - s[1] > 0.0625
        })
        .count();
    assert!(
        resolvable >= 8,
        "the fixture changed: only {resolvable} resolvable steps"
    );
    let (ids, logits) = greedy(&model, &r.ids("prompt_ids"), resolvable, 4096);
    assert_eq!(ids, want[..resolvable]);
    let d = max_abs_diff(&logits, &ref_logits[..resolvable * v]);
    assert!(
        d < 0.5,
        "bf16 logits differ by {d}, more than bf16 rounding explains"
    );
}
