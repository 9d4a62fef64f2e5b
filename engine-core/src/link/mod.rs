//! Moving frames between a host and a helper. A frame is one already encoded protocol message
//! (see [`crate::protocol`]); a link neither parses nor reorders frames, it only carries them,
//! so the same engine code runs over an in-process pair in tests, a shaped link in benchmarks
//! and a WebSocket in production.

#[cfg(not(target_arch = "wasm32"))]
pub mod admission;
#[cfg(all(feature = "secure", feature = "ws", not(target_arch = "wasm32")))]
pub mod doors;
pub mod idle;
#[cfg(feature = "secure")]
pub mod keys;
pub mod memory;
#[cfg(feature = "secure")]
pub mod secure;
#[cfg(not(target_arch = "wasm32"))]
pub mod shaped;
pub mod traffic;
#[cfg(all(feature = "ws", not(target_arch = "wasm32")))]
pub mod ws;

use std::time::Duration;

pub use memory::{pair, MemoryLink};
#[cfg(not(target_arch = "wasm32"))]
pub use shaped::{ShapedLink, StatsHandle};
pub use traffic::{LinkProfile, LinkStats, Traffic};

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The peer went away (orderly or not); nothing more will arrive or leave.
    #[error("link closed: {0}")]
    Closed(String),
    /// Refused without allocating the frame, so a peer cannot exhaust memory by announcing a
    /// size.
    #[error("frame of {len} bytes exceeds the link's limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("link: {0}")]
    Io(String),
    /// A secure link's handshake turned us away, or we turned the peer away: the reason is
    /// shown on both sides.
    #[error("refused: {0}")]
    Refused(String),
}

/// One end of a bidirectional, ordered, reliable frame channel.
pub trait Link: Send {
    /// Queue one frame; returns once queued, so a caller can send the next ubatch while the
    /// previous one is on the wire. An error means the link is unusable, not that this frame
    /// alone was lost.
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError>;

    /// Block until the next frame.
    fn recv(&mut self) -> Result<Vec<u8>, LinkError>;

    /// Wait at most `timeout`; `Ok(None)` on timeout.
    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError>;

    /// Another handle on this link's sending direction. A wrapper needs it to send from its own
    /// thread while the link's owner blocks in `recv` (the link itself cannot be in two places).
    /// Frames from all handles share one ordered stream; the peer sees the link close only once
    /// the link and every handle are dropped.
    fn sender(&self) -> Box<dyn LinkSender>;

    /// When bytes last arrived from the peer, if this link can tell (a WebSocket can): a frame
    /// still on its way proves the peer alive as a whole one does, so a large frame on a slow
    /// link does not read as silence ([`secure::SILENCE`]). `None`: whole frames only.
    fn heard(&self) -> Option<std::time::Instant> {
        None
    }
}

/// The sending direction of a [`Link`], detached from it; see [`Link::sender`].
pub trait LinkSender: Send {
    /// Same contract as [`Link::send`].
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError>;
}

impl<L: Link + ?Sized> Link for Box<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        (**self).send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        (**self).recv()
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        (**self).recv_timeout(timeout)
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        (**self).sender()
    }

    fn heard(&self) -> Option<std::time::Instant> {
        (**self).heard()
    }
}
