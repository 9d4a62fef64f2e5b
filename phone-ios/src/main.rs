//! `tether-helper`: serve this device's memory and compute to a tether host over WebSocket.

use anyhow::{bail, Context, Result};
use clap::Parser;
use engine_core::link::ws::WsListener;
use engine_core::remote::DEFAULT_MAX_FRAME;
use engine_core::source::{load_identity, load_layers, BackendOptions, SynthOptions};
use phone_ios::{Helper, HelperOptions, Weights};

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
    /// Memory for KV pages and the DeltaNet state of the layers a host assigns, in bytes
    /// (suffixes K, M, G allowed).
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
    let listener = WsListener::bind(&a.listen, max_frame)
        .with_context(|| format!("listening on {}", a.listen))?;
    // The first stdout line says where to connect (with --listen HOST:0 the port is chosen here).
    println!("tether-helper listening on ws://{}", listener.local_addr());
    eprintln!(
        "model {} (digest {}), KV budget {} bytes",
        identity.identity.name, identity.identity.digest, a.mem_budget
    );
    let (backend, what) = a.backend.make()?;
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
    loop {
        let mut link = match listener.accept() {
            Ok(l) => l,
            Err(e) => {
                eprintln!("a connection failed its handshake: {e}");
                continue;
            }
        };
        let peer = link.peer_addr();
        eprintln!("host {peer} connected");
        let end = helper.serve(&mut link);
        eprintln!("host {peer}: session ended ({end:?})");
        if a.once {
            return Ok(());
        }
    }
}
