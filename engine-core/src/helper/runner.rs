//! Serve this device's helper over the network: listen for hosts or join one (`--join`),
//! paired and encrypted, one host at a time, with an idle timeout and link shaping, reporting
//! to a [`Control`] (status, stop). The `tether-helper` binary (host-native) parses
//! [`Options`] from its command line and calls [`run`]; the iOS library (phone-ios) runs
//! [`run_with`] on a thread of its own. Native only, with the `runner` feature.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::helper::{Helper, HelperOptions, Loading, SessionEnd, Weights};
use crate::host::remote::DEFAULT_MAX_FRAME;
use crate::link::doors::{self, DialOptions, Doors};
use crate::link::idle::IdleLink;
use crate::link::secure::wire_limit;
use crate::link::ws::{Pending, WsLink, WsListener};
use crate::link::{Link, LinkError, LinkProfile, LinkSender, ShapedLink, StatsHandle};
use crate::protocol::{encode, Message};
use crate::source::{load_identity, load_layers, BackendOptions, LoadOptions};
use anyhow::{bail, Context, Result};
use serde::Serialize;

/// How often a session waiting for its host's next frame looks whether the helper was stopped.
const STOP_POLL: Duration = Duration::from_millis(200);

/// What a helper serves, and how: `tether-helper`'s flags.
#[derive(clap::Args)]
pub struct Options {
    /// Address to listen on. Loopback by default: expose the helper to a network only on purpose.
    #[arg(long, default_value = "127.0.0.1:7341")]
    listen: String,
    /// Dial a host that accepts helpers (`tether run|serve --accept-helpers`) instead of
    /// listening: ws://HOST:PORT. For a helper that cannot be reached (behind NAT); it dials
    /// again when a session ends or the host goes away.
    #[arg(long, value_name = "URL", conflicts_with = "listen")]
    join: Option<String>,
    /// With --join: the pairing code the host shows, the first time (its key is remembered).
    #[arg(long, requires = "join")]
    pair: Option<String>,
    /// The same checkpoint directory or preset as the host's.
    #[arg(long)]
    model: String,
    /// Memory for KV pages, the DeltaNet state of the layers a host assigns and the working
    /// memory of a prefill chunk while it runs, in bytes (suffixes K, M, G allowed).
    #[arg(long, default_value = "4G", value_parser = crate::host::plan::parse_size)]
    mem_budget: u64,
    /// Largest frame accepted, in bytes (suffixes allowed).
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME as u64, value_parser = crate::host::plan::parse_size)]
    max_frame: u64,
    /// Serve one host, then exit.
    #[arg(long)]
    once: bool,
    /// A plain link: no pairing, no encryption; any host that reaches the port may use this
    /// helper. For loopback tests and a cable you trust; hosts must say --insecure too.
    #[arg(long)]
    insecure: bool,
    /// Show a pairing code for a new host even though hosts are paired already (without it,
    /// a code is shown only while none is).
    #[arg(long, conflicts_with = "join")]
    pair_new: bool,
    /// Shape what this helper sends like a real link (usb-c-10g, usb2, wifi) or leave it
    /// (unlimited), as the host's --link shapes what it sends: both for both directions.
    #[arg(long, default_value = "unlimited")]
    link: String,
    /// End a host's session after this many seconds without a request (keep-alives do not
    /// count), so a connected but idle host does not hold this helper from others; 0: never.
    /// A host that needs the helper again reconnects (and re-fills it from its page file).
    #[arg(long, default_value_t = 900, value_name = "SECS")]
    idle_timeout: u64,
    #[command(flatten)]
    synth: LoadOptions,
    #[command(flatten)]
    backend: BackendOptions,
}

/// Serve hosts as `a` says until a refusal ends it, or with `--once` one session.
pub fn run(a: Options) -> Result<()> {
    let control = Control {
        announce: true,
        ..Control::default()
    };
    run_with(a, &control)
}

