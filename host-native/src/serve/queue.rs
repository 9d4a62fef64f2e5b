//! The bounded FIFO in front of the engine's one active sequence. A request that finds it full
//! is refused at once (503) instead of waiting unboundedly; a request whose client goes away
//! leaves it at once, so a disconnected client never holds a place.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use engine_core::generate::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;

use super::api::ApiError;
use super::metrics::Metrics;

/// One request for the engine: a tokenised prompt and how to continue it.
pub struct Job {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Where a chat prompt's history ends and the new turn's generation prompt begins
    /// (`<|im_start|>assistant`...): a checkpoint there survives the next turn, whose prompt
    /// renders the same history but may tokenise the end of this one differently.
    pub turn_start: Option<usize>,
    /// Already capped by the context.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// When the request's time limit runs out, counted from its arrival.
    pub deadline: Instant,
    /// Set when the client has gone; the engine stops at the next token or prefill segment.
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<Event>,
}

/// What the engine tells a request's handler, in order: text pieces, then one `Done` or
/// `Failed`.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(Finish),
    Failed(ApiError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` (or the context's end).
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV and DeltaNet state were reused from the previous request.
    pub cached_tokens: usize,
}

pub struct Queue {
    inner: Mutex<Inner>,
    ready: Condvar,
    capacity: usize,
}

struct Inner {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// Why a job was not queued.
pub enum Refused {
    Full,
    Closed,
}

impl Queue {
    pub fn new(capacity: usize) -> Queue {
        Queue {
            inner: Mutex::new(Inner {
                jobs: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            capacity,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The queue holds no invariant a panicking holder could break halfway.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Requests waiting (not counting the one being generated).
    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    pub fn push(&self, job: Job) -> Result<(), Refused> {
        let mut q = self.lock();
        if q.closed {
            return Err(Refused::Closed);
        }
        if q.jobs.len() >= self.capacity {
            return Err(Refused::Full);
        }
        q.jobs.push_back(job);
        self.ready.notify_one();
        Ok(())
    }

    /// The oldest job, waiting for one; `None` once the queue is closed.
    pub fn pop(&self) -> Option<Job> {
        let mut q = self.lock();
        loop {
            if q.closed {
                return None;
            }
            if let Some(job) = q.jobs.pop_front() {
                return Some(job);
            }
            q = self.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Take a waiting job out (its client left); false if it is not waiting (running or done).
    pub fn remove(&self, id: u64) -> bool {
        let mut q = self.lock();
        let before = q.jobs.len();
        q.jobs.retain(|j| j.id != id);
        q.jobs.len() != before
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Refuse new jobs and wake the engine so it can stop; waiting jobs are dropped, which
    /// ends their handlers' event streams.
    pub fn close(&self) {
        let mut q = self.lock();
        q.closed = true;
        q.jobs.clear();
        self.ready.notify_all();
    }
}

/// Held by a request's handler (or its event stream) for as long as the client is there.
/// Dropping it, which is what happens when the client disconnects, cancels the job and frees
/// its place in the queue.
pub struct Ticket {
    pub id: u64,
    pub cancel: Arc<AtomicBool>,
    pub queue: Arc<Queue>,
    pub metrics: Arc<Metrics>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        // A job the engine already took counts its own cancellation.
        if self.queue.remove(self.id) {
            self.metrics.cancelled();
        }
    }
}
