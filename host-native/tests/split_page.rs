//! The live split page at `/`: `tether serve` on the tiny preset with a helper that joins it,
//! headless Chromium opening the page the server serves and asking one question through its
//! chat box (wasm-demo/tests/split_page.mjs, playwright-core). What the page drew from
//! `/v1/telemetry` is read from its DOM and state: the layer stack split between host and
//! helper, ubatch bars in both lanes with transfers between them, page strips with pages on the
//! helper, link counters that grew. Saves a screenshot at target/screenshots/split-live.png.
//!
//! Needs what tab.rs needs (see browser/mod.rs); without it the test says so and passes, unless
//! TETHER_BROWSER_TESTS=1 (CI) makes it fail.

use std::collections::BTreeMap;
use std::process::Command;

use browser::{browser_ready, chromium, native_helper, repo, scratch, tether, PROMPT, SPLIT};
use tests::Process;

mod browser;

/// What split_page.mjs read from the page.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Seen {
    errors: Vec<String>,
    answer: String,
    answer_class: String,
    devices: Vec<serde_json::Value>,
    /// Layers drawn, ubatch bars and page runs, by the device (or place) they are on.
    layers_drawn: BTreeMap<String, usize>,
    bars: BTreeMap<String, usize>,
    transfers: usize,
    page_runs: BTreeMap<String, usize>,
    rates: usize,
    link_before: u64,
    link_after: u64,
    prefill: String,
    decode: String,
    pipeline: String,
    memory: usize,
    plan: String,
    /// The page's width at a phone's screen width.
    phone: Phone,
}

#[derive(Debug, serde::Deserialize)]
struct Phone {
    width: u64,
    screen: u64,
}

#[test]
fn the_page_shows_a_split_run_as_it_happens() {
    if !browser_ready() {
        return;
    }
    let keys = scratch("split-page-host");
    let serve_args = [
        &[
            "serve",
            "--model",
            "tiny",
            "--threads",
            "1",
            "--port",
            "0",
            "--accept-helpers",
            "--pair-new",
            "--wait-helpers",
            "1",
            "--helper-wait",
            "120",
        ],
        SPLIT,
    ]
    .concat();
    let mut serve = Process::start(tether(&keys).args(serve_args));
    let url = serve
        .stdout_line()
        .strip_prefix("listening on ")
        .expect("serve announces its address")
        .to_string();
    let code = serve.wait_for("pairing code for new helpers: ");
    let helper = native_helper(
        &format!("{}/helper", url.replace("http://", "ws://")),
        &code,
        scratch("split-page-helper"),
    );
    let shots = repo().join("target/screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let out = Command::new("node")
        .arg(repo().join("wasm-demo/tests/split_page.mjs"))
        .arg(format!("{url}/"))
        .arg(PROMPT)
        .env("CHROMIUM", chromium())
        .env("SHOT", shots.join("split-live.png"))
        .env("SHOT_PHONE", shots.join("split-live-phone.png"))
        .output()
        .unwrap();
    drop(serve);
    let _ = helper.join();
    let _ = std::fs::remove_dir_all(keys);
    let text = String::from_utf8_lossy(&out.stdout);
    let seen: Seen = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("{e}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    eprintln!("{seen:#?}");
    assert!(seen.errors.is_empty(), "console errors: {:?}", seen.errors);
    assert!(
        !seen.answer.is_empty() && seen.answer_class == "msg assistant",
        "{seen:?}"
    );
    // The layer stack: layers 0..4 on the host, the rest on the prefill helper.
    let helper = seen.devices[0]["device"].as_str().unwrap().to_string();
    assert_eq!(seen.devices.len(), 1, "{seen:?}");
    assert_eq!(seen.devices[0]["prefill_layers"][0], 4, "{seen:?}");
    assert_eq!(seen.layers_drawn.get("host"), Some(&4), "{seen:?}");
    assert!(seen.layers_drawn.get(&helper) > Some(&0), "{seen:?}");
    // The pipeline: bars in both lanes, residuals and rows crossing between them.
    assert!(seen.bars.get("host") > Some(&0), "{seen:?}");
    assert!(seen.bars.get(&helper) > Some(&0), "{seen:?}");
    assert!(seen.transfers > 0, "{seen:?}");
    assert!(seen.pipeline.contains("efficient"), "{seen:?}");
    // Pages: the oldest on the helper, the newest on the host.
    assert!(seen.page_runs.get(&helper) > Some(&0), "{seen:?}");
    assert!(seen.page_runs.get("host") > Some(&0), "{seen:?}");
    assert_eq!(
        seen.memory, 2,
        "a memory bar for the host and the helper: {seen:?}"
    );
    // Usable on a phone: nothing scrolls sideways.
    assert!(seen.phone.width <= seen.phone.screen, "{:?}", seen.phone);
    // The plan for the helper that joined, not the one printed before it did.
    assert!(!seen.plan.contains("no helper"), "{}", seen.plan);
    // Counters that appeared and changed.
    assert!(seen.link_after > seen.link_before, "{seen:?}");
    assert!(seen.rates > 0, "{seen:?}");
    assert!(
        seen.prefill.contains("tok/s") && seen.decode.contains("tok/s"),
        "{seen:?}"
    );
}
