//! What a link is and what crossed it, on every target: a physical link's bandwidth and
//! latency ([`LinkProfile`]), which [`super::shaped`] imposes on a fast link natively and the
//! page's simulator (wasm-demo/src/sim.rs) reckons on a virtual clock, and the frames and bytes
//! by message type ([`LinkStats`]) that `tether bench` and the live page report.

use std::collections::BTreeMap;
use std::ops::Add;
use std::time::Duration;

use serde::Serialize;

use crate::protocol::peek_type;

/// The sending direction of a physical link: frames leave one after another at
/// `bandwidth_bps` and arrive `latency` after their last bit left.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkProfile {
    pub name: String,
    /// Bits per second; `f64::INFINITY` for no bandwidth limit.
    pub bandwidth_bps: f64,
    pub latency: Duration,
}

impl LinkProfile {
    /// Names accepted by [`LinkProfile::preset`], for listing in error messages.
    pub const PRESETS: [&'static str; 4] = ["usb-c-10g", "usb2", "wifi", "unlimited"];

    pub fn preset(name: &str) -> Option<LinkProfile> {
        let (bandwidth_bps, latency) = match name {
            "usb-c-10g" => (10e9, Duration::from_micros(50)),
            "usb2" => (480e6, Duration::from_micros(100)),
            "wifi" => (300e6, Duration::from_millis(2)),
            "unlimited" => (f64::INFINITY, Duration::ZERO),
            _ => return None,
        };
        Some(LinkProfile {
            name: name.to_string(),
            bandwidth_bps,
            latency,
        })
    }

    /// No bandwidth limit and no latency: nothing to shape.
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth_bps == f64::INFINITY && self.latency.is_zero()
    }

    /// How long `bytes` take to leave at this profile's bandwidth.
    pub fn transmission_time(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 * 8.0 / self.bandwidth_bps)
    }
}

/// One direction of a link as its profile models it: frames leave one after another and each
/// arrives `latency` after its last bit left. `T` is the clock's instant: `Instant` for a
/// shaped link, a `Duration` since the run began for the page's simulator (virtual time).
pub struct Wire<T> {
    profile: LinkProfile,
    /// When the wire finishes sending the frames so far.
    free_at: T,
}

impl<T: Copy + Ord + Add<Duration, Output = T>> Wire<T> {
    pub fn new(profile: LinkProfile, start: T) -> Wire<T> {
        Wire {
            profile,
            free_at: start,
        }
    }

    /// When a frame of `bytes` sent at `sent` arrives.
    pub fn carry(&mut self, sent: T, bytes: usize) -> T {
        self.free_at = sent.max(self.free_at) + self.profile.transmission_time(bytes);
        self.free_at + self.profile.latency
    }
}

/// Messages and bytes of one message type in one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    pub messages: u64,
    pub bytes: u64,
}

impl Traffic {
    fn add(&mut self, bytes: usize) {
        self.messages += 1;
        self.bytes += bytes as u64;
    }
}

/// Counts by message type name ([`crate::protocol::MsgType::name`], or `"unknown"` for a frame
/// without a valid header). Only types that were seen appear.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LinkStats {
    pub sent: BTreeMap<&'static str, Traffic>,
    pub received: BTreeMap<&'static str, Traffic>,
    pub sent_total: Traffic,
    pub received_total: Traffic,
}

/// The protocol name of a frame's message type, as [`LinkStats`] counts it.
pub fn type_name(frame: &[u8]) -> &'static str {
    peek_type(frame).map_or("unknown", |t| t.name())
}

impl LinkStats {
    /// Count a frame of message type `kind` and `bytes` that left this end.
    pub fn count_sent(&mut self, kind: &'static str, bytes: usize) {
        self.sent.entry(kind).or_default().add(bytes);
        self.sent_total.add(bytes);
    }

    /// Count a frame that arrived at this end.
    pub fn count_received(&mut self, frame: &[u8]) {
        self.received
            .entry(type_name(frame))
            .or_default()
            .add(frame.len());
        self.received_total.add(frame.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_queue_on_the_wire_then_take_the_latency() {
        let profile = LinkProfile {
            name: "t".into(),
            bandwidth_bps: 8e3,
            latency: Duration::from_millis(5),
        };
        let mut w = Wire::new(profile, Duration::ZERO);
        let ms = Duration::from_millis;
        // 1000 bytes at 8 kbit/s: one second on the wire, then 5 ms; the next waits for it.
        assert_eq!(w.carry(ms(0), 1000), ms(1005));
        assert_eq!(w.carry(ms(10), 1000), ms(2005));
        assert_eq!(w.carry(ms(3000), 0), ms(3005));
    }
}
