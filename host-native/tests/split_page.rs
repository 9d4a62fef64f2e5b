//! The split page, in headless Chromium driven by playwright-core:
//! - live, at `/`: `tether serve` on the tiny preset with a helper that joins it, the page the
//!   server serves asking one question through its chat box (wasm-demo/tests/split_page.mjs).
//!   What the page drew from `/v1/telemetry` is read from its DOM and state: the helper's card
//!   before any request, the numbered layer stack split between host and helper, ubatch bars
//!   in both lanes on a time axis with transfers between them, page strips with pages on the
//!   helper and their oldest end marked, the decode rate while the answer comes, link
//!   counters that grew and totals that stay; then a browser tab joins at a phone's width,
//!   shows as a second card at once, and leaves by its Leave button.
//! - the simulator, `index.html?sim` as static files with no server
//!   (wasm-demo/tests/sim_page.mjs): runs with the split layer, the KV budget and the link
//!   moved, each giving the host-alone tokens and drawing what its settings imply.
//!
//! - the simulator in Firefox (wasm-demo/tests/firefox.mjs, puppeteer-core over WebDriver
//!   BiDi): its first run, identical to the host alone and drawn.
//!
//! Screenshots land in target/screenshots (split-live*.png, split-sim*.png).
//!
//! Needs what tab.rs needs (see browser/mod.rs); without it the test says so and passes, unless
//! TETHER_BROWSER_TESTS=1 (CI) makes it fail.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use browser::{
    browser_ready, chromium, missing, native_helper, ready, repo, scratch, tether, PROMPT, SPLIT,
};
use tests::Process;

mod browser;

