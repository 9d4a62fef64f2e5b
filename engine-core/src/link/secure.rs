//! The paired, encrypted link: any [`Link`](super::Link) (a WebSocket in production, an
//! in-memory pair in tests) carrying Noise. Only a paired peer gets past the handshake, and that
//! before the helper allocates or computes anything for it; every frame after it is encrypted
//! and authenticated, and a tampered, replayed, reordered or dropped frame ends the link.
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
//!
//! The protocol is written once, sans-IO, so that a browser tab (which can neither block nor
//! start a thread, and has no `Instant`) runs the same code as the native binaries:
//! [`Responder`] (the helper) and [`Initiator`] (the host) take the peer's frames one at a time
//! and answer with the frames to send, until they yield a [`Session`] (which seals and opens
//! `DATA` frames) or a [`Refusal`]. They hold no link, thread or clock: timeouts
//! ([`HANDSHAKE_TIMEOUT`], [`SILENCE`]) and keep-alives belong to whoever drives them. On
//! native targets, `accept`, `connect` and `SecureLink` are that driver over a blocking
//! [`Link`](super::Link).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use snow::{HandshakeState, StatelessTransportState};
use spake2::{Ed25519Group, Identity, Password, Spake2};

use super::keys::{normalise_code, short, Keypair, PairingCode, PublicKey};
use super::LinkError;
use crate::printable::printable_bytes;

#[cfg(not(target_arch = "wasm32"))]
mod blocking;
#[cfg(not(target_arch = "wasm32"))]
pub use blocking::{accept, connect, SecureLink};

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

/// A link that hears nothing from its peer for this long takes the peer as lost (a killed
/// process, a pulled cable, a laptop gone to sleep, a process stopped: nothing says goodbye),
/// and the host carries on from its page file. Both sides send an empty frame every sixth of
/// it when they have nothing else to say, from a thread of their own (a tab: its timer), so
/// only a peer that is really gone trips it; a frame still arriving counts as hearing the peer
/// where the link can tell ([`super::Link::heard`]), so a large frame on a slow link does not.
/// Seconds, not a minute: every request to a host whose helper froze waited this long.
pub const SILENCE: Duration = Duration::from_secs(10);

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
    /// Whether a new host may pair now, and with which code.
    pub pairing: Pairing<'a>,
}

/// Whether a [`Gate`] lets a new host pair.
pub enum Pairing<'a> {
    /// With this code. A lock, because handshakes in flight at once share it: each reads the
    /// code when a host starts pairing and counts a wrong try on it when one ends.
    Open(&'a Mutex<PairingCode>),
    /// Not now; the host is told why.
    Closed(String),
}

impl Pairing<'_> {
    /// Closed, as for a helper that has paired and shows no code.
    pub fn closed() -> Self {
        Pairing::Closed(
            "this helper is not taking new hosts: restart it with --pair-new to show a code".into(),
        )
    }
}

/// How a refusal for a wrong pairing code begins ([`is_wrong_code`]).
pub const WRONG_CODE: &str = "wrong pairing code";

/// Whether `e` refused a wrong pairing code (for a driver that slows such a source down).
pub fn is_wrong_code(e: &LinkError) -> bool {
    matches!(e, LinkError::Refused(why) if why.starts_with(WRONG_CODE))
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

/// How a handshake or a session ends badly: what the peer is owed before the link closes, and
/// the error to report here. A sans-IO side cannot send the peer its reason itself, so it
/// hands the frames to its driver.
#[derive(Debug)]
pub struct Refusal {
    /// Send these, in order, then close (a failed send does not matter: the peer may be gone).
    /// They end with the `REFUSE` frame that tells the peer why; there is none when the peer
    /// refused first, does not speak this protocol or was told already, or the failure is
    /// this side's own.
    pub send: Vec<Vec<u8>>,
    /// Why, as [`LinkError::Refused`] for a handshake turned away (the same reason as the
    /// `REFUSE` frame's, so both sides show it).
    pub error: LinkError,
}

impl Refusal {
    /// `first`, then a `REFUSE` frame saying `why`; the error is the same reason.
    fn after(mut first: Vec<Vec<u8>>, why: String) -> Refusal {
        first.push(frame(REFUSE, why.as_bytes()));
        Refusal {
            send: first,
            error: refused(why),
        }
    }
}

/// An error that owes the peer nothing (its own refusal, a frame outside the protocol, a
/// failure of our own): the link just closes.
impl From<LinkError> for Refusal {
    fn from(error: LinkError) -> Refusal {
        Refusal {
            send: Vec::new(),
            error,
        }
    }
}

/// A refusal with nothing to send before it.
fn refuse(why: impl Into<String>) -> Refusal {
    Refusal::after(Vec::new(), why.into())
}

fn refused(why: impl Into<String>) -> LinkError {
    LinkError::Refused(why.into())
}

fn noise_err(what: &str) -> impl FnOnce(snow::Error) -> LinkError + '_ {
    move |e| LinkError::Io(format!("{what}: {e}"))
}

