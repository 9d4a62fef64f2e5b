//! `tether-helper`: serve this device's memory and compute to a tether host over WebSocket.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use engine_core::helper::{Helper, HelperOptions, Weights};
use engine_core::link::idle::IdleLink;
use engine_core::link::keys::{config_dir, short, KeyStore, Keypair, PairingCode, PublicKey};
use engine_core::link::secure::{self, wire_limit, Accepted, Gate};
use engine_core::link::ws::{Pending, WsListener};
use engine_core::link::{Link, LinkProfile, ShapedLink};
use engine_core::protocol::{encode, Message};
use engine_core::remote::DEFAULT_MAX_FRAME;
use engine_core::source::{load_identity, load_layers, BackendOptions, SynthOptions};

#[derive(Parser)]
#[command(
    name = "tether-helper",
    version,
    about = "Lend this device's memory and compute to a tether host"
)]
struct Args {
    /// Address to listen on. Loopback by default: expose the helper to a network only on purpose.
    #[arg(long, default_value = "127.0.0.1:7341")]
    listen: String,
    /// The same checkpoint directory or preset as the host's.
    #[arg(long)]
    model: String,
    /// Memory for KV pages, the DeltaNet state of the layers a host assigns and the working
    /// memory of a prefill chunk while it runs, in bytes (suffixes K, M, G allowed).
    #[arg(long, default_value = "4G", value_parser = parse_bytes)]
    mem_budget: u64,
    /// Largest frame accepted, in bytes (suffixes allowed).
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME as u64, value_parser = parse_bytes)]
    max_frame: u64,
    #[arg(long)]
    threads: Option<usize>,
    /// Serve one host, then exit.
    #[arg(long)]
    once: bool,
    /// A plain link: no pairing, no encryption; any host that reaches the port may use this
    /// helper. For loopback tests and a cable you trust; hosts must say --insecure too.
    #[arg(long)]
    insecure: bool,
    /// Show a pairing code for a new host even though hosts are paired already (without it,
    /// a code is shown only while none is).
    #[arg(long)]
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
    synth: SynthOptions,
    #[command(flatten)]
    backend: BackendOptions,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("`{s}` is not a byte count (like 512M or 4G)"))
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> Result<()> {
    if let Some(n) = a.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    // Only the model's identity now; the layers a host assigns are built when it configures.
    let identity =
        load_identity(&a.model, &a.synth).with_context(|| format!("loading model {}", a.model))?;
    let load = |layers: std::ops::Range<usize>| {
        eprintln!("building layers {layers:?} of {}", a.model);
        load_layers(&a.model, &a.synth, layers, &identity.identity)
    };
    let max_frame = usize::try_from(a.max_frame).context("--max-frame")?;
    let listener = WsListener::bind(&a.listen, wire_limit(max_frame))
        .with_context(|| format!("listening on {}", a.listen))?
        .allow_browsers(!a.insecure);
    // Flags checked and keys read before the address is announced: a script that reads it may
    // connect at once.
    let doors = Doors::new(&a, &listener)?;
    let (backend, what) = a.backend.make()?;
    // The first stdout line says where to connect (with --listen HOST:0 the port is chosen here).
    say(&format!(
        "tether-helper listening on ws://{}",
        listener.local_addr()
    ));
    eprintln!(
        "model {} (digest {}), memory budget {} bytes",
        identity.identity.name, identity.identity.digest, a.mem_budget
    );
    eprintln!("backend: {what}");
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
    doors.announce();
    std::thread::scope(|scope| loop {
        let pending = match listener.next() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("accepting a connection failed: {e}");
                continue;
            }
        };
        if a.once {
            if doors.session(&helper, pending) {
                return Ok(());
            }
            continue;
        }
        // Each connection's handshakes on a thread of its own: a silent or slow peer holds
        // up nobody else.
        let (doors, helper) = (&doors, &helper);
        scope.spawn(move || doors.session(helper, pending));
    })
}

/// A line for whoever started the helper (a script reads the address and the code from
/// stdout); a closed stdout must not stop a helper, so write errors are ignored.
fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Who may come in, and who is in: the key store and pairing code of a secure helper, and
/// the host being served (one at a time; others are told so).
struct Doors {
    /// `None` with --insecure.
    store: Option<Mutex<KeyStore>>,
    /// This run's key pair: the store's, or a throwaway one for a plain link.
    keys: Keypair,
    code: Mutex<PairingCode>,
    /// Whether a new host may pair now.
    pairing: AtomicBool,
    pair_new: bool,
    serving: Mutex<Option<SocketAddr>>,
    /// Where hosts connect, for the pairing hint.
    addr: SocketAddr,
    /// How this helper's sending direction is shaped (--link).
    profile: LinkProfile,
    /// --idle-timeout, if any.
    idle: Option<Duration>,
}

