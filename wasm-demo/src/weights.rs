//! The tab's weights, from the host it paired with: the sealed manifest once the link is up,
//! then the tensors of the layers the host assigns, fetched over HTTP from the port the tab
//! joined and checked against the manifest (engine_core::lending says how requests and answers
//! are proven). Fetched tensors are kept in the browser's Cache Storage by model digest and
//! name, so the next visit (to this host or another with the same model) fetches nothing; a
//! page that is not a secure context (plain http from another machine) has no Cache Storage
//! and fetches every visit.

use std::ops::Range;
use std::sync::Mutex;

use engine_core::lending::{
    http_base, lending_key, signed, tensor_path, Entry, Manifest, Sealed, MANIFEST_PATH,
};
use engine_core::link::keys::{Keypair, PublicKey};
use engine_core::weights::TensorMap;
use engine_core::{Error, Model};
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_sys::{Cache, Response};

use crate::tab::js_err;

/// The Cache Storage cache the tab keeps weights in.
const CACHE: &str = "tether-weights";

/// What the tab has fetched and taken from its cache so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fetched {
    pub tensors: u64,
    pub bytes: u64,
    pub cached: u64,
}

/// The model a host lends this tab.
pub struct Lending {
    /// `http://HOST:PORT` of the host's port.
    base: String,
    own: PublicKey,
    key: [u8; 32],
    pub manifest: Manifest,
    pub fetched: Mutex<Fetched>,
}

impl Lending {
    /// The manifest of the host at `ws_url` (whose static key is `host`), sealed for this tab.
    pub async fn open(ws_url: &str, keys: &Keypair, host: &PublicKey) -> Result<Lending, String> {
        let base = http_base(ws_url).map_err(|e| e.to_string())?;
        let key = lending_key(keys, host).map_err(|e| e.to_string())?;
        let url = format!("{base}{}", signed(MANIFEST_PATH, &keys.public, &key));
        let body = fetch(&url).await?;
        let sealed: Sealed =
            serde_json::from_slice(&body).map_err(|e| format!("the host's manifest: {e}"))?;
        let manifest = sealed.open(&key).map_err(|e| e.to_string())?;
        Ok(Lending {
            base,
            own: keys.public,
            key,
            manifest,
            fetched: Mutex::new(Fetched::default()),
        })
    }

    /// The model with no layers: what the handshake compares (config and digest).
    pub fn identity(&self) -> Result<Model, String> {
        self.manifest
            .layers(0..0, &TensorMap::new())
            .map_err(|e| e.to_string())
    }

    pub fn fetched(&self) -> Fetched {
        *self.fetched.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `layers` of the model: their tensors from the cache or the host (a preset's generated).
    pub async fn layers(&self, layers: Range<usize>) -> engine_core::Result<Model> {
        let cache = open_cache().await;
        let mut tensors = TensorMap::new();
        for entry in self.manifest.assigned(&layers) {
            let t = self
                .tensor(entry, cache.as_ref())
                .await
                .map_err(Error::Weights)?;
            tensors.insert(entry.name.clone(), t);
        }
        self.manifest.layers(layers, &tensors)
    }

    /// One tensor: the cached copy if it still checks, else fetched, checked and cached.
    async fn tensor(
        &self,
        entry: &Entry,
        cache: Option<&Cache>,
    ) -> Result<engine_core::tensor::Tensor, String> {
        let path = tensor_path(&self.manifest.digest, &entry.name);
        let cache_key = format!("https://tether.invalid{path}");
        if let Some(bytes) = cached(cache, &cache_key).await {
            if let Ok(t) = entry.tensor(bytes) {
                self.count(|f| f.cached += 1);
                return Ok(t);
            }
        }
        let url = format!("{}{}", self.base, signed(&path, &self.own, &self.key));
        let mut bytes = fetch(&url).await?;
        let n = bytes.len() as u64;
        if let Some(cache) = cache {
            // A full or refused cache costs the next visit a fetch, nothing more.
            if let Ok(copy) = Response::new_with_opt_u8_array(Some(&mut bytes)) {
                let _ = JsFuture::from(cache.put_with_str(&cache_key, &copy)).await;
            }
        }
        let t = entry.tensor(bytes).map_err(|e| e.to_string())?;
        self.count(|f| {
            f.tensors += 1;
            f.bytes += n;
        });
        Ok(t)
    }

    fn count(&self, add: impl FnOnce(&mut Fetched)) {
        add(&mut self.fetched.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// The page's Cache Storage, where there is one (secure contexts only).
async fn open_cache() -> Option<Cache> {
    let caches = web_sys::window()?.caches().ok()?;
    let cache = JsFuture::from(caches.open(CACHE)).await.ok()?;
    cache.dyn_into::<Cache>().ok()
}

async fn cached(cache: Option<&Cache>, key: &str) -> Option<Vec<u8>> {
    let found = JsFuture::from(cache?.match_with_str(key)).await.ok()?;
    let response = found.dyn_into::<Response>().ok()?;
    body(&response).await.ok()
}

/// GET `url`'s body; an answer other than 2xx is an error with the host's text.
async fn fetch(url: &str) -> Result<Vec<u8>, String> {
    let window = web_sys::window().ok_or("no window")?;
    let shown = url.split('?').next().unwrap_or(url);
    let response: Response = JsFuture::from(window.fetch_with_str(url))
        .await
        .map_err(|e| format!("{shown}: {}", js_err(e)))?
        .dyn_into()
        .map_err(|_| format!("{shown}: not a response"))?;
    let bytes = body(&response).await?;
    if !response.ok() {
        let text = String::from_utf8_lossy(&bytes);
        return Err(format!("{shown}: {} {}", response.status(), text.trim()));
    }
    Ok(bytes)
}

async fn body(response: &Response) -> Result<Vec<u8>, String> {
    let buf: JsValue = JsFuture::from(response.array_buffer().map_err(js_err)?)
        .await
        .map_err(js_err)?;
    Ok(js_sys::Uint8Array::new(&buf).to_vec())
}
