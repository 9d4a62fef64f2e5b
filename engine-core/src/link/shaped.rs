//! A link wrapper that makes a fast link behave like a slower physical one and counts every
//! byte by message type. Benchmarks run host and helper on one machine over a memory or
//! loopback link; shaping shows what a USB or Wi-Fi cable would cost, and the counts are what
//! DESIGN.md's "subtract traffic" idea is checked against.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::traffic::{type_name, LinkProfile, LinkStats, Wire};
use super::{Link, LinkError, LinkSender};

/// A shared view of a [`ShapedLink`]'s counts, so a benchmark can read them while the link
/// itself is owned by the engine.
#[derive(Clone, Default)]
pub struct StatsHandle(Arc<Mutex<LinkStats>>);

impl StatsHandle {
    pub fn snapshot(&self) -> LinkStats {
        self.lock().clone()
    }

    /// Start counting from zero, e.g. after warm-up.
    pub fn reset(&self) {
        *self.lock() = LinkStats::default();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinkStats> {
        // Counts stay meaningful after a panic elsewhere, so a poisoned lock is still read.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count_sent(&self, kind: &'static str, bytes: usize) {
        self.lock().count_sent(kind, bytes);
    }

    fn count_received(&self, frame: &[u8]) {
        self.lock().count_received(frame);
    }
}

/// Why the delivery thread stopped, for the `send` that finds it gone.
type Failure = Arc<Mutex<Option<String>>>;

enum Outgoing {
    /// No shaping: no thread, no added delay.
    Direct(Box<dyn LinkSender>),
    /// Frames with the instant they were sent, so the delivery thread's own scheduling does
    /// not shift their departure. Not bounded: it holds only frames this end chose to send,
    /// and `send` must not wait (a pipelined host sends ahead, as over a WebSocket, whose
    /// sending queue is not bounded either); what arrives is bounded by the inner link.
    Shaped {
        queue: Sender<(Instant, Vec<u8>)>,
        failure: Failure,
    },
}

struct ShapedSender {
    stats: StatsHandle,
    out: Outgoing,
}

impl LinkSender for ShapedSender {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        let (kind, bytes) = (type_name(&frame), frame.len());
        match &mut self.out {
            Outgoing::Direct(inner) => inner.send(frame)?,
            Outgoing::Shaped { queue, failure } => {
                queue.send((Instant::now(), frame)).map_err(|_| {
                    let why = failure
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    LinkError::Closed(why.unwrap_or_else(|| "link shaper stopped".into()))
                })?
            }
        }
        // After queueing, so that a refused frame is not counted as traffic.
        self.stats.count_sent(kind, bytes);
        Ok(())
    }
}

/// Shapes the sending direction of `L` to a [`LinkProfile`] and counts both directions.
/// Receiving is not delayed: wrap each end to shape both directions.
pub struct ShapedLink<L: Link> {
    inner: L,
    profile: LinkProfile,
    out: ShapedSender,
}

impl<L: Link> ShapedLink<L> {
    pub fn new(inner: L, profile: LinkProfile) -> ShapedLink<L> {
        assert!(
            profile.bandwidth_bps > 0.0,
            "link profile {} has no bandwidth",
            profile.name
        );
        let out = Self::outgoing(&inner, &profile);
        ShapedLink {
            inner,
            profile,
            out: ShapedSender {
                stats: StatsHandle::default(),
                out,
            },
        }
    }

    fn outgoing(inner: &L, profile: &LinkProfile) -> Outgoing {
        if profile.is_unlimited() {
            return Outgoing::Direct(inner.sender());
        }
        let (queue, frames) = mpsc::channel();
        let failure = Failure::default();
        let (target, profile, why) = (inner.sender(), profile.clone(), failure.clone());
        thread::Builder::new()
            .name(format!("link-shaper-{}", profile.name))
            .spawn(move || deliver(&profile, &frames, target, &why))
            .expect("spawning the link shaper thread");
        Outgoing::Shaped { queue, failure }
    }

    pub fn profile(&self) -> &LinkProfile {
        &self.profile
    }

    pub fn stats_handle(&self) -> StatsHandle {
        self.out.stats.clone()
    }

    /// Count into `stats` instead of a handle of its own: a link that replaces a lost one
    /// goes on with the same totals.
    pub fn counting_into(mut self, stats: StatsHandle) -> ShapedLink<L> {
        self.out.stats = stats;
        self
    }
}

/// Hands each frame to the inner link when the modelled link would deliver it. One thread for
/// all frames keeps their order; frames still queued when the link is dropped are delivered.
fn deliver(
    profile: &LinkProfile,
    frames: &Receiver<(Instant, Vec<u8>)>,
    mut target: Box<dyn LinkSender>,
    failure: &Mutex<Option<String>>,
) {
    let mut wire = Wire::new(profile.clone(), Instant::now());
    for (sent_at, frame) in frames {
        let arrival = wire.carry(sent_at, frame.len());
        if let Some(wait) = arrival.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        if let Err(err) = target.send(frame) {
            *failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(err.to_string());
            return;
        }
    }
}

