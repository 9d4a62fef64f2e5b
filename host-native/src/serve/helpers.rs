//! The server's helpers: those it started with, got back when lost (a cable pulled and plugged
//! in again, a helper restarted), and those that join while it runs (`--accept-helpers`).
//! Before each request the engine attaches whatever came: the sequence stays as it is, and a
//! new or returning helper takes new pages and is re-filled from the page file a few pages per
//! pass.

use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use engine_core::host::Sequence;
use engine_core::link::{Link, StatsHandle};
use engine_core::{Backend, Model};
use tracing::{debug, info};

use crate::attach::{Attached, HelperArgs, Source};

/// Helpers attached at once at most: each costs a link and a query per layer.
const MAX_HELPERS: usize = 8;

/// How long a request waits for a connection attempt it started: a helper that answers, or
/// refuses, does so at once; one that does not is left to connect in the background while the
/// request runs without it, and the next request picks up what came of it. Once an attempt
/// has gone unanswered that long (a helper whose process is stopped: its kernel still accepts
/// the connection), later requests wait for none until one is answered.
const RECONNECT_WAIT: Duration = Duration::from_secs(1);

/// A connection attempt under way on a thread of its own.
struct Attempt {
    source: Source,
    stats: StatsHandle,
    link: mpsc::Receiver<anyhow::Result<Box<dyn Link>>>,
}

pub struct Helpers {
    args: HelperArgs,
    /// The helpers the server has, with their traffic (shared with `/metrics`). A dialed one
    /// the sequence lost stays listed, to be connected again, and counts on across
    /// reconnections; a lost one that had joined is dropped (it joins again by itself).
    attached: Arc<Mutex<Vec<Attached>>>,
    /// Attempts to reconnect start at most this often.
    every: Duration,
    next_try: Instant,
    pending: Option<Attempt>,
    /// An attempt went unanswered for [`RECONNECT_WAIT`]: requests no longer wait for one
    /// until an attempt gets a link.
    silent: bool,
    /// Helpers the first request waits for, and how long (`--wait-helpers` on the server's
    /// own port, where none can join before it listens).
    first: Option<(usize, Duration)>,
    /// The server's conversation checkpoints, which its plans count in the host's memory.
    checkpoints: usize,
}

impl Helpers {
    pub fn new(
        args: HelperArgs,
        attached: Vec<Attached>,
        (every, checkpoints): (Duration, usize),
    ) -> Helpers {
        Helpers {
            checkpoints,
            attached: Arc::new(Mutex::new(attached)),
            every,
            next_try: Instant::now(),
            pending: None,
            silent: false,
            first: Some(args.waits_on_port()).filter(|(n, _)| *n > 0),
            args,
        }
    }

    /// `tether plan`'s text for `seq` as it is now (pages of `page_size`, prefill in
    /// `ubatch`es), for a `context`-token context and a `prompt`-token prompt.
    pub fn plan(
        &self,
        model: &Model,
        seq: &Sequence,
        (page_size, ubatch): (usize, usize),
        (context, prompt): (usize, usize),
    ) -> String {
        let offers = super::serving_offers(&self.args, seq);
        let fixed = super::fixed(seq, (page_size, ubatch), self.checkpoints);
        self.args
            .plan_for(model, offers, fixed, context, prompt)
            .text
    }

    /// What the server knows of helper `id` beyond its offer, for the live page's card: how
    /// it came (`"dialed"` or `"joined"`) and its link's round trip when it attached, in ms.
    pub fn about(&self, id: u32) -> (Option<&'static str>, Option<f64>) {
        let list = self.list();
        let Some(a) = list.iter().find(|a| a.id == id) else {
            return (None, None);
        };
        let source = match a.source {
            Source::Joined => "joined",
            Source::Dial(_) => "dialed",
        };
        (Some(source), a.rtt_ms)
    }

