//! The page's simulator (www/sim.js): a host and a helper of a small synthetic model in one
//! browser tab, joined by an in-page link whose bandwidth and latency, and the helper's speed,
//! the visitor sets. Both ends are engine-core's own runtimes on the CPU backend, computing for
//! real (the host's split prefill, page moves and decode; the helper's sans-IO session): only
//! time is simulated, so the timeline shows what that link and that helper would do.
//!
//! One thread runs both ends, so the link keeps a virtual clock ([`Clock`]): the host's time
//! runs with the real clock while the host computes and stands still while the helper does. A
//! frame arrives when its direction of the wire is free, plus its transmission time, plus the
//! latency ([`Wire`]); the helper starts it once it has arrived and the helper is free, and
//! takes its real compute time divided by its speed. The helper runs lazily, when the host
//! waits for a reply; that changes no time, since its frames are served in order and their
//! times depend only on when they were sent.
//!
//! The events are the live page's (docs/TELEMETRY.md), but for the helper's `ubatch` bars: the
//! simulator knows when the helper computed each chunk, so those bars are its own time, where
//! a server's can only show what its host saw (from sending a chunk to taking its reply).
//!
//! Every run is checked against the same prompt on the host alone, as `tether demo` does: the
//! tokens and every step's logits must be the same bits.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use engine_core::cache_types::CacheTypes;
use engine_core::config::ModelConfig;
use engine_core::generate::{Generation, Sampler, SamplingParams};
use engine_core::helper::{Helper, HelperOptions, Session};
use engine_core::host::plan::{Plan, PlanInput};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::split::{SplitPlan, SplitReport};
use engine_core::host::telemetry::Telemetry;
use engine_core::host::Sequence;
use engine_core::link::traffic::{type_name, Wire};
use engine_core::link::{Link, LinkError, LinkProfile, LinkSender, LinkStats};
use engine_core::protocol::{decode, Message};
use engine_core::tensor::DType;
use engine_core::{synth, CpuBackend, Model};
use futures_util::FutureExt;
use serde::Deserialize;
use serde_json::{json, Value};
use web_time::Instant;

/// The memory the simulated helper offers.
const HELPER_BUDGET: u64 = 1 << 30;

/// What the visitor set.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Layers of the synthetic model (the tiny preset's shape: L L L F, repeated).
    pub layers: usize,
    /// The helper runs layers `split_layer ..` of a split prefill; `layers`: it only holds pages.
    pub split_layer: usize,
    /// KV positions per layer the host keeps before pages move to the helper (`None`: all).
    pub host_kv_tokens: Option<usize>,
    pub ubatch: usize,
    pub page_size: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// The link, each way: megabits per second and one-way latency.
    pub bandwidth_mbps: f64,
    pub latency_ms: f64,
    /// The helper's compute speed against this tab's (0.5: half as fast).
    pub helper_speed: f64,
}

impl Settings {
    /// Every number within what the page offers, so a hand-made request cannot ask the tab for
    /// more than it can hold (prompt and completion fit the tiny preset's 4096 positions).
    fn check(&self) -> Result<(), String> {
        let within = |name: &str, v: f64, lo: f64, hi: f64| {
            if v.is_finite() && (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{name} must be within {lo} ..= {hi} (got {v})"))
            }
        };
        within("layers", self.layers as f64, 2.0, 32.0)?;
        within(
            "split_layer",
            self.split_layer as f64,
            1.0,
            self.layers as f64,
        )?;
        within("ubatch", self.ubatch as f64, 1.0, 1024.0)?;
        within("page_size", self.page_size as f64, 1.0, 1024.0)?;
        within("prompt_tokens", self.prompt_tokens as f64, 1.0, 3072.0)?;
        within("gen_tokens", self.gen_tokens as f64, 1.0, 256.0)?;
        within("bandwidth_mbps", self.bandwidth_mbps, 0.1, 1e5)?;
        within("latency_ms", self.latency_ms, 0.0, 1000.0)?;
        within("helper_speed", self.helper_speed, 0.05, 20.0)?;
        if let Some(t) = self.host_kv_tokens {
            within("host_kv_tokens", t as f64, 0.0, 4096.0)?;
        }
        Ok(())
    }

    fn profile(&self) -> LinkProfile {
        LinkProfile {
            name: "simulated".into(),
            bandwidth_bps: self.bandwidth_mbps * 1e6,
            latency: Duration::from_secs_f64(self.latency_ms / 1e3),
        }
    }
}

