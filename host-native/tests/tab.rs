//! A browser tab as a helper: `tether run --accept-helpers` as a user runs it, and headless
//! Chromium opening wasm-demo/www/helper.html with the host's address and pairing code in the
//! query string (wasm-demo/tests/tab.mjs, playwright-core). The tab dials the host with the
//! browser's WebSocket, pairs, holds pages and runs the tail layers of the split prefill; the
//! host's tokens equal the host alone's.
//!
//! Needs the built page (scripts/build-wasm.sh), wasm-demo's node modules (`npm ci` in
//! wasm-demo), node and Chromium. Without them the test says so and passes, unless
//! TETHER_BROWSER_TESTS=1 (CI) makes it fail.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use std::sync::atomic::{AtomicUsize, Ordering};

use browser::{browser_ready, chromium, native_helper, repo, scratch, tether, PROMPT, SPLIT};
use engine_core::helper::SessionEnd;
use tests::Process;

mod browser;

/// Serves `root`'s files over HTTP on 127.0.0.1 (GET only, one request per connection);
/// returns the address.
fn serve_static(root: PathBuf) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let root = root.clone();
            std::thread::spawn(move || answer(&root, stream));
        }
    });
    addr
}

fn answer(root: &Path, mut stream: TcpStream) {
    let mut line = String::new();
    if BufReader::new(&stream).read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let path = path
        .split('?')
        .next()
        .unwrap_or("/")
        .trim_start_matches('/');
    let file = (!path.contains("..")).then(|| root.join(path));
    let (status, kind, body) = match file.and_then(|f| std::fs::read(&f).ok().map(|b| (f, b))) {
        Some((f, body)) => {
            let kind = match f.extension().and_then(|e| e.to_str()) {
                Some("html") => "text/html; charset=utf-8",
                Some("js") => "text/javascript",
                Some("wasm") => "application/wasm",
                _ => "application/octet-stream",
            };
            ("200 OK", kind, body)
        }
        None => ("404 Not Found", "text/plain", b"not found".to_vec()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: \
         close\r\n\r\n",
        body.len()
    );
    let _ = stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(&body));
}

/// `tether run` on `model`, greedy, `tokens` tokens.
fn run_args(model: &str, extra: &[&str], tokens: u32) -> Vec<String> {
    let tokens = tokens.to_string();
    let base = [
        "run",
        "--model",
        model,
        "--threads",
        "1",
        "--prompt",
        PROMPT,
        "--max-tokens",
        &tokens,
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// A host waiting for helpers, its stderr read as it runs.
fn start_host(keys: &Path, model: &str, extra: &[&str], tokens: u32) -> Process {
    Process::start(tether(keys).args(run_args(model, extra, tokens)))
}

/// What a page said when its session ended (wasm-demo/tests/tab.mjs's lines).
#[derive(Debug, serde::Deserialize)]
struct Tab {
    state: String,
    status: String,
    backend: String,
    pages: u64,
    queries: u64,
    chunks: u64,
    /// Weight tensors fetched from the host, and taken from the browser's cache.
    fetched: u64,
    cached: u64,
}

/// Opens one page per URL in headless Chromium (tab.mjs) until each session ends; with
/// `close_after`, the first page is closed once it answered that many attention queries; with
/// `profile`, the pages run in that browser profile (kept for the next visit).
fn tabs(pages: &[String], close_after: Option<u32>, profile: Option<&Path>) -> Child {
    let mut node = Command::new("node");
    node.arg(repo().join("wasm-demo/tests/tab.mjs"))
        .args(pages)
        .env("CHROMIUM", chromium())
        .stdout(Stdio::piped());
    if let Some(n) = close_after {
        node.env("TAB_CLOSE_AFTER_QUERIES", n.to_string());
    }
    if let Some(p) = profile {
        node.env("TAB_PROFILE", p);
    }
    node.spawn().unwrap()
}

/// The pages' reports, once tab.mjs is done.
fn reports(node: Child) -> Vec<Tab> {
    let out = node.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "tab.mjs failed: {text}");
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The host alone's tokens.
fn alone(keys: &Path, model: &str, cache: &[&str], tokens: u32) -> String {
    let alone = tether(keys)
        .args(run_args(model, &[&SPLIT[..2], cache].concat(), tokens))
        .output()
        .unwrap();
    assert!(
        alone.status.success(),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    let alone = String::from_utf8(alone.stdout).unwrap();
    assert!(!alone.trim().is_empty());
    alone
}

/// A page URL that joins `host` on load, on `backend` (auto, gpu or cpu): the page from
/// `www`, or with `www` None the one the host serves at /helper/ on the port helpers join.
fn page(www: Option<&str>, host: &str, code: &str, backend: &str) -> String {
    let page = match www {
        Some(www) => format!("http://{www}/helper.html"),
        None => format!("{}/helper/", host.replace("ws://", "http://")),
    };
    format!("{page}?host={host}&code={code}&backend={backend}&join=1")
}

/// Who helps a host in [`with_helpers`].
struct Helpers<'a> {
    /// One tab per entry, on that backend (auto, gpu or cpu).
    tabs: &'a [&'a str],
    /// A helper that joins from this process too.
    native: bool,
    /// Close the first tab once it answered this many attention queries.
    close_after: Option<u32>,
    /// Tokens the host generates.
    tokens: u32,
    /// `--model`.
    model: &'a str,
    /// Flags the host takes alone and with helpers alike (`--cache-type-k` and the like).
    cache: &'a [&'a str],
    /// The page from the host's own port (/helper/); else from a static server, another
    /// origin, which may not pair.
    from_host: bool,
    /// The tabs' browser profile, kept between runs.
    profile: Option<&'a Path>,
    /// Where the host takes helpers (`--accept-helpers`).
    accept: &'a str,
}