/// One inner-link frame: `kind`, then `body`.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(body.len() + 1);
    f.push(kind);
    f.extend_from_slice(body);
    f
}

/// A handshake frame's payload; a refusal from the peer becomes [`LinkError::Refused`] with
/// its reason. Neither that nor a frame of another kind is answered.
fn handshake_payload(frame: &[u8]) -> Result<&[u8], Refusal> {
    match frame.split_first() {
        Some((&HANDSHAKE, rest)) => Ok(rest),
        Some((&REFUSE, why)) => Err(refused(printable_bytes(why)).into()),
        _ => Err(refused("the peer does not speak tether's secure link").into()),
    }
}

/// One Noise handshake message out, as a frame: `head`, then the message.
fn noise_frame(hs: &mut HandshakeState, head: &[u8]) -> Result<Vec<u8>, LinkError> {
    let mut buf = vec![0u8; head.len() + MAX_MSG];
    buf[..head.len()].copy_from_slice(head);
    let n = hs
        .write_message(&[], &mut buf[head.len()..])
        .map_err(noise_err("handshake"))?;
    buf.truncate(head.len() + n);
    Ok(buf)
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
    secret: &[u8; 32],
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
        .local_private_key(secret)
        .and_then(|b| b.psk(3, &psk));
    let hs = if initiator {
        b.and_then(|b| b.build_initiator())
    } else {
        b.and_then(|b| b.build_responder())
    };
    hs.map_err(|e| format!("pairing: {e}"))
}

fn remote_key(hs: &HandshakeState) -> Result<PublicKey, LinkError> {
    hs.get_remote_static()
        .and_then(|k| k.try_into().ok())
        .ok_or_else(|| LinkError::Io("the handshake gave no peer key".into()))
}

/// What one side of a handshake does with the peer's frame.
pub enum Progress<S, W> {
    /// Send `send` (in order), then give the peer's next frame to `then`.
    Wait { send: Vec<Vec<u8>>, then: S },
    /// Connected: send `send`, then carry frames through `session`; `who` is the peer.
    Done {
        send: Vec<Vec<u8>>,
        session: Session,
        who: W,
    },
}

/// The helper's side of the handshake, sans-IO: it takes the host's frames one at a time
/// ([`Responder::read`]) until it lets the host in through a [`Gate`] or refuses it with a
/// reason both sides show. Nothing is allocated for a host before it is in.
pub struct Responder(Awaiting);

/// The host frame a [`Responder`] waits for.
enum Awaiting {
    /// The hello: version, mode and the mode's first message.
    Hello { secret: [u8; 32] },
    /// Pairing: the host's first Noise message (SPAKE2 is done).
    PairStart(Box<HandshakeState>),
    /// Pairing: the host's last Noise message, the first that depends on the code.
    PairFinish(Box<HandshakeState>),
}

impl Responder {
    /// A helper with `keys`, waiting for a host's hello.
    pub fn new(keys: &Keypair) -> Responder {
        Responder(Awaiting::Hello {
            secret: keys.secret,
        })
    }

    /// Takes the host's next frame. `gate` is what the helper lets in: give every frame of
    /// one connection the same gate, since the code a host pairs with is read from it at the
    /// hello and a wrong one is counted on it at the end ([`PairingCode::wrong_try`]).
    pub fn read(self, frame: &[u8], gate: &Gate) -> Result<Progress<Responder, Accepted>, Refusal> {
        let msg = handshake_payload(frame)?;
        match self.0 {
            Awaiting::Hello { secret } => hello(&secret, msg, gate),
            Awaiting::PairStart(mut hs) => {
                if !read_noise(&mut hs, msg) {
                    return Err(refuse("a malformed pairing message"));
                }
                let reply = noise_frame(&mut hs, &[HANDSHAKE])?;
                Ok(Progress::Wait {
                    send: vec![reply],
                    then: Responder(Awaiting::PairFinish(hs)),
                })
            }
            Awaiting::PairFinish(mut hs) => {
                if !read_noise(&mut hs, msg) {
                    return Err(wrong_code(gate));
                }
                let host = remote_key(&hs)?;
                let (session, confirm) = confirmed(*hs)?;
                Ok(Progress::Done {
                    send: vec![confirm],
                    session,
                    who: Accepted::Paired(host),
                })
            }
        }
    }

