//! Speculative decoding (issue 36): a verify pass of a few rows gives each row, bit for bit,
//! the logits of its own decode step, so a drafted generation keeps exactly the plain run's
//! tokens, and a refused draft leaves the sequence as plain decoding would, on the host alone
//! and with pages on a helper.

use std::path::PathBuf;

use engine_core::backend::{CacheTypes, KvType};
use engine_core::draft::{DraftKind, Drafter, Drafts, Replay};
use engine_core::generate::{DraftStats, Generation, Sampler, SamplingParams};
use engine_core::host::split::SplitPlan;
use engine_core::host::Sequence;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{CpuBackend, Logits, Model};
use tests::{attach, spawn_helper};

const PAGE: usize = 16;

fn preset(name: &str, dtype: &str, layers: Option<usize>) -> Model {
    let o = LoadOptions {
        weight_dtype: dtype.into(),
        layers,
        ..Default::default()
    };
    load_model(name, &o).unwrap()
}

fn gguf(name: &str) -> Model {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/gguf/{name}"));
    let (config, tensors) = engine_core::gguf::qwen35::load(&path).unwrap();
    Model::from_tensors(config, &tensors).unwrap()
}

fn types(k: KvType, v: KvType) -> CacheTypes {
    CacheTypes { k, v }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Float weights (f32, bf16, f16), the integer kernels' types (Q8_0, Q4_0 and the k-quants of
/// Q4_K_M) and a larger shape, each at exact and compact KV: a pass over a prompt's end and six
/// more tokens gives every row the logits of feeding the tokens one at a time.
#[test]
fn a_verify_pass_gives_each_row_its_decode_step_logits() {
    let models = [
        ("tiny256 f32", preset("tiny256", "f32", None)),
        ("tiny256 bf16", preset("tiny256", "bf16", None)),
        ("tiny256 f16", preset("tiny256", "f16", None)),
        (
            "qwen35-0.8b bf16, 4 layers",
            preset("qwen35-0.8b", "bf16", Some(4)),
        ),
        ("q8_0", gguf("tiny_fp32.q8_0.gguf")),
        ("q4_0", gguf("tiny_fp32.q4_0.gguf")),
        ("q4_k_m", gguf("tiny256.q4_k_m.gguf")),
    ];
    let be = &CpuBackend;
    let prompt: Vec<u32> = (0..45).map(|i| (i * 37 + 11) % 200).collect();
    let rows = [5u32, 17, 99, 3, 3, 42];
    let mut compact = 0;
    for (name, m) in &models {
        let all_types = [
            CacheTypes::F32,
            types(KvType::F16, KvType::F16),
            types(KvType::Q8_0, KvType::Q4_0),
        ];
        for types in all_types {
            // Compact blocks need whole blocks of a head: the tiny_fp32 shape's 16 are not.
            let Ok(mut a) = Sequence::typed(&m.config, PAGE, types, be) else {
                continue;
            };
            compact += usize::from(types != CacheTypes::F32);
            let mut b = Sequence::typed(&m.config, PAGE, types, be).unwrap();
            a.forward(m, be, &prompt, Logits::None, None).unwrap();
            b.forward(m, be, &prompt, Logits::None, None).unwrap();
            let all = a.forward(m, be, &rows, Logits::All, None).unwrap();
            let vocab = m.config.vocab_size;
            for (i, &t) in rows.iter().enumerate() {
                let one = b.forward(m, be, &[t], Logits::Last, None).unwrap();
                assert!(
                    bits(&all[i * vocab..][..vocab]) == bits(&one),
                    "{name}, {types}: row {i} differs from its decode step"
                );
            }
        }
    }
    assert!(compact >= 4, "compact KV was checked on {compact} models");
}

/// `n` tokens drawn by `sampler` after `prompt` (with `drafter`, if any), the sequence's
/// logits for feeding the last of them (the state the run left, compared bit for bit), and
/// what the drafts did.
fn generate(
    m: &Model,
    seq: Sequence,
    prompt: &[u32],
    n: usize,
    (sampler, drafter): (SamplingParams, Option<Box<dyn Drafter + Send>>),
) -> (Vec<u32>, Vec<f32>, DraftStats) {
    let be = &CpuBackend;
    let sampler = Sampler::new(sampler).unwrap();
    let mut g = Generation::new(m, be, seq, sampler, Vec::new()).with_drafter(drafter);
    g.limit(n);
    g.prefill(prompt, &SplitPlan::default()).unwrap();
    let tokens: Vec<u32> = (0..n).map(|_| g.next_token().unwrap().unwrap()).collect();
    let last = *tokens.last().unwrap();
    let next = g.seq.forward(m, be, &[last], Logits::Last, None).unwrap();
    assert_eq!(
        g.seq.state.pos,
        prompt.len() + n,
        "the sequence holds every token"
    );
    (tokens, next, g.stats)
}

fn fresh(m: &Model) -> Sequence {
    let f16 = types(KvType::F16, KvType::F16);
    Sequence::typed(&m.config, PAGE, f16, &CpuBackend).unwrap()
}

/// A prompt that repeats: the n-gram drafter proposes its continuation from the repeats.
fn repeating_prompt() -> Vec<u32> {
    let line: Vec<u32> = (0..9).map(|i| (i * 53 + 7) % 250).collect();
    line.iter().cycle().take(60).copied().collect()
}

#[test]
fn ngram_drafts_keep_the_plain_tokens() {
    let m = preset("tiny256", "bf16", None);
    let prompt = repeating_prompt();
    let greedy = SamplingParams::greedy();
    let (want, want_next, _) = generate(&m, fresh(&m), &prompt, 80, (greedy.clone(), None));
    let ngram = Drafts {
        kind: DraftKind::Ngram,
        max: 6,
        min: 1,
    };
    let drafter = ngram.drafter().unwrap();
    let (got, got_next, stats) = generate(&m, fresh(&m), &prompt, 80, (greedy, drafter));
    assert_eq!(got, want);
    assert!(
        bits(&got_next) == bits(&want_next),
        "the final state differs"
    );
    assert!(stats.steps > 0 && stats.drafted > 0, "{stats:?}");
    eprintln!("n-gram drafts over 80 tokens: {stats:?}");
}

/// A draft refused at each index 0..4 (the plain run's own tokens, one changed): the tokens
/// and the state after 70 more are plain decoding's, on the host alone and with the older
/// pages on a helper (a rewind then cuts pages the helper holds).
#[test]
fn a_refused_draft_rolls_back_to_the_plain_state() {
    let m = preset("tiny256", "bf16", None);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 250).collect();
    let greedy = SamplingParams::greedy();
    let n = 70;
    let (want, want_next, _) = generate(&m, fresh(&m), &prompt, n, (greedy.clone(), None));
    let replay = |wrong_at| -> Option<Box<dyn Drafter + Send>> {
        Some(Box::new(Replay {
            prompt: prompt.len(),
            tokens: want.clone(),
            max: 4,
            wrong_at,
        }))
    };
    for helper in [false, true] {
        for wrong_at in [None, Some(0), Some(1), Some(2), Some(3)] {
            let (got, next, stats) = std::thread::scope(|scope| {
                let mut seq = fresh(&m);
                if helper {
                    let link = spawn_helper(scope, &m, &CpuBackend);
                    let layers = m.config.num_hidden_layers;
                    attach(&m, &mut seq, link, layers, PAGE, Some(2 * PAGE));
                }
                generate(&m, seq, &prompt, n, (greedy.clone(), replay(wrong_at)))
            });
            let case = format!("helper {helper}, wrong at {wrong_at:?}");
            assert_eq!(got, want, "{case}");
            assert!(bits(&next) == bits(&want_next), "{case}: the state differs");
            match wrong_at {
                // Every draft kept: five tokens a pass, nothing fed twice.
                None => assert!(stats.replays == 0 && stats.accepted == stats.drafted),
                Some(j) => assert!(
                    stats.replays > 0 && stats.accepted >= j,
                    "{case}: {stats:?}"
                ),
            }
        }
    }
}
