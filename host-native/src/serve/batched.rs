//! The engine worker with `--parallel N` (N > 1): up to N requests run together in one
//! [`Batch`] (continuous batching). Each step feeds every decoding request's last token in one
//! pass over the weights and prefills one ubatch of the oldest request still prefilling; a
//! request joins at the next step after it is queued and leaves as soon as it finishes, its
//! client goes away or its time runs out. Each answer is the one it gets alone (see
//! `engine_core::batch`).
//!
//! Each request forks its sequence where its prompt breaks and where it ends, into a prefix
//! cache ([`PrefixCache`]) that later requests start from: a shared system prompt, or a
//! conversation's previous turn, is prefilled once. What the one-sequence worker
//! ([`super::engine::Engine`]) has and this one has not yet: helpers and speculative drafts
//! (`tether serve` refuses them with `--parallel`). An engine error or panic during a step
//! fails the requests of that step's batch (each with a 500), and the worker goes on with a
//! fresh batch. The prefix cache keeps what it held after an error, and starts afresh after
//! a panic.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::load::fresh_sequence;
use engine_core::backend::CacheTypes;
use engine_core::batch::{self, Batch, Request};
use engine_core::generate::Sampler;
use engine_core::host::split::SplitPlan;
use engine_core::tokenizer::{StreamDecoder, Tokenizer};
use engine_core::{Backend, Model, Result};
use serde_json::json;
use tracing::{info, warn};

use super::api::ApiError;
use super::engine::{interrupted, panic_text, remaining_text, Outcome, StopScan, IDLE_LOOK};
use super::metrics::{KvPlacement, Metrics};
use super::prefix::{Hit, PrefixCache};
use super::queue::{Event, Finish, FinishReason, Job, Next, Queue};
use super::telemetry::Hub;

pub struct Batched {
    pub model: Model,
    pub backend: Box<dyn Backend>,
    pub tokenizer: Tokenizer,
    pub page_size: usize,
    pub kv_types: CacheTypes,
    /// Pack KV pages as they fill for the frozen-page kernel (`--freeze-pages`).
    pub freeze_pages: bool,
    /// Prompts prefill in its ubatches, one a step.
    pub plan: SplitPlan,
    pub stop_ids: Vec<u32>,
    /// Most requests in the batch (`--parallel`).
    pub parallel: usize,
    /// Testing only: panic in the step that prefills a prompt holding this text.
    pub panic_on: Option<String>,
    /// Bytes the prefix cache may hold (0: no cache).
    pub prefix_budget: usize,
    pub metrics: Arc<Metrics>,
    pub timeout_s: u64,
    pub hub: Arc<Hub>,
}

/// How a request in the batch ends.
enum End {
    /// A stop string in its text.
    StopString,
    /// The batch finished it.
    Done(FinishReason),
    /// Its text could not be decoded.
    Failed(engine_core::Error),
}

impl Running {
    /// The text the decoder and the scan still hold, sent; a stop string in it makes the
    /// reason `Stop`.
    fn flush(&mut self, reason: FinishReason) -> Result<FinishReason> {
        let (text, stopped) = remaining_text(&mut self.decoder, &mut self.scan)?;
        if !text.is_empty() {
            let _ = self.job.events.send(Event::Text(text));
        }
        Ok(if stopped { FinishReason::Stop } else { reason })
    }
}

/// A request in the batch: its job and its text so far.
struct Running {
    job: Job,
    decoder: StreamDecoder,
    scan: StopScan,
    sent: usize,
    /// Prompt tokens its sequence held from the prefix cache.
    reused: usize,
    arrived: Instant,
    /// When its first token came (its prefill's end).
    first: Option<Instant>,
}

