//! The engine worker: one thread that owns the model and the one sequence state (neither is
//! async, and the model has one sequence to give), takes jobs from the queue in order, and
//! streams each one's text back as events. Between tokens, and between prefill segments, it
//! checks whether the client is still there and the time limit still holds. A panic while
//! serving a job (a bug) fails that job and restarts the sequence afresh, rather than leaving
//! the server without an engine.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_core::backend::{Act, CacheTypes};
use engine_core::draft::{DraftKind, Drafts, MtpDrafts};
use engine_core::generate::{Generation, Sampler};
use engine_core::host::split::{self, SplitPlan};
use engine_core::host::Sequence;
use engine_core::model::LayerState;
use engine_core::tokenizer::{StreamDecoder, Tokenizer};
use engine_core::{Backend, Error, Logits, Model, Result};
use tracing::{debug, info, warn};

use super::api::ApiError;
use super::conversation::Conversation;
use super::helpers::Helpers;
use super::metrics::{KvPlacement, Metrics};
use super::queue::{Event, Finish, FinishReason, Job, Next, Queue};
use super::telemetry::Hub;
use super::terminal;
use serde_json::json;

pub struct Engine {
    pub model: Model,
    pub backend: Box<dyn Backend>,
    pub tokenizer: Tokenizer,
    pub seq: Sequence,
    pub page_size: usize,
    /// How the sequence's KV pages store keys and values (`--cache-type-k/-v`).
    pub kv_types: CacheTypes,
    /// Pack KV pages as they fill for the frozen-page kernel (`--freeze-pages`).
    pub freeze_pages: bool,
    pub plan: SplitPlan,
    /// Prompt tokens per `split::prefill` call: the unit of the progress bar and of the
    /// cancellation checks during a long prefill.
    pub segment: usize,
    /// Token ids that end a generation (the model's EOS and the chat end-of-turn markers).
    pub stop_ids: Vec<u32>,
    /// Speculative decoding (`--draft`): what drafts each generation checks.
    pub drafts: Drafts,
    /// `--draft mtp`: the head's drafts, following the sequence from turn to turn (its cache
    /// cut with the sequence's rewinds, its last final row kept in the checkpoints).
    pub mtp: Option<MtpDrafts>,
    pub conversation: Conversation,
    pub metrics: Arc<Metrics>,
    pub timeout_s: u64,
    /// The server's helpers: reconnected when lost, taken when they join.
    pub helpers: Option<Helpers>,
    /// Testing only (`--debug-panic-on`, hidden): panic after the prefill of a prompt that
    /// contains this text, to exercise the recovery from a panic.
    pub panic_on: Option<String>,
    /// Where requests, tokens and the helpers are reported for `/v1/telemetry` (the sequence
    /// reports its own ubatches and pages through `seq.placement.telemetry`).
    pub hub: Arc<Hub>,
    /// The context and prompt lengths the plan is made for (`tether serve` prints it at start).
    pub plan_for: (usize, usize),
}

/// How long the engine waits for a request before it looks for helpers that joined: the
/// longest a joined helper stays unseen while the server is idle.
pub(super) const IDLE_LOOK: Duration = Duration::from_millis(250);

/// A request's decoding so far. It outlives a redo: when the helper is lost mid-request the
/// host runs the request again alone and feeds these tokens instead of sampling them again,
/// so the sampler, the streamed text and the stop-string scan go on where they were.
struct Decoding {
    sampler: Sampler,
    decoder: StreamDecoder,
    scan: StopScan,
    /// Tokens sampled and sent so far.
    tokens: Vec<u32>,
}

/// How a job ended, short of an engine error.
pub(super) enum Outcome {
    Finished(Finish),
    /// The client went away.
    Cancelled,
    TimedOut,
}

pub(super) fn interrupted(job: &Job) -> Option<Outcome> {
    if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
        Some(Outcome::Cancelled)
    } else if Instant::now() >= job.deadline {
        Some(Outcome::TimedOut)
    } else {
        None
    }
}

impl Engine {
    /// Serve jobs until the queue closes.
    pub fn run(mut self, queue: &Queue) {
        self.report_devices();
        loop {
            let job = match queue.next_within(IDLE_LOOK) {
                Next::Job(job) => job,
                Next::Idle => {
                    self.attach_joined();
                    continue;
                }
                Next::Closed => break,
            };
            let t = Instant::now();
            self.metrics.set_active(1);
            let last = panic::catch_unwind(AssertUnwindSafe(|| self.serve(&job)))
                .unwrap_or_else(|panic| Some(self.restart(&job, panic.as_ref())));
            self.metrics.set_active(0);
            self.metrics.job_done(
                t.elapsed().as_secs_f64(),
                self.kv_placement(),
                self.seq.placement.helpers.len(),
            );
            // After the metrics: a client that reads /metrics once answered sees this job.
            if let Some(event) = last {
                // A client that left in the meantime no longer listens; nothing to do about it.
                let _ = job.events.send(event);
            }
        }
        debug!("engine stopped");
    }

