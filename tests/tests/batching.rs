//! Continuous batching (issue 37): requests stepped together ([`Batch`]) each get the answer
//! they get alone, token for token with the logits bit for bit, whatever else shares the
//! step: submitted together, staggered, with one cancelled mid-way, more than one decode
//! pass's worth at once; greedy and sampled; on the CPU and on the GPU (lavapipe in CI; one
//! model there: the GPU verify test covers its weight types' row invariance). A request that
//! starts from another's fork (a prefix cache's hit) gets the bits of its run from 0.

use engine_core::backend::{CacheTypes, KvType, STEP_ROWS};
use engine_core::batch::{Batch, Event, Finish, Fork, Request};
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
    /// Where prefill ubatches end and the next ones start from (a chat's message ends).
    breaks: Vec<usize>,
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
                breaks: if i == 5 { vec![21] } else { Vec::new() },
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
    let ends = spec.breaks.iter().copied().chain([spec.prompt.len()]);
    let mut at = 0;
    for end in ends {
        g.prefill(&spec.prompt[at..end], &plan()).unwrap();
        at = end;
    }
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
    let fresh = &mut |_: usize| (sequence(m, be, types), None);
    batched_from(m, be, specs, schedule, fresh).0
}

/// [`batched`] with each request's sequence (and, holding its whole prompt, the logits) from
/// `start`, forking every sequence at its breaks and prompt end: the answers, and the forks.
fn batched_from(
    m: &Model,
    be: &dyn Backend,
    specs: &[Spec],
    schedule: &Schedule,
    start: &mut dyn FnMut(usize) -> (Sequence, Option<Vec<f32>>),
) -> (Vec<Answer>, Vec<Fork>) {
    let mut batch = Batch::new(m, be, plan()).unwrap().keep_logits();
    let mut forks = Vec::new();
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
                let (seq, logits) = start(i);
                batch
                    .join(Request {
                        id: i as u64,
                        seq,
                        prompt: spec.prompt.clone(),
                        logits,
                        breaks: spec.breaks.clone(),
                        fork_at: [&spec.breaks[..], &[spec.prompt.len()]].concat(),
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
        forks.extend(batch.take_forks());
        step += 1;
        assert!(step < 10_000, "the batch never emptied");
    }
    (answers, forks)
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

/// Requests that start from other requests' forks (what `tether serve --parallel`'s prefix
/// cache hands out) get their runs alone from position 0, bit for bit: from a fork at a break
/// they share (a system prompt of 37 tokens: two whole pages and a partial one, which the
/// request then writes to), and from a fork at the whole prompt (no prefill, the saved
/// logits). The forks stay as they were made while the requests that started from them
/// write: a later request from the same fork gets its run alone too.
fn forks_are_prefixes(be: &dyn Backend, models: &[(&str, Model, CacheTypes)]) {
    let shared: Vec<u32> = (0..37).map(|j| (j * 11 + 5) % 250).collect();
    let spec = |tail: u32, seed: u64| Spec {
        prompt: [
            &shared[..],
            &(0..9 + tail)
                .map(|j| (j * 13 + tail * 29) % 250)
                .collect::<Vec<_>>(),
        ]
        .concat(),
        breaks: vec![shared.len()],
        sampling: match seed {
            0 => SamplingParams::greedy(),
            seed => SamplingParams {
                temperature: 0.8,
                seed,
                ..SamplingParams::greedy()
            },
        },
        stop: Vec::new(),
        max_tokens: 6,
    };
    for (name, m, types) in models {
        let first = [spec(0, 0)];
        let fresh = &mut |_: usize| (sequence(m, be, *types), None);
        let once = Schedule {
            joins: vec![0],
            cancel: None,
        };
        let (_, forks) = batched_from(m, be, &first, &once, fresh);
        let at: Vec<usize> = forks.iter().map(|f| f.tokens.len()).collect();
        assert_eq!(
            at,
            [37, first[0].prompt.len()],
            "{name}: where forks were made"
        );
        assert!(forks[0].logits.is_none() && forks[1].logits.is_some());
        assert_eq!(forks[1].tokens, first[0].prompt);
        // From the shared prefix (greedy and sampled), and the first prompt again, wholly
        // cached; then, once those wrote to the fork's partial page, the prefix again.
        let specs = [spec(3, 0), spec(5, 7), first[0].clone(), spec(8, 0)];
        let mut start = |i: usize| {
            let f = &forks[if i == 2 { 1 } else { 0 }];
            let seq = f.seq.fork(&m.config, be).unwrap();
            (seq, f.logits.clone())
        };
        let schedule = Schedule {
            joins: vec![0, 0, 1, 12],
            cancel: None,
        };
        let (got, _) = batched_from(m, be, &specs, &schedule, &mut start);
        for (i, (g, s)) in got.iter().zip(&specs).enumerate() {
            let w = alone(m, be, *types, s);
            assert_eq!(g.tokens, w.tokens, "{name}: request {i}'s tokens");
            assert!(g.logits == w.logits, "{name}: request {i}'s logits");
        }
    }
}

#[test]
fn requests_from_forks_are_their_runs_alone() {
    forks_are_prefixes(
        &CpuBackend,
        &[
            ("tiny256 bf16, f16 KV", preset("tiny256", "bf16"), f16()),
            (
                "q4_k_m, q8_0/q4_0 KV",
                gguf_model("tiny256.q4_k_m.gguf"),
                CacheTypes {
                    k: KvType::Q8_0,
                    v: KvType::Q4_0,
                },
            ),
        ],
    );
}

#[test]
fn gpu_requests_from_forks_are_their_runs_alone() {
    forks_are_prefixes(
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
        logits: None,
        breaks: Vec::new(),
        fork_at: Vec::new(),
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
        ("a sequence held up to no break", {
            let mut r = request(5, vec![1, 2, 3], 3);
            r.seq.state.pos = 2;
            r
        }),
        ("the whole prompt held without its logits", {
            let mut r = request(6, vec![1, 2, 3], 3);
            r.seq.state.pos = 3;
            r
        }),
        (
            "logits for a prompt not all held",
            Request {
                logits: Some(vec![0.0; vocab as usize]),
                ..request(7, vec![1, 2, 3], 3)
            },
        ),
        (
            "breaks out of order",
            Request {
                breaks: vec![2, 1],
                ..request(8, vec![1, 2, 3], 3)
            },
        ),
        (
            "a fork asked for at no break",
            Request {
                fork_at: vec![2],
                ..request(9, vec![1, 2, 3], 3)
            },
        ),
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
