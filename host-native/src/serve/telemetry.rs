//! `GET /v1/telemetry`: the split as it runs, for the page at `/` and any other watcher, as
//! server-sent events of one JSON object each (docs/TELEMETRY.md is the schema). The engine's
//! events (ubatches, link transfers, page placement: engine_core::host::telemetry) and the server's
//! (requests, prefill, tokens, the devices) go through one broadcast channel. A new watcher
//! first gets `hello` (the model's layers, the split, the plan) and the latest `devices` and
//! `pages`, then everything as it happens, and a `link` sample of every helper's traffic
//! twice a second. With nobody watching nothing is serialised; a watcher too slow to keep up
//! is told how many events it missed rather than holding the engine back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::response::sse::{Event as Sse, KeepAlive};
use engine_core::host::telemetry::{Event, Telemetry};
use futures_util::stream;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::broadcast::{self, error::RecvError};

use crate::attach::Attached;

/// Events a watcher may fall behind by before it is told it missed some.
const BACKLOG: usize = 4096;

/// Watchers at once: each holds a backlog; more are refused with 503.
pub const MAX_WATCHERS: usize = 32;

/// How often a watcher gets a `link` sample.
const LINK_EVERY: Duration = Duration::from_millis(500);

pub struct Hub {
    epoch: Instant,
    tx: broadcast::Sender<Arc<str>>,
    hello: Value,
    /// The latest `devices` and `pages` events, for a watcher that arrives mid-run.
    devices: Mutex<Option<Value>>,
    pages: Mutex<Option<Event>>,
    watchers: AtomicUsize,
    /// Set when the server stops: every stream ends, so none holds the shutdown up.
    closed: tokio::sync::watch::Sender<bool>,
}

impl Hub {
    /// `hello` is what every watcher is told first (its `type` and `at_ms` are added).
    pub fn new(hello: Value) -> Arc<Hub> {
        Arc::new(Hub {
            epoch: Instant::now(),
            tx: broadcast::channel(BACKLOG).0,
            hello,
            devices: Mutex::new(None),
            pages: Mutex::new(None),
            watchers: AtomicUsize::new(0),
            closed: tokio::sync::watch::Sender::new(false),
        })
    }

    /// End every stream: the server is stopping (they never end on their own).
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// Milliseconds since the server started: every event's clock.
    pub fn ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e3
    }

    fn watched(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    /// A server event of type `kind` with the fields `fields` builds (an object), stamped
    /// with the time: built and sent only if someone watches (tokens are on the hot path).
    pub fn event(&self, kind: &str, fields: impl FnOnce() -> Value) {
        if self.watched() {
            let mut event = fields();
            event["type"] = kind.into();
            event["at_ms"] = self.ms().into();
            self.send(&event);
        }
    }

    /// Send `event` to every watcher, if there is one.
    fn send(&self, event: &impl Serialize) {
        if self.watched() {
            if let Ok(text) = serde_json::to_string(event) {
                // Nobody listening between the check and the send is fine.
                let _ = self.tx.send(text.into());
            }
        }
    }

    /// The helpers the sequence has now (`[{device, offer_bytes, prefill_layers, backend,
    /// rtt_ms, source}]`, docs/TELEMETRY.md) and the plan for them, if the server takes
    /// helpers.
    pub fn devices(&self, devices: Value, plan: Option<String>) {
        let event =
            json!({"type": "devices", "at_ms": self.ms(), "devices": devices, "plan": plan});
        self.send(&event);
        *self.devices.lock().unwrap_or_else(PoisonError::into_inner) = Some(event);
    }

    /// The sink for the engine's sequence state.
    pub fn telemetry(self: &Arc<Hub>) -> Telemetry {
        let (clock, hub) = (self.clone(), self.clone());
        Telemetry::new(
            move || clock.ms(),
            move |e| {
                hub.send(&e);
                if matches!(e, Event::Pages { .. }) {
                    *hub.pages.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                }
            },
        )
    }

    /// A new watcher's first events and its subscription, or `None` when there are too many.
    fn watch(self: &Arc<Hub>) -> Option<Watcher> {
        let n = self.watchers.fetch_add(1, Ordering::SeqCst);
        let watcher = Watcher {
            hub: self.clone(),
            rx: self.tx.subscribe(),
            closed: self.closed.subscribe(),
        };
        (n < MAX_WATCHERS).then_some(watcher)
    }

    fn opening(&self) -> Vec<String> {
        let mut hello = self.hello.clone();
        hello["type"] = "hello".into();
        hello["at_ms"] = self.ms().into();
        let devices = self
            .devices
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let pages = self
            .pages
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|p| serde_json::to_value(p).ok());
        [Some(hello), devices, pages]
            .into_iter()
            .flatten()
            .map(|v| v.to_string())
            .collect()
    }
}

/// One watcher's subscription; counted until it is dropped (its client left).
struct Watcher {
    hub: Arc<Hub>,
    rx: broadcast::Receiver<Arc<str>>,
    closed: tokio::sync::watch::Receiver<bool>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.hub.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Every helper's traffic so far, by message type and direction.
fn link_sample(hub: &Hub, helpers: Option<&Mutex<Vec<Attached>>>) -> String {
    let links: Vec<Value> = helpers
        .map(|h| {
            h.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .map(|a| {
                    let s = a.stats.snapshot();
                    json!({"device": format!("helper:{}", a.id), "sent": s.sent,
                           "received": s.received,
                           "capacity_bps": hub.hello["link_capacity_bps"]})
                })
                .collect()
        })
        .unwrap_or_default();
    json!({"type": "link", "at_ms": hub.ms(), "links": links}).to_string()
}

/// The SSE response for `/v1/telemetry`, or `None` when too many watch already.
pub fn stream(
    hub: &Arc<Hub>,
    helpers: Option<Arc<Mutex<Vec<Attached>>>>,
) -> Option<axum::response::Response> {
    use axum::response::IntoResponse;
    let watcher = hub.watch()?;
    let opening = watcher.hub.opening();
    let mut tick = tokio::time::interval(LINK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let events = stream::iter(opening.into_iter().map(|t| Ok(Sse::default().data(t))));
    let live = stream::unfold(
        (watcher, tick, helpers),
        |(mut w, mut tick, helpers)| async move {
            let text: String = tokio::select! {
                r = w.rx.recv() => match r {
                    Ok(text) => text.to_string(),
                    Err(RecvError::Lagged(missed)) => {
                        json!({"type": "lagged", "at_ms": w.hub.ms(), "missed": missed})
                            .to_string()
                    }
                    Err(RecvError::Closed) => return None,
                },
                _ = tick.tick() => link_sample(&w.hub, helpers.as_deref()),
                _ = w.closed.wait_for(|&closed| closed) => return None,
            };
            Some((
                Ok::<_, std::convert::Infallible>(Sse::default().data(text)),
                (w, tick, helpers),
            ))
        },
    );
    use futures_util::StreamExt;
    Some(
        axum::response::Sse::new(events.chain(live))
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response(),
    )
}
