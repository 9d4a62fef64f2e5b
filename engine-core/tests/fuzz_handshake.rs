//! Fuzzing the secure link's handshake and transport: a helper listens on a network, so the
//! first frames it reads come from anyone. Whatever they are (random, a real host's frames
//! changed on the way, a refusal, a frame of the wrong kind) the helper must refuse with an
//! error before it lets anyone in, without panicking and without waiting out a timeout; after
//! a handshake, any changed frame must end the link with an error on the side that reads it.
//!
//! The helper's sans-IO core, which a browser tab drives frame by frame, is fuzzed directly
//! too: fed frames with nothing in between, and against the host's core in memory.
//!
//! `scripts/fuzz` runs these with many more cases.

mod common;

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine_core::link::keys::{Keypair, PairingCode, PublicKey};
use engine_core::link::secure::{
    accept, connect, Accepted, Dial, Gate, Initiator, Pairing, Progress, Refusal, Responder,
    SecureLink,
};
use engine_core::link::{pair, Link, LinkError, LinkSender, MemoryLink};
use proptest::prelude::*;

use common::{cases, mutation, Mutation};

/// The inner link's frame kinds (link/secure.rs).
const REFUSE: u8 = 0;
const HANDSHAKE: u8 = 1;
const DATA: u8 = 2;

/// Longer than any handshake takes here, shorter than the link's own timeout: a case that
/// runs into it waited on the peer where it should have refused.
const WATCHDOG: Duration = Duration::from_secs(8);

/// A peer that is only a script: it delivers `frames`, then is gone (so the helper can never
/// wait for more), and records what the helper sent.
struct Script {
    frames: VecDeque<Vec<u8>>,
    sent: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl LinkSender for Script {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.sent.lock().unwrap().push(frame);
        Ok(())
    }
}

impl Link for Script {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        LinkSender::send(self, frame)
    }
    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        self.frames
            .pop_front()
            .ok_or_else(|| LinkError::Closed("the script ended".into()))
    }
    fn recv_timeout(&mut self, _: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        self.recv().map(Some)
    }
    fn sender(&self) -> Box<dyn LinkSender> {
        Box::new(Script {
            frames: VecDeque::new(),
            sent: self.sent.clone(),
        })
    }
}

/// A host's link through a network that applies `how` to the `n`th frame the host sends
/// (counting from 0; keep-alives, sent through `sender`, are not counted or changed).
struct Meddler {
    inner: MemoryLink,
    sent: usize,
    n: usize,
    how: Mutation,
}

impl Link for Meddler {
    fn send(&mut self, mut frame: Vec<u8>) -> Result<(), LinkError> {
        if self.sent == self.n {
            self.how.apply(&mut frame);
        }
        self.sent += 1;
        self.inner.send(frame)
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

type Hosted = Result<(SecureLink<Meddler>, Option<PublicKey>), LinkError>;
type Helped = Result<(SecureLink<MemoryLink>, Accepted), LinkError>;

/// A host (dialling `how` through `meddler`) meets a helper (`gate`) on two threads; `None`
/// if they are not both done within [`WATCHDOG`].
fn meet(
    meddler: Meddler,
    how: Dial<'static>,
    helper_link: MemoryLink,
    gate: Gate<'static>,
) -> Option<(Hosted, Helped)> {
    let (host, helper) = (Keypair::generate(), helper_keys());
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let outcome = std::thread::scope(|s| {
            let h = s.spawn(|| accept(helper_link, &helper, &gate));
            let c = connect(meddler, &host, how);
            (c, h.join().unwrap())
        });
        let _ = done.send(outcome);
    });
    result.recv_timeout(WATCHDOG).ok()
}

/// The helper's key pair, the same in every case so hosts can dial it as known.
fn helper_keys() -> Keypair {
    static KEYS: std::sync::OnceLock<Keypair> = std::sync::OnceLock::new();
    KEYS.get_or_init(Keypair::generate).clone()
}

fn any_host(_: &PublicKey) -> bool {
    true
}

