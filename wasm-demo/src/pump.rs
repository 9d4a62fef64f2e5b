//! The tab's side of a link to its host, without I/O: the secure handshake as the side that
//! dials (the Noise initiator), then the host's frames opened, served by the helper runtime one
//! at a time and in order, and the replies sealed. What happens on the socket and the timer
//! arrives as [`Incoming`] on a channel and frames leave through a callback, so the browser
//! driver (tab.rs: a `WebSocket` and `setInterval`) and the native tests feed the same code.
//!
//! A browser has no `Instant`, so time is counted in timer ticks: a keep-alive goes out on
//! every tick (the host's link drops a peer it has not heard from for [`SILENCE`], and sends
//! its own keep-alives every sixth of it), and a host unheard for more than [`SILENCE`] worth of
//! ticks is taken as lost, as a native helper's link would.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use engine_core::helper::{Session, SessionEnd};
use engine_core::link::keys::{Keypair, PublicKey};
use engine_core::link::secure::{
    self, Dial, Initiator, Progress, Refusal, HANDSHAKE_TIMEOUT, SILENCE,
};
use engine_core::link::LinkError;
use futures_channel::mpsc::UnboundedReceiver;
use futures_util::future::{select, Either};
use futures_util::StreamExt;

/// The timer's period: the keep-alive period of the native link (a sixth of [`SILENCE`]).
pub const TICK: Duration = Duration::from_secs(SILENCE.as_secs() / 6);

/// Something that happened on the socket or the timer, in the order it happened.
#[derive(Debug)]
pub enum Incoming {
    /// A frame from the host, as it came off the socket.
    Frame(Vec<u8>),
    /// The timer ticked (every [`TICK`]).
    Tick,
    /// The socket closed or failed, and why.
    Closed(String),
}

/// Ticks without a frame from the host past which it is taken as lost: at least `wait`.
fn ticks(wait: Duration) -> u32 {
    wait.as_secs().div_ceil(TICK.as_secs()) as u32
}

/// Sends one frame on the socket; fails once the socket is gone.
pub type Send = Box<dyn FnMut(&[u8]) -> Result<(), String>>;

/// One socket and its timer, as the pump sees them.
pub struct Wire {
    incoming: UnboundedReceiver<Incoming>,
    send: Send,
}

impl Wire {
    pub fn new(incoming: UnboundedReceiver<Incoming>, send: Send) -> Wire {
        Wire { incoming, send }
    }

    async fn next(&mut self) -> Incoming {
        self.incoming
            .next()
            .await
            .unwrap_or_else(|| Incoming::Closed("the socket's events stopped".into()))
    }

    fn send(&mut self, frame: &[u8]) -> Result<(), LinkError> {
        (self.send)(frame).map_err(LinkError::Closed)
    }

    /// Sends what a refusal owes the peer, best effort (it may be gone), and returns the error.
    fn refuse(&mut self, refusal: Refusal) -> LinkError {
        for frame in refusal.send {
            let _ = self.send(&frame);
        }
        refusal.error
    }
}

/// Dials `how` over `wire` (a socket just opened): the secure session, and the host's static
/// key (`None` on a plain link). The host has [`HANDSHAKE_TIMEOUT`] (counted in ticks) for
/// each answer.
pub async fn handshake(
    wire: &mut Wire,
    keys: &Keypair,
    how: Dial<'_>,
) -> Result<(secure::Session, Option<PublicKey>), LinkError> {
    let (hello, mut state) = Initiator::start(keys, how)?;
    wire.send(&hello)?;
    let mut quiet = 0;
    loop {
        let frame = match wire.next().await {
            Incoming::Frame(frame) => frame,
            Incoming::Tick => {
                quiet += 1;
                if quiet > ticks(HANDSHAKE_TIMEOUT) {
                    return Err(state.timed_out(HANDSHAKE_TIMEOUT));
                }
                continue;
            }
            Incoming::Closed(why) => return Err(LinkError::Closed(why)),
        };
        quiet = 0;
        match state.read(&frame) {
            Ok(Progress::Wait { send, then }) => {
                for frame in send {
                    wire.send(&frame)?;
                }
                state = then;
            }
            Ok(Progress::Done { send, session, who }) => {
                for frame in send {
                    wire.send(&frame)?;
                }
                return Ok((session, who));
            }
            Err(refusal) => return Err(wire.refuse(refusal)),
        }
    }
}

