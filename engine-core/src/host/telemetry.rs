//! What a split run is doing, as events a live view draws (`tether serve`'s `/v1/telemetry`
//! and the page at `/`): each ubatch's layers on each device, what crossed the link, and where
//! every KV page is. The engine emits them at ubatch and page granularity, and only to a sink
//! someone attached: with none, an emission is one branch and no event is built, so a run
//! nobody watches pays nothing measurable.
//!
//! The clock belongs to the sink (milliseconds since its own epoch), so the same events come
//! from a native host and from engine-core in a browser tab, where `std::time::Instant` does
//! not exist. The JSON form is documented in docs/TELEMETRY.md: change both together.

use std::fmt;
use std::sync::Arc;

use serde::{Serialize, Serializer};

use super::placement::{Holders, Placement};
use crate::kv::PagedKv;
use crate::model::LayerState;

/// A device of the split, as events name it: `"host"` or `"helper:ID"` (the id
/// `HelperClient::id`, which `/metrics` and `tether bench` use too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Host,
    Helper(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Helper(id) => write!(f, "helper:{id}"),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Where a KV page is: on a device, or only in the host's page file (the disk tier: its
/// helper was lost, or it waits to re-fill one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    On(Device),
    Disk,
}

impl Serialize for Place {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Place::On(d) => d.serialize(s),
            Place::Disk => s.serialize_str("disk"),
        }
    }
}

/// One event; serialised with a `"type"` tag (`"ubatch"`, `"transfer"`, `"pages"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// Layers `layers[0] .. layers[1]` of the ubatch of `tokens` tokens at position `pos` ran
    /// on `device` from `start_ms` to `end_ms`. A helper's bar is what the host saw: from when
    /// the ubatch was sent (or the helper's previous bar ended, if later) to when the host took
    /// its reply off the link (later than it arrived while the host ran its own layers).
    Ubatch {
        device: Device,
        pos: usize,
        tokens: usize,
        layers: [usize; 2],
        start_ms: f64,
        end_ms: f64,
    },
    /// A message of type `kind` (the protocol's name for it) and `bytes` of tensor data left
    /// `from` for `to` at `at_ms`.
    Transfer {
        from: Device,
        to: Device,
        kind: &'static str,
        bytes: usize,
        at_ms: f64,
    },
    /// Where the pages of every full-attention layer are, after a forward pass (pages move
    /// only between passes).
    Pages {
        at_ms: f64,
        page_size: usize,
        layers: Vec<LayerPages>,
    },
}

/// One full-attention layer's pages: `len` positions, in runs of pages held at one place.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerPages {
    pub layer: usize,
    pub len: usize,
    pub runs: Vec<PageRun>,
}

/// `count` consecutive pages from page `first` (positions `first * page_size ..`), all at `on`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PageRun {
    pub first: usize,
    pub count: usize,
    pub on: Place,
}

type Clock = dyn Fn() -> f64 + Send + Sync;
type Emit = dyn Fn(Event) + Send + Sync;

struct Sink {
    now: Box<Clock>,
    emit: Box<Emit>,
}

/// Where a sequence's events go ([`crate::State::telemetry`]). The default goes nowhere.
#[derive(Clone, Default)]
pub struct Telemetry(Option<Arc<Sink>>);

impl Telemetry {
    /// Events go to `emit`, timed by `now` (milliseconds since any fixed instant).
    pub fn new(
        now: impl Fn() -> f64 + Send + Sync + 'static,
        emit: impl Fn(Event) + Send + Sync + 'static,
    ) -> Telemetry {
        Telemetry(Some(Arc::new(Sink {
            now: Box::new(now),
            emit: Box::new(emit),
        })))
    }

    /// The sink's clock, or 0 with no sink (so timing costs nothing unwatched).
    pub fn now(&self) -> f64 {
        self.0.as_ref().map_or(0.0, |s| (s.now)())
    }

