//! Continuous batching (issue 37): requests stepped together ([`Batch`]) each get the answer
//! they get alone, token for token with the logits bit for bit, whatever else shares the
//! step: submitted together, staggered, with one cancelled mid-way, more than one decode
//! pass's worth at once; greedy and sampled; on the CPU and on the GPU (lavapipe in CI; one
//! model there: the GPU verify test covers its weight types' row invariance).

use engine_core::backend::{CacheTypes, KvType, STEP_ROWS};
use engine_core::batch::{Batch, Event, Finish, Request};
use engine_core::generate::{Generation, Sampler, SamplingParams};
use engine_core::host::split::SplitPlan;
use engine_core::host::Sequence;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{Backend, CpuBackend, Model};
use tests::{gguf_model, gpu};

const PAGE: usize = 16;

/// Prompts prefill in ubatches of 16: the longer prompts take several steps' chunks.
fn plan() -> SplitPlan {
    SplitPlan {
        ubatch: 16,
        ..SplitPlan::default()
    }
}

fn preset(name: &str, dtype: &str) -> Model {
    let o = LoadOptions {
        weight_dtype: dtype.into(),
        ..Default::default()
    };
    load_model(name, &o).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One request: what it asks for.
#[derive(Clone)]
struct Spec {
    prompt: Vec<u32>,
    /// Where a prefill ubatch ends and the next ones start from (a chat's turn start).
    prefill_break: Option<usize>,
    sampling: SamplingParams,
    stop: Vec<u32>,
    max_tokens: usize,
}

/// An answer: its tokens, the bits of the logits each was drawn from, how it ended.
#[derive(Debug, PartialEq)]
struct Answer {
    tokens: Vec<u32>,
    logits: Vec<Vec<u32>>,
    finish: Option<Finish>,
}

/// `n` requests of different lengths (3 to 47 tokens: several prefill chunks for the longer),
/// every third sampled at its own seed, the rest greedy; the sixth with a prefill break.
fn specs(n: usize, max_tokens: usize) -> Vec<Spec> {
    (0..n)
        .map(|i| {
            let len = 3 + (i * 17) % 45;
            let sampling = match i % 3 {
                2 => SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    seed: 100 + i as u64,
                    ..SamplingParams::greedy()
                },
                _ => SamplingParams::greedy(),
            };
            Spec {
                prompt: (0..len)
                    .map(|j| ((i * 31 + j * 7 + 3) % 250) as u32)
                    .collect(),
                // One prompt of 43 tokens breaks at 21: ubatches 0..16, 16..21, 21..37, 37..43.
                prefill_break: (i == 5).then_some(21),
                sampling,
                stop: Vec::new(),
                max_tokens,
            }
        })
        .collect()
}

fn sequence(m: &Model, be: &dyn Backend, types: CacheTypes) -> Sequence {
    Sequence::typed(&m.config, PAGE, types, be).unwrap()
}

/// The request run alone, as `tether run` runs it (`Generation`).
fn alone(m: &Model, be: &dyn Backend, types: CacheTypes, spec: &Spec) -> Answer {
    let mut seq = sequence(m, be, types);
    let mut sampler = Sampler::new(spec.sampling.clone()).unwrap();
    let mut g = Generation::new(m, be, &mut seq, &mut sampler, spec.stop.clone());
    g.limit(spec.max_tokens);
    let at = spec.prefill_break.unwrap_or(0);
    if at > 0 {
        g.prefill(&spec.prompt[..at], &plan()).unwrap();
    }
    g.prefill(&spec.prompt[at..], &plan()).unwrap();
    let mut a = Answer {
        tokens: Vec::new(),
        logits: Vec::new(),
        finish: Some(Finish::Length),
    };
    while a.tokens.len() < spec.max_tokens {
        let Some(tok) = g.next_token().unwrap() else {
            a.finish = Some(Finish::Stop);
            break;
        };
        a.tokens.push(tok);
        a.logits.push(bits(g.logits()));
    }
    a
}

/// When each request joins (the step before which it is submitted), and which one leaves
/// before which step.
struct Schedule {
    joins: Vec<usize>,
    cancel: Option<(usize, u64)>,
}

/// Every request run in one batch as `schedule` says: the answers by request.
fn batched(
    m: &Model,
    be: &dyn Backend,
    types: CacheTypes,
    specs: &[Spec],
    schedule: &Schedule,
) -> Vec<Answer> {
    let mut batch = Batch::new(m, be, plan()).unwrap().keep_logits();
    let mut answers: Vec<Answer> = specs
        .iter()
        .map(|_| Answer {
            tokens: Vec::new(),
            logits: Vec::new(),
            finish: None,
        })
        .collect();
    let mut step = 0;
    while step <= *schedule.joins.iter().max().unwrap() || !batch.is_empty() {
        for (i, spec) in specs.iter().enumerate() {
            if schedule.joins[i] == step {
                batch
                    .join(Request {
                        id: i as u64,
                        seq: sequence(m, be, types),
                        prompt: spec.prompt.clone(),
                        prefill_break: spec.prefill_break,
                        sampler: Sampler::new(spec.sampling.clone()).unwrap(),
                        stop: spec.stop.clone(),
                        max_tokens: spec.max_tokens,
                    })
                    .unwrap();
            }
        }
        if let Some((at, id)) = schedule.cancel {
            if at == step {
                assert!(batch.leave(id).is_some(), "request {id} was in the batch");
            }
        }
        for event in batch.step().unwrap() {
            match event {
                Event::Token {
                    id,
                    token,
                    n,
                    logits,
                } => {
                    let a = &mut answers[id as usize];
                    a.tokens.push(token);
                    a.logits.push(bits(&logits.unwrap()));
                    assert_eq!(n, a.tokens.len());
                }
                Event::Done { id, reason } => answers[id as usize].finish = Some(reason),
            }
        }
        step += 1;
        assert!(step < 10_000, "the batch never emptied");
    }
    answers
}