/// [`run`], reporting to `control` and ending soon after [`Control::stop`] (the iOS library
/// runs it on a thread of its own).
pub fn run_with(a: Options, control: &Control) -> Result<()> {
    let ran = serve_hosts(&a, control);
    control.update(|s| {
        s.state = if ran.is_ok() { "stopped" } else { "failed" };
        s.error = ran.as_ref().err().map(|e| format!("{e:#}"));
    });
    ran
}

fn serve_hosts(a: &Options, control: &Control) -> Result<()> {
    control.update(|s| {
        s.state = "starting";
        s.mem_budget = a.mem_budget;
    });
    // Only the model's identity now; the layers a host assigns are built when it configures.
    let identity =
        load_identity(&a.model, &a.synth).with_context(|| format!("loading model {}", a.model))?;
    let load = |layers: std::ops::Range<usize>| -> Loading<'_> {
        eprintln!("building layers {layers:?} of {}", a.model);
        let built = load_layers(&a.model, &a.synth, layers, &identity.identity);
        Box::pin(std::future::ready(built))
    };
    let max_frame = usize::try_from(a.max_frame).context("--max-frame")?;
    let session = SessionOptions::new(a, control)?;
    let (backend, what) = a.backend.make()?;
    let helper = Helper::with_weights(
        Weights::Assigned {
            identity: &identity,
            load: &load,
        },
        &*backend,
        HelperOptions {
            mem_budget: a.mem_budget,
            max_frame,
        },
    );
    let about = || {
        eprintln!(
            "model {} (digest {}), memory budget {} bytes",
            identity.identity.name, identity.identity.digest, a.mem_budget
        );
        eprintln!("backend: {what}");
    };
    match &a.join {
        Some(url) => {
            control.say(&format!("tether-helper joining {url}"));
            about();
            join(a, url, max_frame, &session, &helper)
        }
        None => {
            let listener = WsListener::bind(&a.listen, wire_limit(max_frame))
                .with_context(|| format!("listening on {}", a.listen))?
                .allow_browsers(!a.insecure);
            // Flags checked and keys read before the address is announced: a script that
            // reads it may connect at once.
            let doors = Listening::new(a, &listener, session)?;
            // The first stdout line says where to connect (with --listen HOST:0 the port is
            // chosen here).
            control.say(&format!(
                "tether-helper listening on ws://{}",
                listener.local_addr()
            ));
            about();
            doors.announce();
            control.listening(listener.local_addr(), doors.doors.pairing_code());
            *lock(&control.doors) = Some(doors.doors.clone());
            if control.announce {
                let hint = doors.addr;
                Doors::new_codes_on_enter(&doors.doors, move |code| {
                    println!("pairing code: {code}");
                    eprintln!("on the host: tether run --helper ws://{hint} --pair {code} ...");
                });
            }
            listen(a, &listener, &doors, &helper)
        }
    }
}

/// Serve the hosts that connect to `listener`, one at a time.
fn listen(a: &Options, listener: &WsListener, doors: &Listening, helper: &Helper) -> Result<()> {
    doors.session.control.wake_at(listener.local_addr());
    std::thread::scope(|scope| loop {
        let next = listener.next();
        if doors.session.control.stopped() {
            return Ok(());
        }
        let pending = match next {
            Ok(p) => p,
            Err(e) => {
                eprintln!("accepting a connection failed: {e}");
                continue;
            }
        };
        if a.once {
            if doors.session(helper, pending) {
                return Ok(());
            }
            continue;
        }
        // Each connection's handshakes on a thread of its own: a silent or slow peer holds
        // up nobody else.
        scope.spawn(move || doors.session(helper, pending));
    })
}

