//! `tether-helper` as a separate process over WebSocket on loopback, paired and encrypted as
//! a user runs it: the same tokens and bit-identical logits as the host alone, a clear error
//! when the process dies, and pairing that survives a restart of the helper and lets no
//! stranger in.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::Sequence;
use engine_core::link::keys::{KeyStore, Keypair};
use engine_core::link::secure::{self, wire_limit, Dial, SecureLink};
use engine_core::link::ws::{self, WsLink};
use engine_core::link::LinkError;
use engine_core::protocol::Configure;
use engine_core::{CpuBackend, Logits, Model};
use tests::{fixtures_dir, spawn_announcing_lines, Reference};

mod broken;

struct HelperProcess {
    child: Child,
    url: String,
    /// The pairing code it shows, if it takes a new host.
    code: Option<String>,
}

/// A fresh directory for one helper's keys.
fn key_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-keys-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

impl HelperProcess {
    /// A helper with a fresh key store: it shows a pairing code.
    fn start(model: &str) -> HelperProcess {
        let name = format!("{:?}", std::thread::current().id());
        HelperProcess::start_with(
            model,
            &key_dir(&name.replace(|c: char| !c.is_alphanumeric(), "")),
            true,
        )
    }

    /// A helper keeping its keys in `keys`; `pairing` says whether it is expected to show a code.
    fn start_with(model: &str, keys: &Path, pairing: bool) -> HelperProcess {
        HelperProcess::start_args(model, keys, &[], pairing)
    }

    /// [`Self::start_with`] with more arguments.
    fn start_args(model: &str, keys: &Path, args: &[&str], pairing: bool) -> HelperProcess {
        let (child, lines) = spawn_announcing_lines(
            Command::new(env!("CARGO_BIN_EXE_tether-helper"))
                .args([
                    "--listen",
                    "127.0.0.1:0",
                    "--model",
                    model,
                    "--threads",
                    "1",
                ])
                .args(args)
                .env("TETHER_CONFIG_DIR", keys),
            1 + usize::from(pairing),
        );
        let url = lines[0]
            .split_whitespace()
            .last()
            .expect("the helper prints its address")
            .to_string();
        let code = lines.get(1).map(|l| {
            l.strip_prefix("pairing code: ")
                .unwrap_or_else(|| panic!("expected the pairing code, got {l:?}"))
                .to_string()
        });
        HelperProcess { child, url, code }
    }

    /// A link as a host with `keys` dials it: by pairing code if the helper shows one.
    fn dial(&self, keys: &Keypair, how: Dial) -> Result<SecureLink<WsLink>, LinkError> {
        let ws = ws::connect(&self.url, wire_limit(DEFAULT_MAX_FRAME))?;
        secure::connect(ws, keys, how).map(|(link, _)| link)
    }

    /// A paired, encrypted link for a new host.
    fn link(&self) -> SecureLink<WsLink> {
        let code = self
            .code
            .as_deref()
            .expect("the helper shows a pairing code");
        self.dial(&Keypair::generate(), Dial::Pair(code)).unwrap()
    }