/// A run: the events the live page draws (docs/TELEMETRY.md), timed by the virtual clock, and
/// the check against the host alone.
pub struct Outcome {
    pub events: Vec<Value>,
    pub split: Answer,
    pub alone: Answer,
    pub report: SplitReport,
}

impl Outcome {
    /// Whether the split gave the host-alone tokens, and every step's logits bit for bit.
    pub fn tokens_identical(&self) -> bool {
        self.split.tokens == self.alone.tokens
    }

    pub fn logits_identical(&self) -> bool {
        let bits = |a: &Answer| -> Vec<Vec<u32>> {
            a.logits
                .iter()
                .map(|l| l.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        bits(&self.split) == bits(&self.alone)
    }

    /// The whole outcome for the page.
    pub fn to_json(&self) -> Value {
        json!({
            "events": self.events,
            "check": {
                "tokens_identical": self.tokens_identical(),
                "logits_identical": self.logits_identical(),
                "tokens": self.split.tokens,
                "alone_tokens": self.alone.tokens,
            },
            "split": self.split.figures(),
            "alone": self.alone.figures(),
            "report": {
                "ubatches": self.report.ubatches,
                "on_helper": self.report.on_helper,
                "fallback": self.report.fallback,
            },
        })
    }
}

/// What one run generated, and when (in its own clock's milliseconds).
pub struct Answer {
    pub tokens: Vec<u32>,
    /// The logits each token was drawn from.
    pub logits: Vec<Vec<f32>>,
    pub prompt_tokens: usize,
    pub start_ms: f64,
    pub prefill_end_ms: f64,
    pub end_ms: f64,
}

impl Answer {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / ((self.prefill_end_ms - self.start_ms) / 1e3).max(1e-9)
    }

    /// Tokens after the first (each one forward pass) per second.
    pub fn decode_tok_s(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1) as f64;
        steps / ((self.end_ms - self.prefill_end_ms) / 1e3).max(1e-9)
    }

    fn figures(&self) -> Value {
        json!({
            "prefill_ms": self.prefill_end_ms - self.start_ms,
            "prefill_tok_s": self.prefill_tok_s(),
            "decode_tok_s": self.decode_tok_s(),
        })
    }
}

/// Run the settings' prompt on the host alone, then split with a simulated helper.
pub fn run(s: &Settings) -> Result<Outcome, String> {
    s.check()?;
    let (model, helper) = tethered(s.layers)?;
    let prompt = seeded_prompt(model.config.vocab_size, s.prompt_tokens);
    let plan = SplitPlan {
        min_tokens: 0,
        ubatch: s.ubatch,
        interleave_from: usize::MAX,
    };
    // A first pass over every layer, untimed, so the first timed run pays no warm-up (the
    // tab growing its memory, the engine's first allocations).
    let warm = &prompt[..s.ubatch.min(prompt.len())];
    let mut scratch = Sequence::new(&model.config, s.page_size);
    engine_core::host::split::prefill(model, &CpuBackend, &mut scratch, warm, &plan)
        .map_err(|e| e.to_string())?;
    let real = Mutex::new(Clock::running());
    let seq = Sequence::new(&model.config, s.page_size);
    let (alone, _) = generate(model, seq, &prompt, &plan, s, &real, &mut |_| {})?;
    let (split, report, events) = split(model, helper, s, &prompt, &plan)?;
    Ok(Outcome {
        events,
        split,
        alone,
        report,
    })
}

