//! What a host gives browser tabs over plain HTTP on the port they join (`tether serve`'s own,
//! or `--accept-helpers ADDR`): the helper page at `/helper/` (built into this binary, see
//! build.rs), and the weights of the layers a tab is assigned at `/weights/...`, to paired
//! tabs only (engine_core::lending says how a request proves who asks).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use engine_core::identity::ModelIdentity;
use engine_core::lending::{asker, tensor_path, Manifest, Sealed, MANIFEST_PATH};
use engine_core::link::doors::Doors;
use engine_core::link::keys::PublicKey;
use engine_core::source::LoadOptions;
use engine_core::weights::{self, TensorMap};
use engine_core::{Model, ModelConfig};

include!(concat!(env!("OUT_DIR"), "/page.rs"));

/// How long a weights request waits for the model to load before it is answered 503.
const LOADING_WAIT: Duration = Duration::from_secs(120);

/// How long a weights request from an unknown key waits for a pairing under way to store it.
const PAIRING_WAIT: Duration = Duration::from_secs(2);

/// The model a host lends, known once it has loaded.
pub struct Lent {
    spec: String,
    synth: LoadOptions,
    identity: ModelIdentity,
    config: ModelConfig,
    /// The manifest, with the tensors it lists (memory-mapped), made on the first request.
    hashed: OnceLock<Result<Arc<Hashed>, String>>,
}

struct Hashed {
    manifest: Manifest,
    tensors: TensorMap,
}

impl Lent {
    /// `model` as `--model spec` loaded it (a preset with `synth`'s options, or a checkpoint
    /// directory); only its config and identity are kept.
    pub fn new(spec: &str, synth: &LoadOptions, model: &Model) -> Lent {
        Lent {
            spec: spec.to_string(),
            synth: synth.clone(),
            identity: model.identity.clone(),
            config: model.config.clone(),
            hashed: OnceLock::new(),
        }
    }

    /// A preset's manifest names its seed; a checkpoint's hashes every tensor (once per
    /// process: seconds for small models, longer for 27B).
    fn hashed(&self) -> Result<Arc<Hashed>, String> {
        let made = self.hashed.get_or_init(|| {
            let (identity, config) = (&self.identity, &self.config);
            let dir = std::path::Path::new(&self.spec);
            let hashed = if dir.is_dir() {
                let tensors = weights::load_dir(dir).map_err(|e| e.to_string())?;
                Hashed {
                    manifest: Manifest::of_tensors(identity, config, &tensors),
                    tensors,
                }
            } else {
                let dtype = self.synth.dtype().map_err(|e| e.to_string())?;
                Hashed {
                    manifest: Manifest::of_preset(
                        identity,
                        config,
                        &self.spec,
                        dtype,
                        self.synth.weight_seed,
                    ),
                    tensors: TensorMap::new(),
                }
            };
            Ok(Arc::new(hashed))
        });
        made.clone()
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lent({})", self.identity.name)
    }
}

/// Where the host lends its model, set once the model has loaded (a tab may fetch the page,
/// and join, while the weights load: until then `/weights` answers 503).
pub type LentSlot = Arc<OnceLock<Lent>>;

/// An HTTP answer, for whichever server carries it.
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Bytes,
}

impl Answer {
    fn new(status: u16, content_type: &str, body: Bytes) -> Answer {
        Answer {
            status,
            headers: vec![("Content-Type", content_type.to_string())],
            body,
        }
    }

    fn text(status: u16, text: String) -> Answer {
        Answer::new(
            status,
            "text/plain; charset=utf-8",
            Bytes::from(text + "\n"),
        )
    }

    /// Readable by pages of any origin: a page served elsewhere (static files) may fetch
    /// weights too. Safe because what grants them is the MAC in the URL, not a cookie or the
    /// origin.
    fn any_origin(mut self) -> Answer {
        self.headers
            .push(("Access-Control-Allow-Origin", "*".to_string()));
        self
    }
}

/// A tensor's bytes, shared with the memory map: no copy per request. (`load_dir` maps the
/// checkpoint as it lies, so what is stored is the file's layout.)
struct TensorBytes(Arc<Hashed>, String);

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.tensors[&self.1].data.stored()
    }
}

/// The page and the weights, behind the doors of `--accept-helpers` (whose key store says who
/// is paired).
pub struct Lender {
    pub doors: Arc<Doors>,
    pub lent: LentSlot,
}

