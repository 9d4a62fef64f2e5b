//! Weights a host lends a browser tab over HTTP. A tab has no checkpoint of its own: when a host
//! assigns it the tail layers of a split prefill, it fetches those layers' tensors from the host
//! (`GET /weights/...` on the port it joined), checks them, and keeps them in the browser's
//! storage for its next visit.
//!
//! Only paired peers get weights, and a tab takes them only from the host it paired with:
//! - a request names the helper's public key and carries a MAC of its path, under a key both
//!   sides derive from their static keys (X25519 of one's secret and the other's public key,
//!   [`lending_key`]); the host answers only keys in its key store. No session, nonce or
//!   server state is needed, and a MAC names one path, so a stranger who saw a request can ask
//!   for nothing it has not seen;
//! - the manifest (config, digest, each tensor's blake3) comes back sealed with a MAC under the
//!   same key ([`Sealed`]), each tensor is checked against the manifest's blake3, and the
//!   manifest's digest must be the model digest the host proves in the link's handshake (the
//!   helper session refuses any other);
//! - a preset's manifest carries its seed instead of tensors: the tab generates the weights,
//!   and checks that shape, dtype and seed give the digest.
//!
//! Plain HTTP hides nothing from whoever watches the wire (the link itself is encrypted; the
//! weights are not), as `docs/` says.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::identity::ModelIdentity;
use crate::tensor::{DType, Data, SharedBytes, Tensor};
use crate::weights::{layer_of, TensorMap};
use crate::{synth, Model, ModelConfig};

/// Where a host answers with its [`Sealed`] manifest.
pub const MANIFEST_PATH: &str = "/weights/manifest";

/// Where a host answers with one tensor's bytes, as stored in its checkpoint.
pub fn tensor_path(digest: &str, name: &str) -> String {
    format!("/weights/{digest}/{name}")
}

/// Where a tab that joined `ws://HOST:PORT/...` fetches weights: `http://HOST:PORT` (`wss` →
/// `https`), the same port.
pub fn http_base(ws_url: &str) -> Result<String> {
    let bad = |why: &str| Error::Invalid(format!("{ws_url}: {why}"));
    let (scheme, rest) = ws_url.split_once("://").ok_or_else(|| bad("not a URL"))?;
    let scheme = match scheme {
        "ws" => "http",
        "wss" => "https",
        _ => return Err(bad("not a ws:// or wss:// URL")),
    };
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    Ok(format!("{scheme}://{host}"))
}

/// What a tab needs to know of the host's model to build any of its layers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// The model's name and digest, as the handshake shows them.
    pub name: String,
    pub digest: String,
    pub config: ModelConfig,
    pub weights: Lent,
}

/// How a tab gets the weights.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Lent {
    /// A synthetic preset: generated from its seed, as the host did.
    Preset {
        preset: String,
        dtype: String,
        seed: u64,
    },
    /// A checkpoint: each tensor fetched from [`tensor_path`].
    Tensors { tensors: Vec<Entry> },
}

/// One tensor of a checkpoint: its normalised name, storage dtype, shape and blake3 (hex).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub blake3: String,
}

impl Entry {
    /// The bytes the tensor takes, if its dtype is known and its size fits.
    pub fn bytes(&self) -> Option<usize> {
        let dtype = DType::parse(&self.dtype)?;
        let elems = self
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))?;
        dtype.bytes_for(elems)
    }

    /// `bytes` as this tensor, if they are exactly what the manifest says.
    pub fn tensor(&self, bytes: Vec<u8>) -> Result<Tensor> {
        let bad = |why: String| Error::Weights(format!("tensor {}: {why}", self.name));
        let dtype = DType::parse(&self.dtype).ok_or_else(|| bad("an unknown dtype".into()))?;
        let want = self
            .bytes()
            .ok_or_else(|| bad("a shape too large".into()))?;
        if bytes.len() != want {
            return Err(bad(format!(
                "{} bytes, the manifest says {want}",
                bytes.len()
            )));
        }
        let got = blake3::hash(&bytes).to_hex();
        if got.as_str() != self.blake3 {
            return Err(bad(format!(
                "blake3 {got} differs from the manifest's {}",
                self.blake3
            )));
        }
        let range = 0..bytes.len();
        let shared: SharedBytes = Arc::new(bytes);
        let data = Data::from_bytes(dtype, &shared, range);
        Ok(Tensor {
            shape: self.shape.clone(),
            data,
        })
    }
}

impl Manifest {
    /// A preset's manifest: the seed makes every weight.
    pub fn of_preset(
        identity: &ModelIdentity,
        config: &ModelConfig,
        preset: &str,
        dtype: DType,
        seed: u64,
    ) -> Self {
        Manifest {
            name: identity.name.clone(),
            digest: identity.digest.clone(),
            config: config.clone(),
            weights: Lent::Preset {
                preset: preset.into(),
                dtype: dtype.name().into(),
                seed,
            },
        }
    }

