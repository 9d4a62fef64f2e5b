//! The paired, encrypted link: any [`Link`] (a WebSocket in production, an in-memory pair in
//! tests) carrying Noise. Only a paired peer gets past the handshake, and that before the
//! helper allocates or computes anything for it; every frame after it is encrypted and
//! authenticated, and a tampered, replayed, reordered or dropped frame ends the link.
//!
//! The first frame says how the host dials (`MODE_*`):
//! - pairing: SPAKE2 over the helper's six-digit code gives both sides a key that a wrong code
//!   cannot (and an eavesdropper or a man in the middle cannot test guesses of it offline),
//!   then `Noise_XXpsk3` with that key as PSK exchanges the static keys both sides remember;
//! - known: `Noise_IK` with the helper's remembered key; the helper reads the host's static
//!   key from the first message and refuses any it has not paired with;
//! - insecure: today's plain frames, only when both sides say `--insecure`.
//!
//! Frames on the inner link start with a kind byte: `REFUSE` (a plain UTF-8 reason, then the
//! sender closes), `HANDSHAKE`, or `DATA` (a frame as Noise transport messages of at most
//! 65535 bytes, concatenated; each takes the next nonce, so order is authenticated too).
//! After the handshake the helper sends one empty `DATA` frame: the host learns there that
//! the helper accepted it (a wrong pairing code is refused at that point instead).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use snow::{HandshakeState, StatelessTransportState};
use spake2::{Ed25519Group, Identity, Password, Spake2};

use super::keys::{normalise_code, short, Keypair, PairingCode, PublicKey};
use super::{Link, LinkError, LinkSender};

/// Noise protocols: pairing (PSK from SPAKE2) and known peers.
pub const PAIR: &str = "Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s";
pub const KNOWN: &str = "Noise_IK_25519_ChaChaPoly_BLAKE2s";

const VERSION: u8 = 1;
const MODE_INSECURE: u8 = 0;
const MODE_PAIR: u8 = 1;
const MODE_KNOWN: u8 = 2;

const REFUSE: u8 = 0;
const HANDSHAKE: u8 = 1;
const DATA: u8 = 2;

/// Noise's largest message, and its authentication tag.
const MAX_MSG: usize = 65535;
const TAG: usize = 16;
const CHUNK: usize = MAX_MSG - TAG;

/// How long each handshake step may wait for the peer: a stranger that connects and says
/// nothing must not hold a helper's accept.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The inner link's frame limit for frames of up to `max_frame` bytes once encrypted: the kind
/// byte and a tag per chunk.
pub fn wire_limit(max_frame: usize) -> usize {
    max_frame + 1 + max_frame.div_ceil(CHUNK).max(1) * TAG
}

/// How a host dials a helper.
pub enum Dial<'a> {
    /// First connection: the code the helper shows.
    Pair(&'a str),
    /// A helper paired before, by its remembered key.
    Known(PublicKey),
    /// A plain link (`--insecure`).
    Insecure,
}

/// What a helper accepts.
pub struct Gate<'a> {
    /// `--insecure`: plain links only.
    pub insecure: bool,
    /// Whether a host's key is paired.
    pub known: &'a (dyn Fn(&PublicKey) -> bool + Sync),
    /// The code new hosts may pair with, if this helper takes new hosts now.
    pub pairing: Option<&'a Mutex<PairingCode>>,
}

/// Who came in through a [`Gate`].
#[derive(Debug, PartialEq, Eq)]
pub enum Accepted {
    /// A host paired before.
    Known(PublicKey),
    /// A host that just paired with the code: remember it.
    Paired(PublicKey),
    /// A plain link.
    Insecure,
}

fn refused(why: impl Into<String>) -> LinkError {
    LinkError::Refused(why.into())
}

fn noise_err(what: &str) -> impl FnOnce(snow::Error) -> LinkError + '_ {
    move |e| LinkError::Io(format!("{what}: {e}"))
}

/// Sends a refusal the peer can show, and returns the same reason as our error.
fn refuse(link: &mut dyn Link, why: String) -> LinkError {
    let mut frame = vec![REFUSE];
    frame.extend_from_slice(why.as_bytes());
    // Best effort: the peer may be gone already.
    let _ = link.send(frame);
    refused(why)
}