    fn attach(&self, m: &Model, st: &mut Sequence, page: usize, budget: usize) {
        let link = self.link();
        let cfg = Configure {
            first_layer: 0,
            end_layer: 0,
            page_size: page as u32,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        st.placement
            .attach(HelperClient::connect(Box::new(link), m, cfg, DEFAULT_MAX_FRAME).unwrap());
        st.placement.host_kv_tokens = Some(budget);
    }
}

impl Drop for HelperProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn generate(
    m: &Model,
    st: &mut Sequence,
    prompt: &[u32],
    n: usize,
) -> engine_core::Result<(Vec<u32>, Vec<f32>)> {
    generate_with(m, st, prompt, n, &mut |_, _| {})
}

/// [`generate`], calling `before(i, st)` before greedy step `i` (a helper killed or
/// replaced at a chosen step).
fn generate_with(
    m: &Model,
    st: &mut Sequence,
    prompt: &[u32],
    n: usize,
    before: &mut dyn FnMut(usize, &mut Sequence),
) -> engine_core::Result<(Vec<u32>, Vec<f32>)> {
    let mut logits = st.forward(m, &CpuBackend, prompt, Logits::Last, None)?;
    let (mut ids, mut all) = (Vec::new(), Vec::new());
    for i in 0..n {
        before(i, st);
        let next = engine_core::generate::argmax(&logits);
        ids.push(next);
        all.extend_from_slice(&logits);
        logits = st.forward(m, &CpuBackend, &[next], Logits::Last, None)?;
    }
    Ok((ids, all))
}

#[test]
fn helper_process_gives_the_host_alone_result() {
    let dir = fixtures_dir().join("tiny_fp32_T150");
    let m = Model::load_dir(&dir).unwrap();
    let r = Reference::load("tiny_fp32_T150");
    let prompt = r.ids("prompt_ids");
    let want = r.ids("gen_ids");
    let helper = HelperProcess::start(dir.to_str().unwrap());
    let (host_ids, host_logits) =
        generate(&m, &mut Sequence::new(&m.config, 16), &prompt, want.len()).unwrap();
    let mut st = Sequence::new(&m.config, 16);
    helper.attach(&m, &mut st, 16, 48);
    let (ids, logits) = generate(&m, &mut st, &prompt, want.len()).unwrap();
    assert_eq!(host_ids, want);
    assert_eq!(ids, want);
    assert!(
        logits == host_logits,
        "split logits are not bit-identical to the host's"
    );
}

/// The helper process killed while it holds pages mid-decode: the host attends them from the
/// page file and goes on; a restarted helper is re-filled from it. Every token and logit is
/// the host alone's.
#[test]
fn killing_the_helper_during_decode_costs_time_not_tokens_and_a_new_one_is_refilled() {
    let dir = fixtures_dir().join("tiny_fp32_T150");
    let m = Model::load_dir(&dir).unwrap();
    let r = Reference::load("tiny_fp32_T150");
    let (prompt, want) = (r.ids("prompt_ids"), r.ids("gen_ids"));
    let (_, host_logits) =
        generate(&m, &mut Sequence::new(&m.config, 16), &prompt, want.len()).unwrap();
    let mut helper = HelperProcess::start(dir.to_str().unwrap());
    let mut st = Sequence::new(&m.config, 16);
    st.placement.spill = Some(tests::page_file());
    helper.attach(&m, &mut st, 16, 48);
    let (ids, all) = generate_with(&m, &mut st, &prompt, want.len(), &mut |i, st| {
        if i == 3 {
            assert!(st.state.remote_kv_len() > 0, "no page on the helper yet");
            helper.child.kill().unwrap();
            helper.child.wait().unwrap();
        }
        if i == 7 {
            assert!(st.placement.helper_lost.is_some() && st.placement.helpers.is_empty());
            helper = HelperProcess::start(dir.to_str().unwrap());
            helper.attach(&m, st, 16, 48);
        }
    })
    .unwrap();
    assert_eq!(ids, want);
    assert!(all == host_logits, "logits differ from the host alone's");
    assert!(
        !st.placement.helpers.is_empty() && st.placement.pages_all_on_helpers(),
        "the new helper was not re-filled"
    );
}

#[test]
fn killing_the_helper_process_during_a_split_prefill_costs_time_not_tokens() {
    use engine_core::host::split::{prefill, SplitPlan};
    let dir = fixtures_dir().join("tiny_fp32_T150");
    let m = Model::load_dir(&dir).unwrap();
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch: 8,
        ..SplitPlan::default()
    };
    let (want, _) = prefill(
        &m,
        &CpuBackend,
        &mut Sequence::new(&m.config, 16),
        &prompt,
        &plan,
    )
    .unwrap();
    let mut fell_back = 0;
    // The kill lands at different points of the batch (or after it): whenever it lands, the
    // host finishes with the host-alone logits.
    for delay_ms in [0u64, 5, 15, 40, 100] {
        let mut helper = HelperProcess::start(dir.to_str().unwrap());
        let link = helper.link();
        let cfg = Configure {
            first_layer: 4,
            end_layer: 8,
            page_size: 16,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        let mut st = Sequence::new(&m.config, 16);
        st.placement
            .attach(HelperClient::connect(Box::new(link), &m, cfg, DEFAULT_MAX_FRAME).unwrap());
        let (got, report) = std::thread::scope(|scope| {
            let child = &mut helper.child;
            scope.spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(delay_ms));
                let _ = child.kill();
                let _ = child.wait();
            });
            prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap()
        });
        assert!(
            got == want,
            "killed after {delay_ms} ms: logits differ ({report:?})"
        );
        fell_back += usize::from(report.fallback.is_some());
    }
    assert!(fell_back > 0, "no kill landed during a batch");
}