/// The run with the simulated helper attached, and its events.
fn split(
    model: &Model,
    helper: &'static Helper<'static>,
    s: &Settings,
    prompt: &[u32],
    plan: &SplitPlan,
) -> Result<(Answer, SplitReport, Vec<Value>), String> {
    let clock = Arc::new(Mutex::new(Clock::running()));
    let link = SimLink::new(helper.session(), s, clock.clone());
    let far = link.far.clone();
    let configure = planned(&model.config, s).configure_helper(&model.config, true);
    let client = HelperClient::connect(Box::new(link), model, configure, DEFAULT_MAX_FRAME)
        .map_err(|e| format!("the simulated helper: {e}"))?;
    let mut seq = Sequence::new(&model.config, s.page_size);
    seq.placement.host_kv_tokens = s.host_kv_tokens;
    let device = format!("helper:{}", seq.placement.attach(client));
    let events = Arc::new(Mutex::new(opening(model, s, &device)));
    let (sink, time) = (events.clone(), clock.clone());
    seq.placement.telemetry = Telemetry::new(
        move || lock(&time).now(),
        move |e| lock(&sink).push(serde_json::to_value(e).expect("events serialise")),
    );
    let emit = |e: Value| lock(&events).push(e);
    let sample = |at_ms: f64| {
        let stats = lock(&far).stats.clone();
        emit(json!({"type": "link", "at_ms": at_ms, "links": [{
            "device": device, "sent": stats.sent, "received": stats.received,
            "capacity_bps": s.bandwidth_mbps * 1e6,
        }]}));
    };
    sample(lock(&clock).now());
    let (answer, report) = generate(model, seq, prompt, plan, s, &clock, &mut |at| sample(at))?;
    sample(answer.end_ms);
    let ms = answer.prefill_end_ms - answer.start_ms;
    emit(
        json!({"type": "prefill", "id": 1, "tokens": prompt.len(), "ms": ms,
                "tok_s": answer.prefill_tok_s(), "ttft_ms": ms}),
    );
    emit(
        json!({"type": "done", "id": 1, "completion_tokens": answer.tokens.len(),
                "decode_tok_s": answer.decode_tok_s(), "finish": "length"}),
    );
    // The helper's bars as it ran them, for the host's view of them.
    let mut events = std::mem::take(&mut *lock(&events));
    events.retain(|e| e["type"] != "ubatch" || e["device"] == "host");
    events.extend(lock(&far).bars.drain(..).map(|mut bar| {
        bar["device"] = device.as_str().into();
        bar
    }));
    Ok((answer, report, events))
}

/// Prefill `prompt` and draw `s.gen_tokens` greedy tokens, timed by `clock`; `prefilled` is
/// told when the prefill ended.
fn generate(
    model: &Model,
    mut seq: Sequence,
    prompt: &[u32],
    plan: &SplitPlan,
    s: &Settings,
    clock: &Mutex<Clock>,
    prefilled: &mut dyn FnMut(f64),
) -> Result<(Answer, SplitReport), String> {
    let mut sampler = Sampler::new(SamplingParams::greedy()).map_err(|e| e.to_string())?;
    let mut g = Generation::new(model, &CpuBackend, &mut seq, &mut sampler, Vec::new());
    let start_ms = lock(clock).now();
    let report = g.prefill(prompt, plan).map_err(|e| e.to_string())?;
    let prefill_end_ms = lock(clock).now();
    prefilled(prefill_end_ms);
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    while tokens.len() < s.gen_tokens {
        let Some(t) = g.next_token().map_err(|e| e.to_string())? else {
            break;
        };
        tokens.push(t);
        logits.push(g.logits().to_vec());
    }
    let end_ms = lock(clock).now();
    let answer = Answer {
        tokens,
        logits,
        prompt_tokens: prompt.len(),
        start_ms,
        prefill_end_ms,
        end_ms,
    };
    Ok((answer, report))
}

/// The plan of a run: the visitor's settings are its fixed choices (split layer, page size,
/// host KV budget, ubatch), the simulated helper's offer and link its inputs.
fn planned(c: &ModelConfig, s: &Settings) -> Plan {
    Plan::new(
        c,
        &PlanInput {
            context: s.prompt_tokens + s.gen_tokens,
            prompt: s.prompt_tokens,
            weights: Default::default(),
            host_memory: None,
            helpers: vec![HELPER_BUDGET],
            page_size: Some(s.page_size),
            host_kv_tokens: s.host_kv_tokens,
            split_layer: Some(s.split_layer),
            ubatch: Some(s.ubatch),
            split_min: 0,
            interleave_from: usize::MAX,
            link: Some((s.bandwidth_mbps * 1e6, s.latency_ms / 1e3)),
            speeds: None,
            kv_types: CacheTypes::F32,
            checkpoints: None,
        },
    )
}

/// The events a watcher of a server gets first: the model, the helper, the request.
fn opening(model: &Model, s: &Settings, device: &str) -> Vec<Value> {
    let c = &model.config;
    let n = c.num_hidden_layers;
    let plan = planned(c, s).text;
    let prefill_layers = (s.split_layer < n).then_some([s.split_layer, n]);
    vec![
        json!({"type": "hello", "version": 1,
               "model": format!("synthetic, {n} layers (simulated in this tab)"),
               "layers": c.layer_types, "page_size": s.page_size, "ubatch": s.ubatch,
               "host_kv_tokens": s.host_kv_tokens,
               "context_tokens": s.prompt_tokens + s.gen_tokens,
               "kv_types": CacheTypes::F32.to_string(),
               "kv_bytes_per_position": c.kv_row_bytes(CacheTypes::F32),
               "weights_bytes": model.weight_bytes(), "plan": plan,
               "link_capacity_bps": s.bandwidth_mbps * 1e6}),
        json!({"type": "devices", "devices": [{"device": device, "offer_bytes": HELPER_BUDGET,
               "prefill_layers": prefill_layers}], "plan": plan}),
        json!({"type": "request", "id": 1, "prompt_tokens": s.prompt_tokens,
               "reused_tokens": 0}),
    ]
}