    /// The error for a host that sent nothing within `waited` (the driver's timeout: the
    /// responder keeps no clock).
    pub fn timed_out(&self, waited: Duration) -> LinkError {
        refused(format!("no answer within {waited:?}"))
    }
}

/// A host's hello: let it in (insecure, known), start pairing, or refuse it.
fn hello(
    secret: &[u8; 32],
    msg: &[u8],
    gate: &Gate,
) -> Result<Progress<Responder, Accepted>, Refusal> {
    let (version, mode, rest) = match msg {
        [v, m, rest @ ..] => (*v, *m, rest),
        _ => return Err(refuse("a malformed link hello")),
    };
    if version != VERSION {
        return Err(refuse(format!(
            "secure link version {version}; this helper speaks {VERSION}"
        )));
    }
    match (mode, gate.insecure) {
        (MODE_INSECURE, true) => Ok(Progress::Done {
            send: vec![frame(HANDSHAKE, &[VERSION, MODE_INSECURE])],
            session: Session::plain(),
            who: Accepted::Insecure,
        }),
        (MODE_INSECURE, false) => Err(refuse(
            "this helper takes only paired, encrypted links: run the host without --insecure \
             (and with --pair CODE the first time)",
        )),
        (_, true) => Err(refuse(
            "this helper runs --insecure (a plain link): run the host with --insecure too",
        )),
        (MODE_PAIR, false) => start_pairing(secret, gate, rest),
        (MODE_KNOWN, false) => known_host(secret, gate, rest),
        _ => Err(refuse(format!("unknown link mode {mode}"))),
    }
}

/// SPAKE2 with the host's message `spake_msg`: our own message back, then Noise.
fn start_pairing(
    secret: &[u8; 32],
    gate: &Gate,
    spake_msg: &[u8],
) -> Result<Progress<Responder, Accepted>, Refusal> {
    let pairing = match &gate.pairing {
        Pairing::Open(code) => code.lock().unwrap_or_else(PoisonError::into_inner),
        Pairing::Closed(why) => return Err(refuse(why.clone())),
    };
    if pairing.paused() {
        return Err(refuse(PAUSED));
    }
    let digits = pairing.digits().to_string();
    drop(pairing);
    let (spake, msg) = spake(&digits);
    let reply = frame(HANDSHAKE, &msg);
    match pairing_noise(secret, spake, spake_msg, false) {
        Ok(hs) => Ok(Progress::Wait {
            send: vec![reply],
            then: Responder(Awaiting::PairStart(Box::new(hs))),
        }),
        Err(why) => Err(Refusal::after(vec![reply], why)),
    }
}

/// A host's `Noise_IK` first message `ik_msg`: in if its key is paired with, and the message
/// was made for this helper's key.
fn known_host(
    secret: &[u8; 32],
    gate: &Gate,
    ik_msg: &[u8],
) -> Result<Progress<Responder, Accepted>, Refusal> {
    let pro = prologue(MODE_KNOWN);
    let mut hs = builder(KNOWN, &pro)
        .local_private_key(secret)
        .and_then(|b| b.build_responder())
        .map_err(noise_err("handshake"))?;
    if !read_noise(&mut hs, ik_msg) {
        return Err(refuse(
            "the host's handshake does not authenticate: it paired with another key of this \
             helper; pair again with --pair CODE",
        ));
    }
    let host = remote_key(&hs)?;
    if !(gate.known)(&host) {
        return Err(refuse(format!(
            "this helper has not paired with this host (key {}): pair with --pair CODE",
            short(&host)
        )));
    }
    let reply = noise_frame(&mut hs, &[HANDSHAKE])?;
    let (session, confirm) = confirmed(hs)?;
    Ok(Progress::Done {
        send: vec![reply, confirm],
        session,
        who: Accepted::Known(host),
    })
}

/// What a host that pairs is told once [`MAX_WRONG`] wrong codes paused pairing.
const PAUSED: &str = "this device took too many wrong pairing codes and takes no more until a \
                      new code is asked for on it";

/// A pairing whose last message does not authenticate: the host's code was not ours. The try
/// counts on the gate's code, which pauses pairing after too many.
fn wrong_code(gate: &Gate) -> Refusal {
    let paused = match &gate.pairing {
        Pairing::Open(code) => code
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .wrong_try(),
        Pairing::Closed(_) => false,
    };
    match paused {
        true => refuse(format!("{WRONG_CODE}; {PAUSED}")),
        false => refuse(WRONG_CODE),
    }
}