/// Over WebSocket to a real process: a prompt that is layer-pipelined up to position 64 and
/// interleaved past it, with pages on the helper, gives the plain host-alone logits bit for bit,
/// with the helper's replies shaped like Wi-Fi.
#[test]
fn a_helper_process_splits_then_interleaves_bit_identically() {
    use engine_core::host::split::{prefill, SplitPlan};
    let dir = fixtures_dir().join("tiny_fp32_T150");
    let m = Model::load_dir(&dir).unwrap();
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let mut host = m.new_state(8);
    let mut want = Vec::new();
    for c in prompt.chunks(8) {
        want = m
            .forward(&CpuBackend, &mut host, c, Logits::Last, None)
            .unwrap();
    }
    // The helper's replies shaped like Wi-Fi (--link): slower, the same bits.
    let helper = HelperProcess::start_args(
        dir.to_str().unwrap(),
        &key_dir("interleave"),
        &["--link", "wifi"],
        true,
    );
    let link = helper.link();
    let cfg = Configure {
        first_layer: 4,
        end_layer: 8,
        page_size: 8,
        kv_types: engine_core::backend::CacheTypes::F32,
    };
    let mut st = Sequence::new(&m.config, 8);
    st.placement
        .attach(HelperClient::connect(Box::new(link), &m, cfg, DEFAULT_MAX_FRAME).unwrap());
    st.placement.host_kv_tokens = Some(16);
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch: 8,
        interleave_from: 64,
    };
    let (got, report) = prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
    assert!(report.on_helper > 0 && report.interleaved > 0, "{report:?}");
    assert!(
        got == want,
        "logits differ from the host alone ({report:?})"
    );
}

/// Pairing as a user does it, against the real binary: the helper shows a code; a host pairs
/// with it and is remembered across a restart of the helper (which then shows no code); a
/// stranger, a wrong code and a plain link are refused with reasons, and nothing is served
/// to them.
#[test]
fn a_paired_host_is_remembered_and_strangers_are_refused() {
    let dir = fixtures_dir().join("tiny_fp32");
    let m = Model::load_dir(&dir).unwrap();
    let keys = key_dir("remembered");
    let host_dir = key_dir("remembered-host");
    let host = KeyStore::open(&host_dir, "host").unwrap().keypair().clone();
    let cfg = Configure {
        first_layer: 0,
        end_layer: 0,
        page_size: 8,
        kv_types: engine_core::backend::CacheTypes::F32,
    };
    let mut helper = HelperProcess::start_with(dir.to_str().unwrap(), &keys, true);
    let code = helper.code.clone().unwrap();
    let wrong = format!(
        "{:06}",
        (code.replace('-', "").parse::<u32>().unwrap() + 1) % 1_000_000
    );
    let err = helper
        .dial(&Keypair::generate(), Dial::Pair(&wrong))
        .err()
        .unwrap();
    assert!(err.to_string().contains("wrong pairing code"), "{err}");
    let link = helper.dial(&host, Dial::Pair(&code)).unwrap();
    assert!(link.is_encrypted());
    HelperClient::connect(Box::new(link), &m, cfg.clone(), DEFAULT_MAX_FRAME).unwrap();
    // Pairing is closed once a host has paired (no --pair-new).
    let err = helper
        .dial(&Keypair::generate(), Dial::Pair(&code))
        .err()
        .unwrap();
    assert!(err.to_string().contains("not taking new hosts"), "{err}");

    // Restarted with the same keys: no code shown, the host is known.
    let _ = helper.child.kill();
    let _ = helper.child.wait();
    let helper = HelperProcess::start_with(dir.to_str().unwrap(), &keys, false);
    let helper_key = KeyStore::open(&keys, "helper").unwrap().keypair().public;
    let link = helper.dial(&host, Dial::Known(helper_key)).unwrap();
    HelperClient::connect(Box::new(link), &m, cfg, DEFAULT_MAX_FRAME).unwrap();
    let err = helper
        .dial(&Keypair::generate(), Dial::Known(helper_key))
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("has not paired with this host"),
        "{err}"
    );
    let err = helper.dial(&host, Dial::Insecure).err().unwrap();
    assert!(err.to_string().contains("without --insecure"), "{err}");
    for d in [keys, host_dir] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// One host at a time: a second, paired host is told the helper is busy (and by whom) instead
