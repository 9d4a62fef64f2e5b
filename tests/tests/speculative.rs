//! Speculative decoding (issue 36): a verify pass of a few rows gives each row, bit for bit,
//! the logits of its own decode step, so a drafted generation keeps exactly the plain run's
//! tokens, and a refused draft leaves the sequence as plain decoding would, on the host alone
//! and with pages on a helper; on the GPU backend (lavapipe in CI) as on the CPU.

use engine_core::backend::{CacheTypes, KvType, STEP_ROWS};
use engine_core::draft::{DraftKind, Drafter, Drafts, Replay};
use engine_core::generate::{DraftStats, Generation, Sampler, SamplingParams};
use engine_core::host::split::SplitPlan;
use engine_core::host::Sequence;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{Backend, CpuBackend, Logits, Model};
use tests::{attach, gguf_model, gpu, spawn_helper};

const PAGE: usize = 16;

fn preset(name: &str, dtype: &str, layers: Option<usize>) -> Model {
    let o = LoadOptions {
        weight_dtype: dtype.into(),
        layers,
        ..Default::default()
    };
    load_model(name, &o).unwrap()
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
        ("q8_0", gguf_model("tiny_fp32.q8_0.gguf")),
        ("q4_0", gguf_model("tiny_fp32.q4_0.gguf")),
        ("q4_k_m", gguf_model("tiny256.q4_k_m.gguf")),
    ];
    let prompt: Vec<u32> = (0..45).map(|i| (i * 37 + 11) % 200).collect();
    let compact =
        verify_rows_are_steps(&CpuBackend, &models, PAGE, &prompt, &[5, 17, 99, 3, 3, 42]);
    assert!(compact >= 4, "compact KV was checked on {compact} models");
}

/// The same on the GPU, for the weights it holds (f32, bf16 as f16, Q8_0, Q4_0, Q4_K_M's
/// k-quants) and its KV types, with the largest pass (`STEP_ROWS - 1` rows), in pages of 72:
/// rows before position 64 see one of the attention kernel's 64-key ranges of a page that
/// holds two for later rows, and the pass's last row opens a page the others cannot see.
#[test]
fn a_gpu_verify_pass_gives_each_row_its_decode_step_logits() {
    let models = [
        ("tiny256 f32", preset("tiny256", "f32", None)),
        ("tiny256 bf16", preset("tiny256", "bf16", None)),
        ("q8_0", gguf_model("tiny_fp32.q8_0.gguf")),
        ("q4_0", gguf_model("tiny_fp32.q4_0.gguf")),
        ("q4_k_m", gguf_model("tiny256.q4_k_m.gguf")),
    ];
    let prompt: Vec<u32> = (0..58).map(|i| (i * 37 + 11) % 200).collect();
    let rows: Vec<u32> = (0..STEP_ROWS as u32 - 1)
        .map(|i| (i * 53 + 5) % 200)
        .collect();
    let compact = verify_rows_are_steps(gpu(), &models, 72, &prompt, &rows);
    assert!(compact >= 4, "compact KV was checked on {compact} models");
}

