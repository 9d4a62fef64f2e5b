//! A model's identity for the handshake: host and helper must run the same weights, or a split
//! would silently change tokens, the one thing tether promises never happens. So the digest is
//! cryptographic (blake3) and covers every byte that makes the model: the config and every
//! weight byte of a checkpoint (two fine-tunes that differ in a few rows, or in added tokens,
//! differ), or a synthetic preset's shape, dtype and seed (which determine every weight).
//!
//! Hashing a 54 GB checkpoint takes a while, so each weight file's digest is cached in the
//! platform's cache directory, keyed by its path, size and modification time: a checkpoint is
//! read whole once, then every start costs a `stat` per file.

use std::collections::BTreeMap;
#[cfg(not(target_arch = "wasm32"))]
use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
#[cfg(not(target_arch = "wasm32"))]
use crate::error::Result;
use crate::tensor::DType;
use crate::weights::TensorMap;

/// Who a model is: a name for people, a digest for the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// What a person calls the model: a checkpoint directory's name, or the preset with its
    /// dtype and seed. Refusals name both sides' models by this.
    pub name: String,
    /// blake3 (hex) of what the model is made of; peers with different digests must not talk.
    pub digest: String,
}

/// blake3's key derivation context: a digest made for this purpose only.
const CONTEXT: &str = "tether 2026-12 model identity v1";

fn hasher(kind: &str, config: &ModelConfig) -> blake3::Hasher {
    let mut h = blake3::Hasher::new_derive_key(CONTEXT);
    h.update(kind.as_bytes());
    h.update(&[0]);
    let json = serde_json::to_string(config).expect("a config serialises");
    field(&mut h, json.as_bytes());
    h
}

/// A length-prefixed field, so that no two sequences of fields hash alike.
fn field(h: &mut blake3::Hasher, bytes: &[u8]) {
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

impl ModelIdentity {
    /// Weights in memory (tests, conversions): the config, then every tensor's name, dtype,
    /// shape and bytes, in name order.
    pub fn of_tensors(name: &str, config: &ModelConfig, tensors: &TensorMap) -> Self {
        let mut h = hasher("tensors", config);
        let sorted: BTreeMap<&String, _> = tensors.iter().collect();
        for (n, t) in sorted {
            field(&mut h, n.as_bytes());
            field(&mut h, t.dtype().name().as_bytes());
            let dims: Vec<u8> = t
                .shape
                .iter()
                .flat_map(|d| (*d as u64).to_le_bytes())
                .collect();
            field(&mut h, &dims);
            field(&mut h, &t.data.as_bytes());
        }
        ModelIdentity {
            name: name.to_string(),
            digest: h.finalize().to_hex().to_string(),
        }
    }

    /// A synthetic preset: its weights are a function of shape, dtype and seed, so those are
    /// its identity (a helper knows it without generating a weight).
    ///
    /// The MTP head is left out: it runs on the host alone, so a helper started without
    /// `--mtp` holds the same layers as a host started with it.
    pub fn of_preset(preset: &str, config: &ModelConfig, dtype: DType, seed: u64) -> Self {
        let layers_only = ModelConfig {
            mtp_layers: 0,
            ..config.clone()
        };
        let mut h = hasher("preset", &layers_only);
        field(&mut h, preset.as_bytes());
        field(&mut h, dtype.name().as_bytes());
        h.update(&seed.to_le_bytes());
        ModelIdentity {
            name: format!(
                "preset {preset} ({} layers, {}, seed {seed})",
                config.num_hidden_layers,
                dtype.name()
            ),
            digest: h.finalize().to_hex().to_string(),
        }
    }

    /// A checkpoint directory: the config, then each weight file's name and the blake3 of all
    /// its bytes (cached, see the module doc).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn of_checkpoint(dir: &Path, config: &ModelConfig) -> Result<Self> {
        let mut h = hasher("checkpoint", config);
        let mut cache = DigestCache::load();
        for file in crate::weights::checkpoint_files(dir)? {
            let digest = cache.digest(&file)?;
            let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
            field(&mut h, name.unwrap_or_default().as_bytes());
            h.update(&digest);
        }
        cache.save();
        Ok(ModelIdentity {
            name: base_name(dir),
            digest: h.finalize().to_hex().to_string(),
        })
    }

    /// A one-file model (a GGUF): the config, then the blake3 of the file's bytes (cached).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn of_file(path: &Path, config: &ModelConfig) -> Result<Self> {
        let mut h = hasher("file", config);
        let mut cache = DigestCache::load();
        h.update(&cache.digest(path)?);
        cache.save();
        Ok(ModelIdentity {
            name: base_name(path),
            digest: h.finalize().to_hex().to_string(),
        })
    }
}

/// The last component of `path` as the user sees it (`.` resolved).
#[cfg(not(target_arch = "wasm32"))]
fn base_name(path: &Path) -> String {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    canonical.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    )
}