    /// The list `/metrics` reads.
    pub fn shared(&self) -> Arc<Mutex<Vec<Attached>>> {
        self.attached.clone()
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Attached>> {
        self.attached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Attach what came since the last request, with `state`'s `(page_size, context)`:
    /// helpers that joined, and a lost dialed helper that answers again. Returns (helpers
    /// that joined, whether a lost one came back).
    pub fn refresh(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        seq: &mut Sequence,
        shape: (usize, usize),
    ) -> (usize, bool) {
        let live: Vec<u32> = seq.placement.helpers.iter().map(|h| h.id).collect();
        self.list()
            .retain(|a| a.source != Source::Joined || live.contains(&a.id));
        let waiting = match self.first.take() {
            Some((n, wait)) => (n, Instant::now() + wait),
            None => (0, Instant::now()),
        };
        let added = self.take_joined((model, be), seq, shape, waiting);
        let back = self.returning(&live).is_some_and(|(source, stats, link)| {
            self.attach((model, be), seq, shape, link, source, stats)
        });
        (added, back)
    }

    /// Between requests: attach helpers that joined since the last look, waiting for none,
    /// so a helper shows up and gets its share at once rather than at the next request.
    /// Returns how many were attached.
    pub fn joined_meanwhile(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        seq: &mut Sequence,
        shape: (usize, usize),
    ) -> usize {
        self.take_joined((model, be), seq, shape, (0, Instant::now()))
    }

    /// Attach the helpers that joined, waiting until `deadline` while the sequence has fewer
    /// than `wait_for`; returns how many were attached.
    fn take_joined(
        &mut self,
        (model, be): (&Model, &dyn Backend),
        seq: &mut Sequence,
        shape: (usize, usize),
        (wait_for, deadline): (usize, Instant),
    ) -> usize {
        let mut added = 0;
        while self.args.sources().1 && seq.placement.helpers.len() < MAX_HELPERS {
            let stats = StatsHandle::default();
            let wait = match seq.placement.helpers.len() < wait_for {
                true => deadline.saturating_duration_since(Instant::now()),
                false => Duration::ZERO,
            };
            let Ok(link) = self.args.connect(&Source::Joined, &stats, wait) else {
                break;
            };
            let joined = self.attach((model, be), seq, shape, link, Source::Joined, stats);
            added += usize::from(joined);
        }
        added
    }

    /// Attach `link` from `source` (counting into `stats`) with `state`'s `(page_size,
    /// context)` and list it; false if it could not be configured.
    fn attach(
        &mut self,
        (model, be): (&Model, &dyn Backend),
        seq: &mut Sequence,
        shape: (usize, usize),
        link: Box<dyn Link>,
        source: Source,
        stats: StatsHandle,
    ) -> bool {
        match self.args.attach_link(model, be, seq, shape, link, &source) {
            Ok(id) => {
                info!("{source} is attached (helper {id})");
                let attached = Attached::measured(seq, id, source, stats);
                let mut list = self.list();
                list.retain(|a| a.source == Source::Joined || a.source != attached.source);
                list.push(attached);
                true
            }
            Err(e) => {
                debug!("{source} answered but could not be attached: {e:#}");
                false
            }
        }
    }

    /// A lost dialed helper's new link, if an attempt has one within [`RECONNECT_WAIT`]: the
    /// one under way, or one started now if it is time.
    fn returning(&mut self, live: &[u32]) -> Option<(Source, StatsHandle, Box<dyn Link>)> {
        for _ in 0..2 {
            if self.pending.is_none() {
                if Instant::now() < self.next_try {
                    return None;
                }
                self.start(live);
            }
            let attempt = self.pending.as_ref()?;
            let wait = if self.silent {
                Duration::ZERO
            } else {
                RECONNECT_WAIT
            };
            match attempt.link.recv_timeout(wait) {
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.silent = true;
                    return None;
                }
                Ok(Ok(link)) => {
                    self.silent = false;
                    let a = self.pending.take()?;
                    return Some((a.source, a.stats, link));
                }
                Ok(Err(e)) => {
                    debug!("{} is still gone: {e:#}", attempt.source);
                    self.pending = None;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => self.pending = None,
            }
        }
        None
    }

    /// Start an attempt on the first lost dialed helper, on a thread of its own; attempts
    /// start at most every `every`.
    fn start(&mut self, live: &[u32]) {
        let lost = self
            .list()
            .iter()
            .find(|a| a.source != Source::Joined && !live.contains(&a.id))
            .map(|a| (a.source.clone(), a.stats.clone()));
        let Some((source, stats)) = lost else {
            return;
        };
        self.next_try = Instant::now() + self.every;
        let (tx, rx) = mpsc::channel();
        let (args, s, counting) = (self.args.clone(), source.clone(), stats.clone());
        let started = std::thread::Builder::new()
            .name("helper-reconnect".into())
            .spawn(move || {
                let _ = tx.send(args.connect(&s, &counting, Duration::ZERO));
            });
        if started.is_ok() {
            self.pending = Some(Attempt {
                source,
                stats,
                link: rx,
            });
        }
    }
}