    /// Run `job`; returns the event that ends its stream (none for a client that left).
    fn serve(&mut self, job: &Job) -> Option<Event> {
        let event = match self.generate(job) {
            Ok(Outcome::Finished(f)) => Event::Done(f),
            Ok(Outcome::Cancelled) => {
                self.metrics.cancelled();
                info!(
                    request = job.id,
                    "client disconnected; generation cancelled"
                );
                return None;
            }
            Ok(Outcome::TimedOut) => {
                self.metrics.timed_out();
                warn!(
                    request = job.id,
                    "time limit of {} s reached", self.timeout_s
                );
                Event::Failed(ApiError::timeout(self.timeout_s))
            }
            Err(e) => {
                tracing::error!(request = job.id, "generation failed: {e}");
                self.recover();
                Event::Failed(ApiError::server(format!("generation failed: {e}")))
            }
        };
        Some(event)
    }

    /// After a panic nothing the sequence holds can be trusted: start a fresh one on the host
    /// alone (a helper reconnects before the next request); the job fails with a 500.
    fn restart(&mut self, job: &Job, panic: &(dyn Any + Send)) -> Event {
        let why = panic_text(panic);
        tracing::error!(
            request = job.id,
            "the engine panicked ({why}); restarting it with a fresh sequence"
        );
        self.start_afresh();
        self.metrics.engine_restarted();
        Event::Failed(
            ApiError::server(format!(
                "the engine failed unexpectedly ({why}); it was restarted and serves later requests"
            ))
            .with_code("engine_panic"),
        )
    }

    /// After an error the state may be half-updated: start again from position 0, on the
    /// host alone if the helper is what failed.
    fn recover(&mut self) {
        let be = &*self.backend;
        if let Err(e) = self.seq.rewind(be, self.conversation.origin()) {
            warn!("the helper is gone ({e}); continuing on the host alone");
            self.start_afresh();
        } else {
            self.conversation.reset(be, &self.seq.state);
            self.mtp_afresh();
        }
    }

    /// `--draft mtp`: the head's drafts for the sequence at position 0.
    fn mtp_afresh(&mut self) {
        self.mtp = (self.drafts.kind == DraftKind::Mtp).then(|| {
            MtpDrafts::new(&self.model, &self.seq.state, self.drafts.max)
                .expect("the server's first drafts were made for the same model at position 0")
        });
    }

    /// Start a fresh sequence on the host alone, with no cached conversation.
    fn start_afresh(&mut self) {
        let telemetry = self.seq.placement.telemetry.clone();
        let (c, be) = (&self.model.config, &*self.backend);
        let freeze = self.freeze_pages;
        self.seq = crate::load::fresh_sequence(c, self.page_size, self.kv_types, freeze, be)
            .expect("the server's first sequence was made with the same types and backend");
        self.seq.placement.telemetry = telemetry;
        self.report_devices();
        self.conversation.reset(&*self.backend, &self.seq.state);
        self.mtp_afresh();
    }

    /// Before a request: note a lost helper, and attach helpers that joined or came back
    /// (see [`Helpers`]) to the sequence as it is: the cached conversation stays, and pages
    /// that went to the page file meanwhile re-fill them a few per pass. A failed attempt
    /// leaves everything as it was.
    fn refresh_helpers(&mut self) {
        if let Some(why) = self.seq.placement.helper_lost.take() {
            warn!("a helper was lost ({why}); its pages are attended from the page file");
        }
        if let Some(why) = self.seq.placement.helper_set_aside.take() {
            warn!("a helper was set aside: {why}");
        }
        let Some(h) = &mut self.helpers else {
            return;
        };
        let shape = (self.page_size, self.plan_for.0);
        let (joined, back) = h.refresh(&self.model, &*self.backend, &mut self.seq, shape);
        if back {
            info!("a lost helper is back; it is re-filled from the page file as requests run");
            self.metrics.helper_reconnected();
        }
        if joined > 0 {
            info!("{joined} helper(s) joined; they take pages from this request on");
        }
        self.report_devices();
    }