/// of waiting, and gets in once the first has gone.
#[test]
fn a_second_host_is_told_the_helper_is_busy() {
    let dir = fixtures_dir().join("tiny_fp32");
    let m = Model::load_dir(&dir).unwrap();
    let keys = key_dir("busy");
    // --pair-new keeps pairing open, so both hosts pair with the one code.
    let helper = HelperProcess::start_args(dir.to_str().unwrap(), &keys, &["--pair-new"], true);
    let code = helper.code.clone().unwrap();
    let cfg = Configure {
        first_layer: 0,
        end_layer: 0,
        page_size: 8,
        kv_types: engine_core::backend::CacheTypes::F32,
    };
    let (a, b) = (Keypair::generate(), Keypair::generate());
    let first = helper.dial(&a, Dial::Pair(&code)).unwrap();
    let first = HelperClient::connect(Box::new(first), &m, cfg.clone(), DEFAULT_MAX_FRAME).unwrap();
    let second = helper.dial(&b, Dial::Pair(&code)).unwrap();
    let err = HelperClient::connect(Box::new(second), &m, cfg.clone(), DEFAULT_MAX_FRAME)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("busy") && err.contains("serving another host"),
        "{err}"
    );
    // The first host goes; the second, now known, gets in.
    drop(first);
    let helper_key = KeyStore::open(&keys, "helper").unwrap().keypair().public;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let link = helper.dial(&b, Dial::Known(helper_key)).unwrap();
        match HelperClient::connect(Box::new(link), &m, cfg.clone(), DEFAULT_MAX_FRAME) {
            Ok(_) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                assert!(e.to_string().contains("busy"), "{e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => panic!("the helper stayed busy: {e}"),
        }
    }
    let _ = std::fs::remove_dir_all(keys);
}

