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

/// The run of one cache type: the logits of each teacher-forced step, then its own greedy
/// tokens.
struct Run {
    forced: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn run(model: &Model, types: CacheTypes, prompt: &[u32], teacher: &[u32]) -> Result<Run> {
    let (c, be) = (&model.config, &CpuBackend);
    let page = 4096.min(prompt.len() + teacher.len());
    let mut seq = Sequence::typed(c, page, types, be)?;
    let first = seq.forward(model, be, prompt, Logits::Last, None).unwrap();
    let after_prompt = seq.state.checkpoint(be);
    let mut forced = vec![first.clone()];
    for &t in &teacher[..teacher.len() - 1] {
        forced.push(seq.forward(model, be, &[t], Logits::Last, None).unwrap());
    }
    seq.rewind(be, &after_prompt).unwrap();
    let (mut logits, mut greedy) = (first, Vec::with_capacity(teacher.len()));
    for _ in 0..teacher.len() {
        let t = argmax(&logits);
        greedy.push(t);
        logits = seq.forward(model, be, &[t], Logits::Last, None).unwrap();
    }
    Ok(Run { forced, greedy })
}

/// f32's run: its greedy tokens are the teacher, so its forced logits are its own.
fn exact(model: &Model, prompt: &[u32], tokens: usize) -> Run {
    let (c, be) = (&model.config, &CpuBackend);
    let page = 4096.min(prompt.len() + tokens);
    let mut seq = Sequence::typed(c, page, CacheTypes::F32, be).unwrap();
    let mut logits = seq.forward(model, be, prompt, Logits::Last, None).unwrap();
    let (mut forced, mut greedy) = (Vec::new(), Vec::new());
    for _ in 0..tokens {
        let t = argmax(&logits);
        greedy.push(t);
        forced.push(std::mem::replace(
            &mut logits,
            seq.forward(model, be, &[t], Logits::Last, None).unwrap(),
        ));
    }
    Run { forced, greedy }
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
    let exact = exact(&model, &prompt, tokens);
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
