//! The model identity host and helper compare: a checkpoint that differs in one weight byte is
//! another model (the sampled fingerprint it replaced let such pairs through); the digest of
//! each weight file is cached by path, size and modification time, so an unchanged file is not
//! read again and a changed one is.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, SystemTime};

use engine_core::identity::ModelIdentity;
use engine_core::Model;
use tests::fixtures_dir;

fn identity(dir: &Path) -> ModelIdentity {
    ModelIdentity::of_checkpoint(dir, &Model::read_config(dir).unwrap()).unwrap()
}

/// Adds 1 to the byte at `at` of `path`, keeps its size, and moves its modification time on by
/// `secs` (as any later write would).
fn change_byte(path: &Path, at: u64, secs: u64) {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[b[0].wrapping_add(1)]).unwrap();
    f.set_modified(SystemTime::now() + Duration::from_secs(secs))
        .unwrap();
}

/// The digest the cache holds for `dir`'s weight file.
fn file_digest(cache_json: &str, dir: &Path) -> String {
    let entries: serde_json::Value = serde_json::from_str(cache_json).unwrap();
    let key = dir.join("model.safetensors").canonicalize().unwrap();
    entries[key.to_str().unwrap()]["digest"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn one_weight_byte_makes_another_model_and_the_cache_sees_it() {
    let root = std::env::temp_dir().join(format!("tether-identity-{}", std::process::id()));
    let (a, b, cache) = (root.join("a"), root.join("b"), root.join("cache"));
    for d in [&a, &b] {
        std::fs::create_dir_all(d).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixtures_dir().join("tiny_fp32").join(f), d.join(f)).unwrap();
        }
    }
    // This test file is its own process: the variable reaches no other test.
    std::env::set_var("TETHER_CACHE_DIR", &cache);

    let first = identity(&a);
    assert_eq!(first.name, "a");
    assert_eq!(first.digest, identity(&b).digest, "copies are one model");

    // The cache answers for a file whose path, size and time are unchanged: a digest planted
    // there comes back.
    let cache_file = cache.join("model-digests.json");
    let text = std::fs::read_to_string(&cache_file).unwrap();
    let planted = text.replacen(&file_digest(&text, &a), &"0".repeat(64), 1);
    std::fs::write(&cache_file, planted).unwrap();
    assert_ne!(identity(&a).digest, first.digest, "the cache was not read");
    std::fs::remove_dir_all(&cache).unwrap();
    assert_eq!(identity(&a).digest, first.digest);

    // A byte in the middle of the weights, far from anything a sample of each tensor's ends
    // would read, changed after its file's digest was cached: hashed again.
    let weights = b.join("model.safetensors");
    let len = File::open(&weights).unwrap().metadata().unwrap().len();
    change_byte(&weights, len / 2 + 1001, 5);
    assert_ne!(
        identity(&b).digest,
        first.digest,
        "one changed byte is another model"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