/// Dial the host at `url` and serve it; dial again (backing off up to 30 s) when the session
/// ends or the host cannot be reached, until a refusal (a wrong pairing code, a host that does
/// not know this helper) or, with --once, the first session's end.
fn join(
    a: &Options,
    url: &str,
    max_frame: usize,
    session: &SessionOptions,
    helper: &Helper,
) -> Result<()> {
    let dial = DialOptions {
        role: "helper",
        peer: "host",
        insecure: a.insecure,
        pair: a.pair.as_deref(),
        max_frame,
    };
    let mut wait = Duration::from_secs(1);
    let control = session.control;
    while !control.stopped() {
        control.update(|s| s.state = "joining");
        match doors::dial(url, &dial) {
            Ok(link) => {
                wait = Duration::from_secs(1);
                control.say(&format!("joined the host at {url}"));
                let end = session.serve(helper, link, url);
                eprintln!("host {url}: session ended ({end:?})");
                if a.once {
                    return Ok(());
                }
            }
            Err(LinkError::Refused(why)) => bail!("the host at {url} refused this helper: {why}"),
            Err(e) if a.once => bail!("joining the host at {url}: {e}"),
            Err(e) => eprintln!("joining the host at {url}: {e}; again in {wait:?}"),
        }
        control.sleep(wait);
        wait = (wait * 2).min(Duration::from_secs(30));
    }
    Ok(())
}

/// How a host's session runs on the link, however it was opened.
struct SessionOptions<'c> {
    /// How this helper's sending direction is shaped (--link).
    profile: LinkProfile,
    /// --idle-timeout, if any.
    idle: Option<Duration>,
    control: &'c Control,
}

impl<'c> SessionOptions<'c> {
    fn new(a: &Options, control: &'c Control) -> Result<SessionOptions<'c>> {
        let profile = LinkProfile::preset(&a.link).with_context(|| {
            format!(
                "--link {}: known profiles are {}",
                a.link,
                LinkProfile::PRESETS.join(", ")
            )
        })?;
        let idle = (a.idle_timeout > 0).then(|| Duration::from_secs(a.idle_timeout));
        Ok(SessionOptions {
            profile,
            idle,
            control,
        })
    }

    /// `link` with the stop, the idle timeout and the link shaping.
    fn wrap(&self, link: impl Link + 'static) -> ShapedLink<Box<dyn Link>> {
        let link = Stoppable {
            inner: link,
            stop: self.control.stop.clone(),
        };
        let link: Box<dyn Link> = match self.idle {
            Some(idle) => Box::new(IdleLink::new(link, idle)),
            None => Box::new(link),
        };
        ShapedLink::new(link, self.profile.clone())
    }

    /// Serve the host at `peer` on `link` to the session's end, reporting its work.
    fn serve(&self, helper: &Helper, link: impl Link + 'static, peer: &str) -> SessionEnd {
        let mut link = self.wrap(link);
        *lock(&self.control.link) = Some(link.stats_handle());
        self.control.update(|s| {
            s.state = "serving";
            s.host = Some(peer.to_string());
            s.sessions += 1;
        });
        let end = if self.control.announce {
            // A command-line helper's status has no reader: no counters taken per frame.
            helper.serve(&mut link)
        } else {
            helper.serve_watched(&mut link, &mut |session| {
                let counters = session.counters();
                self.control.update(|s| s.helper = counters);
            })
        };
        self.control.update(|s| {
            s.state = if s.address.is_some() {
                "listening"
            } else {
                "joining"
            };
            s.host = None;
        });
        end
    }
}

/// Who may come in, and who is in, on a listening helper: the doors of the secure link, and
/// the host being served (one at a time; others are told so).
struct Listening<'c> {
    doors: Arc<Doors>,
    serving: Mutex<Option<SocketAddr>>,
    /// Where hosts connect, for the pairing hint.
    addr: SocketAddr,
    session: SessionOptions<'c>,
}

