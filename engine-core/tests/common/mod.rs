//! What the fuzz tests share: how many cases a run takes, and byte-level mutations.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};

/// `default` cases, or `PROPTEST_CASES` when set. proptest reads that variable only into its
/// own default config, which a test that sets `cases` overrides; reading it here keeps both
/// the cheap CI default and `scripts/fuzz`'s long runs. Failing inputs are saved beside the
/// test (`fuzz_*.proptest-regressions`, to commit) and replayed first: proptest's default
/// place for them needs a `lib.rs`, which an integration test has not.
pub fn cases(default: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

/// One change to a byte string. Every variant changes its input (so a test can expect the
/// changed bytes to be refused), whatever the input's length.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// XOR the byte at `at` (modulo the length) with a non-zero mask.
    Flip { at: usize, mask: u8 },
    /// Keep only a prefix (shorter than the input).
    Truncate { keep: usize },
    /// Append bytes.
    Extend(Vec<u8>),
    /// Something else entirely.
    Replace(Vec<u8>),
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1..=255u8).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        2 => any::<usize>().prop_map(|keep| Mutation::Truncate { keep }),
        1 => proptest::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
        1 => proptest::collection::vec(any::<u8>(), 0..256).prop_map(Mutation::Replace),
    ]
}

impl Mutation {
    pub fn apply(&self, bytes: &mut Vec<u8>) {
        match self {
            Mutation::Flip { at, mask } if !bytes.is_empty() => {
                let i = at % bytes.len();
                bytes[i] ^= mask;
            }
            Mutation::Flip { .. } => bytes.push(0),
            Mutation::Truncate { keep } if !bytes.is_empty() => {
                bytes.truncate(keep % bytes.len());
            }
            Mutation::Truncate { .. } => bytes.push(0),
            Mutation::Extend(more) => bytes.extend_from_slice(more),
            Mutation::Replace(other) if other != bytes => bytes.clone_from(other),
            Mutation::Replace(_) => bytes.push(0),
        }
    }
}