/// A helper that knows every host's key and takes new ones with `code`: the most it lets
/// through, so only the handshake itself can stop a stranger.
fn open_gate(code: Option<&'static Mutex<PairingCode>>) -> Gate<'static> {
    Gate {
        insecure: false,
        known: &any_host,
        pairing: code.map_or_else(Pairing::closed, Pairing::Open),
    }
}

/// A fresh pairing code and the digits it shows. Gates and dials borrow them from a thread
/// that may outlive a hung case, so they live for the rest of the test process.
fn leaked_code() -> (&'static Mutex<PairingCode>, &'static str) {
    let code: &'static Mutex<PairingCode> = Box::leak(Box::new(Mutex::new(PairingCode::new())));
    let shown = code.lock().unwrap().shown();
    (code, Box::leak(shown.into_boxed_str()))
}

/// A first frame that gets past the kind, version and mode bytes often.
fn first_frame() -> impl Strategy<Value = Vec<u8>> {
    let kind = prop_oneof![Just(HANDSHAKE), Just(REFUSE), Just(DATA), any::<u8>()];
    let version = prop_oneof![3 => Just(1u8), 1 => any::<u8>()];
    let mode = prop_oneof![Just(0u8), Just(1), Just(2), any::<u8>()];
    // A SPAKE2 message is 33 bytes, its side byte first; a Noise_IK first message is 96.
    let rest = prop_oneof![
        proptest::collection::vec(any::<u8>(), 32).prop_map(|mut v| {
            v.insert(0, b'S');
            v
        }),
        proptest::collection::vec(any::<u8>(), 96),
        proptest::collection::vec(any::<u8>(), 0..200),
    ];
    prop_oneof![
        4 => (kind, version, mode, rest).prop_map(|(k, v, m, rest)| {
            let mut f = vec![k, v, m];
            f.extend(rest);
            f
        }),
        1 => proptest::collection::vec(any::<u8>(), 0..8),
    ]
}

/// Runs `accept` over a script of frames (none of them a real host's): who got in, and the
/// frames the helper sent.
fn accept_script(frames: Vec<Vec<u8>>, gate: &Gate) -> (Result<Accepted, LinkError>, Vec<Vec<u8>>) {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let script = Script {
        frames: frames.into(),
        sent: sent.clone(),
    };
    let res = accept(script, &helper_keys(), gate).map(|(_, who)| who);
    let sent = sent.lock().unwrap().clone();
    (res, sent)
}

/// Both sides of a handshake that must fail: the helper lets nobody in, and the host learns
/// it was not let in; neither waits out a timeout.
fn both_refused(outcome: Option<(Hosted, Helped)>) -> Result<(), TestCaseError> {
    let Some((host, helper)) = outcome else {
        return Err(TestCaseError::fail(format!(
            "no outcome within {WATCHDOG:?}"
        )));
    };
    prop_assert!(
        helper.is_err(),
        "the helper let the host in: {:?}",
        helper.map(|h| h.1)
    );
    prop_assert!(host.is_err(), "the host believes it got in");
    Ok(())
}

/// Gives a sans-IO side (if it still waits) a frame through `read`: what it answers goes to
/// `out`, how it ends to `done`.
fn step<S, W>(
    side: &mut Option<S>,
    read: impl FnOnce(S) -> Result<Progress<S, W>, Refusal>,
    out: &mut VecDeque<Vec<u8>>,
    done: &mut Option<Result<W, Refusal>>,
) {
    let Some(s) = side.take() else {
        return;
    };
    match read(s) {
        Ok(Progress::Wait { send, then }) => {
            out.extend(send);
            *side = Some(then);
        }
        Ok(Progress::Done { send, who, .. }) => {
            out.extend(send);
            *done = Some(Ok(who));
        }
        Err(refusal) => {
            out.extend(refusal.send.iter().cloned());
            *done = Some(Err(refusal));
        }
    }
}

/// A host's [`Initiator`] (dialling `how`) meets the helper's [`Responder`] (`gate`) in
/// memory, with no link, thread or clock: each frame one side sends goes to the other; with
/// `change` `(n, how)`, the host's `n`th (counting from 0) is changed by `how` on the way. A
/// side still waiting when no frame is left ends as its driver's timeout would end it.
fn sans_io_meet(
    how: Dial,
    gate: &Gate,
    change: Option<(usize, &Mutation)>,
) -> (
    Result<Option<PublicKey>, Refusal>,
    Result<Accepted, Refusal>,
) {
    let (hello, initiator) = Initiator::start(&Keypair::generate(), how).unwrap();
    let (mut host, mut helper) = (Some(initiator), Some(Responder::new(&helper_keys())));
    let (mut hosted, mut helped) = (None, None);
    let (mut to_helper, mut to_host) = (VecDeque::from([hello]), VecDeque::new());
    let mut from_host = 0;
    loop {
        if let Some(mut frame) = to_helper.pop_front() {
            if let Some((_, how)) = change.filter(|&(n, _)| n == from_host) {
                how.apply(&mut frame);
            }
            from_host += 1;
            step(
                &mut helper,
                |r| r.read(&frame, gate),
                &mut to_host,
                &mut helped,
            );
        } else if let Some(frame) = to_host.pop_front() {
            step(&mut host, |i| i.read(&frame), &mut to_helper, &mut hosted);
        } else {
            break;
        }
    }
    let silent = || Refusal::from(LinkError::Closed("the peer went quiet".into()));
    (
        hosted.unwrap_or_else(|| Err(silent())),
        helped.unwrap_or_else(|| Err(silent())),
    )
}

proptest! {
    #![proptest_config(cases(256))]

    /// Anything at all, first frame and later ones, fed straight to the helper's sans-IO
    /// core: it never panics and never lets a stranger in (a plain hello at a helper run
    /// `--insecure` is the one way in); what it answers is handshake frames, or a refusal whose
    /// `REFUSE` frame carries the reason it reports.
    #[test]
    fn the_sans_io_responder_lets_no_stranger_in(
        first in first_frame(),
        later in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..128), 0..3),
        insecure in any::<bool>(),
    ) {
        let (code, _) = leaked_code();
        let gate = Gate { insecure, known: &any_host, pairing: Pairing::Open(code) };
        let plain = insecure && first.len() >= 3 && first[..3] == [HANDSHAKE, 1, 0];
        let mut frames = vec![first];
        frames.extend(later.into_iter().map(|mut f| {
            f.insert(0, HANDSHAKE);
            f
        }));
        let mut responder = Responder::new(&helper_keys());
        for frame in frames {
            match responder.read(&frame, &gate) {
                Ok(Progress::Wait { send, then }) => {
                    prop_assert!(send.iter().all(|f| f.first() == Some(&HANDSHAKE)));
                    responder = then;
                }
                Ok(Progress::Done { who, .. }) => {
                    prop_assert!(plain && who == Accepted::Insecure, "let in: {:?}", who);
                    return Ok(());
                }
                Err(r) => {
                    prop_assert!(!plain, "the plain hello was refused: {}", r.error);
                    let (last, before) = match r.send.split_last() {
                        Some((last, before)) => (Some(last), before),
                        None => (None, &[][..]),
                    };
                    prop_assert!(before.iter().all(|f| f.first() == Some(&HANDSHAKE)));
                    if let Some(last) = last {
                        prop_assert_eq!(last[0], REFUSE);
                        let why = String::from_utf8_lossy(&last[1..]);
                        prop_assert!(
                            matches!(&r.error, LinkError::Refused(e) if *e == why),
                            "{:?} / {}", r.error, why
                        );
                    }
                    return Ok(());
                }
            }
        }
        // Still waiting, as for a real host's next message: a driver's timeout ends that.
        prop_assert!(!plain);
    }

    /// A real host's handshake frame changed on the way (the first or, pairing, a later one)
    /// between the two sans-IO cores: both sides fail, the helper letting nobody in.
    #[test]
    fn the_sans_io_cores_refuse_a_changed_handshake_frame(
        pairing in any::<bool>(),
        step in 0..3usize,
        how in mutation(),
    ) {
        let (code, shown) = leaked_code();
        let gate = open_gate(Some(code));
        let (dial, n) = if pairing {
            (Dial::Pair(shown), step)
        } else {
            (Dial::Known(helper_keys().public), 0)
        };
        let (host, helper) = sans_io_meet(dial, &gate, Some((n, &how)));
        prop_assert!(helper.is_err(), "the helper let the host in: {:?}", helper.map(|_| ()));
        prop_assert!(host.is_err(), "the host believes it got in");
    }

    /// A stranger's frames, first and later ones: refused, with nothing but handshake frames
    /// and refusals sent back.
    #[test]
    fn random_frames_are_refused(
        first in first_frame(),
        later in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..128), 0..3),
    ) {
        let (code, _) = leaked_code();
        let mut frames = vec![first];
        frames.extend(later.into_iter().map(|mut f| {
            f.insert(0, HANDSHAKE);
            f
        }));
        let (res, sent) = accept_script(frames, &open_gate(Some(code)));
        prop_assert!(res.is_err(), "a stranger got in: {:?}", res);
        for f in &sent {
            prop_assert!(matches!(f.first(), Some(&HANDSHAKE | &REFUSE)), "sent {:?}", f);
        }
    }

    /// A helper run `--insecure` takes exactly the plain hello, and refuses everything else.
    #[test]
    fn an_insecure_helper_takes_only_the_plain_hello(first in first_frame()) {
        let gate = Gate { insecure: true, known: &any_host, pairing: Pairing::closed() };
        let plain = first.len() >= 3 && first[..3] == [HANDSHAKE, 1, 0];
        let (res, _) = accept_script(vec![first], &gate);
        match res {
            Ok(who) => prop_assert!(plain && who == Accepted::Insecure),
            Err(e) => prop_assert!(!plain, "the plain hello was refused: {}", e),
        }
    }

    /// A real pairing whose `step`th host frame (the SPAKE2 hello, then the two Noise
    /// messages) is changed on the way: both sides fail.
    #[test]
    fn a_changed_pairing_frame_is_refused(step in 0..3usize, how in mutation()) {
        let (code, shown) = leaked_code();
        let (a, b) = pair();
        let m = Meddler { inner: a, sent: 0, n: step, how };
        both_refused(meet(m, Dial::Pair(shown), b, open_gate(Some(code))))?;
    }

    /// A known host's hello (the Noise_IK first message) changed on the way: both sides fail.
    #[test]
    fn a_changed_known_hello_is_refused(how in mutation()) {
        let (a, b) = pair();
        let m = Meddler { inner: a, sent: 0, n: 0, how };
        both_refused(meet(m, Dial::Known(helper_keys().public), b, open_gate(None)))?;
    }

    /// After a handshake, the `k`th data frame changed on the way ends the link: the frames
    /// before it arrive intact, it and every later read fail, and the host hears why.
    #[test]
    fn a_changed_data_frame_ends_the_link(
        k in 0..3usize,
        how in mutation(),
        frames in proptest::collection::vec(
            prop_oneof![1..64usize, 65_000..70_000usize].prop_map(|n| vec![0x5a; n]),
            3,
        ),
    ) {
        let (a, b) = pair();
        // Frame 0 is the host's hello.
        let m = Meddler { inner: a, sent: 0, n: 1 + k, how };
        let Some((host, helper)) = meet(m, Dial::Known(helper_keys().public), b, open_gate(None))
        else {
            return Err(TestCaseError::fail("the handshake hung"));
        };
        let (mut c, mut h) = (host.unwrap().0, helper.unwrap().0);
        for f in &frames {
            c.send(f.clone()).unwrap();
        }
        for f in &frames[..k] {
            prop_assert_eq!(&h.recv_timeout(WATCHDOG).unwrap(), &Some(f.clone()));
        }
        let err = h.recv_timeout(WATCHDOG);
        let len = |f: Option<Vec<u8>>| f.map(|f| f.len());
        prop_assert!(err.is_err(), "a changed frame was read: {:?}", err.map(len));
        prop_assert!(h.recv_timeout(Duration::from_millis(1)).is_err());
        // A frame that fails authentication is answered with a refusal; a frame that was
        // turned into a refusal is the host's own word.
        if let Err(LinkError::Io(_)) = err {
            prop_assert!(matches!(c.recv_timeout(WATCHDOG), Err(LinkError::Closed(_))));
        }
    }
}

/// The control for the changed frames above: unchanged, the two sans-IO cores meet in every
/// mode.
#[test]
fn the_sans_io_cores_meet_in_memory() {
    let (code, shown) = leaked_code();
    let helper = helper_keys().public;
    let (host, who) = sans_io_meet(Dial::Pair(shown), &open_gate(Some(code)), None);
    assert_eq!(host.unwrap(), Some(helper));
    assert!(matches!(who.unwrap(), Accepted::Paired(_)));
    let (host, who) = sans_io_meet(Dial::Known(helper), &open_gate(None), None);
    assert_eq!(host.unwrap(), Some(helper));
    assert!(matches!(who.unwrap(), Accepted::Known(_)));
    let plain = Gate {
        insecure: true,
        known: &any_host,
        pairing: Pairing::closed(),
    };
    let (host, who) = sans_io_meet(Dial::Insecure, &plain, None);
    assert_eq!((host.unwrap(), who.unwrap()), (None, Accepted::Insecure));
}
