//! `--accept-helpers ADDR`: helpers that dial this host (`tether-helper --join`, a browser tab)
//! instead of waiting to be dialed, for helpers that cannot be reached (a phone or a tab
//! behind NAT). Only who opens the socket changes: the host still sends Hello and configures
//! the helper, over the same paired, encrypted link, with this host as the side that lets
//! peers in (its key store and pairing code).

use std::net::SocketAddr;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use engine_core::link::admission::{Admission, Ticket};
use engine_core::link::doors::Doors;
use engine_core::link::keys::MAX_WRONG;
use engine_core::link::secure::wire_limit;
use engine_core::link::ws::{Asks, PageOrigin, Pending, WsLink, WsListener, LISTENER_LIMITS};
use engine_core::link::{Link, LinkError};
use engine_core::protocol::{encode, Message};

use crate::lend::{Lender, LentSlot};

/// Helpers let in but not yet taken by a session, at most: a helper past them is told the
/// host is busy.
const WAITING: usize = 4;

/// The doors helpers come in by and the helpers let in, waiting to be taken.
pub struct Acceptor {
    doors: Arc<Doors>,
    /// The page and weights for browser tabs, answered on the same port.
    lender: Arc<Lender>,
    /// Where helpers dial, for messages.
    addr: String,
    tx: SyncSender<Joined>,
    joined: Mutex<Receiver<Joined>>,
    /// Connections not yet let in, from this host's own port and from `tether serve`'s
    /// /helper alike (each holds a thread until its handshake ends): bounded per source and
    /// in all, timed as a whole (engine_core::link::admission).
    handshakes: Admission,
}

/// A helper let in, with where it dialed from.
type Joined = (Box<dyn Link>, String);

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Acceptor({})", self.addr)
    }
}