/// A host run with `flags`, joined by `who`, each pairing with the code the host shows. Panics
/// unless the host finished, its tokens equal the host alone's (run with `flags`' page size)
/// and every helper held pages; returns the host's stderr and the tabs' reports.
fn with_helpers(flags: &[&str], who: Helpers) -> (String, Vec<Tab>) {
    let www = (!who.from_host).then(|| serve_static(repo().join("wasm-demo/www")));
    // Unique per call: tests run at once, and each scratch directory starts empty.
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let name = format!("{}", CALLS.fetch_add(1, Ordering::SeqCst));
    let host_keys = scratch(&format!("host-keys-{name}"));
    let alone = alone(&host_keys, who.model, who.cache, who.tokens);
    let n = who.tabs.len() + usize::from(who.native);
    let wait = n.to_string();
    let accept = [
        flags,
        who.cache,
        &["--accept-helpers", who.accept, "--helper-wait", "120"],
        &["--wait-helpers", &wait, "--pair-new"],
    ]
    .concat();
    let mut host = start_host(&host_keys, who.model, &accept, who.tokens);
    let url = host.wait_for("accepting helpers on ");
    let code = host.wait_for("pairing code for new helpers: ");
    let pages: Vec<String> = who
        .tabs
        .iter()
        .map(|b| page(www.as_deref(), &url, &code, b))
        .collect();
    let node = tabs(&pages, who.close_after, who.profile);
    let native = who
        .native
        .then(|| native_helper(&url, &code, scratch(&format!("helper-keys-{name}"))));
    let (ok, out, err) = host.finish();
    let tabs = reports(node);
    let native = native.map(|h| h.join().unwrap());
    let _ = std::fs::remove_dir_all(host_keys);
    eprintln!("the tabs: {tabs:?}; the native helper: {native:?}");
    assert!(ok, "{err}\nthe tabs: {tabs:?}");
    assert_eq!(
        out, alone,
        "tokens with browser tabs as helpers vs the host alone\n{err}\nthe tabs: {tabs:?}"
    );
    // A tab closed mid-decode holds nothing at the end (its pages went back to the page file).
    for id in (0..n).filter(|_| who.close_after.is_none()) {
        let line = err
            .lines()
            .find(|l| l.starts_with(&format!("link to helper {id} (a helper that joined")))
            .unwrap_or_else(|| panic!("no link line for helper {id}: {err}"));
        // Unless the host found it slower than attending its pages itself (a tab on
        // SwiftShader can be), and said so.
        let set_aside = err.contains(&format!("a helper was set aside: helper {id} makes"));
        assert!(
            !line.contains(" 0 pages held") || set_aside,
            "{line}\n{err}"
        );
    }
    assert!(
        matches!(
            native,
            None | Some(Ok(SessionEnd::Bye | SessionEnd::Closed(_)))
        ),
        "{native:?}"
    );
    assert_eq!(tabs.len(), who.tabs.len(), "{tabs:?}");
    for (tab, backend) in tabs.iter().zip(who.tabs) {
        let closed = who.close_after.is_some() && std::ptr::eq(tab, &tabs[0]);
        let want = if closed { "closed" } else { "ended" };
        assert_eq!(tab.state, want, "{}", tab.status);
        assert!(tab.queries > 0, "{tab:?}");
        if *backend == "cpu" {
            assert_eq!(tab.backend, "cpu");
        }
        eprintln!(
            "a tab ran on {}: {} pages held at the end, {} queries, {} prefill chunks",
            tab.backend, tab.pages, tab.queries, tab.chunks
        );
    }
    (err, tabs)
}