/// The helper's finished handshake in transport mode, and the empty frame that tells the host
/// it is in.
fn confirmed(hs: HandshakeState) -> Result<(Session, Vec<u8>), LinkError> {
    let mut session = Session::encrypted(hs)?;
    let confirm = session.seal(Vec::new())?;
    Ok((session, confirm))
}

/// The host's side of the handshake, sans-IO: [`Initiator::start`] gives the hello to send,
/// then [`Initiator::read`] takes the helper's frames one at a time until the helper lets the
/// host in (its key, if the link is encrypted) or either side refuses.
pub struct Initiator(Expect);

/// The helper frame an [`Initiator`] waits for.
enum Expect {
    /// Insecure: the helper's plain hello back.
    PlainHello,
    /// Pairing: the helper's SPAKE2 message.
    Spake {
        secret: [u8; 32],
        spake: Box<Spake2<Ed25519Group>>,
    },
    /// Pairing: the helper's Noise message (2 of 3).
    PairReply(Box<HandshakeState>),
    /// Known: the helper's `Noise_IK` answer, which only the remembered key can make.
    KnownReply(Box<HandshakeState>),
    /// The helper's empty `DATA` frame that says it let the host in.
    Confirm { session: Session, helper: PublicKey },
}

impl Initiator {
    /// A host with `keys` dialling `how`: the hello to send, and the initiator waiting for the
    /// helper's answer. A pairing code that is not six digits fails here, before anything is
    /// sent.
    pub fn start(keys: &Keypair, how: Dial) -> Result<(Vec<u8>, Initiator), LinkError> {
        let (hello, expect) = match how {
            Dial::Insecure => (
                frame(HANDSHAKE, &[VERSION, MODE_INSECURE]),
                Expect::PlainHello,
            ),
            Dial::Pair(code) => {
                let digits = normalise_code(code);
                if digits.len() != 6 {
                    return Err(refused(format!(
                        "pairing code `{code}`: expected the six digits the helper shows"
                    )));
                }
                let (spake, msg) = spake(&digits);
                let mut hello = frame(HANDSHAKE, &[VERSION, MODE_PAIR]);
                hello.extend_from_slice(&msg);
                let spake = Box::new(spake);
                (
                    hello,
                    Expect::Spake {
                        secret: keys.secret,
                        spake,
                    },
                )
            }
            Dial::Known(helper) => {
                let pro = prologue(MODE_KNOWN);
                let mut hs = builder(KNOWN, &pro)
                    .local_private_key(&keys.secret)
                    .and_then(|b| b.remote_public_key(&helper))
                    .and_then(|b| b.build_initiator())
                    .map_err(noise_err("handshake"))?;
                let hello = noise_frame(&mut hs, &[HANDSHAKE, VERSION, MODE_KNOWN])?;
                (hello, Expect::KnownReply(Box::new(hs)))
            }
        };
        Ok((hello, Initiator(expect)))
    }

    /// Takes the helper's next frame; done, the helper's key (`None` on a plain link).
    pub fn read(self, frame: &[u8]) -> Result<Progress<Initiator, Option<PublicKey>>, Refusal> {
        match self.0 {
            Expect::PlainHello => {
                handshake_payload(frame)?;
                Ok(Progress::Done {
                    send: Vec::new(),
                    session: Session::plain(),
                    who: None,
                })
            }
            Expect::Spake { secret, spake } => {
                let theirs = handshake_payload(frame)?;
                let mut hs = pairing_noise(&secret, *spake, theirs, true).map_err(refused)?;
                let msg = noise_frame(&mut hs, &[HANDSHAKE])?;
                Ok(Progress::Wait {
                    send: vec![msg],
                    then: Initiator(Expect::PairReply(Box::new(hs))),
                })
            }
            Expect::PairReply(mut hs) => {
                if !read_noise(&mut hs, handshake_payload(frame)?) {
                    return Err(refuse("the helper's pairing reply does not authenticate"));
                }
                let msg = noise_frame(&mut hs, &[HANDSHAKE])?;
                Ok(Progress::Wait {
                    send: vec![msg],
                    then: Initiator::confirming(*hs)?,
                })
            }
            Expect::KnownReply(mut hs) => {
                if !read_noise(&mut hs, handshake_payload(frame)?) {
                    return Err(refuse(
                        "the helper at this address is not the one paired (its key changed): \
                         pair again with --pair CODE",
                    ));
                }
                Ok(Progress::Wait {
                    send: Vec::new(),
                    then: Initiator::confirming(*hs)?,
                })
            }
            Expect::Confirm {
                mut session,
                helper,
            } => {
                // Before the session reads it: a refusal here is the helper's answer to the
                // handshake (a wrong code), not the end of an established link.
                if let Some((&REFUSE, why)) = frame.split_first() {
                    return Err(refused(printable_bytes(why)).into());
                }
                if !session.open(frame.to_vec())?.is_empty() {
                    return Err(refused("the helper's confirmation was not empty").into());
                }
                Ok(Progress::Done {
                    send: Vec::new(),
                    session,
                    who: Some(helper),
                })
            }
        }
    }