impl<'c> Listening<'c> {
    fn new(a: &Options, listener: &WsListener, session: SessionOptions<'c>) -> Result<Self> {
        if a.insecure {
            eprintln!(
                "WARNING: --insecure: this helper takes plain, unauthenticated links; anyone who \
                 reaches {} can use it and read what crosses the link",
                listener.local_addr()
            );
        }
        let doors = Doors::open("helper", a.insecure, a.pair_new).context("this helper's keys")?;
        Ok(Listening {
            doors: Arc::new(doors),
            serving: Mutex::new(None),
            addr: listener.local_addr(),
            session,
        })
    }

    /// After the address line: the pairing code, if new hosts may pair.
    fn announce(&self) {
        if let Some(code) = self.doors.pairing_code() {
            self.show_code(&code);
        } else if !self.doors.is_insecure() {
            eprintln!("paired hosts only (--pair-new to pair another)");
        }
    }

    fn show_code(&self, code: &str) {
        self.session.control.say(&format!("pairing code: {code}"));
        self.session
            .control
            .update(|s| s.pairing_code = Some(code.to_string()));
        eprintln!(
            "on the host: tether run --helper ws://{} --pair {code} ...",
            self.addr
        );
    }

    /// Wrong codes paused pairing: say how to get a new code.
    fn paused(&self) {
        eprintln!(
            "pairing paused: {} wrong codes were tried; press Enter here for a new code",
            crate::link::keys::MAX_WRONG
        );
        self.session.control.update(|s| s.pairing_paused = true);
    }

    /// One connection, from its WebSocket upgrade to the end of its session; true if a host
    /// was served.
    fn session(&self, helper: &Helper, mut pending: Pending) -> bool {
        let peer = pending.peer_addr();
        // Bounded and timed until the host is let in (crate::link::admission).
        let ticket = pending.take_ticket();
        let let_in = |ws: WsLink| {
            let origin = ws.origin().clone();
            let paused = || self.paused();
            self.doors.let_in(ws.as_helper(), peer, &origin, paused)
        };
        let mut link = match pending.upgrade().and_then(let_in) {
            Ok(link) => link,
            Err(e) => {
                eprintln!("{peer}: {e}");
                return false;
            }
        };
        drop(ticket);
        {
            let mut serving = lock(&self.serving);
            if let Some(other) = *serving {
                let why = format!(
                    "this helper is serving another host ({other}); try again when it is done"
                );
                eprintln!("{peer}: refused: {why}");
                let _ = link.send(encode(0, &Message::error("busy", why)));
                return false;
            }
            *serving = Some(peer);
        }
        eprintln!("host {peer} connected");
        let end = self.session.serve(helper, link, &peer.to_string());
        eprintln!("host {peer}: session ended ({end:?})");
        *lock(&self.serving) = None;
        true
    }
}

/// What a running helper is doing, as the iOS library reports it (`tether_helper_status`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    /// `starting`, `listening`, `joining`, `serving`, `stopped` or `failed`.
    pub state: &'static str,
    /// Where hosts connect, when listening.
    pub address: Option<String>,
    /// The code a new host pairs with, when listening with pairing open.
    pub pairing_code: Option<String>,
    /// Wrong codes paused pairing: no code is taken until a new one is asked for
    /// ([`Control::new_code`]).
    pub pairing_paused: bool,
    /// The host being served.
    pub host: Option<String>,
    /// Host sessions so far.
    pub sessions: u64,
    /// The memory offered to a host, in bytes.
    pub mem_budget: u64,
    /// The session's counters (requests by type, `kv_pages`, `kv_bytes`, `held_bytes`, as a
    /// Stats request answers), after its last frame.
    pub helper: BTreeMap<String, u64>,
    /// Bytes sent and received on the last session's link, frames and headers included.
    pub link_sent_bytes: u64,
    pub link_received_bytes: u64,
    /// Why the helper stopped, if it failed.
    pub error: Option<String>,
}