    /// While no request waits: attach helpers that joined (calibrated and given their layers
    /// as at a request) and tell `/v1/telemetry` at once, so the page shows a helper when it
    /// joins, and the next prefill is split with it.
    fn attach_joined(&mut self) {
        let Some(h) = &mut self.helpers else {
            return;
        };
        let shape = (self.page_size, self.plan_for.0);
        let joined = h.joined_meanwhile(&self.model, &*self.backend, &mut self.seq, shape);
        if joined > 0 {
            info!("{joined} helper(s) joined; they take part from the next request on");
            self.metrics
                .set_helpers_attached(self.seq.placement.helpers.len());
            self.report_devices();
        }
    }

    /// Tell `/v1/telemetry` which helpers the sequence has (what each offered, which layers
    /// it runs, its backend and link round trip, how it came), and the plan with them (the
    /// one printed at start predates helpers that joined).
    fn report_devices(&self) {
        let devices: Vec<_> = self
            .seq
            .placement
            .helpers
            .iter()
            .map(|h| {
                let layers = &h.prefill_layers;
                let (source, rtt_ms) = self
                    .helpers
                    .as_ref()
                    .map_or((None, None), |a| a.about(h.id));
                json!({
                    "device": format!("helper:{}", h.id),
                    "offer_bytes": h.helper.mem_offer,
                    "prefill_layers": (!layers.is_empty()).then_some([layers.start, layers.end]),
                    "backend": h.helper.backends.first(),
                    "kind": (!h.helper.device.is_empty()).then_some(&h.helper.device),
                    "rtt_ms": rtt_ms,
                    "source": source,
                })
            })
            .collect();
        let plan = self.helpers.as_ref().map(|h| {
            let shape = (self.page_size, self.plan.ubatch);
            h.plan(&self.model, &self.seq, shape, self.plan_for)
        });
        self.hub.devices(devices.into(), plan);
    }

    fn generate(&mut self, job: &Job) -> Result<Outcome> {
        if let Some(o) = interrupted(job) {
            return Ok(o);
        }
        self.refresh_helpers();
        let mut d = Decoding {
            sampler: Sampler::new(job.sampling.clone())?,
            decoder: StreamDecoder::new(&self.tokenizer),
            scan: StopScan::new(&job.stop),
            tokens: Vec::new(),
        };
        let had_helper = !self.seq.placement.helpers.is_empty();
        match self.attempt(job, &mut d) {
            // The host holds every token of the request: it redoes the request alone, in the
            // same ubatches, and feeds the tokens already sent instead of sampling them
            // again, so the client's stream goes on as if nothing had happened.
            Err(Error::Remote(why)) if had_helper => {
                warn!(
                    request = job.id,
                    "the helper was lost ({why}); the host redoes the request alone"
                );
                self.start_afresh();
                self.attempt(job, &mut d)
            }
            r => r,
        }
    }