    /// Emit the event `make` builds from the current time, if anyone listens.
    pub fn emit(&self, make: impl FnOnce(f64) -> Event) {
        if let Some(s) = &self.0 {
            (s.emit)(make((s.now)()));
        }
    }

    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_on() {
            "Telemetry(on)"
        } else {
            "Telemetry(off)"
        })
    }
}

/// The `pages` event for a sequence's `layers` whose pages that left are where `placement`
/// says: where every full-attention layer's pages are.
pub fn pages(at_ms: f64, layers: &[LayerState], placement: &Placement) -> Event {
    let layers = layers
        .iter()
        .enumerate()
        .filter_map(|(layer, l)| match (l, placement.holders(layer)) {
            (LayerState::Attention(kv), Some(held)) => Some(LayerPages {
                layer,
                len: kv.len(),
                runs: runs(kv, held),
            }),
            _ => None,
        })
        .collect();
    Event::Pages {
        at_ms,
        page_size: placement.page_size(),
        layers,
    }
}

/// The pages that left in order of position (each on its helper, or the disk alone), then the
/// pages still here, merged into runs.
fn runs(kv: &PagedKv, held: &Holders) -> Vec<PageRun> {
    let away = kv.remote_len() / kv.page_size();
    let places = (0..away)
        .map(|i| {
            held.holder(i * kv.page_size())
                .map_or(Place::Disk, |id| Place::On(Device::Helper(id)))
        })
        .chain((0..kv.pages().len()).map(|_| Place::On(Device::Host)));
    let mut runs: Vec<PageRun> = Vec::new();
    for (i, on) in places.enumerate() {
        match runs.last_mut() {
            Some(r) if r.on == on => r.count += 1,
            _ => runs.push(PageRun {
                first: i,
                count: 1,
                on,
            }),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Act, CpuBackend};

    #[test]
    fn devices_and_places_serialise_as_the_schema_says() {
        let e = Event::Transfer {
            from: Device::Host,
            to: Device::Helper(3),
            kind: "prefill_chunk",
            bytes: 10,
            at_ms: 1.5,
        };
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            serde_json::json!({"type": "transfer", "from": "host", "to": "helper:3",
                               "kind": "prefill_chunk", "bytes": 10, "at_ms": 1.5})
        );
        assert_eq!(serde_json::to_value(Place::Disk).unwrap(), "disk");
    }

    #[test]
    fn runs_follow_the_holders_then_the_host() {
        let be = CpuBackend;
        let mut kv = PagedKv::new(2, 1, 1, crate::backend::CacheTypes::F32);
        let row = |n: usize| Act::Host(vec![0.0; n]);
        kv.append(&be, &row(9), &row(9));
        // Pages [0,2) and [2,4) leave: one to helper 7, one to the disk alone.
        let mut held = Holders::new(2);
        kv.drop_oldest_page();
        held.push(Some(7));
        kv.drop_oldest_page();
        held.push(None);
        let r = runs(&kv, &held);
        assert_eq!(
            r,
            vec![
                PageRun {
                    first: 0,
                    count: 1,
                    on: Place::On(Device::Helper(7))
                },
                PageRun {
                    first: 1,
                    count: 1,
                    on: Place::Disk
                },
                PageRun {
                    first: 2,
                    count: 3,
                    on: Place::On(Device::Host)
                },
            ]
        );
    }

    #[test]
    fn an_unwatched_sequence_builds_no_event() {
        let off = Telemetry::default();
        off.emit(|_| unreachable!("no sink: the event is never built"));
        assert_eq!(off.now(), 0.0);
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = seen.clone();
        let on = Telemetry::new(|| 42.0, move |e| s.lock().unwrap().push(e));
        on.emit(|t| Event::Pages {
            at_ms: t,
            page_size: 1,
            layers: vec![],
        });
        assert_eq!(
            *seen.lock().unwrap(),
            vec![Event::Pages {
                at_ms: 42.0,
                page_size: 1,
                layers: vec![]
            }]
        );
    }
}
