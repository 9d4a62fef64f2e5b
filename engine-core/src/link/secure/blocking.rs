//! The native drivers of the secure link: [`accept`] and [`connect`] run the sans-IO
//! handshakes over a blocking [`Link`], each wait within [`HANDSHAKE_TIMEOUT`], and
//! [`SecureLink`] carries frames through the [`Session`] with liveness both ways (keep-alives
//! out from a thread, a deadline on silence in). Native only: they block, start a thread and
//! read `Instant`s, none of which a browser has.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{
    Accepted, Dial, Gate, Initiator, Opener, Progress, Refusal, Responder, Sealer, Session,
    HANDSHAKE_TIMEOUT, SILENCE,
};
use crate::link::keys::{Keypair, PublicKey};
use crate::link::{Link, LinkError, LinkSender};

/// Sends the peer what `refusal` owes it, best effort (the peer may be gone already), and
/// returns the error.
fn refuse(link: &mut dyn Link, refusal: Refusal) -> LinkError {
    for frame in refusal.send {
        let _ = link.send(frame);
    }
    refusal.error
}

/// Runs one side of a handshake over `link`: sends `send`, then gives each frame from the
/// peer to `read` until `state` is done or refused. The peer has [`HANDSHAKE_TIMEOUT`] for
/// each frame.
fn handshake<S, W>(
    link: &mut dyn Link,
    mut send: Vec<Vec<u8>>,
    mut state: S,
    read: impl Fn(S, &[u8]) -> Result<Progress<S, W>, Refusal>,
    timed_out: impl Fn(&S, Duration) -> LinkError,
) -> Result<(Session, W), LinkError> {
    loop {
        for frame in send {
            link.send(frame)?;
        }
        let frame = link
            .recv_timeout(HANDSHAKE_TIMEOUT)?
            .ok_or_else(|| timed_out(&state, HANDSHAKE_TIMEOUT))?;
        match read(state, &frame) {
            Ok(Progress::Wait { send: next, then }) => (send, state) = (next, then),
            Ok(Progress::Done { send, session, who }) => {
                for frame in send {
                    link.send(frame)?;
                }
                return Ok((session, who));
            }
            Err(refusal) => return Err(refuse(link, refusal)),
        }
    }
}

/// The host's side: dial `how` over `link`; returns the secure link and the helper's key.
pub fn connect<L: Link>(
    mut link: L,
    keys: &Keypair,
    how: Dial,
) -> Result<(SecureLink<L>, Option<PublicKey>), LinkError> {
    let (hello, initiator) = Initiator::start(keys, how)?;
    let (session, helper) = handshake(
        &mut link,
        vec![hello],
        initiator,
        Initiator::read,
        Initiator::timed_out,
    )?;
    Ok((SecureLink::start(link, session), helper))
}

/// The helper's side: let a host in through `gate`, or refuse it with a reason both sides
/// show. Nothing is allocated for a host before this returns.
pub fn accept<L: Link>(
    mut link: L,
    keys: &Keypair,
    gate: &Gate,
) -> Result<(SecureLink<L>, Accepted), LinkError> {
    let (session, who) = handshake(
        &mut link,
        Vec::new(),
        Responder::new(keys),
        |responder, frame| responder.read(frame, gate),
        Responder::timed_out,
    )?;
    Ok((SecureLink::start(link, session), who))
}

/// Seals `frame` and queues it on `out`, holding the sealer from one to the other so that
/// frames from every handle leave in nonce order.
fn send_sealed(
    sealer: &Mutex<Sealer>,
    out: &mut dyn LinkSender,
    frame: Vec<u8>,
) -> Result<(), LinkError> {
    let mut sealer = sealer.lock().unwrap_or_else(PoisonError::into_inner);
    let wire = sealer.seal(frame)?;
    out.send(wire)
}

/// A [`Link`] whose frames are encrypted and authenticated (or, with `--insecure`, plain),
/// with liveness both ways: keep-alive frames out, a deadline on silence in. An empty frame is
/// a keep-alive and is never delivered (protocol frames are never empty).
pub struct SecureLink<L: Link> {
    inner: L,
    /// The sending direction, shared with the sender handles and the keep-alive thread.
    sealer: Arc<Mutex<Sealer>>,
    opener: Opener,
    encrypted: bool,
    silence: Duration,
    last_heard: Instant,
    /// The keep-alive thread's period (ms).
    every_ms: Arc<AtomicU64>,
    /// A message makes the keep-alive thread read its period again; dropping the link (this
    /// sender) stops it.
    keepalive: mpsc::Sender<()>,
}