/// The next handshake frame's payload, within the handshake timeout; a refusal from the peer
/// becomes [`LinkError::Refused`] with its reason.
fn recv_handshake(link: &mut dyn Link) -> Result<Vec<u8>, LinkError> {
    let frame = link
        .recv_timeout(HANDSHAKE_TIMEOUT)?
        .ok_or_else(|| refused(format!("no answer within {HANDSHAKE_TIMEOUT:?}")))?;
    match frame.split_first() {
        Some((&HANDSHAKE, rest)) => Ok(rest.to_vec()),
        Some((&REFUSE, why)) => Err(refused(String::from_utf8_lossy(why).into_owned())),
        _ => Err(refused("the peer does not speak tether's secure link")),
    }
}

fn send_handshake(link: &mut dyn Link, bytes: &[u8]) -> Result<(), LinkError> {
    let mut frame = Vec::with_capacity(bytes.len() + 1);
    frame.push(HANDSHAKE);
    frame.extend_from_slice(bytes);
    link.send(frame)
}

/// One Noise handshake message out.
fn write_noise(link: &mut dyn Link, hs: &mut HandshakeState) -> Result<(), LinkError> {
    let mut buf = vec![0u8; MAX_MSG];
    let n = hs
        .write_message(&[], &mut buf)
        .map_err(noise_err("handshake"))?;
    send_handshake(link, &buf[..n])
}

/// One Noise handshake message in; false if it does not authenticate.
fn read_noise(hs: &mut HandshakeState, msg: &[u8]) -> bool {
    let mut buf = vec![0u8; MAX_MSG];
    msg.len() <= MAX_MSG && hs.read_message(msg, &mut buf).is_ok()
}

/// A handshake builder for `params`; the prologue binds the mode and version into the
/// handshake, so a man in the middle cannot switch them.
fn builder<'a>(params: &str, prologue: &'a [u8]) -> snow::Builder<'a> {
    snow::Builder::new(params.parse().expect("valid Noise params"))
        .prologue(prologue)
        .expect("a fresh builder")
}

fn prologue(mode: u8) -> [u8; 16] {
    let mut p = *b"tether link v1 \0";
    p[15] = mode;
    p
}

/// SPAKE2 over the code's digits: the key both sides get only with the same code.
fn spake(digits: &str) -> (Spake2<Ed25519Group>, Vec<u8>) {
    Spake2::<Ed25519Group>::start_symmetric(
        &Password::new(digits.as_bytes()),
        &Identity::new(b"tether pairing v1"),
    )
}

/// The pairing handshake's Noise state: SPAKE2 finished with the peer's message `theirs`, its
/// key as the PSK; `Err` if the peer's message is malformed.
fn pairing_noise(
    keys: &Keypair,
    spake: Spake2<Ed25519Group>,
    theirs: &[u8],
    initiator: bool,
) -> Result<HandshakeState, String> {
    let key = spake
        .finish(theirs)
        .map_err(|_| "a malformed pairing message")?;
    let psk: [u8; 32] = key
        .try_into()
        .map_err(|_| "SPAKE2 gave a key of the wrong size")?;
    let pro = prologue(MODE_PAIR);
    let b = builder(PAIR, &pro)
        .local_private_key(&keys.secret)
        .and_then(|b| b.psk(3, &psk));
    let hs = if initiator {
        b.and_then(|b| b.build_initiator())
    } else {
        b.and_then(|b| b.build_responder())
    };
    hs.map_err(|e| format!("pairing: {e}"))
}