/// Seeded prompt ids below `vocab` (splitmix64), the same for both runs.
fn seeded_prompt(vocab: usize, len: usize) -> Vec<u32> {
    let mut x: u64 = 0x7e7e_7e7e;
    (0..len)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab as u64) as u32
        })
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// The model of each layer count asked for, and a helper over it, kept for the page's life:
    /// the helper's session borrows both, and the link that owns the session must be `'static`
    /// (the host's `HelperClient` owns a `Box<dyn Link>`). The page offers a few layer counts.
    static MODELS: RefCell<Vec<(usize, &'static Model, &'static Helper<'static>)>> =
        const { RefCell::new(Vec::new()) };
}

fn tethered(layers: usize) -> Result<(&'static Model, &'static Helper<'static>), String> {
    MODELS.with_borrow_mut(|models| {
        if let Some(&(_, m, h)) = models.iter().find(|(n, ..)| *n == layers) {
            return Ok((m, h));
        }
        let build = || -> engine_core::Result<Model> {
            let c = synth::with_layers(synth::preset("tiny")?, layers)?;
            let tensors = synth::random_weights(&c, DType::F32, 0)?;
            Model::from_tensors(c, &tensors)
        };
        let model: &'static Model = Box::leak(Box::new(build().map_err(|e| e.to_string())?));
        let opts = HelperOptions {
            mem_budget: HELPER_BUDGET,
            max_frame: DEFAULT_MAX_FRAME,
        };
        let helper: &'static Helper<'static> =
            Box::leak(Box::new(Helper::new(model, &CpuBackend, opts)));
        models.push((layers, model, helper));
        Ok((model, helper))
    })
}

/// The host's time in the simulation, in milliseconds: it runs with the real clock while the
/// host computes and stands still while the helper does.
#[derive(Default)]
struct Clock {
    at: f64,
    since: Option<Instant>,
}

impl Clock {
    fn running() -> Clock {
        Clock {
            at: 0.0,
            since: Some(Instant::now()),
        }
    }

    fn now(&self) -> f64 {
        self.at + self.since.map_or(0.0, |s| s.elapsed().as_secs_f64() * 1e3)
    }

    fn stop(&mut self) {
        self.at = self.now();
        self.since = None;
    }

    /// Run again from `at`, or from where it stopped if that is later.
    fn start(&mut self, at: f64) {
        self.at = self.at.max(at);
        self.since = Some(Instant::now());
    }
}

/// Virtual milliseconds as the link model's instants (a `Duration` since the run began).
fn on_wire(wire: &mut Wire<Duration>, at_ms: f64, bytes: usize) -> f64 {
    wire.carry(Duration::from_secs_f64(at_ms / 1e3), bytes)
        .as_secs_f64()
        * 1e3
}

/// The helper's end of the link, and the wire to it.
struct Far {
    session: Session<'static, 'static>,
    speed: f64,
    up: Wire<Duration>,
    down: Wire<Duration>,
    /// When the helper finishes what it was given so far.
    free_at: f64,
    to_helper: VecDeque<(f64, Vec<u8>)>,
    to_host: VecDeque<(f64, Vec<u8>)>,
    /// What crossed, as the host counts it.
    stats: LinkStats,
    /// The prefill chunks the helper ran, as `ubatch` events of its own time (the host's
    /// events can only say when it sent a chunk and when it took the reply).
    bars: Vec<Value>,
    /// The layers it runs in a split prefill, as `ubatch` events name them.
    layers: [usize; 2],
    /// Why the helper's session ended, if it did.
    ended: Option<String>,
}

impl Far {
    fn take_from_host(&mut self, at: f64, frame: Vec<u8>) -> Result<(), LinkError> {
        if let Some(why) = &self.ended {
            return Err(LinkError::Closed(why.clone()));
        }
        self.stats.count_sent(type_name(&frame), frame.len());
        let arrives = on_wire(&mut self.up, at, frame.len());
        self.to_helper.push_back((arrives, frame));
        Ok(())
    }

