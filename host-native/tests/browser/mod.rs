//! What the browser tests share (tab.rs: tabs as helpers; split_page.rs: the split page, live
//! and simulated): where Chromium and the built page are, whether everything they need is there, a scratch
//! directory, the `tether` command, and a native helper that joins from the test's process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread::JoinHandle;

use engine_core::helper::{Helper, HelperOptions, SessionEnd};
use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::link::doors;
use engine_core::link::keys::KeyStore;
use engine_core::link::secure::wire_limit;
use engine_core::link::ws;
use engine_core::link::LinkError;
use engine_core::CpuBackend;
pub use tests::{SPLIT_FLAGS as SPLIT, SPLIT_PROMPT as PROMPT};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn chromium() -> PathBuf {
    std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/bin/chromium".into())
}

/// What the browser test needs and is missing, with how to get it.
pub fn missing() -> Vec<String> {
    let www = repo().join("wasm-demo/www");
    let mut missing = Vec::new();
    if !www.join("pkg/wasm_demo.js").exists() {
        missing.push("the page's module: scripts/build-wasm.sh".to_string());
    }
    if !repo()
        .join("wasm-demo/node_modules/playwright-core")
        .exists()
    {
        missing.push("playwright-core: (cd wasm-demo && npm ci)".to_string());
    }
    if Command::new("node").arg("--version").output().is_err() {
        missing.push("node (20 or later)".to_string());
    }
    if !chromium().exists() {
        missing.push(format!(
            "Chromium at {} (apt-get install chromium, or set CHROMIUM)",
            chromium().display()
        ));
    }
    missing
}

/// Whether to run a Chromium test: everything is there, or say what is missing (and fail under
/// TETHER_BROWSER_TESTS=1).
pub fn browser_ready() -> bool {
    ready(missing())
}

/// Whether to run, given what is `missing`: nothing, or say what (and fail under
/// TETHER_BROWSER_TESTS=1).
pub fn ready(missing: Vec<String>) -> bool {
    if missing.is_empty() {
        return true;
    }
    let msg = format!("the browser tests need: {}", missing.join("; "));
    if std::env::var("TETHER_BROWSER_TESTS").as_deref() == Ok("1") {
        panic!("{msg}");
    }
    eprintln!("skipped: {msg} (TETHER_BROWSER_TESTS=1 makes this a failure)");
    false
}

pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-tab-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub fn tether(keys: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tether"));
    c.env("TETHER_CONFIG_DIR", keys)
        .env("TETHER_CACHE_DIR", keys.join("cache"));
    c
}

/// A helper joining from this process as `tether-helper --join` does (keys in `keys`): pairs
/// with `code`, then serves one session on a thread.
pub fn native_helper(
    url: &str,
    code: &str,
    keys: PathBuf,
) -> JoinHandle<Result<SessionEnd, LinkError>> {
    let (url, code) = (url.to_string(), code.to_string());
    std::thread::spawn(move || {
        let model = engine_core::source::load_model("tiny", &Default::default()).unwrap();
        let mut store = KeyStore::open(&keys, "helper")?;
        let ws = ws::connect(&url, wire_limit(DEFAULT_MAX_FRAME))?;
        let mut link = doors::pair_with(&url, ws, &mut store, &code, "host")?;
        let helper = Helper::new(
            &model,
            &CpuBackend,
            HelperOptions {
                mem_budget: 1 << 30,
                max_frame: DEFAULT_MAX_FRAME,
            },
        );
        Ok(helper.serve(&mut link))
    })
}