/// The host's side: dial `how` over `link`; returns the secure link and the helper's key.
pub fn connect<L: Link>(
    mut link: L,
    keys: &Keypair,
    how: Dial,
) -> Result<(SecureLink<L>, Option<PublicKey>), LinkError> {
    let mode = match how {
        Dial::Insecure => MODE_INSECURE,
        Dial::Pair(_) => MODE_PAIR,
        Dial::Known(_) => MODE_KNOWN,
    };
    let mut first = vec![VERSION, mode];
    let pro = prologue(mode);
    let hs = match how {
        Dial::Insecure => {
            send_handshake(&mut link, &first)?;
            recv_handshake(&mut link)?;
            return Ok((SecureLink::plain(link), None));
        }
        Dial::Pair(code) => {
            let digits = normalise_code(code);
            if digits.len() != 6 {
                return Err(refused(format!(
                    "pairing code `{code}`: expected the six digits the helper shows"
                )));
            }
            let (spake, msg) = spake(&digits);
            first.extend_from_slice(&msg);
            send_handshake(&mut link, &first)?;
            let theirs = recv_handshake(&mut link)?;
            let mut hs = pairing_noise(keys, spake, &theirs, true).map_err(refused)?;
            write_noise(&mut link, &mut hs)?;
            let msg = recv_handshake(&mut link)?;
            if !read_noise(&mut hs, &msg) {
                return Err(refuse(
                    &mut link,
                    "the helper's pairing reply does not authenticate".into(),
                ));
            }
            write_noise(&mut link, &mut hs)?;
            hs
        }
        Dial::Known(helper) => {
            let mut hs = builder(KNOWN, &pro)
                .local_private_key(&keys.secret)
                .and_then(|b| b.remote_public_key(&helper))
                .and_then(|b| b.build_initiator())
                .map_err(noise_err("handshake"))?;
            let mut buf = vec![0u8; MAX_MSG];
            let n = hs
                .write_message(&[], &mut buf)
                .map_err(noise_err("handshake"))?;
            first.extend_from_slice(&buf[..n]);
            send_handshake(&mut link, &first)?;
            let msg = recv_handshake(&mut link)?;
            if !read_noise(&mut hs, &msg) {
                return Err(refuse(
                    &mut link,
                    "the helper at this address is not the one paired (its key changed): pair again with --pair CODE".into(),
                ));
            }
            hs
        }
    };
    let helper_key = remote_key(&hs)?;
    let mut secure = SecureLink::encrypted(link, hs)?;
    // The helper's confirmation: an empty frame, or its refusal.
    let frame = secure
        .inner
        .recv_timeout(HANDSHAKE_TIMEOUT)?
        .ok_or_else(|| {
            refused(format!(
                "the helper did not confirm within {HANDSHAKE_TIMEOUT:?}"
            ))
        })?;
    if let Some((&REFUSE, why)) = frame.split_first() {
        return Err(refused(String::from_utf8_lossy(why).into_owned()));
    }
    if !secure.open(frame)?.is_empty() {
        return Err(refused("the helper's confirmation was not empty"));
    }
    Ok((secure, Some(helper_key)))
}

fn remote_key(hs: &HandshakeState) -> Result<PublicKey, LinkError> {
    hs.get_remote_static()
        .and_then(|k| k.try_into().ok())
        .ok_or_else(|| LinkError::Io("the handshake gave no peer key".into()))
}

/// The helper's side: let a host in through `gate`, or refuse it with a reason both sides
/// show. Nothing is allocated for a host before this returns.
pub fn accept<L: Link>(
    mut link: L,
    keys: &Keypair,
    gate: &Gate,
) -> Result<(SecureLink<L>, Accepted), LinkError> {
    let first = recv_handshake(&mut link)?;
    let (version, mode, rest) = match first.as_slice() {
        [v, m, rest @ ..] => (*v, *m, rest),
        _ => return Err(refuse(&mut link, "a malformed link hello".into())),
    };
    if version != VERSION {
        return Err(refuse(
            &mut link,
            format!("secure link version {version}; this helper speaks {VERSION}"),
        ));
    }
    match (mode, gate.insecure) {
        (MODE_INSECURE, true) => {
            send_handshake(&mut link, &[VERSION, MODE_INSECURE])?;
            Ok((SecureLink::plain(link), Accepted::Insecure))
        }
        (MODE_INSECURE, false) => Err(refuse(
            &mut link,
            "this helper takes only paired, encrypted links: run the host without --insecure \
             (and with --pair CODE the first time)"
                .into(),
        )),
        (_, true) => Err(refuse(
            &mut link,
            "this helper runs --insecure (a plain link): run the host with --insecure too".into(),
        )),
        (MODE_PAIR, false) => accept_pairing(link, keys, gate, rest),
        (MODE_KNOWN, false) => accept_known(link, keys, gate, rest),
        _ => Err(refuse(&mut link, format!("unknown link mode {mode}"))),
    }
}