/// Where tether keeps caches: `$TETHER_CACHE_DIR`, else the platform's cache directory
/// (`~/.cache/tether` on Linux, `~/Library/Caches/tether` on macOS).
#[cfg(not(target_arch = "wasm32"))]
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("TETHER_CACHE_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None => dirs::cache_dir().map(|d| d.join("tether")),
    }
}

/// What a file's digest was computed from: if any of it changed, the file is hashed again.
#[cfg(not(target_arch = "wasm32"))]
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Stamp {
    len: u64,
    modified_ns: u128,
    digest: String,
}

/// File digests by absolute path, in `model-digests.json` of [`cache_dir`]. A cache that is
/// missing, unreadable or unwritable only costs hashing again; it never fails a load.
#[cfg(not(target_arch = "wasm32"))]
struct DigestCache {
    path: Option<PathBuf>,
    entries: BTreeMap<String, Stamp>,
    changed: bool,
}

#[cfg(not(target_arch = "wasm32"))]
impl DigestCache {
    fn load() -> Self {
        let path = cache_dir().map(|d| d.join("model-digests.json"));
        let entries = path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        DigestCache {
            path,
            entries,
            changed: false,
        }
    }

    fn digest(&mut self, file: &Path) -> Result<[u8; 32]> {
        let io = |e| crate::error::Error::io(file, e);
        let meta = std::fs::metadata(file).map_err(io)?;
        let modified_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let key = file
            .canonicalize()
            .unwrap_or_else(|_| file.to_path_buf())
            .display()
            .to_string();
        let cached = self
            .entries
            .get(&key)
            .filter(|s| s.len == meta.len() && s.modified_ns == modified_ns && modified_ns != 0);
        if let Some(bytes) = cached.and_then(|s| parse_hex32(&s.digest)) {
            return Ok(bytes);
        }
        eprintln!(
            "hashing {} ({:.1} GB) for the model's identity; cached from now on",
            file.display(),
            meta.len() as f64 / 1e9
        );
        let mut h = blake3::Hasher::new();
        h.update_mmap_rayon(file).map_err(io)?;
        let digest = *h.finalize().as_bytes();
        self.entries.insert(
            key,
            Stamp {
                len: meta.len(),
                modified_ns,
                digest: blake3::Hash::from(digest).to_hex().to_string(),
            },
        );
        self.changed = true;
        Ok(digest)
    }

    /// Writes the cache if it changed: to a temporary file renamed over the old one, so a
    /// concurrent reader sees the old cache or the new one, never half of one.
    fn save(&self) {
        let Some(path) = self.path.as_ref().filter(|_| self.changed) else {
            return;
        };
        // Named by process and thread: two loads at once each write their own.
        let thread = format!("{:?}", std::thread::current().id());
        let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
        let tmp = path.with_extension(format!("tmp{}-{thread}", std::process::id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| {
                std::fs::write(
                    &tmp,
                    serde_json::to_vec_pretty(&self.entries).unwrap_or_default(),
                )
            })
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            eprintln!("could not write the digest cache {}: {e}", path.display());
        }
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    blake3::Hash::from_hex(s).ok().map(|h| *h.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;

    #[test]
    fn same_weights_same_digest_other_weights_other_digest() {
        let c = synth::preset("tiny").unwrap();
        let a = synth::random_weights(&c, DType::F32, 1).unwrap();
        let b = synth::random_weights(&c, DType::F32, 2).unwrap();
        let id = |t: &TensorMap| ModelIdentity::of_tensors("m", &c, t).digest;
        assert_eq!(id(&a), id(&a.clone()));
        assert_ne!(id(&a), id(&b));
        assert_ne!(
            id(&a),
            id(&synth::random_weights(&c, DType::BF16, 1).unwrap())
        );
        // One weight changed anywhere: a different model.
        let mut changed = a.clone();
        let t = changed
            .get_mut("model.layers.5.mlp.down_proj.weight")
            .unwrap();
        let mut v = t.data.to_f32_vec();
        v[1234] += 1e-3;
        t.data = crate::tensor::Data::from_f32(&v, DType::F32);
        assert_ne!(id(&a), id(&changed));
    }

    #[test]
    fn presets_differ_by_seed_dtype_and_shape() {
        let c = synth::preset("tiny").unwrap();
        let id = |c: &ModelConfig, d, s| ModelIdentity::of_preset("tiny", c, d, s).digest;
        let base = id(&c, DType::BF16, 0);
        assert_eq!(base, id(&c, DType::BF16, 0));
        assert_ne!(base, id(&c, DType::BF16, 1));
        assert_ne!(base, id(&c, DType::F32, 0));
        assert_ne!(
            base,
            id(&synth::with_layers(c.clone(), 4).unwrap(), DType::BF16, 0)
        );
    }
}
