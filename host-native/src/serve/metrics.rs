//! Counters the engine and the handlers keep, rendered as Prometheus text for `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, MutexGuard, PoisonError};

use engine_core::link::LinkStats;

use super::queue::Load;

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Counters>,
}

/// Where KV pages live after the last request, summed over the full-attention layers.
#[derive(Clone, Default)]
pub struct KvPlacement {
    pub host_pages: usize,
    pub helper_pages: usize,
    /// Positions of one layer on each device (pages move for all layers together).
    pub host_positions: usize,
    pub helper_positions: usize,
    /// Positions only in the page file: a helper was lost or one is still being re-filled.
    pub disk_positions: usize,
    /// Pages held on each helper, by its id, summed over full-attention layers.
    pub per_helper: BTreeMap<u32, usize>,
}

#[derive(Default)]
struct Counters {
    /// Responses by route and status.
    responses: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    prompt_tokens_reused: u64,
    prompt_tokens_prefilled: u64,
    completion_tokens: u64,
    /// Drafted tokens checked, and those kept (`--draft`).
    drafted: u64,
    drafts_kept: u64,
    prefill_seconds: f64,
    decode_seconds: f64,
    last_prefill_tps: f64,
    last_decode_tps: f64,
    /// Jobs that ended because their client left (while queued or running).
    cancelled: u64,
    timed_out: u64,
    /// Refused with 503 because the queue was full.
    rejected: u64,
    /// Prompts tokenised (after admission), and the time it took.
    tokenised: u64,
    tokenise_seconds: f64,
    /// Times the engine panicked and was restarted.
    engine_restarts: u64,
    /// Requests the engine is running now.
    active: usize,
    /// Requests run at once (`--parallel`; 0 until set, read as 1).
    parallel: usize,
    /// `--parallel`: sequences the batch holds, and the bytes of their KV pages and states.
    batch_sequences: usize,
    batch_state_bytes: usize,
    /// `--parallel`: the prefix cache's lookups that found a prefix and those that did not,
    /// its entries, bytes and evictions.
    prefix_hits: u64,
    prefix_misses: u64,
    prefix_entries: usize,
    prefix_bytes: usize,
    prefix_evictions: u64,
    /// Seconds an engine job takes, smoothed; sizes `Retry-After`.
    job_seconds: f64,
    kv: KvPlacement,
    /// Helpers the sequence had after the last request.
    helpers_attached: usize,
    /// Times a lost helper was connected again.
    helper_reconnects: u64,
}