fn accept_pairing<L: Link>(
    mut link: L,
    keys: &Keypair,
    gate: &Gate,
    spake_msg: &[u8],
) -> Result<(SecureLink<L>, Accepted), LinkError> {
    let Some(pairing) = gate.pairing else {
        return Err(refuse(
            &mut link,
            "this helper is not taking new hosts: restart it with --pair-new to show a code".into(),
        ));
    };
    let digits = pairing
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .digits()
        .to_string();
    let (spake, msg) = spake(&digits);
    send_handshake(&mut link, &msg)?;
    let mut hs = pairing_noise(keys, spake, spake_msg, false).map_err(|e| refuse(&mut link, e))?;
    let msg = recv_handshake(&mut link)?;
    if !read_noise(&mut hs, &msg) {
        return Err(refuse(&mut link, "a malformed pairing message".into()));
    }
    write_noise(&mut link, &mut hs)?;
    let msg = recv_handshake(&mut link)?;
    if !read_noise(&mut hs, &msg) {
        let new_code = pairing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .wrong_try();
        let more = if new_code {
            " (too many wrong codes: the helper shows a new one)"
        } else {
            ""
        };
        return Err(refuse(&mut link, format!("wrong pairing code{more}")));
    }
    let host = remote_key(&hs)?;
    Ok((confirm(link, hs)?, Accepted::Paired(host)))
}

fn accept_known<L: Link>(
    mut link: L,
    keys: &Keypair,
    gate: &Gate,
    ik_msg: &[u8],
) -> Result<(SecureLink<L>, Accepted), LinkError> {
    let pro = prologue(MODE_KNOWN);
    let mut hs = builder(KNOWN, &pro)
        .local_private_key(&keys.secret)
        .and_then(|b| b.build_responder())
        .map_err(noise_err("handshake"))?;
    if !read_noise(&mut hs, ik_msg) {
        return Err(refuse(
            &mut link,
            "the host's handshake does not authenticate: it paired with another key of this \
             helper; pair again with --pair CODE"
                .into(),
        ));
    }
    let host = remote_key(&hs)?;
    if !(gate.known)(&host) {
        return Err(refuse(
            &mut link,
            format!(
                "this helper has not paired with this host (key {}): pair with --pair CODE",
                short(&host)
            ),
        ));
    }
    write_noise(&mut link, &mut hs)?;
    Ok((confirm(link, hs)?, Accepted::Known(host)))
}

/// Into transport mode, then the empty frame that tells the host it is in.
fn confirm<L: Link>(link: L, hs: HandshakeState) -> Result<SecureLink<L>, LinkError> {
    let mut secure = SecureLink::encrypted(link, hs)?;
    secure.send(Vec::new())?;
    Ok(secure)
}

/// The transport keys and the sending nonce, shared by a link and its sender handles. The
/// nonce's lock is held from encrypting a frame to queueing it, so frames leave in nonce order.
struct Sealer {
    noise: StatelessTransportState,
    send_nonce: Mutex<u64>,
}

impl Sealer {
    fn send(&self, inner: &mut dyn LinkSender, frame: &[u8]) -> Result<(), LinkError> {
        let chunks = frame.len().div_ceil(CHUNK).max(1);
        let mut out = vec![0u8; 1 + frame.len() + chunks * TAG];
        out[0] = DATA;
        let mut nonce = self
            .send_nonce
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut at = 1;
        for i in 0..chunks {
            let piece = &frame[i * CHUNK..((i + 1) * CHUNK).min(frame.len())];
            at += self
                .noise
                .write_message(*nonce, piece, &mut out[at..])
                .map_err(noise_err("encrypting a frame"))?;
            *nonce += 1;
        }
        inner.send(out)
    }
}

/// A link that hears nothing from its peer for this long takes the peer as lost (a killed
/// process, a pulled cable, a laptop gone to sleep: nothing says goodbye). Both sides send an
/// empty frame every sixth of it when they have nothing else to say, so only a peer that is
/// really gone (or a frame that takes longer than this to cross the link) trips it.
pub const SILENCE: Duration = Duration::from_secs(60);

/// What a failed link answers every later read with: the error (`Io` or `Closed`) and why.
type Failure = (fn(String) -> LinkError, String);

/// A [`Link`] whose frames are encrypted and authenticated (or, with `--insecure`, plain),
/// with liveness both ways: keep-alive frames out, a deadline on silence in. An empty frame is
/// a keep-alive and is never delivered (protocol frames are never empty).
pub struct SecureLink<L: Link> {
    inner: L,
    sealer: Option<Arc<Sealer>>,
    recv_nonce: u64,
    /// Why the link failed, and as which error, once a frame did not authenticate or the peer
    /// ended the link: it stays failed.
    broken: Option<Failure>,
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
    fn plain(inner: L) -> Self {
        SecureLink::start(inner, None)
    }

