//! Two ends of a link in one process: tests and single-machine runs exercise the whole host /
//! helper exchange without sockets. Channels only, no threads, so it also builds for wasm.
//!
//! The channels are not bounded, unlike a WebSocket link's incoming queue: with no writer
//! thread between the ends, a bound would make `send` itself wait for the peer, against
//! [`Link::send`]'s contract, and two ends that both send ahead before reading (a pipelined
//! split prefill's host, and the helper answering it) would wait on each other for good. Both
//! ends are this process's own code, so there is no untrusted fast peer to hold back.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use super::{Link, LinkError, LinkSender};

pub struct MemoryLink {
    tx: Sender<Vec<u8>>,
    rx: Receiver<Vec<u8>>,
}

/// Two connected ends: what one sends, the other receives, in order.
pub fn pair() -> (MemoryLink, MemoryLink) {
    let (a_tx, b_rx) = mpsc::channel();
    let (b_tx, a_rx) = mpsc::channel();
    (
        MemoryLink { tx: a_tx, rx: a_rx },
        MemoryLink { tx: b_tx, rx: b_rx },
    )
}

fn peer_dropped() -> LinkError {
    LinkError::Closed("the other end of the memory link was dropped".into())
}

impl LinkSender for Sender<Vec<u8>> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        Sender::send(self, frame).map_err(|_| peer_dropped())
    }
}

impl Link for MemoryLink {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        LinkSender::send(&mut self.tx, frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        self.rx.recv().map_err(|_| peer_dropped())
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        match self.rx.recv_timeout(timeout) {
            Ok(frame) => Ok(Some(frame)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(peer_dropped()),
        }
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        Box::new(self.tx.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_cross_in_order_both_ways() {
        let (mut a, mut b) = pair();
        a.send(vec![1]).unwrap();
        a.send(vec![2, 2]).unwrap();
        b.send(vec![3]).unwrap();
        assert_eq!(b.recv().unwrap(), vec![1]);
        assert_eq!(
            b.recv_timeout(Duration::from_millis(10)).unwrap(),
            Some(vec![2, 2])
        );
        assert_eq!(b.recv_timeout(Duration::from_millis(1)).unwrap(), None);
        assert_eq!(a.recv().unwrap(), vec![3]);

        let mut handle = a.sender();
        handle.send(vec![4]).unwrap();
        assert_eq!(b.recv().unwrap(), vec![4]);
    }

    #[test]
    fn dropping_one_end_closes_the_other() {
        let (mut a, b) = pair();
        let mut handle = a.sender();
        drop(b);
        assert!(matches!(a.recv(), Err(LinkError::Closed(_))));
        assert!(matches!(
            a.recv_timeout(Duration::from_millis(1)),
            Err(LinkError::Closed(_))
        ));
        assert!(matches!(a.send(vec![1]), Err(LinkError::Closed(_))));
        assert!(matches!(handle.send(vec![1]), Err(LinkError::Closed(_))));

        // Frames queued before the drop are still delivered, then the close shows.
        let (mut a, mut b) = pair();
        a.send(vec![7]).unwrap();
        drop(a);
        assert_eq!(b.recv().unwrap(), vec![7]);
        assert!(matches!(b.recv(), Err(LinkError::Closed(_))));
    }
}