impl Batched {
    /// Serve jobs until the queue closes and the batch has finished.
    pub fn run(self, queue: &Queue) {
        let (model, be) = (&self.model, &*self.backend);
        let fresh = || {
            Batch::new(model, be, self.plan.clone())
                .expect("`tether serve` checked the backend before choosing --parallel")
        };
        let mut batch = fresh();
        let mut running: HashMap<u64, Running> = HashMap::new();
        let mut cache = PrefixCache::new(self.prefix_budget);
        let mut closed = false;
        while !(closed && running.is_empty()) {
            closed |= self.take_jobs(queue, &mut batch, &mut running, &mut cache);
            self.drop_interrupted(&mut batch, &mut running);
            // The batch's gauges before the requests': a client that sees no request running
            // sees no sequence held either.
            self.metrics.set_batch(batch.len(), batch.state_bytes());
            self.metrics.set_active(running.len());
            if running.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            let stepped = panic::catch_unwind(AssertUnwindSafe(|| {
                let events = batch.step()?;
                self.debug_panic(&events, &running);
                Ok::<_, engine_core::Error>(events)
            }));
            self.hub.event("batch", || {
                let rows: Vec<_> = (batch.last_step().iter())
                    .map(|r| json!({"id": r.id, "rows": r.rows, "prefill": r.prefill}))
                    .collect();
                json!({"ms": t0.elapsed().as_secs_f64() * 1e3, "requests": running.len(),
                       "rows": rows})
            });
            // Forks are whole prefixes even when a later part of the step failed; after a
            // panic (a bug) nothing is trusted: the cache starts afresh.
            if stepped.is_err() {
                batch.take_forks();
                cache = PrefixCache::new(self.prefix_budget);
            }
            for f in batch.take_forks() {
                cache.insert(f);
            }
            self.metrics
                .set_prefix_cache(cache.len(), cache.bytes(), cache.evicted);
            match stepped {
                Ok(Ok(events)) => {
                    for e in events {
                        self.deliver(e, &mut batch, &mut running);
                    }
                }
                Ok(Err(e)) => {
                    let error = ApiError::server(format!("generation failed: {e}"));
                    self.fail_all(&mut running, error);
                }
                Err(p) => {
                    self.metrics.engine_restarted();
                    let why = panic_text(p.as_ref());
                    let error = ApiError::server(format!(
                        "the engine failed unexpectedly ({why}); it was restarted with an empty batch and serves later requests"
                    ))
                    .with_code("engine_panic");
                    self.fail_all(&mut running, error);
                }
            }
            if running.is_empty() && !batch.is_empty() {
                batch = fresh();
            }
            self.metrics.set_batch(batch.len(), batch.state_bytes());
        }
        tracing::debug!("engine stopped");
    }

    /// `--debug-panic-on`: a panic once a prompt holding the text has been prefilled.
    fn debug_panic(&self, events: &[batch::Event], running: &HashMap<u64, Running>) {
        let Some(text) = &self.panic_on else {
            return;
        };
        let prefilled = events.iter().filter_map(|e| match e {
            batch::Event::Token { id, n: 1, .. } => running.get(id),
            _ => None,
        });
        for r in prefilled {
            if (self.tokenizer.decode(&r.job.prompt)).is_ok_and(|p| p.contains(text.as_str())) {
                panic!("--debug-panic-on {text:?}: the prompt holds it");
            }
        }
    }

    /// Fill the batch from the queue (waiting only while nothing runs); true once the queue
    /// is closed.
    fn take_jobs(
        &self,
        queue: &Queue,
        batch: &mut Batch,
        running: &mut HashMap<u64, Running>,
        cache: &mut PrefixCache,
    ) -> bool {
        while running.len() < self.parallel {
            let wait = if running.is_empty() {
                IDLE_LOOK
            } else {
                Duration::ZERO
            };
            match queue.next_within(wait) {
                Next::Job(job) => self.admit(job, batch, running, cache),
                Next::Idle => return false,
                Next::Closed => return true,
            }
        }
        false
    }

    fn admit(
        &self,
        job: Job,
        batch: &mut Batch,
        running: &mut HashMap<u64, Running>,
        cache: &mut PrefixCache,
    ) {
        let mut reused = 0;
        let mut request = || -> Result<Request> {
            let (c, be) = (&self.model.config, &*self.backend);
            let hit = cache.lookup(c, be, &job.prompt, &job.breaks)?;
            if self.prefix_budget > 0 {
                self.metrics.prefix_lookup(hit.is_some());
            }
            let Hit { seq, logits } = match hit {
                Some(hit) => hit,
                None => Hit {
                    seq: fresh_sequence(c, self.page_size, self.kv_types, self.freeze_pages, be)?,
                    logits: None,
                },
            };
            reused = seq.state.pos;
            Ok(Request {
                id: job.id,
                seq,
                prompt: job.prompt.clone(),
                logits,
                breaks: job.breaks.clone(),
                // Into the prefix cache, where there is one.
                fork_at: match self.prefix_budget {
                    0 => Vec::new(),
                    _ => job.keep_at(),
                },
                sampler: Sampler::new(job.sampling.clone())?,
                stop: self.stop_ids.clone(),
                max_tokens: job.max_tokens,
            })
        };
        if let Err(e) = request().and_then(|r| batch.join(r)) {
            let _ = job.events.send(Event::Failed(ApiError::server(format!(
                "the request could not start: {e}"
            ))));
            return;
        }
        self.hub.event(
            "request",
            || json!({"id": job.id, "prompt_tokens": job.prompt.len(), "reused_tokens": reused}),
        );
        running.insert(
            job.id,
            Running {
                decoder: StreamDecoder::new(&self.tokenizer),
                scan: StopScan::new(&job.stop),
                sent: 0,
                reused,
                arrived: Instant::now(),
                first: None,
                job,
            },
        );
    }