    /// The finished handshake in transport mode, waiting for the helper's confirmation.
    fn confirming(hs: HandshakeState) -> Result<Initiator, LinkError> {
        let helper = remote_key(&hs)?;
        let session = Session::encrypted(hs)?;
        Ok(Initiator(Expect::Confirm { session, helper }))
    }

    /// The error for a helper that sent nothing within `waited` (the driver's timeout: the
    /// initiator keeps no clock).
    pub fn timed_out(&self, waited: Duration) -> LinkError {
        match self.0 {
            Expect::Confirm { .. } => {
                refused(format!("the helper did not confirm within {waited:?}"))
            }
            _ => refused(format!("no answer within {waited:?}")),
        }
    }
}

/// An established link, frame by frame: what goes out is sealed into `DATA` frames, what
/// comes in is opened (with `--insecure`, frames pass as they are). An empty frame is a
/// keep-alive: a driver sends one when it has had nothing to say for a while, and skips the
/// ones it opens (protocol frames are never empty).
pub struct Session {
    sealer: Sealer,
    opener: Opener,
}

impl Session {
    fn plain() -> Session {
        Session {
            sealer: Sealer {
                noise: None,
                nonce: 0,
            },
            opener: Opener {
                noise: None,
                nonce: 0,
                broken: None,
            },
        }
    }

    fn encrypted(hs: HandshakeState) -> Result<Session, LinkError> {
        let noise = Arc::new(
            hs.into_stateless_transport_mode()
                .map_err(noise_err("handshake"))?,
        );
        Ok(Session {
            sealer: Sealer {
                noise: Some(noise.clone()),
                nonce: 0,
            },
            opener: Opener {
                noise: Some(noise),
                nonce: 0,
                broken: None,
            },
        })
    }

    /// Whether frames are encrypted (false only for `--insecure`).
    pub fn is_encrypted(&self) -> bool {
        self.sealer.noise.is_some()
    }

    /// See [`Sealer::seal`].
    pub fn seal(&mut self, frame: Vec<u8>) -> Result<Vec<u8>, LinkError> {
        self.sealer.seal(frame)
    }

    /// See [`Opener::open`].
    pub fn open(&mut self, frame: Vec<u8>) -> Result<Vec<u8>, Refusal> {
        self.opener.open(frame)
    }

    /// The two directions apart, for a driver that sends from other threads (keep-alives,
    /// sender handles) while one waits to receive.
    pub fn split(self) -> (Sealer, Opener) {
        (self.sealer, self.opener)
    }
}

/// A [`Session`]'s sending direction.
pub struct Sealer {
    noise: Option<Arc<StatelessTransportState>>,
    nonce: u64,
}

impl Sealer {
    /// `frame` as it goes on the inner link: a `DATA` frame of Noise messages under this
    /// direction's next nonces. The peer opens frames only in the order they were sealed, so a
    /// driver that shares a sealer holds it from sealing a frame to queueing it.
    pub fn seal(&mut self, frame: Vec<u8>) -> Result<Vec<u8>, LinkError> {
        let Some(noise) = &self.noise else {
            return Ok(frame);
        };
        let chunks = frame.len().div_ceil(CHUNK).max(1);
        let mut out = vec![0u8; 1 + frame.len() + chunks * TAG];
        out[0] = DATA;
        let mut at = 1;
        for i in 0..chunks {
            let piece = &frame[i * CHUNK..((i + 1) * CHUNK).min(frame.len())];
            at += noise
                .write_message(self.nonce, piece, &mut out[at..])
                .map_err(noise_err("encrypting a frame"))?;
            self.nonce += 1;
        }
        Ok(out)
    }
}

/// What a failed link answers every later read with: the error (`Io` or `Closed`) and why.
type Failure = (fn(String) -> LinkError, String);

/// A [`Session`]'s receiving direction.
pub struct Opener {
    noise: Option<Arc<StatelessTransportState>>,
    nonce: u64,
    /// Why the link failed, and as which error, once a frame did not authenticate or the peer
    /// ended the link: it stays failed.
    broken: Option<Failure>,
}

