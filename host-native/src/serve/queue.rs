//! The bounded FIFO in front of the engine's one active sequence. A request is admitted first,
//! against a count and a memory bound, and only then tokenised and queued; one that finds no
//! room is refused at once (503) instead of waiting unboundedly. A request whose client goes
//! away leaves at once, so a disconnected client never holds a place.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use engine_core::generate::SamplingParams;
use tokio::sync::mpsc::UnboundedSender;

use super::api::ApiError;
use super::metrics::Metrics;

/// One request for the engine: a tokenised prompt and how to continue it.
pub struct Job {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Where a chat prompt's prefill restarts its ubatches and its state is kept (the ends
    /// of its system prompt, of the previous turn's history and of this one's: see
    /// [`engine_core::tokenizer::Tokenizer::chat_breaks`]); empty for a completion.
    pub breaks: Vec<usize>,
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

impl Job {
    /// Where a worker keeps a copy of the request's state for later requests: where its
    /// first message ends (a system prompt others share), where its last ends (the history
    /// the next turn extends) and where its prompt ends (the same prompt again). Its prefill
    /// restarts at every break, but a copy of every DeltaNet state at each of a long chat's
    /// message ends would cost more than it saves.
    pub fn keep_at(&self) -> Vec<usize> {
        let mut at: Vec<usize> = [self.breaks.first(), self.breaks.last()]
            .into_iter()
            .flatten()
            .copied()
            .chain([self.prompt.len()])
            .collect();
        at.dedup();
        at
    }
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

/// What the engine found in the queue.
pub enum Next {
    Job(Job),
    /// No job came within the wait.
    Idle,
    /// The server is stopping.
    Closed,
}

pub struct Queue {
    inner: Mutex<Inner>,
    ready: Condvar,
    /// Most requests admitted and not yet taken by the engine (`--queue`).
    capacity: usize,
    /// Most bytes those requests may hold together (`--queue-memory`).
    budget: u64,
}

struct Inner {
    /// Waiting jobs, each with the bytes it was admitted with.
    jobs: VecDeque<(Job, u64)>,
    /// Requests admitted and still being tokenised.
    tokenising: usize,
    /// Bytes of every admitted request not yet taken by the engine.
    bytes: u64,
    closed: bool,
}

/// Why a request was not admitted or queued.
#[derive(Debug)]
pub enum Refused {
    Full,
    Closed,
}

/// How full the queue is, for `/metrics` and error messages.
pub struct Load {
    /// Requests admitted and not yet taken by the engine, being tokenised included.
    pub waiting: usize,
    pub capacity: usize,
    pub bytes: u64,
    pub budget: u64,
}

/// A place in the queue, taken before a request is tokenised (so a request that will be
/// refused is refused before any work is spent on it); dropping it unused gives it back.
pub struct Admission {
    queue: Arc<Queue>,
    bytes: u64,
    /// Passed on to a waiting job, which gives the bytes back when it leaves the queue.
    queued: bool,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.queued {
            let mut q = self.queue.lock();
            q.tokenising -= 1;
            q.bytes -= self.bytes;
        }
    }
}

impl Queue {
    pub fn new(capacity: usize, budget: u64) -> Queue {
        Queue {
            inner: Mutex::new(Inner {
                jobs: VecDeque::new(),
                tokenising: 0,
                bytes: 0,
                closed: false,
            }),
            ready: Condvar::new(),
            capacity,
            budget,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The queue holds no invariant a panicking holder could break halfway.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn load(&self) -> Load {
        let q = self.lock();
        Load {
            waiting: q.jobs.len() + q.tokenising,
            capacity: self.capacity,
            bytes: q.bytes,
            budget: self.budget,
        }
    }

    /// Admit a request that will hold `bytes` while it waits, if both the count and the
    /// memory bound leave room for it.
    pub fn admit(self: &Arc<Self>, bytes: u64) -> Result<Admission, Refused> {
        let mut q = self.lock();
        if q.closed {
            return Err(Refused::Closed);
        }
        if q.jobs.len() + q.tokenising >= self.capacity || q.bytes + bytes > self.budget {
            return Err(Refused::Full);
        }
        q.tokenising += 1;
        q.bytes += bytes;
        Ok(Admission {
            queue: self.clone(),
            bytes,
            queued: false,
        })
    }

    /// Queue an admitted request's job.
    pub fn push(&self, job: Job, mut admission: Admission) -> Result<(), Refused> {
        let mut q = self.lock();
        if q.closed {
            return Err(Refused::Closed);
        }
        admission.queued = true;
        q.tokenising -= 1;
        q.jobs.push_back((job, admission.bytes));
        self.ready.notify_one();
        Ok(())
    }

    /// The oldest job, waiting at most `wait` for one: the engine wakes now and then while
    /// idle, to take helpers that joined before the next request comes.
    pub fn next_within(&self, wait: Duration) -> Next {
        let deadline = Instant::now() + wait;
        let mut q = self.lock();
        loop {
            if q.closed {
                return Next::Closed;
            }
            if let Some((job, bytes)) = q.jobs.pop_front() {
                q.bytes -= bytes;
                return Next::Job(job);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Next::Idle;
            }
            q = self
                .ready
                .wait_timeout(q, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Take a waiting job out (its client left); false if it is not waiting (running or done).
    pub fn remove(&self, id: u64) -> bool {
        let mut q = self.lock();
        let Some(at) = q.jobs.iter().position(|(j, _)| j.id == id) else {
            return false;
        };
        if let Some((_, bytes)) = q.jobs.remove(at) {
            q.bytes -= bytes;
        }
        true
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Refuse new jobs and wake the engine so it can stop; waiting jobs are dropped, which
    /// ends their handlers' event streams.
    pub fn close(&self) {
        let mut q = self.lock();
        q.closed = true;
        let held: u64 = q.jobs.drain(..).map(|(_, bytes)| bytes).sum();
        q.bytes -= held;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: u64) -> Job {
        Job {
            id,
            prompt: vec![1],
            breaks: Vec::new(),
            max_tokens: 1,
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
            },
            stop: Vec::new(),
            deadline: Instant::now(),
            cancel: Arc::default(),
            events: tokio::sync::mpsc::unbounded_channel().0,
        }
    }

    fn held(q: &Queue) -> (usize, u64) {
        let l = q.load();
        (l.waiting, l.bytes)
    }

    #[test]
    fn admission_is_bounded_by_count_and_bytes_and_given_back() {
        let q = Arc::new(Queue::new(3, 100));
        let a = q.admit(60).unwrap();
        // Past the bytes, though not the count.
        assert!(matches!(q.admit(41), Err(Refused::Full)));
        // Dropped unused (a client that left while it was tokenised): given back.
        drop(q.admit(40).unwrap());
        assert_eq!(held(&q), (1, 60));
        q.push(job(1), a).unwrap();
        let b = q.admit(10).unwrap();
        let c = q.admit(10).unwrap();
        assert_eq!(held(&q), (3, 80));
        // Past the count, though not the bytes.
        assert!(matches!(q.admit(1), Err(Refused::Full)));
        assert!(matches!(q.next_within(Duration::ZERO), Next::Job(j) if j.id == 1));
        assert_eq!(held(&q), (2, 20));
        q.push(job(2), b).unwrap();
        assert!(q.remove(2));
        assert!(!q.remove(2));
        drop(c);
        assert_eq!(held(&q), (0, 0));
        let d = q.admit(50).unwrap();
        q.close();
        assert!(matches!(q.push(job(3), d), Err(Refused::Closed)));
        assert!(matches!(q.admit(1), Err(Refused::Closed)));
        assert_eq!(held(&q), (0, 0));
    }
}