    fn encrypted(inner: L, hs: HandshakeState) -> Result<Self, LinkError> {
        let noise = hs
            .into_stateless_transport_mode()
            .map_err(noise_err("handshake"))?;
        let sealer = Arc::new(Sealer {
            noise,
            send_nonce: Mutex::new(0),
        });
        Ok(SecureLink::start(inner, Some(sealer)))
    }

    fn start(inner: L, sealer: Option<Arc<Sealer>>) -> Self {
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
            recv_nonce: 0,
            broken: None,
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
        self.sealer.is_some()
    }

    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// A frame from the inner link, decrypted.
    fn open(&mut self, frame: Vec<u8>) -> Result<Vec<u8>, LinkError> {
        let Some(sealer) = self.sealer.clone() else {
            return Ok(frame);
        };
        match frame.split_first() {
            Some((&DATA, body)) if !body.is_empty() => {
                let mut out = vec![0u8; body.len()];
                let mut len = 0;
                for piece in body.chunks(MAX_MSG) {
                    match sealer
                        .noise
                        .read_message(self.recv_nonce, piece, &mut out[len..])
                    {
                        Ok(n) => len += n,
                        Err(_) => return Err(self.tampered()),
                    }
                    self.recv_nonce += 1;
                }
                out.truncate(len);
                Ok(out)
            }
            // The peer has gone (`LinkError::Closed`: nothing more arrives), so the link stays
            // failed: a later read must not deliver frames that still come (or that anyone on
            // the way, who can also send the unauthenticated refusal, sends after it).
            Some((&REFUSE, why)) => {
                let why = format!("the peer ended the link: {}", String::from_utf8_lossy(why));
                self.broken = Some((LinkError::Closed, why.clone()));
                Err(LinkError::Closed(why))
            }
            _ => Err(self.tampered()),
        }
    }

    /// Fails if the link failed before: a frame did not authenticate (the nonces no longer
    /// line up), or the peer ended it.
    fn check(&self) -> Result<(), LinkError> {
        match &self.broken {
            Some((kind, why)) => Err(kind(why.clone())),
            None => Ok(()),
        }
    }

    /// A frame that does not authenticate: tell the peer, and stay failed.
    fn tampered(&mut self) -> LinkError {
        let why = "a frame failed authentication (tampered, replayed, reordered or lost on \
                   the way); the link is closed"
            .to_string();
        self.broken = Some((LinkError::Io, why.clone()));
        refuse(&mut self.inner, why.clone());
        LinkError::Io(why)
    }
}

struct SecureSender {
    inner: Box<dyn LinkSender>,
    sealer: Option<Arc<Sealer>>,
}