/// Run wasm-demo/tests/`script` with `args` (Chromium and Firefox named as this machine has
/// them; each of `shots` an environment variable naming a screenshot in target/screenshots)
/// and read the one JSON line it prints.
fn page_script<T: serde::de::DeserializeOwned + std::fmt::Debug>(
    script: &str,
    args: &[&str],
    shots: &[(&str, &str)],
) -> T {
    let dir = repo().join("target/screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let mut node = Command::new("node");
    node.arg(repo().join("wasm-demo/tests").join(script))
        .args(args)
        .env("CHROMIUM", chromium())
        .env("FIREFOX", firefox());
    for (var, file) in shots {
        node.env(var, dir.join(file));
    }
    let out = node.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let seen: T = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("{e}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    eprintln!("{seen:#?}");
    seen
}

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
    /// The link table's last column: each rate's share of the link's capacity.
    shares: Vec<String>,
    link_before: u64,
    link_after: u64,
    /// The helper cards before any request, and the link table's byte totals two samples
    /// after the run.
    cards_before: Vec<BTreeMap<String, String>>,
    totals_after: u64,
    /// The pipeline's figures: whether it says the split was slower than the host alone, and
    /// the speed-up it estimated.
    slower: bool,
    speedup: f64,
    ticks: Vec<String>,
    layer_numbers: Vec<String>,
    page_ends: String,
    /// The page strip's caption: layers, page size, cache types, pages by place.
    page_figures: String,
    decode_texts: Vec<String>,
    tab: TabSeen,
    prefill: String,
    decode: String,
    pipeline: String,
    memory: usize,
    plan: String,
    /// The page's width at a phone's screen width.
    phone: Phone,
}

/// The tab that joined while the page watched, and left.
#[derive(Debug, serde::Deserialize)]
struct TabSeen {
    cards: Vec<BTreeMap<String, String>>,
    width: u64,
    left: serde_json::Value,
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
            // A link of known capacity: the page shows each rate's share of it.
            "--link",
            "usb2",
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
    // The simulator's files come from the server too (`/?sim`), the module built in.
    for (path, kind) in [
        ("sim.js", "text/javascript; charset=utf-8"),
        ("sim-worker.js", "text/javascript; charset=utf-8"),
        ("pkg/wasm_demo.js", "text/javascript; charset=utf-8"),
        ("pkg/wasm_demo_bg.wasm", "application/wasm"),
    ] {
        let mut r = ureq::get(format!("{url}/{path}")).call().unwrap();
        assert_eq!(r.headers()["content-type"], kind, "{path}");
        let body = r.body_mut().with_config().limit(64 << 20).read_to_vec();
        let on_disk = std::fs::read(repo().join("wasm-demo/www").join(path)).unwrap();
        assert!(
            body.unwrap() == on_disk,
            "{path} differs from the built file"
        );
    }
    let seen: Seen = page_script(
        "split_page.mjs",
        &[&format!("{url}/"), PROMPT, &code],
        &[
            ("SHOT", "split-live.png"),
            ("SHOT_PHONE", "split-live-phone.png"),
            ("SHOT_TAB", "helper-tab-phone.png"),
        ],
    );
    drop(serve);
    let _ = helper.join();
    let _ = std::fs::remove_dir_all(keys);
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
    // A time axis in ms, and the gain against the host alone, flagged when it is a loss.
    assert!(
        seen.ticks.len() >= 2 && seen.ticks.contains(&"ms".to_string()),
        "{seen:?}"
    );
    assert!(seen.pipeline.contains("the host alone"), "{seen:?}");
    assert_eq!(
        seen.slower,
        seen.speedup < 1.0,
        "a slower split is flagged: {seen:?}"
    );
    assert_eq!(
        seen.pipeline.contains("slower than the host alone"),
        seen.slower,
        "{seen:?}"
    );
    // Every layer numbered, in order.
    let numbers: Vec<String> = (0..seen.layer_numbers.len())
        .map(|i| i.to_string())
        .collect();
    assert_eq!(seen.layer_numbers, numbers, "{seen:?}");
    assert!(
        seen.page_ends.contains("oldest") && seen.page_ends.contains("newest"),
        "{seen:?}"
    );
    // The helper that joined showed as a card before any request, with its kind (it said so
    // in its Welcome), layers, backend and link round trip.
    assert_eq!(seen.cards_before.len(), 1, "{seen:?}");
    let card = &seen.cards_before[0];
    assert_eq!(card["device"], helper, "{seen:?}");
    assert!(card["layers"].starts_with("4–7"), "{seen:?}");
    assert!(card["link round trip"].ends_with(" ms"), "{seen:?}");
    assert_ne!(card["backend"], "-", "{seen:?}");
    assert_eq!(card["kind"], "native", "{seen:?}");
    // The decode rate is this answer's, live: it said "so far" while tokens came, after the
    // figures were cleared for the question.
    assert_eq!(
        seen.decode_texts.first().map(String::as_str),
        Some("…"),
        "{seen:?}"
    );
    assert!(
        seen.decode_texts.iter().any(|t| t.contains("so far")),
        "{seen:?}"
    );
    assert!(!seen.decode.contains("so far"), "{seen:?}");
    // After the run the rates read 0 again; the totals do not.
    assert!(seen.totals_after > 0, "{seen:?}");
    // A tab that joins shows as a second card at once, fits a phone, and leaves cleanly.
    assert_eq!(seen.tab.cards.len(), 2, "{seen:?}");
    assert_eq!(seen.tab.cards[1]["kind"], "tab", "{seen:?}");
    assert!(seen.tab.width <= 390, "{seen:?}");
    assert_eq!(seen.tab.left["status"], "left the host", "{seen:?}");
    assert_eq!(seen.tab.left["join"], serde_json::Value::Null, "{seen:?}");
    // Pages: the oldest on the helper, the newest on the host.
    assert!(seen.page_runs.get(&helper) > Some(&0), "{seen:?}");
    assert!(seen.page_runs.get("host") > Some(&0), "{seen:?}");
    // The server's default cache types on the CPU, which the helper holds too.
    assert!(seen.page_figures.contains("(K f16 / V f16)"), "{seen:?}");
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
        seen.shares.len() == seen.rates && seen.shares.iter().all(|s| s.ends_with('%')),
        "{seen:?}"
    );
    assert!(
        seen.prefill.contains("tok/s") && seen.decode.contains("tok/s"),
        "{seen:?}"
    );
}

/// What sim_page.mjs read from the page after each run.
#[derive(Debug, serde::Deserialize)]
struct SimSeen {
    errors: Vec<String>,
    runs: Vec<SimRun>,
    phone: Phone,
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct SimRun {
    error: Option<String>,
    settings: serde_json::Value,
    check: serde_json::Value,
    report: serde_json::Value,
    check_text: String,
    devices: Vec<serde_json::Value>,
    layers: BTreeMap<String, usize>,
    bars: BTreeMap<String, usize>,
    transfers: usize,
    page_runs: BTreeMap<String, usize>,
    /// The last column of the link table: each row's share of the link's capacity.
    rates: Vec<String>,
    prefill: String,
    plan: String,
}

#[test]
fn the_simulator_runs_a_split_in_the_page_with_the_host_alone_tokens() {
    if !browser_ready() {
        return;
    }
    let seen: SimSeen = page_script(
        "sim_page.mjs",
        &[],
        &[
            ("SHOT", "split-sim.png"),
            ("SHOT_PHONE", "split-sim-phone.png"),
        ],
    );
    assert!(seen.errors.is_empty(), "console errors: {:?}", seen.errors);
    assert_eq!(seen.runs.len(), 3, "{seen:?}");
    for run in &seen.runs {
        assert_eq!(run.error, None, "{run:?}");
        // The page's own check against the host alone, and what it says.
        assert_eq!(run.check["tokens_identical"], true, "{run:?}");
        assert_eq!(run.check["logits_identical"], true, "{run:?}");
        assert_eq!(run.check["tokens"], run.check["alone_tokens"], "{run:?}");
        assert!(run.check_text.starts_with("Identical"), "{run:?}");
        assert!(run.prefill.contains("tok/s"), "{run:?}");
        // The layer stack as set: the helper runs the layers from the split on.
        let layers = run.settings["layers"].as_u64().unwrap() as usize;
        let split = run.settings["split_layer"].as_u64().unwrap() as usize;
        let helper = run.devices[0]["device"].as_str().unwrap();
        assert_eq!(run.layers.get("host"), Some(&split), "{run:?}");
        assert_eq!(run.layers.get(helper), Some(&(layers - split)), "{run:?}");
        // The pipeline: the tail of every ubatch but the last on the helper, drawn as bars.
        let ubatches = run.report["ubatches"].as_u64().unwrap() as usize;
        assert_eq!(run.report["on_helper"], ubatches - 1, "{run:?}");
        assert_eq!(run.bars.get(helper), Some(&(ubatches - 1)), "{run:?}");
        assert!(run.transfers >= 2 * (ubatches - 1), "{run:?}");
        // The link's capacity is known here, so every row has its share of it.
        assert!(
            !run.rates.is_empty() && run.rates.iter().all(|r| r.ends_with('%')),
            "{run:?}"
        );
        assert!(run.plan.contains("helper"), "{run:?}");
        // Pages: on the helper past the host's budget, all here without one.
        let on_helper = run.page_runs.get(helper).copied().unwrap_or(0);
        match run.settings["host_kv_tokens"].as_u64() {
            Some(_) => assert!(on_helper > 0, "{run:?}"),
            None => assert_eq!(on_helper, 0, "{run:?}"),
        }
    }
    // The runs followed the controls: the split layer moved to 8, then the link slowed to
    // 10 Mbit/s with every position kept on the host.
    let (first, second, third) = (&seen.runs[0], &seen.runs[1], &seen.runs[2]);
    assert_eq!(second.settings["split_layer"], 8, "{second:?}");
    assert_ne!(first.settings["split_layer"], 8, "{first:?}");
    assert_eq!(third.settings["bandwidth_mbps"], 10.0, "{third:?}");
    assert_eq!(third.settings["host_kv_tokens"], serde_json::Value::Null);
    assert!(seen.phone.width <= seen.phone.screen, "{:?}", seen.phone);
}

/// Debian's Firefox, which wasm-demo/tests/firefox.mjs drives.
fn firefox() -> PathBuf {
    std::env::var_os("FIREFOX")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/usr/bin/firefox-esr".into())
}

/// [`browser_ready`] for the Firefox test.
fn firefox_ready() -> bool {
    let mut missing = missing();
    if !firefox().exists() {
        missing.push(format!(
            "Firefox at {} (apt-get install firefox-esr, or set FIREFOX)",
            firefox().display()
        ));
    }
    if !repo()
        .join("wasm-demo/node_modules/puppeteer-core")
        .exists()
    {
        missing.push("puppeteer-core: (cd wasm-demo && npm ci)".to_string());
    }
    ready(missing)
}

/// What firefox.mjs read from the page after the simulator's first run.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct FirefoxSeen {
    errors: Vec<String>,
    browser: String,
    check: serde_json::Value,
    error: Option<String>,
    bars: BTreeMap<String, usize>,
    page_runs: BTreeMap<String, usize>,
    layers: BTreeMap<String, usize>,
    phone: Phone,
}

#[test]
fn the_simulator_runs_in_firefox_too() {
    if !firefox_ready() {
        return;
    }
    let seen: FirefoxSeen = page_script("firefox.mjs", &[], &[("SHOT", "split-sim-firefox.png")]);
    assert!(seen.errors.is_empty(), "console errors: {:?}", seen.errors);
    assert!(seen.browser.contains("Firefox"), "{seen:?}");
    assert_eq!(seen.error, None, "{seen:?}");
    assert_eq!(seen.check["tokens_identical"], true, "{seen:?}");
    assert_eq!(seen.check["logits_identical"], true, "{seen:?}");
    // The default run: 16 layers split at 12, 8 ubatches, pages past 256 tokens on the helper.
    let helper = seen
        .layers
        .keys()
        .find(|d| d.starts_with("helper:"))
        .expect("layers on a helper")
        .clone();
    assert_eq!(seen.layers.get("host"), Some(&12), "{seen:?}");
    assert_eq!(seen.layers.get(&helper), Some(&4), "{seen:?}");
    assert_eq!(seen.bars.get(&helper), Some(&7), "{seen:?}");
    assert!(seen.page_runs.get(&helper) > Some(&0), "{seen:?}");
    assert!(seen.phone.width <= seen.phone.screen, "{:?}", seen.phone);
}

/// What batch_page.mjs read from the page of a `--parallel` server.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct BatchSeen {
    errors: Vec<String>,
    answers: Vec<i64>,
    /// `batch` events (one a step), the most requests one held, and those that ran a prefill
    /// ubatch beside decode rows.
    steps: usize,
    most: usize,
    mixed: usize,
    /// The steps the page keeps, the columns and segments it drew of them, and their rows.
    kept: usize,
    columns: usize,
    segments: usize,
    drawn_rows: usize,
    figures: String,
}