impl Lender {
    /// The answer to a plain `method` request for `target` (path and query).
    pub fn answer(&self, method: &str, target: &str) -> Answer {
        if method != "GET" {
            return Answer::text(405, format!("{method} {target}: only GET is served here"));
        }
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        if path == "/helper" {
            let mut a = Answer::text(308, "the helper page is at /helper/".into());
            a.headers.push(("Location", "/helper/".into()));
            return a;
        }
        if let Some(file) = path.strip_prefix("/helper/") {
            return page(file);
        }
        if path.starts_with("/weights/") {
            return self.weights(path, query).any_origin();
        }
        Answer::text(
            404,
            format!(
                "{path}: this port takes helpers (a WebSocket), serves the helper page at \
                 /helper/ and weights to paired helpers"
            ),
        )
    }

    /// The model once loaded: a tab may pair while the host still loads it, and then asks at
    /// once; it waits here (on a thread of its own) rather than failing.
    fn loaded(&self) -> Option<&Lent> {
        let deadline = Instant::now() + LOADING_WAIT;
        loop {
            if let Some(lent) = self.lent.get() {
                return Some(lent);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The lending key of `who`, if paired. A tab asks as soon as its side of the pairing
    /// handshake ends, which can be before this side has stored its key: an unknown key gets
    /// [`PAIRING_WAIT`] to appear.
    fn paired(&self, who: &PublicKey) -> Option<[u8; 32]> {
        let deadline = Instant::now() + PAIRING_WAIT;
        loop {
            if let Some(key) = self.doors.lending_key(who) {
                return Some(key);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `/weights/manifest` or `/weights/DIGEST/NAME`, for a paired helper only.
    fn weights(&self, path: &str, query: &str) -> Answer {
        let Some((who, mac)) = asker(query) else {
            return Answer::text(
                401,
                "weights go to paired helpers only: the request must name its key and MAC".into(),
            );
        };
        let Some(key) = self.paired(&who) else {
            return Answer::text(403, "this helper is not paired with this host".into());
        };
        if !engine_core::lending::verify(&key, path.as_bytes(), &mac) {
            return Answer::text(403, "the request's MAC is not this helper's".into());
        }
        let Some(lent) = self.loaded() else {
            return Answer::text(503, "the model is still loading; try again".into());
        };
        let hashed = match lent.hashed() {
            Ok(h) => h,
            Err(e) => return Answer::text(500, format!("the model's weights: {e}")),
        };
        if path == MANIFEST_PATH {
            let sealed = Sealed::new(&hashed.manifest, &key);
            let body = serde_json::to_vec(&sealed).expect("a sealed manifest serialises");
            return Answer::new(200, "application/json", Bytes::from(body));
        }
        let digest = &hashed.manifest.digest;
        let name = path
            .strip_prefix("/weights/")
            .and_then(|rest| rest.strip_prefix(digest.as_str()))
            .and_then(|rest| rest.strip_prefix('/'));
        match name.filter(|n| hashed.tensors.contains_key(*n)) {
            Some(name) => {
                debug_assert_eq!(tensor_path(digest, name), path);
                let body = Bytes::from_owner(TensorBytes(hashed.clone(), name.to_string()));
                let mut a = Answer::new(200, "application/octet-stream", body);
                // The digest in the path names the bytes for good.
                a.headers.push((
                    "Cache-Control",
                    "private, max-age=31536000, immutable".into(),
                ));
                a
            }
            None => Answer::text(404, format!("{path}: no such tensor of model {digest}")),
        }
    }
}

/// One of the helper page's files.
fn page(file: &str) -> Answer {
    let file = if file.is_empty() { "helper.html" } else { file };
    let Some(files) = PAGE else {
        return Answer::text(
            404,
            "this tether was built without the helper page: its source tree lacked \
             wasm-demo/www/pkg, which is checked in; restore it (or rebuild it with \
             scripts/build-wasm.sh), then build tether again"
                .into(),
        );
    };
    match files.iter().find(|(name, _)| *name == file) {
        Some((name, bytes)) => {
            let kind = match name.rsplit('.').next() {
                Some("html") => "text/html; charset=utf-8",
                Some("js") => "text/javascript; charset=utf-8",
                Some("wasm") => "application/wasm",
                _ => "application/octet-stream",
            };
            Answer::new(200, kind, Bytes::from_static(bytes))
        }
        None => Answer::text(
            404,
            format!("/helper/{file}: no such file of the helper page"),
        ),
    }
}