impl Opener {
    /// A frame from the inner link, opened: the frame the peer sealed. A frame that does not
    /// authenticate (tampered, replayed, reordered, or one before it lost) fails the link for
    /// good with a `REFUSE` frame to send the peer; so does a `REFUSE` from the peer, with
    /// nothing to send.
    pub fn open(&mut self, frame: Vec<u8>) -> Result<Vec<u8>, Refusal> {
        self.check()?;
        let Some(noise) = self.noise.clone() else {
            return Ok(frame);
        };
        match frame.split_first() {
            Some((&DATA, body)) if !body.is_empty() => {
                let mut out = vec![0u8; body.len()];
                let mut len = 0;
                for piece in body.chunks(MAX_MSG) {
                    match noise.read_message(self.nonce, piece, &mut out[len..]) {
                        Ok(n) => len += n,
                        Err(_) => return Err(self.tampered()),
                    }
                    self.nonce += 1;
                }
                out.truncate(len);
                Ok(out)
            }
            // The peer has gone (`LinkError::Closed`: nothing more arrives), so the link stays
            // failed: a later read must not deliver frames that still come (or that anyone on
            // the way, who can also send the unauthenticated refusal, sends after it).
            Some((&REFUSE, why)) => {
                let why = format!("the peer ended the link: {}", printable_bytes(why));
                self.broken = Some((LinkError::Closed, why.clone()));
                Err(LinkError::Closed(why).into())
            }
            _ => Err(self.tampered()),
        }
    }

    /// Fails if the link failed before: a frame did not authenticate (the nonces no longer
    /// line up), or the peer ended it. A driver asks before it waits for another frame.
    pub fn check(&self) -> Result<(), LinkError> {
        match &self.broken {
            Some((kind, why)) => Err(kind(why.clone())),
            None => Ok(()),
        }
    }