/// Every row of a pass over `rows` after `prompt`, in pages of `page`, gets the logits of
/// feeding the rows one at a time, bit for bit, for each model at exact and compact KV (where
/// `be` holds it); returns how many compact cases ran.
fn verify_rows_are_steps(
    be: &dyn Backend,
    models: &[(&str, Model)],
    page: usize,
    prompt: &[u32],
    rows: &[u32],
) -> usize {
    let mut compact = 0;
    for (name, m) in models {
        let all_types = [
            CacheTypes::F32,
            types(KvType::F16, KvType::F16),
            types(KvType::Q8_0, KvType::Q4_0),
        ];
        for types in all_types {
            // Compact blocks need whole blocks of a head: the tiny_fp32 shape's 16 are not.
            let Ok(mut a) = Sequence::typed(&m.config, page, types, be) else {
                continue;
            };
            compact += usize::from(types != CacheTypes::F32);
            let mut b = Sequence::typed(&m.config, page, types, be).unwrap();
            a.forward(m, be, prompt, Logits::None, None).unwrap();
            b.forward(m, be, prompt, Logits::None, None).unwrap();
            let all = a.forward(m, be, rows, Logits::All, None).unwrap();
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
    compact
}

/// `n` tokens drawn by `sampler` after `prompt` (with `drafter`, if any), the sequence's
/// logits for feeding the last of them (the state the run left, compared bit for bit), and
/// what the drafts did.
fn generate(
    (m, be): (&Model, &dyn Backend),
    mut seq: Sequence,
    prompt: &[u32],
    n: usize,
    how: (SamplingParams, Option<Box<dyn Drafter + Send>>),
) -> (Vec<u32>, Vec<f32>, DraftStats) {
    let (tokens, stats) = draw((m, be), &mut seq, prompt, n, how);
    let last = *tokens.last().unwrap();
    let next = seq.forward(m, be, &[last], Logits::Last, None).unwrap();
    assert_eq!(
        seq.state.pos,
        prompt.len() + n,
        "the sequence holds every token"
    );
    (tokens, next, stats)
}

/// `n` tokens drawn after `prompt` into `seq`, and what the drafts did.
fn draw(
    (m, be): (&Model, &dyn Backend),
    seq: &mut Sequence,
    prompt: &[u32],
    n: usize,
    (sampler, drafter): (SamplingParams, Option<Box<dyn Drafter + Send>>),
) -> (Vec<u32>, DraftStats) {
    let mut sampler = Sampler::new(sampler).unwrap();
    let mut g = Generation::new(m, be, seq, &mut sampler, Vec::new()).with_drafter(drafter);
    g.limit(n);
    g.prefill(prompt, &SplitPlan::default()).unwrap();
    let tokens = (0..n).map(|_| g.next_token().unwrap().unwrap()).collect();
    (tokens, g.stats)
}

fn fresh(m: &Model, be: &dyn Backend) -> Sequence {
    let f16 = types(KvType::F16, KvType::F16);
    Sequence::typed(&m.config, PAGE, f16, be).unwrap()
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
    let be = &CpuBackend;
    let (want, want_next, _) =
        generate((&m, be), fresh(&m, be), &prompt, 80, (greedy.clone(), None));
    let ngram = Drafts {
        kind: DraftKind::Ngram,
        max: 6,
        min: 1,
    };
    let drafter = ngram.drafter().unwrap();
    let (got, got_next, stats) = generate((&m, be), fresh(&m, be), &prompt, 80, (greedy, drafter));
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
    let every = [None, Some(0), Some(1), Some(2), Some(3)];
    refused_drafts_keep_the_plain_run(&CpuBackend, 70, &[false, true], &every);
}

/// The same on the GPU over 48 tokens, host alone and with pages on a helper that attends
/// them on the GPU too, keeping every draft or refusing from the first or the third (the
/// rollback itself is the backends' shared code, which the CPU test takes through every
/// index; lavapipe runs each case for tens of seconds).
#[test]
fn a_refused_draft_on_the_gpu_rolls_back_to_the_plain_state() {
    refused_drafts_keep_the_plain_run(gpu(), 48, &[false, true], &[None, Some(0), Some(2)]);
}

/// Greedy runs of `n` tokens on `be` with the plain run's own tokens as drafts of 4, all kept
/// (`None` of `wrongs`) or refused from each index of `wrongs`: each keeps the plain run's
/// tokens and final state, on the host alone and, for each `true` of `helpers`, with the older
/// pages on a helper (on `be` too).
fn refused_drafts_keep_the_plain_run(
    be: &dyn Backend,
    n: usize,
    helpers: &[bool],
    wrongs: &[Option<usize>],
) {
    let m = preset("tiny256", "bf16", None);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 250).collect();
    let greedy = SamplingParams::greedy();
    let (want, want_next, _) =
        generate((&m, be), fresh(&m, be), &prompt, n, (greedy.clone(), None));
    let replay = |wrong_at| -> Option<Box<dyn Drafter + Send>> {
        Some(Box::new(Replay {
            prompt: prompt.len(),
            tokens: want.clone(),
            max: 4,
            wrong_at,
        }))
    };
    for &helper in helpers {
        for &wrong_at in wrongs {
            let (got, next, stats) = std::thread::scope(|scope| {
                let mut seq = fresh(&m, be);
                if helper {
                    let link = spawn_helper(scope, &m, be);
                    let layers = m.config.num_hidden_layers;
                    attach(&m, &mut seq, link, layers, PAGE, Some(2 * PAGE));
                }
                generate(
                    (&m, be),
                    seq,
                    &prompt,
                    n,
                    (greedy.clone(), replay(wrong_at)),
                )
            });
            let case = format!("{}, helper {helper}, wrong at {wrong_at:?}", be.name());
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

/// The sampler's distribution over `logits` (temperature `temp`, the `top_k` most likely),
/// computed here in f64 from its definition.
fn filtered(logits: &[f32], temp: f64, top_k: usize) -> Vec<(u32, f64)> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    ids.truncate(top_k);
    let top = logits[ids[0] as usize] as f64;
    let w: Vec<f64> = ids
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - top) / temp).exp())
        .collect();
    let total: f64 = w.iter().sum();
    ids.into_iter().zip(w.iter().map(|x| x / total)).collect()
}