/// The live page of `tether serve --parallel 4` shows the batch: a column per step with a
/// segment per request in it, and a caption with the latest step's requests and rows, while
/// four completions sent at once run together.
#[test]
fn the_page_shows_the_batch_of_a_parallel_server() {
    if !browser_ready() {
        return;
    }
    let mut serve = Process::start(Command::new(env!("CARGO_BIN_EXE_tether")).args([
        "serve",
        "--model",
        "tiny",
        "--port",
        "0",
        "--parallel",
        "4",
    ]));
    let url = serve
        .stdout_line()
        .strip_prefix("listening on ")
        .expect("serve announces its address")
        .to_string();
    let seen: BatchSeen = page_script(
        "batch_page.mjs",
        &[&format!("{url}/"), "4"],
        &[("SHOT", "split-batch.png")],
    );
    drop(serve);
    assert!(seen.errors.is_empty(), "console errors: {:?}", seen.errors);
    assert_eq!(seen.answers, [24; 4], "{seen:?}");
    assert!((2..=4).contains(&seen.most), "{seen:?}");
    assert!(seen.mixed > 0, "a prefill beside decode rows: {seen:?}");
    assert_eq!(seen.kept, seen.steps.min(120), "{seen:?}");
    assert_eq!(seen.columns, seen.kept, "{seen:?}");
    assert_eq!(seen.segments, seen.drawn_rows, "{seen:?}");
    assert!(
        seen.figures.contains(" request") && seen.figures.contains(" row"),
        "{seen:?}"
    );
}