    /// A checkpoint's manifest: every tensor hashed (on every core; a 54 GB checkpoint takes
    /// a while, once per host process).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn of_tensors(identity: &ModelIdentity, config: &ModelConfig, tensors: &TensorMap) -> Self {
        use rayon::prelude::*;
        let mut entries: Vec<Entry> = tensors
            .par_iter()
            .map(|(name, t)| Entry {
                name: name.clone(),
                dtype: t.dtype().name().into(),
                shape: t.shape.clone(),
                blake3: blake3::hash(&t.data.as_bytes()).to_hex().to_string(),
            })
            .collect();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Manifest {
            name: identity.name.clone(),
            digest: identity.digest.clone(),
            config: config.clone(),
            weights: Lent::Tensors { tensors: entries },
        }
    }

    pub fn identity(&self) -> ModelIdentity {
        ModelIdentity {
            name: self.name.clone(),
            digest: self.digest.clone(),
        }
    }

    /// A preset's seed, shape and dtype must give its digest (a checkpoint's digest is checked
    /// by the handshake against the host's).
    pub fn check(&self) -> Result<()> {
        let Lent::Preset {
            preset,
            dtype,
            seed,
        } = &self.weights
        else {
            return Ok(());
        };
        let dtype = parse_dtype(dtype)?;
        let made = ModelIdentity::of_preset(preset, &self.config, dtype, *seed);
        if made.digest != self.digest {
            return Err(Error::Weights(format!(
                "the manifest's preset {preset} (seed {seed}) has digest {}, not {}",
                made.digest, self.digest
            )));
        }
        Ok(())
    }

    /// The tensors of `layers`, to fetch (none for a preset).
    pub fn assigned(&self, layers: &Range<usize>) -> Vec<&Entry> {
        match &self.weights {
            Lent::Preset { .. } => Vec::new(),
            Lent::Tensors { tensors } => tensors
                .iter()
                .filter(|e| layer_of(&e.name).is_some_and(|l| layers.contains(&l)))
                .collect(),
        }
    }

    /// `layers` of the model, from the fetched `tensors` (a preset's generated here).
    pub fn layers(&self, layers: Range<usize>, tensors: &TensorMap) -> Result<Model> {
        let generated;
        let tensors = match &self.weights {
            Lent::Tensors { .. } => tensors,
            Lent::Preset { dtype, seed, .. } => {
                let keep = |name: &str| layer_of(name).is_some_and(|l| layers.contains(&l));
                generated =
                    synth::random_weights_where(&self.config, parse_dtype(dtype)?, *seed, &keep)?;
                &generated
            }
        };
        Model::layers_only(self.config.clone(), tensors, layers, self.identity())
    }
}

fn parse_dtype(dtype: &str) -> Result<DType> {
    DType::parse(dtype).ok_or_else(|| Error::Weights(format!("the manifest's dtype {dtype}")))
}

/// The body of `GET` [`MANIFEST_PATH`]: the manifest's JSON text, and its MAC under the
/// lending key of the helper that asked.
#[cfg(feature = "secure")]
#[derive(Debug, Serialize, Deserialize)]
pub struct Sealed {
    pub manifest: String,
    pub mac: String,
}

#[cfg(feature = "secure")]
mod seal {
    use super::*;
    use crate::link::keys::{hex, unhex, Keypair, PublicKey};

    /// blake3's key derivation context for lending keys.
    const CONTEXT: &str = "tether 2026-12 weights lent over HTTP v1";

    /// The key a host and a paired helper share for weights: X25519 of one's static secret and
    /// the other's static public key, through blake3's key derivation.
    pub fn lending_key(own: &Keypair, peer: &PublicKey) -> Result<[u8; 32]> {
        use snow::params::DHChoice;
        use snow::resolvers::{CryptoResolver, DefaultResolver};
        let mut dh = DefaultResolver
            .resolve_dh(&DHChoice::Curve25519)
            .ok_or_else(|| Error::Invalid("no X25519 in this build".into()))?;
        dh.set(&own.secret);
        let mut shared = [0u8; 32];
        dh.dh(peer, &mut shared)
            .map_err(|e| Error::Invalid(format!("X25519: {e}")))?;
        Ok(blake3::derive_key(CONTEXT, &shared))
    }

    /// The MAC (hex) of `what` under `key`.
    pub fn mac(key: &[u8; 32], what: &[u8]) -> String {
        blake3::keyed_hash(key, what).to_hex().to_string()
    }

    /// Whether `mac` (hex) is `what`'s under `key`; compared in constant time.
    pub fn verify(key: &[u8; 32], what: &[u8], mac: &str) -> bool {
        unhex(mac).is_some_and(|m| blake3::keyed_hash(key, what) == blake3::Hash::from_bytes(m))
    }