impl Doors {
    fn new(a: &Args, listener: &WsListener) -> Result<Doors> {
        let profile = LinkProfile::preset(&a.link).with_context(|| {
            format!(
                "--link {}: known profiles are {}",
                a.link,
                LinkProfile::PRESETS.join(", ")
            )
        })?;
        let store = if a.insecure {
            eprintln!(
                "WARNING: --insecure: this helper takes plain, unauthenticated links; anyone who \
                 reaches {} can use it and read what crosses the link",
                listener.local_addr()
            );
            None
        } else {
            let dir = config_dir()?;
            Some(
                KeyStore::open(&dir, "helper")
                    .with_context(|| format!("keys in {}", dir.display()))?,
            )
        };
        let keys = store
            .as_ref()
            .map_or_else(Keypair::generate, |s| s.keypair().clone());
        let pairing = store.as_ref().is_some_and(|s| s.is_empty() || a.pair_new);
        let doors = Doors {
            store: store.map(Mutex::new),
            keys,
            code: Mutex::new(PairingCode::new()),
            pairing: AtomicBool::new(pairing),
            pair_new: a.pair_new,
            serving: Mutex::new(None),
            addr: listener.local_addr(),
            profile,
            idle: (a.idle_timeout > 0).then(|| Duration::from_secs(a.idle_timeout)),
        };
        Ok(doors)
    }

    /// After the address line: the pairing code, if new hosts may pair.
    fn announce(&self) {
        if self.pairing.load(Ordering::SeqCst) {
            self.show_code();
        } else if self.store.is_some() {
            eprintln!("paired hosts only (--pair-new to pair another)");
        }
    }

    fn code_now(&self) -> String {
        self.code.lock().unwrap_or_else(|e| e.into_inner()).shown()
    }

    fn show_code(&self) {
        let code = self.code_now();
        say(&format!("pairing code: {code}"));
        eprintln!(
            "on the host: tether run --helper ws://{} --pair {code} ...",
            self.addr
        );
    }

    /// One connection, from its WebSocket upgrade to the end of its session; true if a host
    /// was served.
    fn session(&self, helper: &Helper, pending: Pending) -> bool {
        let peer = pending.peer_addr();
        let mut link = match pending.upgrade().and_then(|ws| self.let_in(ws, peer)) {
            Ok(link) => {
                let link: Box<dyn Link> = match self.idle {
                    Some(idle) => Box::new(IdleLink::new(link, idle)),
                    None => Box::new(link),
                };
                ShapedLink::new(link, self.profile.clone())
            }
            Err(e) => {
                eprintln!("{peer}: {e}");
                return false;
            }
        };
        {
            let mut serving = self.serving.lock().unwrap_or_else(|e| e.into_inner());
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
        let end = helper.serve(&mut link);
        eprintln!("host {peer}: session ended ({end:?})");
        *self.serving.lock().unwrap_or_else(|e| e.into_inner()) = None;
        true
    }

    /// The secure handshake; remembers a host that pairs.
    fn let_in<L: Link>(
        &self,
        ws: L,
        peer: SocketAddr,
    ) -> Result<secure::SecureLink<L>, engine_core::link::LinkError> {
        let known = |k: &PublicKey| {
            self.store
                .as_ref()
                .is_some_and(|s| s.lock().unwrap_or_else(|e| e.into_inner()).knows(k))
        };
        let gate = Gate {
            insecure: self.store.is_none(),
            known: &known,
            pairing: self.pairing.load(Ordering::SeqCst).then_some(&self.code),
        };
        let shown = self.code_now();
        let result = secure::accept(ws, &self.keys, &gate);
        // Wrong codes may have drawn a new one: show it.
        if result.is_err() && self.code_now() != shown {
            self.show_code();
        }
        let (link, who) = result?;
        if let (Accepted::Paired(key), Some(store)) = (who, &self.store) {
            let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
            store.add(&peer.to_string(), &key)?;
            eprintln!("paired with host {peer} (key {})", short(&key));
            if !self.pair_new {
                self.pairing.store(false, Ordering::SeqCst);
            }
        }
        Ok(link)
    }
}