impl<L: Link> Link for ShapedLink<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.out.send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        let frame = self.inner.recv()?;
        self.out.stats.count_received(&frame);
        Ok(frame)
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        let frame = self.inner.recv_timeout(timeout)?;
        if let Some(frame) = &frame {
            self.out.stats.count_received(frame);
        }
        Ok(frame)
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        let out = match &self.out.out {
            Outgoing::Direct(_) => Outgoing::Direct(self.inner.sender()),
            Outgoing::Shaped { queue, failure } => Outgoing::Shaped {
                queue: queue.clone(),
                failure: failure.clone(),
            },
        };
        Box::new(ShapedSender {
            stats: self.out.stats.clone(),
            out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::pair;
    use crate::link::traffic::Traffic;
    use crate::protocol::{MsgType, HEADER_LEN, MAGIC, PROTOCOL_VERSION};

    /// A frame with a valid header, `request` as its id and `payload_len` bytes of tensor data.
    fn frame(t: MsgType, request: u32, payload_len: usize) -> Vec<u8> {
        let mut f = Vec::with_capacity(HEADER_LEN + payload_len);
        f.extend_from_slice(&MAGIC);
        f.extend_from_slice(&[PROTOCOL_VERSION, t as u8]);
        f.extend_from_slice(&request.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&(payload_len as u32).to_le_bytes());
        f.resize(HEADER_LEN + payload_len, 0xAB);
        f
    }

    fn request_id(frame: &[u8]) -> u32 {
        u32::from_le_bytes(frame[4..8].try_into().unwrap())
    }

    fn profile(bandwidth_bps: f64, latency: Duration) -> LinkProfile {
        LinkProfile {
            name: "test".into(),
            bandwidth_bps,
            latency,
        }
    }

    #[test]
    fn presets_resolve_by_name() {
        for name in LinkProfile::PRESETS {
            assert_eq!(LinkProfile::preset(name).unwrap().name, name);
        }
        assert!(LinkProfile::preset("usb7").is_none());
        assert!(LinkProfile::preset("unlimited").unwrap().is_unlimited());
        assert!(!LinkProfile::preset("wifi").unwrap().is_unlimited());
    }

    #[test]
    fn counts_by_message_type_in_both_directions() {
        let (a, mut b) = pair();
        let mut a = ShapedLink::new(a, LinkProfile::preset("unlimited").unwrap());
        let stats = a.stats_handle();
        a.send(frame(MsgType::Hello, 0, 10)).unwrap();
        a.send(frame(MsgType::KvAppend, 1, 100)).unwrap();
        a.sender().send(frame(MsgType::KvAppend, 2, 100)).unwrap();
        a.send(vec![1, 2, 3]).unwrap();
        for _ in 0..4 {
            b.recv().unwrap();
        }
        b.send(frame(MsgType::Pong, 3, 0)).unwrap();
        b.send(frame(MsgType::AttnPartials, 4, 50)).unwrap();
        a.recv().unwrap();
        a.recv_timeout(Duration::from_secs(1)).unwrap().unwrap();

        let s = stats.snapshot();
        let t = |messages, bytes| Traffic { messages, bytes };
        assert_eq!(s.sent["Hello"], t(1, 26));
        assert_eq!(s.sent["KvAppend"], t(2, 232));
        assert_eq!(s.sent["unknown"], t(1, 3));
        assert_eq!(s.sent.len(), 3);
        assert_eq!(s.sent_total, t(4, 261));
        assert_eq!(s.received["Pong"], t(1, 16));
        assert_eq!(s.received["AttnPartials"], t(1, 66));
        assert_eq!(s.received_total, t(2, 82));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["sent"]["KvAppend"]["bytes"], 232);

        stats.reset();
        assert_eq!(stats.snapshot(), LinkStats::default());
    }

    #[test]
    fn shaping_preserves_order() {
        let (a, mut b) = pair();
        let mut a = ShapedLink::new(a, profile(1e9, Duration::from_micros(200)));
        let mut side = a.sender();
        for i in 0..100u32 {
            let f = frame(MsgType::PrefillChunk, i, (i as usize * 7919) % 5000);
            if i % 3 == 0 {
                side.send(f).unwrap();
            } else {
                a.send(f).unwrap();
            }
        }
        for i in 0..100u32 {
            assert_eq!(request_id(&b.recv().unwrap()), i);
        }
        assert_eq!(a.stats_handle().snapshot().sent_total.messages, 100);
    }

    #[test]
    fn shaping_applies_bandwidth_and_latency() {
        // 1 MiB at 80 Mb/s takes 104.9 ms on the wire, plus 20 ms for the last bit to arrive.
        let (a, mut b) = pair();
        let mut a = ShapedLink::new(a, profile(80e6, Duration::from_millis(20)));
        let start = Instant::now();
        for i in 0..16 {
            a.send(frame(MsgType::PrefillChunk, i, (1 << 16) - HEADER_LEN))
                .unwrap();
        }
        for _ in 0..16 {
            b.recv().unwrap();
        }
        assert!(
            start.elapsed() >= Duration::from_millis(124),
            "{:?}",
            start.elapsed()
        );

        // An empty wire adds only the latency (and the 16-byte frame's 1.6 µs).
        let start = Instant::now();
        a.send(frame(MsgType::Ping, 0, 0)).unwrap();
        b.recv().unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(20),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn dropping_the_shaped_end_delivers_queued_frames_then_closes() {
        let (a, mut b) = pair();
        let mut a = ShapedLink::new(a, profile(1e9, Duration::from_millis(5)));
        a.send(frame(MsgType::Bye, 9, 0)).unwrap();
        drop(a);
        assert_eq!(request_id(&b.recv().unwrap()), 9);
        assert!(matches!(b.recv(), Err(LinkError::Closed(_))));

        let (a, b) = pair();
        let mut a = ShapedLink::new(a, profile(1e9, Duration::ZERO));
        drop(b);
        a.send(frame(MsgType::Ping, 0, 0)).unwrap();
        assert!(matches!(a.recv(), Err(LinkError::Closed(_))));
    }
}