impl Acceptor {
    /// Listen on `addr` and let helpers in from now on (each connection's handshakes on a
    /// thread of its own, so a silent peer holds up nobody); says on stderr how helpers join.
    pub fn start(
        addr: &str,
        max_frame: usize,
        insecure: bool,
        pair_new: bool,
        lent: LentSlot,
    ) -> Result<Acceptor> {
        let bound = WsListener::bind(addr, wire_limit(max_frame))
            .with_context(|| format!("--accept-helpers {addr}"))?;
        let local = format!("ws://{}", bound.local_addr());
        let acceptor = Acceptor::new(&local, insecure, pair_new, lent)?;
        let listener = bound
            .admitting(acceptor.handshakes.clone())
            // A browser tab is a helper too; its links are paired like any other.
            .allow_browsers(!insecure);
        let (doors, tx, shown) = (acceptor.doors.clone(), acceptor.tx.clone(), local.clone());
        let lender = acceptor.lender.clone();
        std::thread::Builder::new()
            .name("accept-helpers".into())
            .spawn(move || loop {
                match listener.next() {
                    Ok(pending) => {
                        let (doors, tx, shown) = (doors.clone(), tx.clone(), shown.clone());
                        let lender = lender.clone();
                        let peer = pending.peer_addr();
                        let _ = std::thread::Builder::new()
                            .name("helper-handshake".into())
                            .spawn(move || {
                                if let Some((ws, ticket)) = upgrade_or_answer(pending, &lender) {
                                    let origin = ws
                                        .as_ref()
                                        .map_or(PageOrigin::NotAPage, |ws| ws.origin().clone());
                                    let_in(&doors, ws, peer, &origin, &shown, &tx);
                                    drop(ticket);
                                }
                            });
                    }
                    Err(e) => {
                        // Out of file descriptors: do not spin.
                        eprintln!("accepting a helper failed: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
            .context("starting the accept thread")?;
        Ok(acceptor)
    }

    /// Doors for helpers that dial `addr` (a URL, for messages), with no socket of their own:
    /// links come through [`Self::offer`] (`tether serve`'s `/helper`).
    pub fn new(addr: &str, insecure: bool, pair_new: bool, lent: LentSlot) -> Result<Acceptor> {
        let doors = Arc::new(Doors::open("host", insecure, pair_new).context("this host's keys")?);
        let lender = Arc::new(Lender {
            doors: doors.clone(),
            lent,
        });
        let flag = if insecure { " --insecure" } else { "" };
        eprintln!("accepting helpers on {addr}");
        match doors.pairing_code() {
            Some(code) => {
                show_code(addr, &code);
                let shown = addr.to_string();
                Doors::new_codes_on_enter(&doors, move |code| show_code(&shown, code));
            }
            None if insecure => eprintln!(
                "WARNING: --insecure: any helper that reaches {addr} is taken, and can read \
                 what crosses the link; helpers join with: tether-helper --join {addr}{flag}"
            ),
            None => eprintln!("paired helpers only (--pair-new to pair another)"),
        }
        let (tx, rx) = mpsc::sync_channel(WAITING);
        Ok(Acceptor {
            doors,
            lender,
            addr: addr.to_string(),
            tx,
            joined: Mutex::new(rx),
            handshakes: Admission::new(LISTENER_LIMITS),
        })
    }

    /// A connection from `peer` that reached this host some other way (a WebSocket upgraded
    /// by the HTTP server): admitted as this host's own connections are (`close` closes it if
    /// it is pushed out or overstays), then its secure handshake runs on a thread of its own.
    /// Without room (every place busy) the link is dropped, which closes it.
    pub fn offer(
        &self,
        link: impl Link + 'static,
        peer: SocketAddr,
        origin: PageOrigin,
        close: impl FnOnce() + Send + 'static,
    ) {
        let Some(ticket) = self.handshakes.admit(peer.ip(), close) else {
            return;
        };
        let (doors, tx, addr) = (self.doors.clone(), self.tx.clone(), self.addr.clone());
        let _ = std::thread::Builder::new()
            .name("helper-handshake".into())
            .spawn(move || {
                let_in(&doors, Ok(link), peer, &origin, &addr, &tx);
                drop(ticket);
            });
    }

    /// What browser tabs fetch over HTTP: the page and the weights.
    pub fn lender(&self) -> &Lender {
        &self.lender
    }

    /// The next helper that joins, waiting at most `wait`.
    pub fn next(&self, wait: Duration) -> Result<Box<dyn Link>> {
        let joined = self.joined.lock().unwrap_or_else(PoisonError::into_inner);
        match joined.recv_timeout(wait) {
            Ok((link, peer)) => {
                eprintln!("helper {peer} joined");
                Ok(link)
            }
            Err(RecvTimeoutError::Timeout) => bail!(
                "no helper joined {} within {} s (start one with tether-helper --join {})",
                self.addr,
                wait.as_secs(),
                self.addr
            ),
            Err(RecvTimeoutError::Disconnected) => bail!("the accept thread stopped"),
        }
    }
}

/// A connection's WebSocket with its admission ticket (held until the secure handshake ends),
/// or `None` once a plain request (the page, weights) is answered; a plain request is marked
/// busy meanwhile (a lent tensor, or a wait for the model to
/// load, outlasts a handshake's deadline).
fn upgrade_or_answer(
    mut pending: Pending,
    lender: &Lender,
) -> Option<(Result<WsLink, LinkError>, Option<Ticket>)> {
    match pending.asks() {
        Ok(Asks::Upgrade) => {
            let ticket = pending.take_ticket();
            Some((pending.upgrade(), ticket))
        }
        Ok(Asks::Plain { method, target }) => {
            let _busy = pending.busy();
            let a = lender.answer(&method, &target);
            if let Err(e) = pending.answer(a.status, &a.headers, &a.body) {
                eprintln!("{method} {target}: {e}");
            }
            None
        }
        Err(e) => Some((Err(e), None)),
    }
}

fn show_code(addr: &str, code: &str) {
    eprintln!("pairing code for new helpers: {code}");
    eprintln!("on the helper: tether-helper --join {addr} --pair {code} --model ...");
}

/// One connection's secure handshake (after its WebSocket upgrade, `ws`); a helper let in
/// waits for a session, or is told the host is busy.
fn let_in<L: Link + 'static>(
    doors: &Doors,
    ws: Result<L, LinkError>,
    peer: SocketAddr,
    origin: &PageOrigin,
    addr: &str,
    tx: &SyncSender<Joined>,
) {
    let paused = || {
        eprintln!(
            "pairing paused: {MAX_WRONG} wrong codes were tried; press Enter here for a new code \
             for {addr}"
        );
    };
    let link = ws.and_then(|ws| doors.let_in(ws, peer, origin, paused));
    match link {
        Ok(link) => match tx.try_send((Box::new(link), peer.to_string())) {
            Ok(()) => {}
            Err(
                TrySendError::Full((mut link, peer)) | TrySendError::Disconnected((mut link, peer)),
            ) => {
                let why = "this host has as many helpers waiting as it takes; try again later";
                eprintln!("helper {peer}: refused: {why}");
                let _ = link.send(encode(0, &Message::error("busy", why.to_string())));
            }
        },
        Err(e) => eprintln!("helper {peer}: {e}"),
    }
}