    /// The helper's next reply and when it reaches the host, serving what it was sent until
    /// it answers.
    fn reply(&mut self) -> Option<(f64, Vec<u8>)> {
        while self.to_host.is_empty() && self.ended.is_none() {
            let (arrived, frame) = self.to_helper.pop_front()?;
            self.serve(arrived, &frame);
        }
        let (at, frame) = self.to_host.pop_front()?;
        self.stats.count_received(&frame);
        Some((at, frame))
    }

    fn serve(&mut self, arrived: f64, frame: &[u8]) {
        let started = Instant::now();
        // The CPU backend's read-backs are ready at once, so a step never waits.
        let step = self.session.on_frame(frame).now_or_never();
        let took = started.elapsed().as_secs_f64() * 1e3 / self.speed;
        self.free_at = arrived.max(self.free_at) + took;
        if let Ok((_, Message::PrefillChunk { pos, residual, .. })) = decode(frame, usize::MAX) {
            self.bars
                .push(json!({"type": "ubatch", "device": "", "pos": pos,
                "tokens": residual.shape[0], "layers": self.layers,
                "start_ms": self.free_at - took, "end_ms": self.free_at}));
        }
        let Some(step) = step else {
            self.ended = Some("the simulated helper's backend did not answer at once".into());
            return;
        };
        if let Some(reply) = step.reply {
            let at = on_wire(&mut self.down, self.free_at, reply.len());
            self.to_host.push_back((at, reply));
        }
        if let Some(end) = step.end {
            self.ended = Some(format!("the simulated helper's session ended: {end:?}"));
        }
    }
}

/// The host's end of the in-page link.
struct SimLink {
    far: Arc<Mutex<Far>>,
    clock: Arc<Mutex<Clock>>,
}

impl SimLink {
    fn new(session: Session<'static, 'static>, s: &Settings, clock: Arc<Mutex<Clock>>) -> Self {
        let wire = || Wire::new(s.profile(), Duration::ZERO);
        let far = Far {
            session,
            speed: s.helper_speed,
            up: wire(),
            down: wire(),
            free_at: 0.0,
            to_helper: VecDeque::new(),
            to_host: VecDeque::new(),
            stats: LinkStats::default(),
            bars: Vec::new(),
            layers: [s.split_layer, s.layers],
            ended: None,
        };
        SimLink {
            far: Arc::new(Mutex::new(far)),
            clock,
        }
    }

    /// The next reply: the host's clock stops while the helper computes, then moves on to
    /// when the reply arrives if the host was not already past it.
    fn next(&mut self) -> Result<Option<Vec<u8>>, LinkError> {
        lock(&self.clock).stop();
        let mut far = lock(&self.far);
        let got = far.reply();
        lock(&self.clock).start(got.as_ref().map_or(0.0, |(at, _)| *at));
        match (got, &far.ended) {
            (Some((_, frame)), _) => Ok(Some(frame)),
            (None, Some(why)) => Err(LinkError::Closed(why.clone())),
            (None, None) => Ok(None),
        }
    }
}

/// Sends into the link at the host's current time.
#[derive(Clone)]
struct SimSender {
    far: Arc<Mutex<Far>>,
    clock: Arc<Mutex<Clock>>,
}

impl LinkSender for SimSender {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        let at = lock(&self.clock).now();
        lock(&self.far).take_from_host(at, frame)
    }
}

impl Link for SimLink {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.sender().send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        self.next()?
            .ok_or_else(|| LinkError::Closed("the simulated helper has no reply coming".into()))
    }

    /// The helper always answers at once in real time: no wait is ever needed.
    fn recv_timeout(&mut self, _: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        self.next()
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        Box::new(SimSender {
            far: self.far.clone(),
            clock: self.clock.clone(),
        })
    }
}