fn tabs_on<'a>(backends: &'a [&'a str]) -> Helpers<'a> {
    Helpers {
        tabs: backends,
        native: false,
        close_after: None,
        tokens: 12,
        model: "tiny",
        cache: &[],
        from_host: true,
        profile: None,
        accept: "127.0.0.1:0",
    }
}

/// The whole flow on the tab's CPU backend: pairing, the split prefill's tail layers, pages
/// and attention in the tab.
#[test]
fn a_browser_tab_pairs_helps_and_gives_the_host_alone_tokens() {
    if !browser_ready() {
        return;
    }
    let (err, tabs) = with_helpers(SPLIT, tabs_on(&["cpu"]));
    assert!(
        err.contains("ubatches ran their tail layers on the helper"),
        "{err}"
    );
    assert!(tabs[0].chunks > 0, "{tabs:?}");
}

/// Pages and attention on the page's WebGPU (SwiftShader in headless Chromium), or on the
/// CPU where the browser gives no adapter (the output says which ran).
#[test]
fn a_tab_holds_pages_and_answers_attention_on_webgpu() {
    if !browser_ready() {
        return;
    }
    with_helpers(&SPLIT[..4], tabs_on(&["gpu"]));
}

/// Compact pages in a tab on WebGPU: q8_0 keys and q4_0 values, as the host stores them,
/// held and attended there (`tiny256`: heads of 64 values, whole blocks) give the host-alone
/// tokens.
#[test]
fn a_tab_holds_compact_pages_on_webgpu() {
    if !browser_ready() {
        return;
    }
    let cache = ["--cache-type-k", "q8_0", "--cache-type-v", "q4_0"];
    let who = Helpers {
        model: "tiny256",
        cache: &cache,
        ..tabs_on(&["gpu"])
    };
    let (_, tabs) = with_helpers(&SPLIT[..4], who);
    assert!(
        tabs[0].backend.starts_with("gpu") && tabs[0].pages > 0,
        "{tabs:?}"
    );
}

/// `auto` does not pick a software WebGPU adapter (SwiftShader, all headless Chromium has
/// here): it is slower than the tab's CPU backend, and the page says why it chose the CPU.
#[test]
fn auto_passes_over_a_software_webgpu_adapter() {
    if !browser_ready() {
        return;
    }
    let (_, tabs) = with_helpers(&SPLIT[..4], tabs_on(&["auto"]));
    let backend = &tabs[0].backend;
    assert!(
        backend.starts_with("cpu (WebGPU here is a software adapter"),
        "{backend}"
    );
}

/// The split prefill's tail layers (DeltaNet and gated attention) on the tab's WebGPU
/// (SwiftShader in headless Chromium): the host's tokens equal the host alone's. This is where
/// a kernel that Chromium's shader compiler (Tint) rejects but naga accepts shows: its batches
/// run nothing in the tab, and the tokens change (the delta kernel once did).
#[test]
fn a_tab_runs_the_tail_layers_on_webgpu_with_the_host_alone_tokens() {
    if !browser_ready() {
        return;
    }
    let (_, tabs) = with_helpers(SPLIT, tabs_on(&["gpu"]));
    assert!(tabs[0].chunks > 0, "{tabs:?}");
}

/// Two tabs at once: the pages spread over both, the same tokens.
#[test]
fn two_tabs_at_once_give_the_host_alone_tokens() {
    if !browser_ready() {
        return;
    }
    with_helpers(SPLIT, tabs_on(&["cpu", "cpu"]));
}

/// A tab and a native helper together.
#[test]
fn a_tab_and_a_native_helper_give_the_host_alone_tokens() {
    if !browser_ready() {
        return;
    }
    let who = Helpers {
        native: true,
        ..tabs_on(&["cpu"])
    };
    with_helpers(SPLIT, who);
}

/// A tab closed while the host decodes with pages on it: the host attends them from its page
/// file and finishes with the host-alone tokens.
#[test]
fn a_tab_closed_mid_decode_costs_no_tokens() {
    if !browser_ready() {
        return;
    }
    // Long enough a decode that the tab is closed well before its end.
    let who = Helpers {
        close_after: Some(4),
        tokens: 200,
        ..tabs_on(&["cpu"])
    };
    let (err, tabs) = with_helpers(&SPLIT[..4], who);
    assert!(err.contains("a helper was lost"), "{err}");
    assert!(
        tabs[0].pages > 0,
        "the tab held no pages when closed: {tabs:?}"
    );
}

/// A checkpoint rather than a preset: the tab takes its page from the host's port (/helper/),
/// fetches the weights of the tail layers it is given from the host, and on its next visit
/// (the same browser profile, a new host run) takes them from its cache; the tokens are the
/// host alone's both times.
#[test]
fn a_tab_fetches_a_checkpoints_weights_from_the_host_and_keeps_them() {
    if !browser_ready() {
        return;
    }
    let dir = scratch("checkpoint");
    let made = tether(&dir)
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let profile = scratch("profile");
    let model = dir.to_str().unwrap();
    // The same address both times: a browser keeps a cache per origin, port included.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let accept = port.to_string();
    let visit = || {
        let who = Helpers {
            model,
            profile: Some(&profile),
            accept: &accept,
            ..tabs_on(&["cpu"])
        };
        let (_, tabs) = with_helpers(SPLIT, who);
        assert!(tabs[0].chunks > 0, "{tabs:?}");
        (tabs[0].fetched, tabs[0].cached)
    };
    let (fetched, cached) = visit();
    assert!(
        fetched > 0 && cached == 0,
        "first visit: {fetched} fetched, {cached} cached"
    );
    let (again, from_cache) = visit();
    assert_eq!(
        (again, from_cache),
        (0, fetched),
        "the next visit fetches nothing"
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(profile);
}

/// A page from another site (here a static server on another port: another origin) may not
/// pair: any page a user opens could otherwise guess codes at a host on the LAN. The tab says
/// why (the host, waiting for a helper, is then stopped).
#[test]
fn a_page_from_another_site_is_refused_pairing() {
    if !browser_ready() {
        return;
    }
    let www = serve_static(repo().join("wasm-demo/www"));
    let keys = scratch("host-keys-other-site");
    let flags = [
        "--accept-helpers",
        "127.0.0.1:0",
        "--helper-wait",
        "120",
        "--pair-new",
    ];
    let mut host = start_host(&keys, "tiny", &flags, 4);
    let url = host.wait_for("accepting helpers on ");
    let code = host.wait_for("pairing code for new helpers: ");
    let tabs = reports(tabs(&[page(Some(&www), &url, &code, "cpu")], None, None));
    drop(host);
    assert_eq!(tabs[0].state, "error", "{tabs:?}");
    assert!(tabs[0].status.contains("may not pair"), "{tabs:?}");
    let _ = std::fs::remove_dir_all(keys);
}