/// Serves the host over `link` until it says Bye, breaks the protocol, goes silent or the
/// socket closes. Each frame is answered before the next is handled, as the host expects;
/// `served` is called after each of the host's frames is handled (for the page's counters).
pub async fn serve(
    wire: &mut Wire,
    link: &mut secure::Session,
    session: &mut Session<'_, '_>,
    mut served: impl FnMut(&Session<'_, '_>),
) -> SessionEnd {
    let mut quiet = 0;
    // What arrived while a frame was being handled, in order.
    let mut early = VecDeque::new();
    loop {
        let next = match early.pop_front() {
            Some(next) => next,
            None => wire.next().await,
        };
        let frame = match next {
            Incoming::Frame(frame) => frame,
            Incoming::Tick => {
                quiet += 1;
                if quiet > ticks(SILENCE) {
                    return SessionEnd::Closed(format!(
                        "nothing from the host for {SILENCE:?}: taken as lost"
                    ));
                }
                if let Err(e) = keepalive(link, wire) {
                    return SessionEnd::Closed(e.to_string());
                }
                continue;
            }
            Incoming::Closed(why) => return SessionEnd::Closed(why),
        };
        quiet = 0;
        let frame = match link.open(frame) {
            // A keep-alive.
            Ok(frame) if frame.is_empty() => continue,
            Ok(frame) => frame,
            Err(refusal) => return SessionEnd::Closed(wire.refuse(refusal).to_string()),
        };
        let work = session.on_frame(&frame);
        let step = match alive_while(work, wire, &mut early, |w| keepalive(link, w)).await {
            Ok(step) => step,
            Err(e) => return SessionEnd::Closed(e.to_string()),
        };
        if let Some(reply) = step.reply {
            if let Err(e) = link.seal(reply).and_then(|f| wire.send(&f)) {
                return step
                    .end
                    .unwrap_or(SessionEnd::Closed(format!("while replying: {e}")));
            }
        }
        served(session);
        if let Some(end) = step.end {
            return end;
        }
    }
}

fn keepalive(link: &mut secure::Session, wire: &mut Wire) -> Result<(), LinkError> {
    link.seal(Vec::new()).and_then(|f| wire.send(&f))
}