#[test]
fn an_unknown_link_profile_is_an_error_naming_the_known_ones() {
    let out = Command::new(env!("CARGO_BIN_EXE_tether-helper"))
        .args([
            "--model",
            "tiny",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--link",
            "pigeon",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--link pigeon") && err.contains("usb-c-10g"),
        "{err}"
    );
}

/// A helper checks the whole checkpoint at startup as `tether eval` does, though it builds
/// only the layers a host assigns later: it exits with eval's message, listening nowhere.
#[test]
fn a_helper_refuses_at_startup_a_checkpoint_eval_refuses() {
    use std::io::BufRead;
    let dir = key_dir("broken");
    for (model, problem) in broken::checkpoints(&dir) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tether-helper"))
            .args(["--listen", "127.0.0.1:0", "--insecure", "--model"])
            .arg(&model)
            .env("TETHER_CONFIG_DIR", dir.join("keys"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Its first line on stdout is the address it listens on; a refusal prints none.
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        if let Some(line) = stdout.lines().next() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the helper took {}: {line:?}", model.display());
        }
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(problem), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A host that stays connected but sends no request for `--idle-timeout` seconds is let go:
/// a second host gets in at once, and the first goes on from its page file, with the tokens
/// it would have had.
#[test]
fn an_idle_host_is_let_go_and_another_gets_in() {
    let dir = fixtures_dir().join("tiny_fp32");
    let m = Model::load_dir(&dir).unwrap();
    let keys = key_dir("idle");
    let helper = HelperProcess::start_args(
        dir.to_str().unwrap(),
        &keys,
        &["--pair-new", "--idle-timeout", "1"],
        true,
    );
    let prompt: Vec<u32> = (0..40).collect();
    let want = generate(&m, &mut Sequence::new(&m.config, 8), &prompt, 4).unwrap();
    let mut st = Sequence::new(&m.config, 8);
    st.placement.spill = Some(tests::page_file());
    helper.attach(&m, &mut st, 8, 8);
    let got = generate_with(&m, &mut st, &prompt, 4, &mut |i, st| {
        if i > 0 {
            return;
        }
        assert!(st.state.remote_kv_len() > 0);
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let cfg = Configure {
            first_layer: 0,
            end_layer: 0,
            page_size: 8,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        let code = helper.code.clone().unwrap();
        let second = helper
            .dial(&Keypair::generate(), Dial::Pair(&code))
            .unwrap();
        HelperClient::connect(Box::new(second), &m, cfg, DEFAULT_MAX_FRAME)
            .expect("the idle host no longer holds the helper");
    })
    .unwrap();
    assert!(
        st.placement.helper_lost.is_some(),
        "the first host saw no loss"
    );
    assert!(got == want, "the first host's tokens changed");
    let _ = std::fs::remove_dir_all(keys);
}

/// `tether-helper --join`: the helper dials a host that accepts helpers (here the host side
/// in this process: the same listener and gate `tether run --accept-helpers` uses), pairs by
/// the code the host shows, and serves it: tokens and logits equal the host alone's. With a
/// wrong code it is refused and exits with the reason.
#[test]
fn a_helper_that_joins_the_host_pairs_by_its_code_and_gives_the_host_alone_result() {
    use engine_core::link::keys::{PairingCode, PublicKey};
    use engine_core::link::secure::{Gate, Pairing};
    use engine_core::link::ws::WsListener;
    let dir = fixtures_dir().join("tiny_fp32_T150");
    let m = Model::load_dir(&dir).unwrap();
    let r = Reference::load("tiny_fp32_T150");
    let (prompt, want) = (r.ids("prompt_ids"), r.ids("gen_ids"));
    let (_, host_logits) =
        generate(&m, &mut Sequence::new(&m.config, 16), &prompt, want.len()).unwrap();

    let listener = WsListener::bind("127.0.0.1:0", wire_limit(DEFAULT_MAX_FRAME)).unwrap();
    let url = format!("ws://{}", listener.local_addr());
    let code = PairingCode::new();
    let shown = code.shown();
    let code = std::sync::Mutex::new(code);
    let host_keys = Keypair::generate();
    let known = |_: &PublicKey| false;
    let gate = Gate {
        insecure: false,
        known: &known,
        pairing: Pairing::Open(&code),
    };
    let join = |pair: &str| {
        Command::new(env!("CARGO_BIN_EXE_tether-helper"))
            .args(["--join", &url, "--pair", pair, "--once", "--model"])
            .arg(&dir)
            .args(["--threads", "1"])
            .env("TETHER_CONFIG_DIR", key_dir("joining"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };

    let wrong = join("000-000");
    let ws = listener.accept().unwrap();
    assert!(secure::accept(ws, &host_keys, &gate).is_err());
    let out = wrong.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("refused this helper") && err.contains("wrong"),
        "{err}"
    );

    let mut helper = join(&shown);
    let ws = listener.accept().unwrap();
    let (link, _) = secure::accept(ws, &host_keys, &gate).unwrap();
    let cfg = Configure {
        first_layer: 0,
        end_layer: 0,
        page_size: 16,
        kv_types: engine_core::backend::CacheTypes::F32,
    };
    let mut st = Sequence::new(&m.config, 16);
    st.placement
        .attach(HelperClient::connect(Box::new(link), &m, cfg, DEFAULT_MAX_FRAME).unwrap());
    st.placement.host_kv_tokens = Some(48);
    let (ids, logits) = generate(&m, &mut st, &prompt, want.len()).unwrap();
    assert!(st.state.remote_kv_len() > 0, "no page went to the helper");
    assert_eq!(ids, want);
    assert!(logits == host_logits, "logits differ from the host alone's");
    drop(st);
    // --once: the helper exits when the host goes.
    assert!(helper.wait().unwrap().success());
}