impl Metrics {
    fn lock(&self) -> MutexGuard<'_, Counters> {
        // Counters stay readable after a panic elsewhere.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn response(&self, route: &'static str, status: u16) {
        *self.lock().responses.entry((route, status)).or_default() += 1;
    }

    pub fn cancelled(&self) {
        self.lock().cancelled += 1;
    }

    pub fn timed_out(&self) {
        self.lock().timed_out += 1;
    }

    pub fn rejected(&self) {
        self.lock().rejected += 1;
    }

    pub fn tokenised(&self, seconds: f64) {
        let mut c = self.lock();
        c.tokenised += 1;
        c.tokenise_seconds += seconds;
    }

    pub fn engine_restarted(&self) {
        self.lock().engine_restarts += 1;
    }

    /// Requests the engine is running now (one at a time, or a batch's).
    pub fn set_active(&self, running: usize) {
        self.lock().active = running;
    }

    /// `--parallel`: what the batch holds after a step.
    pub fn set_batch(&self, sequences: usize, state_bytes: usize) {
        let mut c = self.lock();
        c.batch_sequences = sequences;
        c.batch_state_bytes = state_bytes;
    }

    /// `--parallel`: a prefix cache lookup, which found a prefix or not.
    pub fn prefix_lookup(&self, hit: bool) {
        let mut c = self.lock();
        match hit {
            true => c.prefix_hits += 1,
            false => c.prefix_misses += 1,
        }
    }

    /// `--parallel`: what the prefix cache holds after a step.
    pub fn set_prefix_cache(&self, entries: usize, bytes: usize, evictions: u64) {
        let mut c = self.lock();
        c.prefix_entries = entries;
        c.prefix_bytes = bytes;
        c.prefix_evictions = evictions;
    }

    /// A prefill of `prefilled` new tokens for a prompt of `prompt` (the rest reused).
    pub fn prefill(&self, prompt: usize, prefilled: usize, seconds: f64) {
        let mut c = self.lock();
        c.prompt_tokens += prompt as u64;
        c.prompt_tokens_prefilled += prefilled as u64;
        c.prompt_tokens_reused += (prompt - prefilled) as u64;
        c.prefill_seconds += seconds;
        if prefilled > 0 && seconds > 0.0 {
            c.last_prefill_tps = prefilled as f64 / seconds;
        }
    }

    pub fn decode(&self, tokens: usize, seconds: f64) {
        let mut c = self.lock();
        c.completion_tokens += tokens as u64;
        c.decode_seconds += seconds;
        if tokens > 0 && seconds > 0.0 {
            c.last_decode_tps = tokens as f64 / seconds;
        }
    }

    /// A generation's speculation: `drafted` tokens checked, `kept` of them kept.
    pub fn drafts(&self, drafted: usize, kept: usize) {
        let mut c = self.lock();
        c.drafted += drafted as u64;
        c.drafts_kept += kept as u64;
    }

    pub fn set_helpers_attached(&self, attached: usize) {
        self.lock().helpers_attached = attached;
    }

    pub fn helper_reconnected(&self) {
        self.lock().helper_reconnects += 1;
    }

    pub fn job_done(&self, seconds: f64, kv: KvPlacement, helpers_attached: usize) {
        let mut c = self.lock();
        c.job_seconds = if c.job_seconds == 0.0 {
            seconds
        } else {
            0.8 * c.job_seconds + 0.2 * seconds
        };
        c.kv = kv;
        c.helpers_attached = helpers_attached;
    }

    /// A guess at when a refused client may find room: the jobs ahead of it at the usual
    /// pace (`--parallel` of them at a time), at least one second and at most a minute.
    pub fn retry_after(&self, queued: usize) -> u64 {
        let c = self.lock();
        // With --parallel the jobs ahead finish that many at a time.
        let rounds = (queued + 1).div_ceil(c.parallel.max(1));
        let s = c.job_seconds * rounds as f64;
        (s.ceil() as u64).clamp(1, 60)
    }

    /// Requests the engine runs at once (`--parallel`), for [`Self::retry_after`].
    pub fn set_parallel(&self, n: usize) {
        self.lock().parallel = n;
    }

    /// The metrics in Prometheus' text format; `links` are the helpers' links by helper id
    /// (`None` without helpers).
    pub fn render(&self, queue: &Load, links: Option<&[(u32, LinkStats)]>) -> String {
        let c = self.lock();
        let mut t = String::new();
        let mut one = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(
                t,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        one(
            "tether_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished prefills, reused or not.",
            c.prompt_tokens as f64,
        );
        one(
            "tether_prompt_tokens_reused_total",
            "counter",
            "Prompt tokens whose state was reused from the previous request instead of prefilled.",
            c.prompt_tokens_reused as f64,
        );
        one(
            "tether_prompt_tokens_prefilled_total",
            "counter",
            "Prompt tokens run through the model.",
            c.prompt_tokens_prefilled as f64,
        );
        one(
            "tether_completion_tokens_total",
            "counter",
            "Tokens generated.",
            c.completion_tokens as f64,
        );
        one(
            "tether_draft_tokens_total",
            "counter",
            "Drafted tokens checked by speculative decoding (--draft).",
            c.drafted as f64,
        );
        one(
            "tether_draft_tokens_kept_total",
            "counter",
            "Drafted tokens kept: each saved a forward pass.",
            c.drafts_kept as f64,
        );
        one(
            "tether_prefill_seconds_total",
            "counter",
            "Time spent prefilling.",
            c.prefill_seconds,
        );
        one(
            "tether_decode_seconds_total",
            "counter",
            "Time spent generating.",
            c.decode_seconds,
        );
        one(
            "tether_prefill_tokens_per_second",
            "gauge",
            "Prefill speed of the last request that prefilled.",
            c.last_prefill_tps,
        );
        one(
            "tether_decode_tokens_per_second",
            "gauge",
            "Decode speed of the last request that generated.",
            c.last_decode_tps,
        );
        one(
            "tether_queue_length",
            "gauge",
            "Requests waiting for the engine, being tokenised included.",
            queue.waiting as f64,
        );
        one(
            "tether_queue_capacity",
            "gauge",
            "Most requests that may wait.",
            queue.capacity as f64,
        );
        one(
            "tether_queue_bytes",
            "gauge",
            "Bytes the waiting requests are counted as holding.",
            queue.bytes as f64,
        );
        one(
            "tether_queue_memory_limit_bytes",
            "gauge",
            "Most bytes the waiting requests may hold.",
            queue.budget as f64,
        );
        one(
            "tether_prompts_tokenised_total",
            "counter",
            "Prompts tokenised (after admission to the queue).",
            c.tokenised as f64,
        );
        one(
            "tether_tokenise_seconds_total",
            "counter",
            "Time spent tokenising prompts.",
            c.tokenise_seconds,
        );
        one(
            "tether_engine_restarts_total",
            "counter",
            "Times the engine panicked and was restarted with a fresh sequence.",
            c.engine_restarts as f64,
        );
        one(
            "tether_active_requests",
            "gauge",
            "Requests being generated (one at a time, or up to --parallel in one batch).",
            c.active as f64,
        );
        one(
            "tether_batch_sequences",
            "gauge",
            "With --parallel: sequences the batch holds (each running request's).",
            c.batch_sequences as f64,
        );
        one(
            "tether_batch_state_bytes",
            "gauge",
            "With --parallel: bytes of the batch's KV pages and DeltaNet states.",
            c.batch_state_bytes as f64,
        );
        one(
            "tether_prefix_cache_hits_total",
            "counter",
            "With --parallel: requests that started from a cached prefix of their prompt.",
            c.prefix_hits as f64,
        );
        one(
            "tether_prefix_cache_misses_total",
            "counter",
            "With --parallel: requests that found no cached prefix and prefilled from 0.",
            c.prefix_misses as f64,
        );
        one(
            "tether_prefix_cache_entries",
            "gauge",
            "With --parallel: prefixes the cache holds (sequences forked at prompt breaks and ends).",
            c.prefix_entries as f64,
        );
        one(
            "tether_prefix_cache_bytes",
            "gauge",
            "With --parallel: bytes the prefix cache holds (pages shared by entries counted once).",
            c.prefix_bytes as f64,
        );
        one(
            "tether_prefix_cache_evictions_total",
            "counter",
            "With --parallel: prefixes evicted, least recently used first, to keep the budget.",
            c.prefix_evictions as f64,
        );
        one(
            "tether_requests_rejected_total",
            "counter",
            "Requests refused with 503 because the queue was full (by count or by memory).",
            c.rejected as f64,
        );
        one(
            "tether_requests_cancelled_total",
            "counter",
            "Requests whose client disconnected before the end.",
            c.cancelled as f64,
        );
        one(
            "tether_requests_timed_out_total",
            "counter",
            "Requests that ran past the time limit.",
            c.timed_out as f64,
        );
        if links.is_some() {
            one(
                "tether_helpers_attached",
                "gauge",
                "Helpers the sequence has (one lost counts no more until it reconnects).",
                c.helpers_attached as f64,
            );
            one(
                "tether_helper_reconnects_total",
                "counter",
                "Times a lost helper was connected again.",
                c.helper_reconnects as f64,
            );
        }
        let _ = writeln!(
            t,
            "# HELP tether_responses_total HTTP responses by route and status.\n# TYPE tether_responses_total counter"
        );
        for ((route, status), n) in &c.responses {
            let _ = writeln!(
                t,
                "tether_responses_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let _ = writeln!(
            t,
            "# HELP tether_kv_pages KV pages held per device, summed over full-attention layers.\n# TYPE tether_kv_pages gauge\n\
             tether_kv_pages{{device=\"host\"}} {}\ntether_kv_pages{{device=\"helper\"}} {}",
            c.kv.host_pages, c.kv.helper_pages
        );
        let _ = writeln!(
            t,
            "# HELP tether_kv_positions KV positions of one full-attention layer per device.\n# TYPE tether_kv_positions gauge\n\
             tether_kv_positions{{device=\"host\"}} {}\ntether_kv_positions{{device=\"helper\"}} {}\n\
             tether_kv_positions{{device=\"disk\"}} {}",
            c.kv.host_positions, c.kv.helper_positions, c.kv.disk_positions
        );
        let _ = writeln!(
            t,
            "# HELP tether_helper_pages KV pages on each helper, summed over full-attention layers.\n# TYPE tether_helper_pages gauge"
        );
        for (id, pages) in &c.kv.per_helper {
            let _ = writeln!(t, "tether_helper_pages{{helper=\"{id}\"}} {pages}");
        }
        let links = links.unwrap_or_default();
        for (metric, field, help) in [
            (
                "tether_link_bytes_total",
                "bytes",
                "Bytes on the link to each helper by direction and message type.",
            ),
            (
                "tether_link_messages_total",
                "messages",
                "Messages on the link to each helper by direction and message type.",
            ),
        ] {
            if links.is_empty() {
                break;
            }
            let _ = writeln!(t, "# HELP {metric} {help}\n# TYPE {metric} counter");
            for (id, link) in links {
                for (dir, by_type) in [("sent", &link.sent), ("received", &link.received)] {
                    for (kind, traffic) in by_type {
                        let v = match field {
                            "bytes" => traffic.bytes,
                            _ => traffic.messages,
                        };
                        let _ = writeln!(
                            t,
                            "{metric}{{helper=\"{id}\",direction=\"{dir}\",type=\"{kind}\"}} {v}"
                        );
                    }
                }
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::{KvPlacement, Metrics};

    /// Retry-After counts the jobs ahead at the usual pace, `--parallel` of them at a time.
    #[test]
    fn retry_after_counts_rounds_of_parallel_jobs() {
        let m = Metrics::default();
        m.job_done(2.0, KvPlacement::default(), 0);
        assert_eq!(m.retry_after(3), 8, "one at a time: four jobs of 2 s");
        m.set_parallel(4);
        assert_eq!(m.retry_after(3), 2, "four at a time: one round");
        assert_eq!(m.retry_after(4), 4, "five jobs: two rounds");
        assert_eq!(m.retry_after(400), 60, "at most a minute");
    }
}