    /// A frame that does not authenticate: tell the peer, and stay failed.
    fn tampered(&mut self) -> Refusal {
        let why = "a frame failed authentication (tampered, replayed, reordered or lost on \
                   the way); the link is closed"
            .to_string();
        self.broken = Some((LinkError::Io, why.clone()));
        Refusal {
            send: vec![frame(REFUSE, why.as_bytes())],
            error: LinkError::Io(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use super::*;
    use crate::link::keys::MAX_WRONG;
    use crate::link::{pair, Link, LinkSender, MemoryLink};

    /// A helper gate: `paired` hosts known, pairing with `code` if given.
    fn gate<'a>(
        paired: &'a (dyn Fn(&PublicKey) -> bool + Sync),
        code: Option<&'a Mutex<PairingCode>>,
    ) -> Gate<'a> {
        Gate {
            insecure: false,
            known: paired,
            pairing: code.map_or_else(Pairing::closed, Pairing::Open),
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

        // Wrong codes: refused, and the code stays the one shown; the last one pauses it.
        for i in 1..=MAX_WRONG {
            let (a, b) = pair();
            let (c, h) = meet(a, Dial::Pair(&wrong), &stranger, &helper, &g, b);
            let (c, h) = (refusal(c), refusal(h));
            assert!(h.starts_with("wrong pairing code") && c == h, "{c} / {h}");
            assert_eq!(code.lock().unwrap().digits(), right);
            assert_eq!(h.contains("takes no more"), i == MAX_WRONG, "{h}");
        }
        // Paused: even the right code is refused until a new one is drawn on the device.
        let (a, b) = pair();
        let (c, _) = meet(a, Dial::Pair(&right), &host, &helper, &g, b);
        assert!(refusal(c).contains("takes no more"));

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
            pairing: Pairing::closed(),
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

    /// The helper as a browser tab runs it: the sans-IO [`Responder`] fed the host's frames
    /// one at a time from `link`, its answers sent back; the established session and who came
    /// in, or the refusal (whose frames it sent).
    fn respond(
        link: &mut MemoryLink,
        helper: &Keypair,
        gate: &Gate,
    ) -> Result<(Session, Accepted), Refusal> {
        let mut responder = Responder::new(helper);
        loop {
            let frame = match link.recv_timeout(HANDSHAKE_TIMEOUT) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Err(responder.timed_out(HANDSHAKE_TIMEOUT).into()),
                Err(e) => return Err(e.into()),
            };
            match responder.read(&frame, gate) {
                Ok(Progress::Wait { send, then }) => {
                    for f in send {
                        link.send(f).unwrap();
                    }
                    responder = then;
                }
                Ok(Progress::Done { send, session, who }) => {
                    for f in send {
                        link.send(f).unwrap();
                    }
                    return Ok((session, who));
                }
                Err(refusal) => {
                    for f in &refusal.send {
                        let _ = link.send(f.clone());
                    }
                    return Err(refusal);
                }
            }
        }
    }

    type Hosted = Result<(SecureLink<MemoryLink>, Option<PublicKey>), LinkError>;

    /// The real host (`connect`, on its own thread) dials `how`; the helper is [`respond`],
    /// here. The helper's end of the link comes back for the session's frames.
    fn meet_responder(
        how: Dial,
        host: &Keypair,
        helper: &Keypair,
        gate: &Gate,
    ) -> (Hosted, Result<(Session, Accepted), Refusal>, MemoryLink) {
        let (a, mut b) = pair();
        std::thread::scope(|s| {
            let c = s.spawn(|| connect(a, host, how));
            let h = respond(&mut b, helper, gate);
            (c.join().unwrap(), h, b)
        })
    }

    /// The next frame the helper's session opens from `link`, keep-alives skipped.
    fn open_next(session: &mut Session, link: &mut MemoryLink) -> Result<Vec<u8>, Refusal> {
        loop {
            let frame = session.open(link.recv().unwrap())?;
            if !frame.is_empty() {
                return Ok(frame);
            }
        }
    }

    #[test]
    fn the_sans_io_responder_pairs_with_the_right_code_then_knows_the_host() {
        let (host, helper) = (Keypair::generate(), Keypair::generate());
        let code = Mutex::new(PairingCode::new());
        let shown = code.lock().unwrap().shown();
        let nobody = |_: &PublicKey| false;
        let g = gate(&nobody, Some(&code));
        let (c, h, mut b) = meet_responder(Dial::Pair(&shown), &host, &helper, &g);
        let (mut c, helper_key) = c.unwrap();
        let (mut session, who) = h.unwrap();
        assert_eq!(helper_key, Some(helper.public));
        assert_eq!(who, Accepted::Paired(host.public));
        assert!(session.is_encrypted() && c.is_encrypted());
        // Frames across chunk boundaries, both ways, between the blocking host and the
        // frame-level session.
        for n in [1, CHUNK, CHUNK + 1, 2 * CHUNK + 3] {
            c.send(numbered(n)).unwrap();
            assert_eq!(open_next(&mut session, &mut b).unwrap(), numbered(n));
            b.send(session.seal(numbered(n + 1)).unwrap()).unwrap();
            assert_eq!(c.recv().unwrap(), numbered(n + 1));
        }

        // The paired host dials the helper's key; the responder finds the host's among those
        // it knows, with no pairing open.
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let g = gate(&known, None);
        let (c, h, mut b) = meet_responder(Dial::Known(helper.public), &host, &helper, &g);
        let (mut c, _) = c.unwrap();
        let (mut session, who) = h.unwrap();
        assert_eq!(who, Accepted::Known(host.public));
        c.send(b"hello".to_vec()).unwrap();
        assert_eq!(open_next(&mut session, &mut b).unwrap(), b"hello");
    }

    /// The reason of a host's refusal and of the responder's, which must carry it as its
    /// `REFUSE` frame.
    fn refusals(c: Hosted, h: Result<(Session, Accepted), Refusal>) -> (String, Refusal) {
        let c = refusal(c);
        let Err(h) = h else {
            panic!("the responder let the host in")
        };
        (c, h)
    }

    fn why(r: &Refusal) -> String {
        match &r.error {
            LinkError::Refused(why) => {
                let last = r.send.last().expect("a REFUSE frame to send");
                assert_eq!(last[0], REFUSE);
                assert_eq!(&last[1..], why.as_bytes());
                why.clone()
            }
            e => panic!("not a refusal: {e}"),
        }
    }

    /// A peer's refusal is shown, never obeyed: its newlines and escape codes cannot draw a
    /// fake line (a "pairing code") on the terminal that prints it.
    #[test]
    fn a_peers_refusal_reaches_the_terminal_escaped() {
        let fake = b"busy\n\x1b[2K\rpairing code: 111-111";
        let code = Mutex::new(PairingCode::new());
        let known = |_: &PublicKey| false;
        let g = gate(&known, Some(&code));
        let refusal = Responder::new(&Keypair::generate())
            .read(&frame(REFUSE, fake), &g)
            .err()
            .expect("a refusal");
        let shown = refusal.error.to_string();
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert!(
            shown.contains("busy\\u{a}\\u{1b}[2K\\u{d}pairing code"),
            "{shown}"
        );
    }

    #[test]
    fn the_sans_io_responder_refuses_wrong_codes_strangers_and_the_wrong_mode() {
        let (host, helper, stranger) = (
            Keypair::generate(),
            Keypair::generate(),
            Keypair::generate(),
        );
        let code = Mutex::new(PairingCode::new());
        let right = code.lock().unwrap().shown();
        let wrong = format!(
            "{:06}",
            (normalise_code(&right).parse::<u32>().unwrap() + 1) % 1_000_000
        );
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let g = gate(&known, Some(&code));

        // Wrong codes: refused on both sides with the same reason; the code stays the one
        // shown, and the last try it takes pauses pairing, which the refusal says.
        for i in 1..=MAX_WRONG {
            let (c, h, _) = meet_responder(Dial::Pair(&wrong), &stranger, &helper, &g);
            let (c, h) = refusals(c, h);
            assert!(
                why(&h).starts_with("wrong pairing code") && c == why(&h),
                "{c}"
            );
            assert_eq!(why(&h).contains("takes no more"), i == MAX_WRONG);
            assert_eq!(code.lock().unwrap().shown(), right);
        }
        let (c, h, _) = meet_responder(Dial::Pair(&right), &stranger, &helper, &g);
        let (c, h) = refusals(c, h);
        assert!(
            c.contains("takes no more") && c == why(&h),
            "paused: the right code too"
        );
        // A new code, asked for on the device, is taken.
        *code.lock().unwrap() = PairingCode::new();
        let new = code.lock().unwrap().shown();
        let (c, h, _) = meet_responder(Dial::Pair(&new), &host, &helper, &g);
        assert!(c.is_ok() && h.is_ok());

        // A key it has not paired with.
        let (c, h, _) = meet_responder(Dial::Known(helper.public), &stranger, &helper, &g);
        let (c, h) = refusals(c, h);
        assert!(
            c.contains("has not paired with this host") && c == why(&h),
            "{c}"
        );

        // A plain host at a secure helper, and a secure host at a plain one.
        let (c, h, _) = meet_responder(Dial::Insecure, &host, &helper, &g);
        let (c, h) = refusals(c, h);
        assert!(c.contains("without --insecure") && c == why(&h), "{c}");
        let plain = Gate {
            insecure: true,
            known: &known,
            pairing: Pairing::closed(),
        };
        let (c, h, _) = meet_responder(Dial::Known(helper.public), &host, &helper, &plain);
        let (c, h) = refusals(c, h);
        assert!(c.contains("--insecure too") && c == why(&h), "{c}");

        // Plain host, plain helper: in, and frames pass as they are.
        let (c, h, mut b) = meet_responder(Dial::Insecure, &host, &helper, &plain);
        let (mut c, helper_key) = c.unwrap();
        let (mut session, who) = h.unwrap();
        assert_eq!((helper_key, who), (None, Accepted::Insecure));
        assert!(!session.is_encrypted());
        c.send(b"TH plain".to_vec()).unwrap();
        assert_eq!(open_next(&mut session, &mut b).unwrap(), b"TH plain");
        assert_eq!(session.seal(b"TH back".to_vec()).unwrap(), b"TH back");
    }

    #[test]
    fn a_session_fails_for_good_on_a_replayed_frame_or_the_peers_refusal() {
        let (host, helper) = (Keypair::generate(), Keypair::generate());
        let host_pub = host.public;
        let known = move |k: &PublicKey| *k == host_pub;
        let g = gate(&known, None);

        // A replayed frame: refused with a REFUSE frame for the host, then failed for good.
        let (c, h, mut b) = meet_responder(Dial::Known(helper.public), &host, &helper, &g);
        let (mut c, _) = c.unwrap();
        let (mut session, _) = h.unwrap();
        c.send(numbered(10)).unwrap();
        let sealed = loop {
            let f = b.recv().unwrap();
            // The frame itself, not a keep-alive: an empty frame seals to a tag alone.
            if f.len() > 1 + TAG {
                break f;
            }
            session.open(f).unwrap();
        };
        assert_eq!(session.open(sealed.clone()).unwrap(), numbered(10));
        let r = session.open(sealed).unwrap_err();
        assert!(
            matches!(&r.error, LinkError::Io(e) if e.contains("failed authentication")),
            "{:?}",
            r.error
        );
        assert_eq!(r.send.len(), 1);
        b.send(r.send[0].clone()).unwrap();
        assert!(
            matches!(c.recv(), Err(LinkError::Closed(e)) if e.contains("failed authentication"))
        );
        let again = session.open(numbered(5)).unwrap_err();
        assert!(again.send.is_empty() && matches!(again.error, LinkError::Io(_)));

        // The host's refusal ends the session, with nothing owed back.
        let (c, h, _) = meet_responder(Dial::Known(helper.public), &host, &helper, &g);
        drop(c);
        let (mut session, _) = h.unwrap();
        let r = session.open(frame(REFUSE, b"bye")).unwrap_err();
        assert!(r.send.is_empty() && matches!(&r.error, LinkError::Closed(e) if e.contains("bye")));
        assert!(session.open(Vec::new()).is_err());
    }
}
