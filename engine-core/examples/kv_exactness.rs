//! What a compact KV cache costs in exactness, against f32 pages: for each cache type, the
//! next-token distributions of `--tokens` teacher-forced steps after a `--context`-token
//! prompt (top-1 agreement with f32, mean KL(f32 || type)), and where greedy decoding from the
//! same prompt first leaves f32's tokens, with f32's margin (top-1 minus top-2 logit) there.
//!
//! The teacher is f32's own greedy continuation, so every type decodes the same tokens; the
//! prompt is seeded random ids (the presets have random weights and no tokenizer of meaning).
//!
//! `cargo run --release -p engine-core --example kv_exactness -- MODEL CONTEXT TOKENS [SEED]`

use engine_core::backend::{CacheTypes, KvType};
use engine_core::generate::argmax;
use engine_core::host::Sequence;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{CpuBackend, Logits, Model, Result};

/// Decoding from a prompt: the logits before each step, and the token each step fed.
struct Run {
    forced: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

/// `steps` decode steps of `seq` from the prompt's logits `first`, feeding `teacher`'s tokens
/// if given, else each step's argmax.
fn decode(
    model: &Model,
    seq: &mut Sequence,
    first: Vec<f32>,
    steps: usize,
    teacher: Option<&[u32]>,
) -> Run {
    let (mut logits, mut run) = (
        first,
        Run {
            forced: Vec::new(),
            greedy: Vec::new(),
        },
    );
    for i in 0..steps {
        let t = teacher.map_or_else(|| argmax(&logits), |t| t[i]);
        let next = seq
            .forward(model, &CpuBackend, &[t], Logits::Last, None)
            .unwrap();
        run.forced.push(std::mem::replace(&mut logits, next));
        run.greedy.push(t);
    }
    run
}

/// The prompt's sequence at `types`, and the logits after it.
fn prefill(
    model: &Model,
    types: CacheTypes,
    prompt: &[u32],
    steps: usize,
) -> Result<(Sequence, Vec<f32>)> {
    let (c, be) = (&model.config, &CpuBackend);
    let mut seq = Sequence::typed(c, 4096.min(prompt.len() + steps), types, be)?;
    let first = seq.forward(model, be, prompt, Logits::Last, None)?;
    Ok((seq, first))
}

/// A cache type's run: its logits along f32's tokens (`teacher`), then its own greedy tokens
/// from the same prompt.
fn run(model: &Model, types: CacheTypes, prompt: &[u32], teacher: &[u32]) -> Result<Run> {
    let (mut seq, first) = prefill(model, types, prompt, teacher.len())?;
    let after_prompt = seq.state.checkpoint(&CpuBackend);
    let steps = teacher.len();
    let forced = decode(model, &mut seq, first.clone(), steps, Some(teacher)).forced;
    seq.rewind(&CpuBackend, &after_prompt)?;
    let greedy = decode(model, &mut seq, first, steps, None).greedy;
    Ok(Run { forced, greedy })
}

fn softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter()
        .zip(q)
        .filter(|(p, _)| **p > 0.0)
        .map(|(p, q)| p * (p / q.max(1e-300)).ln())
        .sum()
}

/// Top-1 minus top-2 logit.
fn margin(x: &[f32]) -> f32 {
    let top = argmax(x) as usize;
    let second = (x.iter().enumerate())
        .filter(|(i, _)| *i != top)
        .map(|(_, v)| *v)
        .fold(f32::NEG_INFINITY, f32::max);
    x[top] - second
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, context, tokens, rest @ ..] = args.as_slice() else {
        eprintln!("usage: kv_exactness MODEL CONTEXT TOKENS [SEED]");
        std::process::exit(2);
    };
    let (context, tokens): (usize, usize) = (context.parse().unwrap(), tokens.parse().unwrap());
    let seed: u64 = rest.first().map_or(1, |s| s.parse().unwrap());
    let model = load_model(model, &LoadOptions::default()).unwrap();
    let vocab = model.config.vocab_size as u64;
    let mut x = seed;
    let prompt: Vec<u32> = (0..context)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab) as u32
        })
        .collect();
    // f32's run: its greedy tokens are the teacher, so its forced logits are its own.
    let (mut seq, first) = prefill(&model, CacheTypes::F32, &prompt, tokens).unwrap();
    let exact = decode(&model, &mut seq, first, tokens, None);
    println!("context {context}, {tokens} tokens, seed {seed}");
    println!("| K / V | top-1 agreement | mean KL (nats) | max KL | greedy first differs at | f32 margin there |");
    println!("|---|---|---|---|---|---|");
    let pairs = [
        (KvType::F16, KvType::F16),
        (KvType::Q8_0, KvType::Q8_0),
        (KvType::Q8_0, KvType::F16),
        (KvType::Q4_0, KvType::Q4_0),
    ];
    for (k, v) in pairs {
        let r = match run(&model, CacheTypes { k, v }, &prompt, &exact.greedy) {
            Ok(r) => r,
            Err(e) => {
                println!("| {} / {} | refused: {e} |", k.name(), v.name());
                continue;
            }
        };
        let (mut agree, mut sum, mut max) = (0, 0.0f64, 0.0f64);
        for (a, b) in exact.forced.iter().zip(&r.forced) {
            agree += usize::from(argmax(a) == argmax(b));
            let d = kl(&softmax(a), &softmax(b));
            sum += d;
            max = max.max(d);
        }
        let differs = exact.greedy.iter().zip(&r.greedy).position(|(a, b)| a != b);
        let (at, m) = match differs {
            Some(i) => (i.to_string(), format!("{:.4}", margin(&exact.forced[i]))),
            None => (format!("never in {tokens}"), "-".into()),
        };
        println!(
            "| {} / {} | {agree}/{tokens} | {:.2e} | {:.2e} | {at} | {m} |",
            k.name(),
            v.name(),
            sum / tokens as f64,
            max
        );
    }
}