/// Waits for `work` (a frame being handled) while the link stays alive: each tick still
/// sends a keep-alive, since a tab fetching the weights of the layers it is assigned may take
/// longer than the host waits for a silent peer; whatever else arrives meanwhile waits in
/// `early`, in order.
async fn alive_while<T>(
    work: impl Future<Output = T>,
    wire: &mut Wire,
    early: &mut VecDeque<Incoming>,
    mut keepalive: impl FnMut(&mut Wire) -> Result<(), LinkError>,
) -> Result<T, LinkError> {
    let mut work = pin!(work);
    loop {
        // Taking the next event is cancel-safe: if `work` finishes first, nothing is lost.
        let event = match select(work.as_mut(), pin!(wire.next())).await {
            Either::Left((done, _)) => return Ok(done),
            Either::Right((event, _)) => event,
        };
        match event {
            Incoming::Tick => keepalive(wire)?,
            other => early.push_back(other),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The pump against a scripted host: the host's side of the handshake (a `Responder`
    //! behind the gate a host that accepts helpers uses) and a few protocol frames, run in the
    //! send callback, so the whole exchange happens on one thread as it does in a tab.

    use std::cell::RefCell;
    use std::rc::Rc;
    use std::sync::Mutex;

    use engine_core::helper::{Helper, HelperOptions};
    use engine_core::link::keys::PairingCode;
    use engine_core::link::secure::{Gate, Pairing, Responder};
    use engine_core::protocol::{decode, encode, Message};
    use engine_core::source::LoadOptions;
    use engine_core::{CpuBackend, Model};
    use futures_channel::mpsc::{unbounded, UnboundedSender};

    use super::*;

    const MAX_FRAME: usize = 1 << 20;

    /// What the scripted host saw from the tab.
    #[derive(Default)]
    struct Seen {
        keepalives: usize,
        replies: Vec<Message>,
    }

    /// The host's state: handshaking, then a session.
    enum Host {
        Handshake(Option<Responder>),
        Session(secure::Session),
    }

    fn tiny() -> Model {
        let o = LoadOptions::default();
        let (config, tensors) = o.tensors("tiny").unwrap();
        let identity = o.identity("tiny", &config).unwrap();
        Model::with_identity(config, &tensors, identity).unwrap()
    }

    /// A wire to a host that pairs with `code`, then sends `script` once the tab is in and
    /// `answers` after the tab's first reply. Returns the wire and what the host saw.
    fn host(
        code: &'static Mutex<PairingCode>,
        script: Vec<Incoming>,
        answers: Vec<Message>,
    ) -> (Wire, Rc<RefCell<Seen>>) {
        let (tx, rx) = unbounded();
        let seen = Rc::new(RefCell::new(Seen::default()));
        let keys = Keypair::generate();
        let mut state = Host::Handshake(Some(Responder::new(&keys)));
        let (mut script, mut answers) = (Some(script), Some(answers));
        let saw = seen.clone();
        let push = move |tx: &UnboundedSender<Incoming>, what| {
            tx.unbounded_send(what).map_err(|e| e.to_string())
        };
        let send: Send = Box::new(move |frame: &[u8]| match &mut state {
            Host::Handshake(responder) => {
                let gate = Gate {
                    insecure: false,
                    known: &|_| false,
                    pairing: Pairing::Open(code),
                };
                match responder.take().unwrap().read(frame, &gate) {
                    Ok(Progress::Wait { send, then }) => {
                        *responder = Some(then);
                        send.into_iter()
                            .try_for_each(|f| push(&tx, Incoming::Frame(f)))
                    }
                    Ok(Progress::Done {
                        send, mut session, ..
                    }) => {
                        for f in send {
                            push(&tx, Incoming::Frame(f))?;
                        }
                        for what in script.take().unwrap() {
                            let what = match what {
                                Incoming::Frame(f) => Incoming::Frame(session.seal(f).unwrap()),
                                other => other,
                            };
                            push(&tx, what)?;
                        }
                        state = Host::Session(session);
                        Ok(())
                    }
                    Err(refusal) => {
                        for f in refusal.send {
                            push(&tx, Incoming::Frame(f))?;
                        }
                        push(&tx, Incoming::Closed(refusal.error.to_string()))
                    }
                }
            }
            Host::Session(session) => {
                let frame = session
                    .open(frame.to_vec())
                    .map_err(|r| r.error.to_string())?;
                let mut seen = saw.borrow_mut();
                if frame.is_empty() {
                    seen.keepalives += 1;
                    return Ok(());
                }
                seen.replies.push(decode(&frame, MAX_FRAME).unwrap().1);
                for msg in answers.take().unwrap_or_default() {
                    push(&tx, Incoming::Frame(session.seal(encode(2, &msg)).unwrap()))?;
                }
                Ok(())
            }
        });
        (Wire::new(rx, send), seen)
    }

    fn code() -> &'static Mutex<PairingCode> {
        Box::leak(Box::new(Mutex::new(PairingCode::new())))
    }

    fn helper_opts() -> HelperOptions {
        HelperOptions {
            mem_budget: 1 << 26,
            max_frame: MAX_FRAME,
        }
    }

    #[test]
    fn pairs_serves_in_order_keeps_alive_and_ends_on_bye() {
        let model = tiny();
        let code = code();
        let shown = code.lock().unwrap().shown();
        let ping = Message::Ping { nonce: 7 };
        let bye = Message::Bye {
            reason: "done".into(),
        };
        let script = vec![
            // The host's keep-alive is not answered; the tab's own go out on its ticks.
            Incoming::Frame(Vec::new()),
            Incoming::Frame(encode(
                1,
                &engine_core::host::remote::hello(&model, MAX_FRAME),
            )),
            Incoming::Tick,
            Incoming::Tick,
        ];
        let (mut wire, seen) = host(code, script, vec![ping, bye]);
        let keys = Keypair::generate();
        let (mut link, host_key) =
            pollster::block_on(handshake(&mut wire, &keys, Dial::Pair(&shown))).unwrap();
        assert!(host_key.is_some() && link.is_encrypted());

        let helper = Helper::new(&model, &CpuBackend, helper_opts());
        let mut session = helper.session();
        let mut served = 0;
        let end = pollster::block_on(serve(&mut wire, &mut link, &mut session, |_| served += 1));
        assert_eq!(end, SessionEnd::Bye);
        let seen = seen.borrow();
        assert_eq!(seen.keepalives, 2);
        assert!(matches!(
            seen.replies[..],
            [Message::Welcome(_), Message::Pong { nonce: 7 }]
        ));
        // Hello, Ping and Bye (which ends without a reply).
        assert_eq!(served, 3);
        assert_eq!(session.counters()["Ping"], 1);
    }

    #[test]
    fn a_wrong_code_is_refused_in_the_handshake() {
        let code = code();
        let (mut wire, _) = host(code, Vec::new(), Vec::new());
        let wrong = if code.lock().unwrap().shown() == "000-000" {
            "000-001"
        } else {
            "000-000"
        };
        let err = pollster::block_on(handshake(
            &mut wire,
            &Keypair::generate(),
            Dial::Pair(wrong),
        ))
        .err()
        .unwrap();
        assert!(
            matches!(&err, LinkError::Refused(why) if why.contains("wrong pairing code")),
            "{err:?}"
        );
    }

    #[test]
    fn a_silent_host_is_taken_as_lost() {
        let model = tiny();
        let code = code();
        let shown = code.lock().unwrap().shown();
        let silence = (0..=ticks(SILENCE)).map(|_| Incoming::Tick).collect();
        let (mut wire, seen) = host(code, silence, Vec::new());
        let keys = Keypair::generate();
        let (mut link, _) =
            pollster::block_on(handshake(&mut wire, &keys, Dial::Pair(&shown))).unwrap();
        let helper = Helper::new(&model, &CpuBackend, helper_opts());
        let mut session = helper.session();
        let end = pollster::block_on(serve(&mut wire, &mut link, &mut session, |_| {}));
        assert!(
            matches!(&end, SessionEnd::Closed(why) if why.contains("taken as lost")),
            "{end:?}"
        );
        assert_eq!(seen.borrow().keepalives, ticks(SILENCE) as usize);
    }

    /// Work that outlasts several ticks (a tab fetching weights) keeps the link alive, and what
    /// arrives meanwhile is kept, in order, for after it.
    #[test]
    fn long_work_sends_keepalives_and_keeps_what_arrives() {
        let (tx, rx) = unbounded();
        let sent = Rc::new(RefCell::new(0usize));
        let counted = sent.clone();
        let mut wire = Wire::new(
            rx,
            Box::new(move |_: &[u8]| {
                *counted.borrow_mut() += 1;
                Ok(())
            }),
        );
        for what in [
            Incoming::Tick,
            Incoming::Frame(vec![1]),
            Incoming::Tick,
            Incoming::Frame(vec![2]),
        ] {
            tx.unbounded_send(what).unwrap();
        }
        // Done once two keep-alives went out and both frames arrived.
        let (sent_now, mut early) = (sent.clone(), VecDeque::new());
        let work = std::future::poll_fn(|_| match *sent_now.borrow() {
            2 => std::task::Poll::Ready("done"),
            _ => std::task::Poll::Pending,
        });
        let done = pollster::block_on(alive_while(work, &mut wire, &mut early, |w| w.send(&[])));
        assert_eq!(done.unwrap(), "done");
        assert_eq!(*sent.borrow(), 2);
        let frames: Vec<_> = early
            .iter()
            .map(|e| match e {
                Incoming::Frame(f) => f[0],
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(frames, [1], "the second frame is still on the wire");
    }
}