    /// Prefill what the conversation cache lacks of the prompt, feed the tokens `d` already
    /// holds (none unless this is a redo), then sample and stream the rest.
    fn attempt(&mut self, job: &Job, d: &mut Decoding) -> Result<Outcome> {
        let t0 = Instant::now();
        let held = self.seq.state.pos;
        let restored = self
            .conversation
            .restore(&*self.backend, &mut self.seq, &job.prompt)?;
        if let Some(m) = self.mtp.as_mut().filter(|_| restored.reused != held) {
            m.rewind(&*self.backend, restored.reused, restored.last_row.clone())?;
        }
        let new = &job.prompt[restored.reused..];
        self.hub.event("request", || {
            json!({"id": job.id, "prompt_tokens": job.prompt.len(),
                   "reused_tokens": restored.reused})
        });
        let mut logits = restored.logits.unwrap_or_default();
        let bar = terminal::prefill_bar(new.len(), self.segment);
        // The prefill restarts at each break still ahead; checkpoints where the job keeps
        // its state.
        let keep = job.keep_at();
        let mut pos = restored.reused;
        let ends: Vec<usize> = (job.breaks.iter().copied())
            .filter(|&t| t > pos && t < job.prompt.len())
            .chain((pos < job.prompt.len()).then_some(job.prompt.len()))
            .collect();
        for end in ends {
            for seg in job.prompt[pos..end].chunks(self.segment) {
                if let Some(o) = interrupted(job) {
                    return Ok(o);
                }
                let (l, report) = self.prefill(seg, &job.prompt[..end])?;
                self.conversation.consumed(seg);
                if let Some(why) = &report.fallback {
                    warn!("the helper failed during prefill ({why}); the host redid its share");
                }
                logits = l;
                bar.inc(seg.len());
            }
            pos = end;
            if keep.contains(&end) {
                let last_row = self.mtp.as_ref().and_then(MtpDrafts::last_row);
                self.conversation
                    .checkpoint(&*self.backend, &self.seq.state, &logits, last_row);
            }
        }
        drop(bar);
        self.debug_panic(job);
        let prefill_s = t0.elapsed().as_secs_f64();
        self.metrics.prefill(job.prompt.len(), new.len(), prefill_s);
        self.hub.event("prefill", || {
            json!({"id": job.id, "tokens": new.len(), "ms": prefill_s * 1e3,
                   "tok_s": new.len() as f64 / prefill_s.max(1e-9), "ttft_ms": prefill_s * 1e3})
        });

        let t1 = Instant::now();
        let context = [&job.prompt[..], &d.tokens].concat();
        for (i, &tok) in d.tokens.iter().enumerate() {
            logits = self.feed(tok, &context[..=job.prompt.len() + i])?;
            self.conversation.consumed(&[tok]);
        }
        let mut n = d.tokens.len();
        let mut reason = FinishReason::Length;
        let mut stopped_by_string = false;
        let stop = self.stop_ids.clone();
        let fed = job.prompt.len() + n;
        let be = &*self.backend;
        let g = Generation::new(&self.model, be, &mut self.seq, &mut d.sampler, stop);
        let mut g = match self.mtp.take() {
            Some(mtp) => g.with_mtp(mtp)?,
            None => g.with_drafts(self.drafts)?,
        };
        g.resume(logits, context);
        // The last token is never fed: its forward pass would serve no one.
        g.limit(job.max_tokens - n);
        let mut outcome = None;
        while n < job.max_tokens {
            if let Some(o) = interrupted(job) {
                outcome = Some(o);
                break;
            }
            let before = g.stats;
            let next = g.next_token()?;
            let pass = g.stats;
            // A checking pass of drafts, for the live page.
            if pass.steps > before.steps {
                self.hub.event("draft", || {
                    json!({"id": job.id, "drafted": pass.drafted - before.drafted,
                           "kept": pass.accepted - before.accepted})
                });
            }
            let Some(tok) = next else {
                reason = FinishReason::Stop;
                break;
            };
            n += 1;
            d.tokens.push(tok);
            self.hub.event("token", || json!({"id": job.id, "n": n}));
            let (text, stopped) = d.scan.push(&d.decoder.push(tok)?);
            if !text.is_empty() && job.events.send(Event::Text(text)).is_err() {
                outcome = Some(Outcome::Cancelled);
                break;
            }
            if stopped {
                reason = FinishReason::Stop;
                stopped_by_string = true;
                break;
            }
        }
        let drafts = g.stats;
        self.mtp = g.take_mtp();
        self.conversation.consumed(&g.context()[fed..]);
        self.metrics.drafts(drafts.drafted, drafts.accepted);
        if let Some(o) = outcome {
            self.metrics.decode(n, t1.elapsed().as_secs_f64());
            return Ok(o);
        }
        if !stopped_by_string {
            let (text, stopped) = remaining_text(&mut d.decoder, &mut d.scan)?;
            if stopped {
                reason = FinishReason::Stop;
            }
            if !text.is_empty() {
                let _ = job.events.send(Event::Text(text));
            }
        }
        let decode_s = t1.elapsed().as_secs_f64();
        self.metrics.decode(n, decode_s);
        self.hub.event("done", || {
            json!({"id": job.id, "completion_tokens": n,
                   "decode_tok_s": n as f64 / decode_s.max(1e-9), "finish": reason.as_str(),
                   "drafted": drafts.drafted, "drafts_kept": drafts.accepted})
        });
        info!(
            request = job.id,
            prompt = job.prompt.len(),
            reused = restored.reused,
            generated = n,
            finish = reason.as_str(),
            "prefill {:.1} tok/s, decode {:.1} tok/s",
            new.len() as f64 / prefill_s.max(1e-9),
            n as f64 / decode_s.max(1e-9)
        );
        Ok(Outcome::Finished(Finish {
            reason,
            prompt_tokens: job.prompt.len(),
            completion_tokens: n,
            cached_tokens: restored.reused,
        }))
    }

