//! An idle timeout: a peer that sends nothing for a while is let go. A secure link's
//! keep-alives prove the peer is there, not that it uses the helper; without this, a host that
//! stays connected and idle would hold a helper (which serves one host at a time) for good.

use std::time::{Duration, Instant};

use super::{Link, LinkError, LinkSender};

/// `inner`, whose receiving side fails with [`LinkError::Closed`] once no frame has arrived
/// for `idle`.
pub struct IdleLink<L> {
    inner: L,
    idle: Duration,
    last: Instant,
}

impl<L: Link> IdleLink<L> {
    pub fn new(inner: L, idle: Duration) -> IdleLink<L> {
        IdleLink {
            inner,
            idle,
            last: Instant::now(),
        }
    }

    fn gone(&self) -> LinkError {
        LinkError::Closed(format!(
            "no request for {} s: the session ends (idle timeout)",
            self.idle.as_secs()
        ))
    }

    fn arrived(&mut self, frame: Vec<u8>) -> Vec<u8> {
        self.last = Instant::now();
        frame
    }
}

impl<L: Link> Link for IdleLink<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.inner.send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        loop {
            if let Some(frame) = self.recv_timeout(self.idle)? {
                return Ok(frame);
            }
        }
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        let left = self.idle.saturating_sub(self.last.elapsed());
        if left.is_zero() {
            return Err(self.gone());
        }
        match self.inner.recv_timeout(timeout.min(left))? {
            Some(frame) => Ok(Some(self.arrived(frame))),
            None if self.last.elapsed() >= self.idle => Err(self.gone()),
            None => Ok(None),
        }
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        self.inner.sender()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::pair;

    #[test]
    fn frames_keep_the_link_and_silence_ends_it() {
        let (mut a, b) = pair();
        let mut b = IdleLink::new(b, Duration::from_millis(300));
        for n in 0..4u8 {
            std::thread::sleep(Duration::from_millis(150));
            a.send(vec![n]).unwrap();
            assert_eq!(b.recv().unwrap(), vec![n], "a frame every 150 ms keeps it");
        }
        let t0 = Instant::now();
        let e = b.recv().unwrap_err().to_string();
        assert!(e.contains("idle timeout"), "{e}");
        assert!(
            t0.elapsed() >= Duration::from_millis(250),
            "{:?}",
            t0.elapsed()
        );
        assert!(
            b.recv_timeout(Duration::from_secs(5)).is_err(),
            "it stays ended"
        );
    }
}