/// Sampled speculation keeps the model's distribution: three tokens drawn with drafts (two a
/// step, often kept, sometimes not) over 1500 seeds against the exact joint distribution of
/// plain sampling, by a chi-square test (cells of small expectation pooled).
#[test]
fn sampled_drafts_keep_the_distribution() {
    let m = preset("tiny", "f32", None);
    let be = &CpuBackend;
    let prompt = [3u32, 141, 59, 26];
    let (temp, top_k) = (1.0f64, 3);
    let params = |seed| SamplingParams {
        temperature: temp as f32,
        top_k,
        top_p: 1.0,
        min_p: 0.0,
        seed,
    };
    // The exact joint of (t1, t2, t3) under plain sampling.
    let logits_after = |tokens: &[u32]| {
        let mut seq = Sequence::new(&m.config, PAGE);
        seq.forward(&m, be, tokens, Logits::Last, None).unwrap()
    };
    let mut joint = std::collections::BTreeMap::new();
    for (t1, p1) in filtered(&logits_after(&prompt), temp, top_k) {
        let ctx1 = [&prompt[..], &[t1]].concat();
        for (t2, p2) in filtered(&logits_after(&ctx1), temp, top_k) {
            let ctx2 = [&ctx1[..], &[t2]].concat();
            for (t3, p3) in filtered(&logits_after(&ctx2), temp, top_k) {
                joint.insert([t1, t2, t3], p1 * p2 * p3);
            }
        }
    }
    // Drafts of the likeliest path: kept where the draws follow it.
    let likeliest = *joint.iter().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let runs = 1500;
    let mut seen = std::collections::BTreeMap::new();
    let mut kept = 0;
    for seed in 0..runs {
        let drafter: Box<dyn Drafter + Send> = Box::new(Replay {
            prompt: prompt.len(),
            tokens: likeliest.to_vec(),
            max: 2,
            wrong_at: None,
        });
        let mut seq = Sequence::new(&m.config, PAGE);
        let (got, stats) = draw(
            (&m, be),
            &mut seq,
            &prompt,
            3,
            (params(seed), Some(drafter)),
        );
        kept += stats.accepted;
        *seen.entry([got[0], got[1], got[2]]).or_insert(0usize) += 1;
    }
    assert!(kept > runs as usize / 10, "drafts were rarely kept: {kept}");
    assert!(seen.keys().all(|k| joint.contains_key(k)), "{seen:?}");
    // Cells expected fewer than 5 times are pooled into one.
    let (mut chi2, mut cells, mut pool) = (0.0, 0, (0.0, 0.0));
    for (k, &p) in &joint {
        let (want, got) = (p * runs as f64, *seen.get(k).unwrap_or(&0) as f64);
        if want < 5.0 {
            pool = (pool.0 + want, pool.1 + got);
            continue;
        }
        chi2 += (got - want).powi(2) / want;
        cells += 1;
    }
    if pool.0 > 0.0 {
        chi2 += (pool.1 - pool.0).powi(2) / pool.0;
        cells += 1;
    }
    // Chi-square's 0.999 quantile for up to 26 degrees of freedom is below 55.
    assert!(
        cells <= 27 && chi2 < 55.0,
        "chi2 {chi2:.1} over {cells} cells"
    );
    eprintln!("sampled drafts: chi2 {chi2:.1} over {cells} cells, {kept} drafts kept");
}