/// The page's entry: `simulate(JSON.stringify(settings))` runs one simulation (blocking the tab
/// for its length: the tiny model's runs take a fraction of a second) and returns
/// [`Outcome::to_json`] as a string; bad settings reject with the reason.
#[cfg(target_arch = "wasm32")]
#[wasm_bindgen::prelude::wasm_bindgen]
pub fn simulate(settings: &str) -> Result<String, wasm_bindgen::JsValue> {
    let s: Settings = serde_json::from_str(settings)
        .map_err(|e| wasm_bindgen::JsValue::from_str(&format!("settings: {e}")))?;
    let out = run(&s).map_err(|e| wasm_bindgen::JsValue::from_str(&e))?;
    Ok(out.to_json().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            layers: 8,
            split_layer: 4,
            host_kv_tokens: Some(64),
            ubatch: 32,
            page_size: 16,
            prompt_tokens: 160,
            gen_tokens: 6,
            bandwidth_mbps: 1000.0,
            latency_ms: 0.5,
            helper_speed: 1.0,
        }
    }

    fn bars_of(out: &Outcome, device: &str) -> Vec<(f64, f64)> {
        out.events
            .iter()
            .filter(|e| e["type"] == "ubatch" && e["device"] == device)
            .map(|e| {
                (
                    e["start_ms"].as_f64().unwrap(),
                    e["end_ms"].as_f64().unwrap(),
                )
            })
            .collect()
    }

    fn helper_device(out: &Outcome) -> String {
        let d = out.events.iter().find(|e| e["type"] == "devices").unwrap();
        d["devices"][0]["device"].as_str().unwrap().to_string()
    }

    #[test]
    fn a_split_in_the_page_gives_the_host_alone_bits() {
        for split_layer in [1, 4, 6, 8] {
            let s = Settings {
                split_layer,
                ..settings()
            };
            let out = run(&s).unwrap();
            assert_eq!(out.split.tokens.len(), 6);
            assert!(
                out.tokens_identical() && out.logits_identical(),
                "split at {split_layer}"
            );
            // All but the last ubatch ran their tail on the helper, unless it only holds pages.
            let expect = if split_layer < 8 { 4 } else { 0 };
            assert_eq!(out.report.on_helper, expect, "split at {split_layer}");
            assert_eq!(bars_of(&out, &helper_device(&out)).len(), expect);
            // The oldest pages went to the helper: of 160 + 5 positions, whole pages until at
            // most 64 stay here.
            let pages = out
                .events
                .iter()
                .rev()
                .find(|e| e["type"] == "pages")
                .unwrap();
            let runs = &pages["layers"][0]["runs"];
            assert_eq!(runs[0]["on"], helper_device(&out).as_str(), "{pages}");
            assert_eq!(runs[0]["count"], (165 - 64usize).div_ceil(16), "{pages}");
        }
    }

    #[test]
    fn the_timeline_follows_the_link_and_the_helper() {
        let base = run(&settings()).unwrap();
        // At 1 Mbit/s every residual of 32 rows of 64 floats (8 KiB and a header) takes at
        // least 65 ms to cross, so the helper's bars stretch past the host's by that much.
        let slow = run(&Settings {
            bandwidth_mbps: 1.0,
            ..settings()
        })
        .unwrap();
        let residual_ms = (32 * 64 * 4) as f64 * 8.0 / 1e6 * 1e3;
        let span = |o: &Outcome| o.split.prefill_end_ms - o.split.start_ms;
        assert!(span(&slow) >= 4.0 * residual_ms, "{} ms", span(&slow));
        assert!(span(&slow) > span(&base) + 3.0 * residual_ms);
        // The wire carries one residual after another: the helper starts its k-th no sooner
        // than k + 1 of them could cross.
        let bars = bars_of(&slow, &helper_device(&slow));
        assert_eq!(bars.len(), 4);
        for (k, (start, end)) in bars.into_iter().enumerate() {
            assert!(
                start >= (k + 1) as f64 * residual_ms,
                "bar {k}: {start} .. {end}"
            );
            assert!(end >= start);
        }
        // Latency alone: every reply waits for it.
        let far = run(&Settings {
            latency_ms: 50.0,
            ..settings()
        })
        .unwrap();
        assert!(span(&far) >= 100.0, "{} ms", span(&far));
        // Same bits whatever the link.
        assert!(slow.tokens_identical() && slow.logits_identical());
        assert!(far.tokens_identical() && far.logits_identical());
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        for bad in [
            Settings {
                split_layer: 0,
                ..settings()
            },
            Settings {
                split_layer: 9,
                ..settings()
            },
            Settings {
                bandwidth_mbps: f64::NAN,
                ..settings()
            },
            Settings {
                prompt_tokens: 100_000,
                ..settings()
            },
        ] {
            assert!(run(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_virtual_clock_stops_while_the_helper_works() {
        let mut c = Clock::running();
        c.stop();
        let stopped = c.now();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(c.now(), stopped);
        c.start(stopped + 500.0);
        assert!(c.now() >= stopped + 500.0 && c.now() < stopped + 510.0);
    }
}