/// Submitted together, staggered (a request joins while others decode and while one
/// prefills), and with a cancellation mid-way: every answer is its run alone (the cancelled
/// one, a prefix of it).
fn answers_are_their_runs_alone(be: &dyn Backend, models: &[(&str, Model, CacheTypes)]) {
    for (name, m, types) in models {
        let mut specs = specs(8, 12);
        // One request ends at a stop token: the fourth token of its answer alone.
        let ends = alone(m, be, *types, &specs[4]);
        specs[4].stop = vec![ends.tokens[3]];
        let want: Vec<Answer> = specs.iter().map(|s| alone(m, be, *types, s)).collect();
        assert_eq!(want[4].finish, Some(Finish::Stop), "{name}");
        let schedules = [
            (
                "together",
                Schedule {
                    joins: vec![0; 8],
                    cancel: None,
                },
            ),
            (
                "staggered",
                Schedule {
                    joins: vec![0, 1, 1, 3, 6, 7, 11, 20],
                    cancel: None,
                },
            ),
            (
                "one cancelled",
                Schedule {
                    joins: vec![0, 0, 2, 2, 4, 4, 5, 5],
                    cancel: Some((9, 3)),
                },
            ),
        ];
        for (how, schedule) in &schedules {
            let got = batched(m, be, *types, &specs, schedule);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                if schedule.cancel.is_some_and(|(_, id)| id == i as u64) {
                    assert!(
                        g.finish.is_none(),
                        "{name}, {how}: request {i} was cancelled"
                    );
                    assert_eq!(
                        g.tokens[..],
                        w.tokens[..g.tokens.len()],
                        "{name}, {how}: {i}"
                    );
                    assert!(
                        g.logits[..] == w.logits[..g.logits.len()],
                        "{name}, {how}: {i}"
                    );
                    continue;
                }
                assert_eq!(g.tokens, w.tokens, "{name}, {how}: request {i}'s tokens");
                assert!(
                    g.logits == w.logits,
                    "{name}, {how}: request {i}'s logits differ from its run alone"
                );
                assert_eq!(g.finish, w.finish, "{name}, {how}: request {i}");
            }
        }
    }
}

fn f16() -> CacheTypes {
    CacheTypes {
        k: KvType::F16,
        v: KvType::F16,
    }
}

#[test]
fn batched_answers_are_their_runs_alone() {
    let q8 = CacheTypes {
        k: KvType::Q8_0,
        v: KvType::Q4_0,
    };
    answers_are_their_runs_alone(
        &CpuBackend,
        &[
            ("tiny256 bf16, f16 KV", preset("tiny256", "bf16"), f16()),
            (
                "tiny256 f32, f32 KV",
                preset("tiny256", "f32"),
                CacheTypes::F32,
            ),
            (
                "q4_k_m, q8_0/q4_0 KV",
                gguf_model("tiny256.q4_k_m.gguf"),
                q8,
            ),
        ],
    );
}

#[test]
fn gpu_batched_answers_are_their_runs_alone() {
    answers_are_their_runs_alone(
        gpu(),
        &[("q4_k_m, f16 KV", gguf_model("tiny256.q4_k_m.gguf"), f16())],
    );
}

/// More requests than one decode pass takes (`STEP_ROWS - 1` rows): the step runs two, and
/// every answer is still its run alone.
#[test]
fn more_requests_than_a_pass_takes_are_their_runs_alone() {
    let (m, be) = (preset("tiny256", "bf16"), &CpuBackend);
    let specs = specs(STEP_ROWS + 3, 6);
    let want: Vec<Answer> = specs.iter().map(|s| alone(&m, be, f16(), s)).collect();
    let schedule = Schedule {
        joins: vec![0; specs.len()],
        cancel: None,
    };
    let got = batched(&m, be, f16(), &specs, &schedule);
    assert!(got == want, "an answer differs from its run alone");
}

/// Bad requests are refused at the door, and the batch goes on with the others.
#[test]
fn bad_requests_are_refused_and_the_batch_goes_on() {
    let (m, be) = (preset("tiny256", "bf16"), &CpuBackend);
    let mut batch = Batch::new(&m, be, plan()).unwrap();
    let request = |id, prompt: Vec<u32>, max_tokens| Request {
        id,
        seq: sequence(&m, be, f16()),
        prompt,
        prefill_break: None,
        sampler: Sampler::new(SamplingParams::greedy()).unwrap(),
        stop: Vec::new(),
        max_tokens,
    };
    batch.join(request(1, vec![5, 6, 7], 3)).unwrap();
    let vocab = m.config.vocab_size as u32;
    for (why, r) in [
        ("an empty prompt", request(2, vec![], 3)),
        (
            "a token outside the vocabulary",
            request(3, vec![1, vocab], 3),
        ),
        ("no room for a token", request(4, vec![1], 0)),
        ("a taken id", request(1, vec![1], 3)),
    ] {
        assert!(batch.join(r).is_err(), "{why} was taken");
    }
    assert_eq!(batch.len(), 1);
    let mut tokens = 0;
    while !batch.is_empty() {
        tokens += batch
            .step()
            .unwrap()
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
    }
    assert_eq!(tokens, 3);
}
