//! Strangers cannot exhaust a helper or the server before proving who they are: with 2000
//! idle or half-open sockets held open against it (half raw TCP, half finished WebSocket
//! upgrades that never start the secure handshake), a helper still lets a real host pair and
//! talk, `tether serve` still answers a real HTTP client, and neither grows a thread or much
//! memory per socket (engine_core::link::admission). The latencies are printed; the bounds
//! asserted are loose (a lock-out lasted until the sockets timed out, 10 s and more).

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::link::keys::Keypair;
use engine_core::link::secure::{self, wire_limit, Dial};
use engine_core::link::ws;
use engine_core::link::Link;
use engine_core::protocol::{decode, encode, Message};
use tests::{fixtures_dir, spawn_announcing, spawn_announcing_lines};

/// Sockets held open against the process under test.
const SOCKETS: usize = 2000;

/// Memory a flooded process may hold (the goal for the tiny model's processes).
const MAX_RSS: u64 = 200 << 20;

/// Raises this process's open-file limit: it holds [`SOCKETS`] sockets.
fn raise_file_limit() {
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// A field of /proc/PID/status (`VmRSS` in kB, `Threads`).
fn status(child: &Child, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {s}"))
}

/// `SOCKETS` connections to `addr`: the first half say nothing, the second half finish a
/// WebSocket upgrade (where they are let in far enough) and then say nothing.
fn flood(addr: SocketAddr) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(SOCKETS);
    for i in 0..SOCKETS {
        let Ok(s) = TcpStream::connect(addr) else {
            continue;
        };
        if i >= SOCKETS / 2 {
            upgrade(&s, addr);
        }
        held.push(s);
    }
    held
}

/// A WebSocket upgrade on `s`, waiting briefly for its answer (101, or the socket closed when
/// the bound pushes it out: held all the same).
fn upgrade(s: &TcpStream, addr: SocketAddr) {
    use std::io::{Read, Write};
    let mut s = s;
    let request = format!(
        "GET / HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    let _ = s.write_all(request.as_bytes());
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let _ = s.read(&mut [0u8; 256]);
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("ws://")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_flooded_helper_still_pairs_and_serves_its_host() {
    raise_file_limit();
    let keys = std::env::temp_dir().join(format!("tether-flood-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&keys);
    let model = fixtures_dir().join("tiny_fp32");
    let (child, lines) = spawn_announcing_lines(
        Command::new(env!("CARGO_BIN_EXE_tether-helper"))
            .args(["--listen", "127.0.0.1:0", "--threads", "1", "--model"])
            .arg(&model)
            .env("TETHER_CONFIG_DIR", &keys),
        2,
    );
    let helper = Killed(child);
    let url = lines[0].split_whitespace().last().unwrap().to_string();
    let code = lines[1].strip_prefix("pairing code: ").unwrap().to_string();
    let (rss0, threads0) = (status(&helper.0, "VmRSS"), status(&helper.0, "Threads"));

    let held = flood(addr_of(&url));
    let t0 = Instant::now();
    let ws = ws::connect(&url, wire_limit(DEFAULT_MAX_FRAME)).expect("let in to try");
    let (mut link, _) = secure::connect(ws, &Keypair::generate(), Dial::Pair(&code)).unwrap();
    link.send(encode(1, &Message::Stats(Default::default())))
        .unwrap();
    let reply = link.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    let served = t0.elapsed();
    assert!(matches!(
        decode(&reply, DEFAULT_MAX_FRAME).unwrap().1,
        Message::Stats(_) | Message::Error { .. }
    ));
    let (rss, threads) = (
        status(&helper.0, "VmRSS") << 10,
        status(&helper.0, "Threads"),
    );
    eprintln!(
        "helper with {} sockets held: host served in {served:?}; {} MB resident ({} before), \
         {threads} threads ({threads0} before)",
        held.len(),
        rss >> 20,
        rss0 >> 10
    );
    assert!(served < Duration::from_secs(5), "{served:?}");
    assert!(rss < MAX_RSS, "{} MB", rss >> 20);
    assert!(threads < 200, "{threads} threads");
    drop(link);
    drop(held);
    let _ = std::fs::remove_dir_all(keys);
}

#[test]
fn a_flooded_server_still_answers_a_real_client() {
    raise_file_limit();
    let keys = std::env::temp_dir().join(format!("tether-flood-serve-{}", std::process::id()));
    let (child, line) = spawn_announcing(
        Command::new(env!("CARGO_BIN_EXE_tether"))
            .args(["serve", "--model", "tiny", "--port", "0", "--threads", "1"])
            .args(["--log", "warn"])
            .env("TETHER_CONFIG_DIR", &keys),
    );
    let server = Killed(child);
    let base = line.strip_prefix("listening on ").unwrap().to_string();
    let held = flood(addr_of(&base));
    let t0 = Instant::now();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let health = agent
        .get(format!("{base}/health"))
        .call()
        .expect("answered")
        .into_body()
        .read_to_string()
        .unwrap();
    let served = t0.elapsed();
    let (rss, threads) = (
        status(&server.0, "VmRSS") << 10,
        status(&server.0, "Threads"),
    );
    eprintln!(
        "server with {} sockets held: /health in {served:?}; {} MB resident, {threads} threads",
        held.len(),
        rss >> 20
    );
    assert!(health.contains("\"status\""), "{health}");
    assert!(served < Duration::from_secs(5), "{served:?}");
    assert!(rss < MAX_RSS, "{} MB", rss >> 20);
    drop(held);
    let _ = std::fs::remove_dir_all(keys);
}
