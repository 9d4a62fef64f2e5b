//! What a host gives browser tabs over plain HTTP (host-native/src/lend.rs), as `tether serve
//! --accept-helpers` runs it: the helper page at /helper/, and a checkpoint's tensors at
//! /weights/... to a paired helper only. A request without a MAC, a stranger's, and one whose
//! MAC is for another path are refused; what a paired helper gets checks against the
//! checkpoint's own bytes. (A browser tab doing all of this: host-native/tests/tab.rs.)

use std::path::{Path, PathBuf};
use std::process::Command;

use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::lending::{lending_key, signed, tensor_path, Lent, Sealed, MANIFEST_PATH};
use engine_core::link::doors;
use engine_core::link::keys::{KeyStore, Keypair};
use engine_core::link::secure::wire_limit;
use engine_core::link::ws;
use tests::Process;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-lend-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn tether(keys: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tether"));
    c.env("TETHER_CONFIG_DIR", keys)
        .env("TETHER_CACHE_DIR", keys.join("cache"));
    c
}

/// GET `url` without following redirects: status, Location, body.
fn get(agent: &ureq::Agent, url: &str) -> (u16, String, Vec<u8>) {
    let mut r = agent.get(url).call().unwrap();
    let location = r
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = r
        .body_mut()
        .with_config()
        .limit(1 << 30)
        .read_to_vec()
        .unwrap();
    (r.status().as_u16(), location, body)
}

#[test]
fn a_paired_helper_gets_the_weights_and_nobody_else_does() {
    let dir = scratch("dir");
    let model = dir.join("model");
    let made = tether(&dir)
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let mut server = Process::start(
        tether(&dir.join("host"))
            .args(["serve", "--threads", "1", "--port", "0", "--log", "warn"])
            .args(["--accept-helpers", "--model"])
            .arg(&model),
    );
    let base = server
        .stdout_line()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    let code = server.wait_for("pairing code for new helpers: ");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();

    // The page, for a person who opens /helper in a browser.
    let (status, location, _) = get(&agent, &format!("{base}/helper"));
    assert_eq!((status, location.as_str()), (308, "/helper/"));
    let (status, _, page) = get(&agent, &format!("{base}/helper/"));
    let text = String::from_utf8_lossy(&page);
    match status {
        200 => assert!(text.contains("<title>tether"), "{text}"),
        // Built before scripts/build-wasm.sh ran: it says how to get the page.
        _ => assert!(text.contains("scripts/build-wasm.sh"), "{status}: {text}"),
    }

    // A helper pairs on /helper by the code; its key store then holds the host's key.
    let mut store = KeyStore::open(&dir.join("helper"), "helper").unwrap();
    let url = format!("{}/helper", base.replace("http://", "ws://"));
    let ws = ws::connect(&url, wire_limit(DEFAULT_MAX_FRAME)).unwrap();
    let link = doors::pair_with(&url, ws, &mut store, &code, "host").unwrap();
    let host = store.peer(&url).unwrap();
    let key = lending_key(store.keypair(), &host).unwrap();

    let (status, _, _) = get(&agent, &format!("{base}{MANIFEST_PATH}"));
    assert_eq!(status, 401, "no key and MAC");
    let stranger = Keypair::generate();
    let theirs = lending_key(&stranger, &host).unwrap();
    let (status, _, _) = get(
        &agent,
        &format!("{base}{}", signed(MANIFEST_PATH, &stranger.public, &theirs)),
    );
    assert_eq!(status, 403, "an unpaired key");

    let sealed = format!(
        "{base}{}",
        signed(MANIFEST_PATH, &store.keypair().public, &key)
    );
    let (status, _, body) = get(&agent, &sealed);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let sealed: Sealed = serde_json::from_slice(&body).unwrap();
    assert!(sealed.open(&theirs).is_err(), "sealed for this helper only");
    let manifest = sealed.open(&key).unwrap();
    let Lent::Tensors { tensors } = &manifest.weights else {
        panic!("a checkpoint lends tensors: {manifest:?}")
    };
    let on_disk = engine_core::weights::load_dir(&model).unwrap();
    assert_eq!(tensors.len(), on_disk.len());

    let entry = &manifest.assigned(&(4..8))[0];
    let path = tensor_path(&manifest.digest, &entry.name);
    let url = format!("{base}{}", signed(&path, &store.keypair().public, &key));
    let (status, _, bytes) = get(&agent, &url);
    assert_eq!(status, 200);
    assert_eq!(bytes, *on_disk[&entry.name].data.as_bytes());
    entry.tensor(bytes).unwrap();
    // The manifest's MAC does not open a tensor.
    let manifest_query = signed(MANIFEST_PATH, &store.keypair().public, &key);
    let query = manifest_query.split_once('?').unwrap().1;
    let (status, _, _) = get(&agent, &format!("{base}{path}?{query}"));
    assert_eq!(status, 403, "a MAC for another path");

    drop(link);
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}
