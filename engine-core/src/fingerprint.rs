//! A model's identity for the handshake: host and helper must run the same weights, or a
//! split would silently change tokens. Hashing every weight byte of a 27B checkpoint would
//! take minutes, so the digest covers the config, every tensor's name, dtype and shape, and
//! a fixed sample of each tensor's bytes (both ends and evenly spaced windows): different
//! checkpoints of one shape differ in the sampled bytes with near certainty, and the sampled
//! pages are all a memory-mapped checkpoint has to read.

use crate::config::ModelConfig;
use crate::tensor::Tensor;
use crate::weights::TensorMap;

/// 64-bit FNV-1a, run twice with different offsets for a 128-bit digest.
struct Fnv([u64; 2]);

impl Fnv {
    fn new() -> Self {
        Fnv([0xcbf2_9ce4_8422_2325, 0x6c62_272e_07bb_0142])
    }

    fn update(&mut self, bytes: &[u8]) {
        for h in &mut self.0 {
            for &b in bytes {
                *h = (*h ^ b as u64).wrapping_mul(0x100_0000_01b3);
            }
        }
    }

    fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.0[0], self.0[1])
    }
}

/// Windows of this many bytes are sampled from each tensor, plus its first and last.
const WINDOWS: usize = 32;
const WINDOW: usize = 64;

/// The digest built one tensor at a time, in name order, so a helper can fingerprint weights
/// it generates and drops (it keeps only its layers).
pub struct Fingerprinter {
    h: Fnv,
    last: Option<String>,
}

impl Fingerprinter {
    pub fn new(config: &ModelConfig) -> Self {
        let mut h = Fnv::new();
        h.update(
            serde_json::to_string(config)
                .expect("a config serialises")
                .as_bytes(),
        );
        Fingerprinter { h, last: None }
    }

    /// Add the next tensor; names must come in ascending order.
    pub fn add(&mut self, name: &str, t: &Tensor) {
        assert!(
            self.last.as_deref().is_none_or(|l| l < name),
            "tensors must be fingerprinted in name order"
        );
        let h = &mut self.h;
        h.update(name.as_bytes());
        h.update(t.dtype().name().as_bytes());
        for d in &t.shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        let bytes = t.data.as_bytes();
        h.update(&(bytes.len() as u64).to_le_bytes());
        let span = bytes.len().saturating_sub(WINDOW);
        for i in 0..=WINDOWS {
            let at = span * i / WINDOWS;
            h.update(&bytes[at..(at + WINDOW).min(bytes.len())]);
        }
        self.last = Some(name.to_string());
    }

    pub fn finish(&self) -> String {
        self.h.hex()
    }
}

pub fn model_fingerprint(config: &ModelConfig, tensors: &TensorMap) -> String {
    let mut f = Fingerprinter::new(config);
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        f.add(name, &tensors[name]);
    }
    f.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;
    use crate::tensor::DType;

    #[test]
    fn same_weights_same_print_other_weights_other_print() {
        let c = synth::preset("tiny").unwrap();
        let a = synth::random_weights(&c, DType::F32, 1).unwrap();
        let b = synth::random_weights(&c, DType::F32, 2).unwrap();
        assert_eq!(model_fingerprint(&c, &a), model_fingerprint(&c, &a.clone()));
        assert_ne!(model_fingerprint(&c, &a), model_fingerprint(&c, &b));
        let bf = synth::random_weights(&c, DType::BF16, 1).unwrap();
        assert_ne!(model_fingerprint(&c, &a), model_fingerprint(&c, &bf));
    }
}
