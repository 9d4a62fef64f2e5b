//! The iOS library's C ABI from C: tests/c_abi.c, compiled with the system C compiler against
//! include/tether_helper.h and linked with this crate's static library (as an iOS app links
//! it), starts a helper from a JSON config, reports its status and stops it. A host in this
//! process pairs with it by the code its status shows and checks a split prefill and decode
//! give the host-alone bits.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::host::split::{prefill, SplitPlan};
use engine_core::host::Sequence;
use engine_core::link::keys::Keypair;
use engine_core::link::secure::{self, wire_limit, Dial};
use engine_core::link::ws;
use engine_core::source::{load_model, LoadOptions};
use engine_core::{CpuBackend, Logits, Model};
use serde_json::Value;

/// This crate's static library, which cargo built beside this test.
fn static_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    std::fs::read_dir(deps)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("libphone_ios") && name.ends_with(".a")
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .expect("cargo builds libphone_ios.a (crate-type staticlib) with the tests")
}

/// The C program, built once per test run.
fn c_program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let here = Path::new(env!("CARGO_MANIFEST_DIR"));
            // In target/ (not /tmp), replaced by each run: the program holds the whole library.
            let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tether-c-abi");
            let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
            let built = Command::new(&cc)
                .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
                .arg(here.join("include"))
                .arg(here.join("tests/c_abi.c"))
                .arg(static_library())
                .args(["-lpthread", "-ldl", "-lm", "-o"])
                .arg(&out)
                .output()
                .unwrap_or_else(|e| {
                    panic!("{cc}: {e} (a C compiler is needed: apt-get install gcc)")
                });
            assert!(
                built.status.success(),
                "{}",
                String::from_utf8_lossy(&built.stderr)
            );
            out
        })
        .clone()
}

/// The C program running a helper, its stdout lines arriving on a channel.
struct CHelper {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl CHelper {
    fn start(config: &str, keys: &Path) -> CHelper {
        let mut child = Command::new(c_program())
            .env("TETHER_CONFIG_DIR", keys)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "{config}").unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        CHelper {
            child,
            stdin,
            lines,
        }
    }

    fn line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the C program answers")
    }

    fn status(&mut self) -> Value {
        writeln!(self.stdin, "status").unwrap();
        let line = self.line();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    /// The status once it is `state`, polled for up to a minute.
    fn wait_for(&mut self, state: &str) -> Value {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let s = self.status();
            if s["state"] == state {
                return s;
            }
            assert!(Instant::now() < until, "never {state}: {s}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for CHelper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keys(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tether-c-abi-keys-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Prefill `prompt` (split when `st` has a helper) and 4 greedy steps: every logit.
fn run(m: &Model, st: &mut Sequence, prompt: &[u32]) -> Vec<f32> {
    let plan = SplitPlan {
        min_tokens: 8,
        ubatch: 8,
        interleave_from: usize::MAX,
    };
    let (mut logits, report) = prefill(m, &CpuBackend, st, prompt, &plan).unwrap();
    assert_eq!(report.fallback, None);
    let mut all = logits.clone();
    for _ in 0..4 {
        let next = engine_core::generate::argmax(&logits);
        logits = st
            .forward(m, &CpuBackend, &[next], Logits::Last, None)
            .unwrap();
        all.extend_from_slice(&logits);
    }
    all
}

#[test]
fn a_c_caller_starts_a_helper_watches_it_serve_and_stops_it() {
    let dir = keys("serve");
    let mut helper = CHelper::start(
        r#"{"model": "tiny", "listen": "127.0.0.1:0", "mem_budget": "64M"}"#,
        &dir,
    );
    let listening = helper.wait_for("listening");
    assert_eq!(listening["mem_budget"], 64 << 20, "{listening}");
    let url = listening["address"].as_str().unwrap().to_string();
    // A new helper shows a code; a host pairs with it, as the app's screen would show it.
    let code = listening["pairing_code"].as_str().expect("a pairing code");

    let m = load_model("tiny", &LoadOptions::default()).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 256).collect();
    let alone = run(&m, &mut Sequence::new(&m.config, 8), &prompt);
    let mut st = Sequence::new(&m.config, 8);
    let ws = ws::connect(&url, wire_limit(DEFAULT_MAX_FRAME)).unwrap();
    let (link, _) = secure::connect(ws, &Keypair::generate(), Dial::Pair(code)).unwrap();
    tests::attach(&m, &mut st, link, 4, 8, Some(16));
    let split = run(&m, &mut st, &prompt);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&split) == bits(&alone), "the split's logits differ");

    // What it did, as the app would show it.
    let serving = helper.status();
    assert_eq!(serving["state"], "serving", "{serving}");
    assert_eq!(serving["sessions"], 1, "{serving}");
    assert!(
        serving["helper"]["kv_pages"].as_u64() > Some(0),
        "{serving}"
    );
    assert!(
        serving["helper"]["PrefillChunk"].as_u64() > Some(0),
        "{serving}"
    );
    assert!(
        serving["link_received_bytes"].as_u64() > Some(0),
        "{serving}"
    );
    assert!(serving["link_sent_bytes"].as_u64() > Some(0), "{serving}");

    // Stopped with the host still connected: the session ends, the call returns.
    let asked = Instant::now();
    writeln!(helper.stdin, "stop").unwrap();
    assert_eq!(helper.line(), "stopped");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    assert!(helper.child.wait().unwrap().success());
    let next = engine_core::generate::argmax(&split[split.len() - 256..]);
    assert!(
        st.forward(&m, &CpuBackend, &[next], Logits::Last, None)
            .is_err(),
        "the host's pages were on the stopped helper"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_configs_are_refused_with_the_reason() {
    let dir = keys("bad");
    // Not a flag: start returns NULL and says which.
    let mut c = CHelper::start(r#"{"model": "tiny", "no-such-flag": 1}"#, &dir);
    let line = c.line();
    assert!(
        line.starts_with("error: ") && line.contains("--no-such-flag"),
        "{line}"
    );
    assert!(!c.child.wait().unwrap().success());
    // Not JSON.
    let mut c = CHelper::start("model=tiny", &dir);
    assert!(c.line().starts_with("error: the config is not JSON"));
    assert!(!c.child.wait().unwrap().success());
    // A model that does not load: the helper starts and reports why it failed.
    let mut c = CHelper::start(
        r#"{"model": "no-such-model", "listen": "127.0.0.1:0", "insecure": true}"#,
        &dir,
    );
    let failed = c.wait_for("failed");
    assert!(
        failed["error"].as_str().unwrap().contains("no-such-model"),
        "{failed}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
