//! Fuzzing the GGUF reader: a model file is untrusted input, so `gguf::Gguf::parse` and the
//! `qwen35` reading of what it parsed must turn any bytes into a model or an error (never a
//! panic, never an allocation sized by a count the file announces), and every tensor range
//! it accepts must lie in the file. Seeds: the files llama.cpp's converter wrote from the
//! fixtures (tests/fixtures/gguf), mutated.
//!
//! `scripts/fuzz` runs this with many more cases.

mod common;

use std::sync::Arc;

use engine_core::gguf::{qwen35, Gguf};
use engine_core::tensor::SharedBytes;
use proptest::prelude::*;

use common::{cases, mutation};

fn seed() -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gguf/tiny_fp32.f32.gguf"
    );
    std::fs::read(path).expect("the converter's GGUF fixture")
}

/// Parse, then read as a qwen35 model: an error or a model, and accepted ranges in bounds.
fn read(bytes: Vec<u8>) {
    let len = bytes.len();
    let Ok(g) = Gguf::parse(&bytes) else { return };
    for t in &g.tensors {
        assert!(t.range.start <= t.range.end && t.range.end <= len, "{t:?}");
    }
    let Ok(config) = qwen35::config(&g) else {
        return;
    };
    let shared: SharedBytes = Arc::new(bytes);
    if let Ok(tensors) = qwen35::tensors(&g, &shared, config.num_hidden_layers) {
        // Building the model checks every shape against the config.
        let _ = engine_core::Model::from_tensors(config, &tensors);
    }
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn random_bytes_are_refused_or_read(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut with_magic = b"GGUF\x03\x00\x00\x00".to_vec();
        with_magic.extend_from_slice(&bytes);
        read(bytes);
        read(with_magic);
    }

    #[test]
    fn mutated_converter_files_are_refused_or_read(
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let mut bytes = seed();
        for m in &mutations {
            m.apply(&mut bytes);
        }
        read(bytes);
    }

    /// Header counts and a tensor's dimensions and offset set to any value.
    #[test]
    fn any_count_or_offset_is_checked(at in 8usize..4096, value in any::<u64>()) {
        let mut bytes = seed();
        let at = at.min(bytes.len() - 8);
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        read(bytes);
    }
}