impl LinkSender for SecureSender {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        match &self.sealer {
            Some(s) => s.send(&mut *self.inner, &frame),
            None => self.inner.send(frame),
        }
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
        match self.sealer.clone() {
            Some(s) => s.send(&mut Direct(&mut self.inner), &frame),
            None => self.inner.send(frame),
        }
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
            self.check()?;
            let lost_at = self.last_heard + self.silence;
            let now = Instant::now();
            if now >= lost_at {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::link::keys::MAX_WRONG;
    use crate::link::{pair, MemoryLink};

    /// A helper gate: `paired` hosts known, pairing with `code` if given.
    fn gate<'a>(
        paired: &'a (dyn Fn(&PublicKey) -> bool + Sync),
        code: Option<&'a Mutex<PairingCode>>,
    ) -> Gate<'a> {
        Gate {
            insecure: false,
            known: paired,
            pairing: code,
        }
    }

    /// The host dials `how` while the helper accepts through `gate`, on two threads.
    #[allow(clippy::type_complexity)]
    fn meet<H: Link>(
        host_link: H,
        how: Dial,
        host: &Keypair,
        helper: &Keypair,
        gate: &Gate,
        helper_link: MemoryLink,
    ) -> (
        Result<(SecureLink<H>, Option<PublicKey>), LinkError>,
        Result<(SecureLink<MemoryLink>, Accepted), LinkError>,
    ) {
        std::thread::scope(|s| {
            let h = s.spawn(|| accept(helper_link, helper, gate));
            let c = connect(host_link, host, how);
            (c, h.join().unwrap())
        })
    }

    fn numbered(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn pairing_then_known_keys_carry_frames_both_ways() {
        let (host, helper) = (Keypair::generate(), Keypair::generate());
        let code = Mutex::new(PairingCode::new());
        let shown = code.lock().unwrap().shown();
        let nobody = |_: &PublicKey| false;
        let (a, b) = pair();
        let (c, h) = meet(
            a,
            Dial::Pair(&shown),
            &host,
            &helper,
            &gate(&nobody, Some(&code)),
            b,
        );
        let (mut c, helper_key) = c.unwrap();
        let (mut h, who) = h.unwrap();
        assert_eq!(helper_key, Some(helper.public));
        assert_eq!(who, Accepted::Paired(host.public));
        assert!(c.is_encrypted() && h.is_encrypted());
        // Frames of every size, across chunk boundaries, from the link and a sender handle.
        // (Empty frames are the keep-alives: never delivered.)
        for n in [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
            c.send(numbered(n)).unwrap();
            assert_eq!(h.recv().unwrap(), numbered(n));
            h.sender().send(numbered(n + 1)).unwrap();
            assert_eq!(c.recv().unwrap(), numbered(n + 1));
        }

        // Next time the host dials the helper's key, and the helper knows the host's.
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let (a, b) = pair();
        let (c, h) = meet(
            a,
            Dial::Known(helper.public),
            &host,
            &helper,
            &gate(&known, None),
            b,
        );
        let (mut c, _) = c.unwrap();
        let (mut h, who) = h.unwrap();
        assert_eq!(who, Accepted::Known(host.public));
        c.send(b"hello".to_vec()).unwrap();
        assert_eq!(h.recv().unwrap(), b"hello");
    }

    fn refusal(r: Result<impl Sized, LinkError>) -> String {
        match r {
            Err(LinkError::Refused(why)) => why,
            Err(e) => panic!("not a refusal: {e}"),
            Ok(_) => panic!("not refused"),
        }
    }

    #[test]
    fn strangers_wrong_codes_and_mismatched_modes_are_refused_on_both_sides() {
        let (host, helper, stranger) = (
            Keypair::generate(),
            Keypair::generate(),
            Keypair::generate(),
        );
        let code = Mutex::new(PairingCode::new());
        let right = code.lock().unwrap().digits().to_string();
        let wrong = format!("{:06}", (right.parse::<u32>().unwrap() + 1) % 1_000_000);
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let g = gate(&known, Some(&code));

        // A wrong code, twice: refused, the code stays; the third draws a new one.
        for i in 1..=MAX_WRONG {
            let (a, b) = pair();
            let (c, h) = meet(a, Dial::Pair(&wrong), &stranger, &helper, &g, b);
            let (c, h) = (refusal(c), refusal(h));
            assert!(h.starts_with("wrong pairing code") && c == h, "{c} / {h}");
            assert_eq!(code.lock().unwrap().digits() == right, i < MAX_WRONG);
        }

        // A key the helper never paired with.
        let (a, b) = pair();
        let (c, h) = meet(a, Dial::Known(helper.public), &stranger, &helper, &g, b);
        let (c, h) = (refusal(c), refusal(h));
        assert!(h.contains("has not paired with this host") && c == h, "{c}");

        // A host that remembers another key for this helper.
        let (a, b) = pair();
        let other = Keypair::generate().public;
        let (c, h) = meet(a, Dial::Known(other), &host, &helper, &g, b);
        assert!(refusal(h).contains("pair again"));
        assert!(refusal(c).contains("pair again"));

        // Pairing while the helper takes no new hosts.
        let (a, b) = pair();
        let (c, _) = meet(
            a,
            Dial::Pair("123456"),
            &host,
            &helper,
            &gate(&known, None),
            b,
        );
        assert!(refusal(c).contains("not taking new hosts"));

        // A plain host at a secure helper, and the reverse.
        let (a, b) = pair();
        let (c, _) = meet(a, Dial::Insecure, &host, &helper, &g, b);
        assert!(refusal(c).contains("without --insecure"));
        let plain = Gate {
            insecure: true,
            known: &known,
            pairing: None,
        };
        let (a, b) = pair();
        let (c, _) = meet(a, Dial::Known(helper.public), &host, &helper, &plain, b);
        assert!(refusal(c).contains("--insecure too"));
        let (a, b) = pair();
        let (c, h) = meet(a, Dial::Insecure, &host, &helper, &plain, b);
        let (mut c, mut h) = (c.unwrap().0, h.unwrap().0);
        assert!(!c.is_encrypted());
        c.send(b"TH plain".to_vec()).unwrap();
        assert_eq!(h.recv().unwrap(), b"TH plain");
    }

    /// The host's link as a network that changes one sent frame: `n` is the frame (counting
    /// from 0), `how` what happens to it.
    struct Meddler {
        inner: MemoryLink,
        sent: Arc<AtomicUsize>,
        n: usize,
        how: fn(&mut Vec<u8>) -> Vec<Vec<u8>>,
    }

    impl Link for Meddler {
        fn send(&mut self, mut frame: Vec<u8>) -> Result<(), LinkError> {
            if self.sent.fetch_add(1, Ordering::SeqCst) != self.n {
                return self.inner.send(frame);
            }
            for f in (self.how)(&mut frame) {
                self.inner.send(f)?;
            }
            Ok(())
        }
        fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
            self.inner.recv()
        }
        fn recv_timeout(&mut self, t: Duration) -> Result<Option<Vec<u8>>, LinkError> {
            self.inner.recv_timeout(t)
        }
        fn sender(&self) -> Box<dyn LinkSender> {
            self.inner.sender()
        }
    }

    #[test]
    fn a_tampered_replayed_or_dropped_frame_ends_the_link_on_both_sides() {
        let (host, helper) = (Keypair::generate(), Keypair::generate());
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let g = gate(&known, None);
        let flip: fn(&mut Vec<u8>) -> Vec<Vec<u8>> = |f| {
            let at = f.len() / 2;
            f[at] ^= 1;
            vec![f.clone()]
        };
        let replay: fn(&mut Vec<u8>) -> Vec<Vec<u8>> = |f| vec![f.clone(), f.clone()];
        let drop_it: fn(&mut Vec<u8>) -> Vec<Vec<u8>> = |_| vec![];
        for (what, how) in [
            ("tampered", flip),
            ("replayed", replay),
            ("dropped", drop_it),
        ] {
            let (a, b) = pair();
            // Frame 0 is the handshake; 1 and 2 are data.
            let m = Meddler {
                inner: a,
                sent: Arc::default(),
                n: 1,
                how,
            };
            let (c, h) = meet(m, Dial::Known(helper.public), &host, &helper, &g, b);
            let (mut c, mut h) = (c.unwrap().0, h.unwrap().0);
            c.send(numbered(100)).unwrap();
            c.send(numbered(200)).unwrap();
            let got = h.recv();
            let first_ok = matches!(&got, Ok(f) if *f == numbered(100));
            let err = if first_ok { h.recv() } else { got };
            assert!(
                matches!(&err, Err(LinkError::Io(e)) if e.contains("failed authentication")),
                "{what}: {err:?}"
            );
            // Failed for good, and the host hears why.
            assert!(h.recv_timeout(Duration::from_millis(10)).is_err(), "{what}");
            assert!(
                matches!(c.recv(), Err(LinkError::Closed(e)) if e.contains("failed authentication")),
                "{what}"
            );
        }
    }

    #[test]
    fn keepalives_hold_an_idle_link_and_a_silent_peer_is_lost() {
        let (host, helper) = (Keypair::generate(), Keypair::generate());
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let g = gate(&known, None);
        let silence = Duration::from_secs(1);
        // Both sides keep the deadline: an idle 2.5 s pass without a word, and a frame after
        // them still arrives.
        let (a, b) = pair();
        let (c, h) = meet(a, Dial::Known(helper.public), &host, &helper, &g, b);
        let mut c = c.unwrap().0.with_silence(silence);
        let mut h = h.unwrap().0.with_silence(silence);
        assert_eq!(h.recv_timeout(Duration::from_millis(2500)).unwrap(), None);
        c.send(b"still here".to_vec()).unwrap();
        assert_eq!(h.recv().unwrap(), b"still here");
        // A host that stops talking (its keep-alives far apart, as a frozen process's) is lost
        // once the deadline passes, idle or waiting.
        // The deadline counts from the last word heard: the handshake, after `t`.
        let t = Instant::now();
        let (a, b) = pair();
        let (c, h) = meet(a, Dial::Known(helper.public), &host, &helper, &g, b);
        let _quiet = c.unwrap().0;
        let mut h = h.unwrap().0.with_silence(silence);
        let err = h.recv().unwrap_err();
        assert!(
            matches!(&err, LinkError::Closed(e) if e.contains("taken as lost")),
            "{err}"
        );
        assert!(t.elapsed() >= silence && t.elapsed() < 10 * silence);
    }
}
