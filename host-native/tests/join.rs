//! Helpers that dial the host: `tether run --accept-helpers` as a user runs it, with a helper
//! that joins over loopback the way `tether-helper --join` does (engine-core's `doors::dial`
//! and helper runtime, in this process). The tokens equal the host alone's; the helper pairs
//! once by the code the host shows and is known afterwards; a stranger is turned away.

use std::path::PathBuf;
use std::process::Command;

use engine_core::helper::{Helper, HelperOptions, SessionEnd};
use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::link::doors::{self, DialOptions};
use engine_core::link::LinkError;
use tests::{Process, SPLIT_FLAGS as SPLIT, SPLIT_PROMPT as PROMPT};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-join-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn tether(keys: &PathBuf) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tether"));
    c.env("TETHER_CONFIG_DIR", keys)
        .env("TETHER_CACHE_DIR", keys.join("cache"));
    c
}

fn run_args(extra: &[&str]) -> Vec<String> {
    let base = [
        "run",
        "--model",
        "tiny",
        "--threads",
        "1",
        "--prompt",
        PROMPT,
        "--max-tokens",
        "12",
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// A host waiting for helpers, its stderr read as it runs.
fn start_host(keys: &PathBuf, extra: &[&str]) -> Process {
    Process::start(tether(keys).args(run_args(extra)))
}

/// One greedy completion of [`PROMPT`] from a `tether serve` with `extra` flags, once
/// `before(base URL)` ran: its text and the server's metrics after it.
fn serve_once(
    keys: &PathBuf,
    extra: &[&str],
    before: impl FnOnce(&str, &mut Process),
) -> (String, String) {
    let mut server = Process::start(
        tether(keys)
            .args(["serve", "--model", "tiny", "--threads", "1", "--port", "0"])
            .args(["--log", "warn", "--page-size", "8", "--split-min", "16"])
            .args(["--split-ubatch", "8", "--split-layer", "4"])
            .args(extra),
    );
    let first = server.stdout_line();
    let base = first.strip_prefix("listening on ").unwrap().to_string();
    before(&base, &mut server);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let body = serde_json::json!({
        "model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0
    });
    let reply: serde_json::Value = agent
        .post(&format!("{base}/v1/completions"))
        .send_json(&body)
        .unwrap()
        .body_mut()
        .read_json()
        .unwrap();
    let metrics = agent
        .get(&format!("{base}/metrics"))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    // Stopped now: a helper it holds sees its session end.
    drop(server);
    let text = reply["choices"][0]["text"].as_str();
    (
        text.unwrap_or_else(|| panic!("{reply}")).to_string(),
        metrics,
    )
}

/// A helper joining the host at `url` (keys in this process's TETHER_CONFIG_DIR), serving
/// one session on a thread.
fn join(url: &str, pair: Option<&str>) -> std::thread::JoinHandle<Result<SessionEnd, LinkError>> {
    let opts = DialOptions {
        role: "helper",
        peer: "host",
        insecure: false,
        pair: None,
        max_frame: DEFAULT_MAX_FRAME,
    };
    let (url, pair) = (url.to_string(), pair.map(str::to_string));
    std::thread::spawn(move || {
        let model = engine_core::source::load_model("tiny", &Default::default()).unwrap();
        let opts = DialOptions {
            pair: pair.as_deref(),
            ..opts
        };
        let mut link = doors::dial(&url, &opts)?;
        let helper = Helper::new(
            &model,
            &engine_core::CpuBackend,
            HelperOptions {
                mem_budget: 1 << 30,
                max_frame: DEFAULT_MAX_FRAME,
            },
        );
        Ok(helper.serve(&mut link))
    })
}

/// One test (so this process's key directory can be set once, before any thread reads it):
/// pairing by the host's code, tokens equal to the host alone, a known helper joining again
/// without a code, and a stranger turned away.
#[test]
fn a_helper_that_dials_in_pairs_once_and_gives_the_host_alone_tokens() {
    let helper_keys = scratch("helper-keys");
    std::env::set_var("TETHER_CONFIG_DIR", &helper_keys);
    let host_keys = scratch("host-keys");
    let alone = tether(&host_keys)
        .args(run_args(&SPLIT[..2]))
        .output()
        .unwrap();
    assert!(
        alone.status.success(),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    let alone = String::from_utf8(alone.stdout).unwrap();
    assert!(!alone.trim().is_empty());

    // One address for both hosts, as a user's host keeps its port: the helper remembers the
    // host's key by its address.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .to_string();
    let accept = [SPLIT, &["--accept-helpers", &addr, "--helper-wait", "60"]].concat();
    // First time: the host shows a code, the helper pairs with it.
    let mut host = start_host(&host_keys, &accept);
    let url = host.wait_for("accepting helpers on ");
    let code = host.wait_for("pairing code for new helpers: ");
    let helper = join(&url, Some(&code));
    let (ok, out, err) = host.finish();
    assert!(ok, "{err}");
    assert_eq!(
        out, alone,
        "tokens with a helper that joined vs the host alone\n{err}"
    );
    assert!(
        err.contains("ubatches ran their tail layers on the helper"),
        "{err}"
    );
    assert!(
        err.contains("link to helper 0 (a helper that joined"),
        "{err}"
    );
    let end = helper.join().unwrap();
    assert!(
        matches!(end, Ok(SessionEnd::Bye | SessionEnd::Closed(_))),
        "{end:?}"
    );

    // Again: pairing is closed now; the helper is known by its key and needs no code.
    let mut host = start_host(&host_keys, &accept);
    let url = host.wait_for("accepting helpers on ");
    let helper = join(&url, None);
    let (ok, out, err) = host.finish();
    assert!(ok, "{err}\nthe helper: {:?}", helper.join());
    assert!(err.contains("paired helpers only"), "{err}");
    assert_eq!(out, alone, "{err}");
    let end = helper.join().unwrap();
    assert!(
        matches!(end, Ok(SessionEnd::Bye | SessionEnd::Closed(_))),
        "{end:?}"
    );

    // A stranger (other keys) is refused, with a code or without (pairing closed once a
    // helper paired); the host waits on and gives up clearly.
    std::env::set_var("TETHER_CONFIG_DIR", scratch("stranger-keys"));
    let short = [
        SPLIT,
        &["--accept-helpers", "127.0.0.1:0", "--helper-wait", "3"],
    ]
    .concat();
    let mut host = start_host(&host_keys, &short);
    let url = host.wait_for("accepting helpers on ");
    let stranger = join(&url, None).join().unwrap();
    assert!(
        matches!(&stranger, Err(LinkError::Refused(why)) if why.contains("not paired")),
        "{stranger:?}"
    );
    let wrong = join(&url, Some("000-000")).join().unwrap();
    assert!(
        matches!(&wrong, Err(LinkError::Refused(why)) if why.contains("--pair-new")),
        "{wrong:?}"
    );
    let (ok, _, err) = host.finish();
    assert!(!ok && err.contains("no helper joined"), "{err}");

    // Two helpers at once (both known): the pages spread over both, same tokens.
    std::env::set_var("TETHER_CONFIG_DIR", &helper_keys);
    let two = [&accept[..], &["--wait-helpers", "2"]].concat();
    let mut host = start_host(&host_keys, &two);
    let url = host.wait_for("accepting helpers on ");
    let helpers = [join(&url, None), join(&url, None)];
    let (ok, out, err) = host.finish();
    assert!(ok, "{err}");
    assert_eq!(
        out, alone,
        "tokens with two helpers vs the host alone\n{err}"
    );
    for id in 0..2 {
        let line = err
            .lines()
            .find(|l| l.starts_with(&format!("link to helper {id} (")))
            .unwrap_or_else(|| panic!("no link line for helper {id}: {err}"));
        assert!(!line.contains(" 0 pages held"), "{line}");
    }
    for h in helpers {
        assert!(h.join().unwrap().is_ok());
    }

    // `tether serve` takes helpers on its own port, at /helper; its first request waits for
    // one, which then holds pages; the completion equals the server alone's.
    let (want, _) = serve_once(&host_keys, &[], |_, _| {});
    let accept = [
        "--accept-helpers",
        "--pair-new",
        "--helper-wait",
        "60",
        "--host-kv-tokens",
        "16",
    ];
    let mut helper = None;
    let (text, metrics) = serve_once(&host_keys, &accept, |base, server| {
        // A new address for the helper: it pairs by the code the server shows.
        let code = server.wait_for("pairing code for new helpers: ");
        let url = format!("{}/helper", base.replace("http://", "ws://"));
        helper = Some(join(&url, Some(&code)));
    });
    assert_eq!(text, want);
    assert!(metrics.contains("tether_helpers_attached 1"), "{metrics}");
    let pages: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("tether_helper_pages{helper=\"0\"} ")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(pages > 0.0, "{metrics}");
    let helper = helper.unwrap();
    let end = helper.join().unwrap();
    assert!(
        matches!(end, Ok(SessionEnd::Closed(_) | SessionEnd::Bye)),
        "{end:?}"
    );
    for d in [helper_keys, host_keys] {
        let _ = std::fs::remove_dir_all(d);
    }
}