/// Stops a helper from another thread and reads its [`Status`].
#[derive(Default)]
pub struct Control {
    /// Print the address, the pairing code and each join on stdout, where a script that
    /// started `tether-helper` reads them (a library's caller reads the status instead).
    announce: bool,
    stop: Arc<AtomicBool>,
    /// The last session's link counters, read when the status is.
    link: Mutex<Option<StatsHandle>>,
    /// The listening address to connect to, to wake a helper waiting for a host.
    wake: Mutex<Option<SocketAddr>>,
    /// A listening helper's doors, for [`Control::new_code`].
    doors: Mutex<Option<Arc<Doors>>>,
    status: Mutex<Status>,
}

impl Control {
    /// Ask the helper to stop: a waiting helper stops at once, a serving one within
    /// `STOP_POLL` of its host's next frame (the session ends as if the link closed).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let wake = *lock(&self.wake);
        if let Some(mut addr) = wake {
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            // The accept returns; the loop sees the flag. A failed connect means it is gone.
            let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        }
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// A new pairing code, asked for by the person at the device (the app's button): the old
    /// one stops working, and pairing resumes if wrong codes paused it. `None` unless
    /// listening with pairing open.
    pub fn new_code(&self) -> Option<String> {
        let code = lock(&self.doors).as_ref()?.new_code()?;
        self.update(|s| {
            s.pairing_code = Some(code.clone());
            s.pairing_paused = false;
        });
        Some(code)
    }

    pub fn status(&self) -> Status {
        let mut status = lock(&self.status).clone();
        if let Some(traffic) = lock(&self.link).as_ref().map(StatsHandle::snapshot) {
            status.link_sent_bytes = traffic.sent_total.bytes;
            status.link_received_bytes = traffic.received_total.bytes;
        }
        status
    }

    /// A line for whoever started the helper, when it announces; a closed stdout must not stop
    /// a helper, so write errors are ignored.
    fn say(&self, line: &str) {
        use std::io::Write;
        if self.announce {
            let mut out = std::io::stdout();
            let _ = writeln!(out, "{line}").and_then(|()| out.flush());
        }
    }

    /// Record that the helper ended with `why`.
    pub fn failed(&self, why: &str) {
        self.update(|s| {
            s.state = "failed";
            s.error = Some(why.to_string());
        });
    }

    fn update(&self, f: impl FnOnce(&mut Status)) {
        f(&mut lock(&self.status));
    }

    fn listening(&self, addr: SocketAddr, code: Option<String>) {
        self.update(|s| {
            s.state = "listening";
            s.address = Some(format!("ws://{addr}"));
            s.pairing_code = code;
        });
    }

    fn wake_at(&self, addr: SocketAddr) {
        *lock(&self.wake) = Some(addr);
    }

    /// Wait `d`, or less if the helper is stopped meanwhile.
    fn sleep(&self, d: Duration) {
        let until = Instant::now() + d;
        while !self.stopped() && Instant::now() < until {
            std::thread::sleep(STOP_POLL.min(until - Instant::now()));
        }
    }
}

/// A link that closes when its helper is stopped, checked while it waits for a frame.
struct Stoppable<L> {
    inner: L,
    stop: Arc<AtomicBool>,
}

impl<L: Link> Link for Stoppable<L> {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.inner.send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, LinkError> {
        loop {
            if let Some(frame) = self.recv_timeout(STOP_POLL)? {
                return Ok(frame);
            }
        }
    }

    fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>, LinkError> {
        let until = Instant::now() + timeout;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Err(LinkError::Closed("this helper was stopped".into()));
            }
            let left = until.saturating_duration_since(Instant::now());
            match self.inner.recv_timeout(left.min(STOP_POLL))? {
                Some(frame) => return Ok(Some(frame)),
                None if left <= STOP_POLL => return Ok(None),
                None => {}
            }
        }
    }

    fn sender(&self) -> Box<dyn LinkSender> {
        self.inner.sender()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