/// Sends an empty frame every `every_ms` until `wake`'s sender is dropped (or the link fails).
fn keepalive(mut out: Box<dyn LinkSender>, wake: mpsc::Receiver<()>, every_ms: Arc<AtomicU64>) {
    loop {
        let every = Duration::from_millis(every_ms.load(Ordering::Relaxed));
        match wake.recv_timeout(every) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if out.send(Vec::new()).is_err() {
                    return;
                }
            }
            Ok(()) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

impl<L: Link> SecureLink<L> {
    fn start(inner: L, session: Session) -> Self {
        let encrypted = session.is_encrypted();
        let (sealer, opener) = session.split();
        let sealer = Arc::new(Mutex::new(sealer));
        let (stop, stopped) = mpsc::channel();
        let every_ms = Arc::new(AtomicU64::new((SILENCE / 6).as_millis() as u64));
        let out = Box::new(SecureSender {
            inner: inner.sender(),
            sealer: sealer.clone(),
        });
        let period = every_ms.clone();
        // Without a thread there is no keep-alive, and the peer drops the link in time: a
        // failure to start one is not an error here.
        let _ = std::thread::Builder::new()
            .name("link-keepalive".into())
            .spawn(move || keepalive(out, stopped, period));
        SecureLink {
            inner,
            sealer,
            opener,
            encrypted,
            silence: SILENCE,
            last_heard: Instant::now(),
            every_ms,
            keepalive: stop,
        }
    }

    /// Another silence deadline (and keep-alive period, a sixth of it) than [`SILENCE`]; both
    /// sides of a link must agree.
    pub fn with_silence(mut self, silence: Duration) -> Self {
        self.silence = silence;
        let every = (silence / 6).as_millis().max(1) as u64;
        self.every_ms.store(every, Ordering::Relaxed);
        // The thread may be waiting out the old period already.
        let _ = self.keepalive.send(());
        self
    }

    /// Whether frames are encrypted (false only for `--insecure`).
    pub fn is_encrypted(&self) -> bool {
        self.encrypted
    }

    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// A frame from the inner link, opened; a frame that fails it is answered as the opener
    /// says.
    fn open(&mut self, frame: Vec<u8>) -> Result<Vec<u8>, LinkError> {
        self.opener
            .open(frame)
            .map_err(|refusal| refuse(&mut self.inner, refusal))
    }
}

struct SecureSender {
    inner: Box<dyn LinkSender>,
    sealer: Arc<Mutex<Sealer>>,
}

impl LinkSender for SecureSender {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        send_sealed(&self.sealer, &mut *self.inner, frame)
    }
}

/// Sends through a [`Link`] as a [`LinkSender`] (the link's own direction).
struct Direct<'a, L: Link>(&'a mut L);

impl<L: Link> LinkSender for Direct<'_, L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.0.send(frame)
    }
}

impl<L: Link> Link for SecureLink<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        send_sealed(&self.sealer, &mut Direct(&mut self.inner), frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        loop {
            if let Some(frame) = self.recv_timeout(self.silence)? {
                return Ok(frame);
            }
        }
    }

    /// Waits for a frame that is not a keep-alive, up to `timeout`; a peer silent past the
    /// deadline is lost ([`LinkError::Closed`]).
    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        let until = Instant::now() + timeout;
        loop {
            self.opener.check()?;
            if let Some(heard) = self.inner.heard() {
                self.last_heard = self.last_heard.max(heard);
            }
            let lost_at = self.last_heard + self.silence;
            let now = Instant::now();
            // Frames that arrived while nobody read the link (a helper waiting to be taken)
            // were heard in time: look at them before calling the peer silent.
            if now >= lost_at {
                if let Some(frame) = self.inner.recv_timeout(Duration::ZERO)? {
                    self.last_heard = now;
                    let frame = self.open(frame)?;
                    if !frame.is_empty() {
                        return Ok(Some(frame));
                    }
                    continue;
                }
                return Err(LinkError::Closed(format!(
                    "nothing from the peer for {:?}: taken as lost",
                    self.silence
                )));
            }
            if now >= until {
                return Ok(None);
            }
            let Some(frame) = self.inner.recv_timeout(until.min(lost_at) - now)? else {
                continue;
            };
            self.last_heard = Instant::now();
            let frame = self.open(frame)?;
            if !frame.is_empty() {
                return Ok(Some(frame));
            }
        }
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        Box::new(SecureSender {
            inner: self.inner.sender(),
            sealer: self.sealer.clone(),
        })
    }
}