    /// Requests whose client left or whose time ran out leave before the step.
    fn drop_interrupted(&self, batch: &mut Batch, running: &mut HashMap<u64, Running>) {
        let gone: Vec<(u64, Outcome)> = running
            .iter()
            .filter_map(|(&id, r)| interrupted(&r.job).map(|o| (id, o)))
            .collect();
        for (id, outcome) in gone {
            batch.leave(id);
            let r = running.remove(&id).expect("listed above");
            match outcome {
                Outcome::TimedOut => {
                    self.metrics.timed_out();
                    warn!(request = id, "time limit of {} s reached", self.timeout_s);
                    let _ = r
                        .job
                        .events
                        .send(Event::Failed(ApiError::timeout(self.timeout_s)));
                }
                Outcome::Cancelled | Outcome::Finished(_) => {
                    self.metrics.cancelled();
                    info!(request = id, "client disconnected; generation cancelled");
                }
            }
            self.metrics
                .decode(r.sent, r.first.map_or(0.0, |t| t.elapsed().as_secs_f64()));
        }
    }

    /// One event of a step: text to its client, or its end.
    fn deliver(&self, e: batch::Event, batch: &mut Batch, running: &mut HashMap<u64, Running>) {
        let (id, end) = match e {
            batch::Event::Token { id, token, n, .. } => {
                let Some(r) = running.get_mut(&id) else {
                    return;
                };
                if n == 1 {
                    self.prefilled(r);
                }
                r.sent = n;
                self.hub.event("token", || json!({"id": id, "n": n}));
                match r.decoder.push(token) {
                    Ok(piece) => {
                        let (text, stopped) = r.scan.push(&piece);
                        // A client that left leaves before the next step.
                        if !text.is_empty() {
                            let _ = r.job.events.send(Event::Text(text));
                        }
                        if !stopped {
                            return;
                        }
                        (id, End::StopString)
                    }
                    Err(e) => (id, End::Failed(e)),
                }
            }
            batch::Event::Done { id, reason } => {
                let reason = match reason {
                    batch::Finish::Stop => FinishReason::Stop,
                    batch::Finish::Length => FinishReason::Length,
                };
                (id, End::Done(reason))
            }
        };
        // A stop string or a decoding error ends a request the batch still holds.
        batch.leave(id);
        let Some(mut r) = running.remove(&id) else {
            return;
        };
        // The gauges first: a client that reads /metrics once answered finds neither its
        // request nor its sequence counted.
        self.metrics.set_active(running.len());
        self.metrics.set_batch(batch.len(), batch.state_bytes());
        let ended = match end {
            // The text after a stop string is dropped.
            End::StopString => Ok(FinishReason::Stop),
            End::Done(reason) => r.flush(reason),
            End::Failed(e) => Err(e),
        };
        match ended {
            Ok(reason) => self.finish(r, reason),
            Err(e) => {
                tracing::error!(request = id, "generation failed: {e}");
                let why = format!("generation failed: {e}");
                let _ = r.job.events.send(Event::Failed(ApiError::server(why)));
            }
        }
    }

    /// The request's prefill is over: its first token came.
    fn prefilled(&self, r: &mut Running) {
        let s = r.arrived.elapsed().as_secs_f64();
        r.first = Some(Instant::now());
        let n = r.job.prompt.len();
        let new = n - r.reused;
        self.metrics.prefill(n, new, s);
        self.hub.event("prefill", || {
            json!({"id": r.job.id, "tokens": new, "ms": s * 1e3,
                   "tok_s": new as f64 / s.max(1e-9), "ttft_ms": s * 1e3})
        });
    }

    /// The end of the stream, its text already sent.
    fn finish(&self, r: Running, reason: FinishReason) {
        let decode_s = r.first.map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.metrics.decode(r.sent, decode_s);
        self.metrics
            .job_done(r.arrived.elapsed().as_secs_f64(), KvPlacement::default(), 0);
        self.hub.event("done", || {
            json!({"id": r.job.id, "completion_tokens": r.sent,
                   "decode_tok_s": r.sent as f64 / decode_s.max(1e-9), "finish": reason.as_str()})
        });
        let _ = r.job.events.send(Event::Done(Finish {
            reason,
            prompt_tokens: r.job.prompt.len(),
            completion_tokens: r.sent,
            cached_tokens: r.reused,
        }));
    }

    /// A step failed: every request in it fails with `error` (their sequences may have moved
    /// on part of the step); the worker goes on with a fresh batch.
    fn fail_all(&self, running: &mut HashMap<u64, Running>, error: ApiError) {
        let n = running.len();
        tracing::error!("{}; the {n} request(s) of the batch fail", error.message);
        self.metrics.set_active(0);
        for (_, r) in running.drain() {
            let _ = r.job.events.send(Event::Failed(error.clone()));
        }
    }
}