    /// Prefill `seg` (the tokens after the sequence's position); `context` is every token up
    /// to the segment's end. With MTP drafts the head's cache takes the segment's final rows.
    fn prefill(&mut self, seg: &[u32], context: &[u32]) -> Result<(Vec<f32>, split::SplitReport)> {
        let (model, be) = (&self.model, &*self.backend);
        let Some(mtp) = &mut self.mtp else {
            return split::prefill(model, be, &mut self.seq, seg, &self.plan);
        };
        let mut take = |x: &Act, pos: usize| {
            mtp.take_rows(model, be, &model.final_norm_rows(be, x)?, pos, context)
        };
        split::prefill_rows(model, be, &mut self.seq, seg, &self.plan, Some(&mut take))
    }

    /// Feed one token sent before (a redo's); `context` is every token up to it.
    fn feed(&mut self, tok: u32, context: &[u32]) -> Result<Vec<f32>> {
        let (model, be) = (&self.model, &*self.backend);
        let Some(mtp) = &mut self.mtp else {
            return self.seq.forward(model, be, &[tok], Logits::Last, None);
        };
        let pos = self.seq.state.pos;
        let (hidden, logits) = self.seq.forward_rows(model, be, &[tok])?;
        mtp.take_rows(model, be, &hidden, pos, context)?;
        Ok(logits)
    }

    /// `--debug-panic-on`: panic, with the state just updated by a prefill, when the prompt
    /// holds the text.
    fn debug_panic(&self, job: &Job) {
        let Some(text) = &self.panic_on else {
            return;
        };
        if self
            .tokenizer
            .decode(&job.prompt)
            .is_ok_and(|p| p.contains(text.as_str()))
        {
            panic!("--debug-panic-on {text:?}: the prompt holds it");
        }
    }

    fn kv_placement(&self) -> KvPlacement {
        let mut p = KvPlacement::default();
        let placement = &self.seq.placement;
        for (i, l) in self.seq.state.layers.iter().enumerate() {
            if let (LayerState::Attention(kv), Some(held)) = (l, placement.holders(i)) {
                p.host_pages += kv.pages().len();
                for h in &placement.helpers {
                    *p.per_helper.entry(h.id).or_default() += held.count_on(h.id);
                }
                let on_helpers = held.helper_pages();
                p.helper_pages += on_helpers;
                p.host_positions = kv.local_len();
                p.helper_positions = on_helpers * kv.page_size();
                p.disk_positions = kv.remote_len() - on_helpers * kv.page_size();
            }
        }
        p
    }
}

/// The end of a generation's text: what the decoder and the stop scan still hold, cut at a
/// stop string if one is found in it; and whether one was.
pub(super) fn remaining_text(
    decoder: &mut StreamDecoder,
    scan: &mut StopScan,
) -> Result<(String, bool)> {
    let (mut text, stopped) = scan.push(&decoder.finish()?);
    if !stopped {
        text.push_str(&scan.finish());
    }
    Ok((text, stopped))
}

/// A panic's message, for the log and the failed request's error.
pub(super) fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

/// Finds stop strings in streamed text. Text that could still be the start of one is held
/// back, so a client never sees a stop string or a piece of one.
pub struct StopScan {
    stops: Vec<String>,
    /// Text not yet released.
    pending: String,
}

impl StopScan {
    pub fn new(stops: &[String]) -> StopScan {
        StopScan {
            stops: stops.to_vec(),
            pending: String::new(),
        }
    }

    /// Add `piece`; returns the text now safe to release and whether a stop string was found
    /// (the text before it is released, the rest dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return (text, true);
        }
        // The longest tail of the pending text that begins some stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(|(i, _)| &s[..i]))
            .filter(|prefix| self.pending.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let keep = self.pending.split_off(self.pending.len() - hold);
        (std::mem::replace(&mut self.pending, keep), false)
    }

    /// The held-back text, at the end of the generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::StopScan;

    fn scan(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopScan::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (t, stopped) = s.push(p);
            out.push_str(&t);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn stop_strings_split_across_pieces() {
        assert_eq!(
            scan(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
        assert_eq!(
            scan(&["END"], &["hello E", "N"]),
            ("hello EN".into(), false)
        );
        assert_eq!(scan(&[], &["a", "b"]), ("ab".into(), false));
        // The earliest of several.
        assert_eq!(scan(&["c", "ab"], &["xabc"]), ("x".into(), true));
        // Multi-byte stop strings are held back on character boundaries.
        assert_eq!(scan(&["éé"], &["aé", "é"]), ("a".into(), true));
    }

    #[test]
    fn held_text_is_released_as_soon_as_it_cannot_match() {
        let stops = vec!["STOP".to_string()];
        let mut s = StopScan::new(&stops);
        assert_eq!(s.push("abST"), ("ab".into(), false));
        assert_eq!(s.push("x"), ("STx".into(), false));
    }
}
