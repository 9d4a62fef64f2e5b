//! Frozen pages (`--freeze-pages`) in a model's decode: every page that fills is packed in
//! fp16 for the frozen-page kernel, and decode rows read it. Over 256 greedy tokens the tokens
//! are those of the paged kernel, with logits close to its (the sums run in another order,
//! and an f32 page's keys and values are rounded to fp16), on the fixtures and on a model with
//! Qwen3.5's grouping; a rewind into a frozen page unfreezes it.

use engine_core::backend::{CacheTypes, KvType};
use engine_core::config::LayerKind;
use engine_core::host::Sequence;
use engine_core::model::LayerState;
use engine_core::{CpuBackend, Logits, Model};
use tests::{fixtures_dir, max_abs_diff, tiny256, Reference};

const PAGE: usize = 16;
const TOKENS: usize = 256;

/// Greedy tokens after `prompt`, with every step's logits; the sequence afterwards.
fn greedy(
    m: &Model,
    types: CacheTypes,
    freeze: bool,
    prompt: &[u32],
) -> (Vec<u32>, Vec<f32>, Sequence) {
    let be = &CpuBackend;
    let mut seq = Sequence::typed(&m.config, PAGE, types, be).unwrap();
    if freeze {
        seq.state.freeze_pages();
    }
    let mut logits = seq.forward(m, be, prompt, Logits::Last, None).unwrap();
    let (mut ids, mut all) = (Vec::new(), logits.clone());
    for _ in 0..TOKENS {
        let next = engine_core::generate::argmax(&logits);
        ids.push(next);
        logits = seq.forward(m, be, &[next], Logits::Last, None).unwrap();
        all.extend_from_slice(&logits);
    }
    (ids, all, seq)
}

fn frozen_pages(seq: &Sequence) -> usize {
    let caches = seq.state.layers.iter().filter_map(|l| match l {
        LayerState::Attention(kv) => Some(kv),
        _ => None,
    });
    caches
        .flat_map(|kv| kv.pages())
        .filter(|p| p.frozen.is_some())
        .count()
}

fn attention_layers(m: &Model) -> usize {
    let kinds = m.config.layer_types.iter();
    kinds
        .filter(|k| matches!(k, LayerKind::FullAttention))
        .count()
}

#[test]
fn frozen_pages_decode_the_paged_kernels_tokens() {
    let fixture = Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap();
    let fixture_prompt = Reference::load("tiny_fp32").ids("prompt_ids");
    let synth_prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 1024).collect();
    let f16 = CacheTypes {
        k: KvType::F16,
        v: KvType::F16,
    };
    for (name, m, prompt, types) in [
        ("tiny_fp32, f16 KV", &fixture, &fixture_prompt, f16),
        (
            "tiny_fp32, f32 KV",
            &fixture,
            &fixture_prompt,
            CacheTypes::F32,
        ),
        ("tiny256, f16 KV", &tiny256(), &synth_prompt, f16),
    ] {
        let (want, want_logits, _) = greedy(m, types, false, prompt);
        let (got, got_logits, seq) = greedy(m, types, true, prompt);
        let attention_layers = attention_layers(m);
        let full = (prompt.len() + TOKENS) / PAGE;
        assert_eq!(frozen_pages(&seq), full * attention_layers, "{name}");
        assert_eq!(got, want, "{name}: tokens");
        let diff = max_abs_diff(&got_logits, &want_logits);
        println!("{name}: {TOKENS} tokens identical, logits within {diff:.2e}");
        assert!(diff < 1e-2, "{name}: logits differ by {diff}");
    }
}

/// A pass of a few rows (a speculative verify) gives each row, bit for bit, what its decode
/// step gives over frozen pages too.
#[test]
fn a_few_rows_over_frozen_pages_are_their_decode_steps() {
    let m = tiny256();
    let be = &CpuBackend;
    let prompt: Vec<u32> = (0..37).map(|i| (i * 11 + 5) % 1024).collect();
    let f16 = CacheTypes {
        k: KvType::F16,
        v: KvType::F16,
    };
    let fresh = || {
        let mut seq = Sequence::typed(&m.config, PAGE, f16, be).unwrap();
        seq.state.freeze_pages();
        seq.forward(&m, be, &prompt, Logits::Last, None).unwrap();
        seq
    };
    let rows = [17u32, 400, 3, 999, 42];
    let together = fresh().forward(&m, be, &rows, Logits::All, None).unwrap();
    let mut alone = fresh();
    let steps: Vec<f32> = rows
        .iter()
        .flat_map(|&t| alone.forward(&m, be, &[t], Logits::Last, None).unwrap())
        .collect();
    assert!(frozen_pages(&alone) > 0);
    assert_eq!(together, steps);
}

#[test]
fn a_rewind_into_a_frozen_page_unfreezes_it() {
    let m = tiny256();
    let be = &CpuBackend;
    let prompt: Vec<u32> = (0..50).map(|i| (i * 7 + 3) % 1024).collect();
    let f16 = CacheTypes {
        k: KvType::F16,
        v: KvType::F16,
    };
    let mut seq = Sequence::typed(&m.config, PAGE, f16, be).unwrap();
    seq.state.freeze_pages();
    let cp = {
        seq.forward(&m, be, &prompt[..40], Logits::Last, None)
            .unwrap();
        seq.state.checkpoint(be)
    };
    seq.forward(&m, be, &prompt[40..], Logits::Last, None)
        .unwrap();
    let layers = attention_layers(&m);
    assert_eq!(frozen_pages(&seq), 3 * layers);
    // Back to 40: the page 32..48 is written again, so it is frozen no more.
    seq.rewind(be, &cp).unwrap();
    assert_eq!(frozen_pages(&seq), 2 * layers);
    // Decode rows from 40 on, one at a time, against a sequence that froze the same pages and
    // never had others: a stale copy of 32..48 would give position 40 the old key.
    let mut plain = Sequence::typed(&m.config, PAGE, f16, be).unwrap();
    plain.state.freeze_pages();
    plain
        .forward(&m, be, &prompt[..40], Logits::Last, None)
        .unwrap();
    for t in [5u32, 9, 200, 31, 7, 77, 12, 3, 100] {
        let a = seq.forward(&m, be, &[t], Logits::Last, None).unwrap();
        let b = plain.forward(&m, be, &[t], Logits::Last, None).unwrap();
        assert_eq!(a, b, "token {t}");
    }
    assert_eq!(
        frozen_pages(&seq),
        3 * layers,
        "the page refilled is frozen again"
    );
}