    /// `path` with the query that proves who asks: `?key=<own public key>&mac=<MAC of path>`.
    pub fn signed(path: &str, own: &PublicKey, key: &[u8; 32]) -> String {
        format!("{path}?key={}&mac={}", hex(own), mac(key, path.as_bytes()))
    }

    /// Who a request's query (after `?`) says asks, and the MAC it carries.
    pub fn asker(query: &str) -> Option<(PublicKey, String)> {
        let mut key = None;
        let mut mac = None;
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some(("key", v)) => key = unhex(v),
                Some(("mac", v)) => mac = Some(v.to_string()),
                _ => {}
            }
        }
        Some((key?, mac?))
    }

    impl Sealed {
        pub fn new(manifest: &Manifest, key: &[u8; 32]) -> Sealed {
            let text = serde_json::to_string(manifest).expect("a manifest serialises");
            let mac = mac(key, text.as_bytes());
            Sealed {
                manifest: text,
                mac,
            }
        }

        /// The manifest, if the host that shares `key` sealed it.
        pub fn open(&self, key: &[u8; 32]) -> Result<Manifest> {
            if !verify(key, self.manifest.as_bytes(), &self.mac) {
                return Err(Error::Weights(
                    "the manifest is not sealed by the paired host (its MAC differs)".into(),
                ));
            }
            let m: Manifest = serde_json::from_str(&self.manifest)
                .map_err(|e| Error::Weights(format!("the manifest: {e}")))?;
            m.check()?;
            Ok(m)
        }
    }
}

#[cfg(feature = "secure")]
pub use seal::{asker, lending_key, mac, signed, verify};

#[cfg(test)]
#[test]
fn the_weights_come_from_the_port_the_tab_joined() {
    assert_eq!(
        http_base("ws://10.0.0.2:7342").unwrap(),
        "http://10.0.0.2:7342"
    );
    assert_eq!(
        http_base("wss://h.example/helper").unwrap(),
        "https://h.example"
    );
    assert!(http_base("http://h").is_err());
}

#[cfg(all(test, feature = "secure"))]
mod tests {
    use super::*;
    use crate::link::keys::Keypair;
    use crate::source::LoadOptions;

    #[test]
    fn both_sides_derive_the_same_key_and_strangers_another() {
        let (host, tab, stranger) = (
            Keypair::generate(),
            Keypair::generate(),
            Keypair::generate(),
        );
        let a = lending_key(&host, &tab.public).unwrap();
        assert_eq!(a, lending_key(&tab, &host.public).unwrap());
        assert_ne!(a, lending_key(&stranger, &host.public).unwrap());
        let url = signed("/weights/manifest", &tab.public, &a);
        let (who, m) = asker(url.split_once('?').unwrap().1).unwrap();
        assert_eq!(who, tab.public);
        assert!(verify(&a, b"/weights/manifest", &m));
        assert!(!verify(&a, b"/weights/other", &m));
        assert!(!verify(&a, b"/weights/manifest", "zz"));
    }

    #[test]
    fn a_sealed_manifest_opens_only_with_its_key_and_checks_its_tensors() {
        let o = LoadOptions::default();
        let (config, tensors) = o.tensors("tiny").unwrap();
        let identity = ModelIdentity::of_tensors("t", &config, &tensors);
        let m = Manifest::of_tensors(&identity, &config, &tensors);
        let key = [7u8; 32];
        let sealed = Sealed::new(&m, &key);
        assert!(sealed.open(&[8u8; 32]).is_err());
        let opened = sealed.open(&key).unwrap();
        let layer1 = opened.assigned(&(1..2));
        assert!(!layer1.is_empty());
        let e = layer1[0];
        let bytes = tensors[&e.name].data.as_bytes().to_vec();
        let mut wrong = bytes.clone();
        wrong[0] ^= 1;
        assert!(e.tensor(wrong).is_err());
        assert!(e.tensor(bytes[1..].to_vec()).is_err());
        let t = e.tensor(bytes.clone()).unwrap();
        assert_eq!(t.data.as_bytes(), &bytes[..]);
    }

    #[test]
    fn a_preset_manifest_must_give_its_digest() {
        let o = LoadOptions::default();
        let config = o.config("tiny").unwrap();
        let identity = o.identity("tiny", &config).unwrap();
        let m = Manifest::of_preset(&identity, &config, "tiny", DType::BF16, 0);
        m.check().unwrap();
        let mut other = m.clone();
        other.weights = Lent::Preset {
            preset: "tiny".into(),
            dtype: "bf16".into(),
            seed: 1,
        };
        assert!(other.check().is_err());
        let built = m.layers(4..8, &TensorMap::new()).unwrap();
        assert_eq!(built.loaded_layers(), 4..8);
    }
}
