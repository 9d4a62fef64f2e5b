//! Drafts for speculative decoding: tokens proposed cheaply, then checked by the model in one
//! forward pass of several rows ([`crate::generate::Generation`]), which keeps exactly the
//! tokens plain decoding would have drawn. Here the n-gram drafter (llama.cpp's `ngram`
//! speculation, "prompt lookup decoding"): text that repeats its context (code being edited,
//! a quoted document, a loop) is proposed from where it appeared before.

use crate::backend::STEP_ROWS;
use crate::error::{Error, Result};

/// The most tokens a draft may hold: with the token being fed, a verify pass is at most
/// `STEP_ROWS - 1` rows, so every row is computed as its own decode step would be.
pub const MAX_DRAFT: usize = STEP_ROWS - 2;

/// The longest n-gram looked up: the last 3 tokens, then 2, then 1.
const NGRAM: usize = 3;

/// Where drafts come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum DraftKind {
    /// No drafts: one token per forward pass.
    #[default]
    None,
    /// The tokens that followed an earlier occurrence of the context's last 3 (else 2, else 1)
    /// tokens: the latest with a whole draft after it.
    Ngram,
}

/// How many tokens to draft, and from where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drafts {
    pub kind: DraftKind,
    /// At most this many tokens a step (`--draft-max`), at most [`MAX_DRAFT`].
    pub max: usize,
    /// A lookup that finds fewer is not drafted (`--draft-min`): the pass would cost more than
    /// its likely gain.
    pub min: usize,
}

impl Default for Drafts {
    fn default() -> Self {
        Drafts {
            kind: DraftKind::None,
            max: 8,
            min: 1,
        }
    }
}

/// Something that proposes drafts.
pub trait Drafter {
    /// The draft that follows `context` (every token consumed or about to be), at most `room`
    /// tokens (what the caller may still use); empty where nothing is worth checking.
    fn propose(&mut self, context: &[u32], room: usize) -> Vec<u32>;
}

impl Drafts {
    pub fn validate(&self) -> Result<()> {
        if self.max == 0 || self.max > MAX_DRAFT || self.min == 0 || self.min > self.max {
            return Err(Error::Invalid(format!(
                "--draft-max {} / --draft-min {}: need 1 <= min <= max <= {MAX_DRAFT}",
                self.max, self.min
            )));
        }
        Ok(())
    }

    /// The drafter these settings ask for (`None`: no speculation), once they are checked.
    pub fn drafter(self) -> Result<Option<Box<dyn Drafter + Send>>> {
        self.validate()?;
        Ok(match self.kind {
            DraftKind::None => None,
            DraftKind::Ngram => Some(Box::new(Ngram {
                max: self.max,
                min: self.min,
            })),
        })
    }
}

/// The n-gram drafter: [`lookup`], at most `max` tokens, none where it finds fewer than `min`.
struct Ngram {
    max: usize,
    min: usize,
}

impl Drafter for Ngram {
    fn propose(&mut self, context: &[u32], room: usize) -> Vec<u32> {
        let draft = lookup(context, self.max.min(room));
        match draft.len() >= self.min {
            true => draft,
            false => Vec::new(),
        }
    }
}

/// Drafts that replay a known continuation of a prompt of `prompt` tokens (a plain run's own
/// tokens): the ceiling of what drafting can buy, where every draft is kept (`tether bench
/// --draft-ceiling`), and, with `wrong_at`, a draft whose token at that index is changed so
/// that it is refused there (the rollback tests).
pub struct Replay {
    pub prompt: usize,
    pub tokens: Vec<u32>,
    pub max: usize,
    pub wrong_at: Option<usize>,
}

impl Drafter for Replay {
    fn propose(&mut self, context: &[u32], room: usize) -> Vec<u32> {
        let from = context.len().saturating_sub(self.prompt);
        let end = (from + self.max.min(room)).min(self.tokens.len());
        let mut draft = self.tokens[from.min(end)..end].to_vec();
        if let Some(d) = self.wrong_at.and_then(|i| draft.get_mut(i)) {
            *d = d.wrapping_add(1);
        }
        draft
    }
}

/// Up to `max` tokens that followed an earlier occurrence of the last `n` tokens of `context`,
/// for the longest `n` up to [`NGRAM`] that occurs earlier: the latest occurrence with `max`
/// tokens after it, else the one with the most (in a run of one repeated token the latest
/// occurrence is followed by a single token).
fn lookup(context: &[u32], max: usize) -> Vec<u32> {
    if max == 0 {
        return Vec::new();
    }
    for n in (1..=NGRAM).rev() {
        let Some(start) = context.len().checked_sub(n) else {
            continue;
        };
        let key = &context[start..];
        let mut best: Option<(usize, usize)> = None;
        for i in (0..start).rev().filter(|&i| &context[i..i + n] == key) {
            let (from, len) = (i + n, (context.len() - i - n).min(max));
            if best.is_none_or(|(_, l)| len > l) {
                best = Some((from, len));
            }
            if len == max {
                break;
            }
        }
        if let Some((from, len)) = best {
            return context[from..from + len].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ngram(max: usize, min: usize) -> Drafts {
        Drafts {
            kind: DraftKind::Ngram,
            max,
            min,
        }
    }

    fn drafter(max: usize, min: usize) -> Box<dyn Drafter + Send> {
        ngram(max, min).drafter().unwrap().unwrap()
    }

    #[test]
    fn the_longest_earlier_ngram_proposes_what_followed_it() {
        let mut d = drafter(4, 1);
        // "1 2 3" occurred at 0 and was followed by 9 8 7 6 5; the latest "3" alone by 4.
        let ctx = [1, 2, 3, 9, 8, 7, 6, 5, 3, 4, 1, 2, 3];
        assert_eq!(d.propose(&ctx, 100), vec![9, 8, 7, 6]);
        // Two tokens of room: two drafted.
        assert_eq!(d.propose(&ctx, 2), vec![9, 8]);
        // No 3-gram or 2-gram match: an earlier occurrence of the last token, the latest
        // with a whole draft after it.
        assert_eq!(d.propose(&[5, 6, 7, 5, 8, 9, 5], 100), vec![6, 7, 5, 8]);
        assert_eq!(d.propose(&[5, 6, 7, 5, 8, 9, 5], 3), vec![8, 9, 5]);
        // A run of one token: the occurrence with a whole draft after it.
        assert_eq!(d.propose(&[5, 7, 7, 7, 7, 7, 7, 7], 100), vec![7, 7, 7, 7]);
        // Nothing repeats: nothing drafted.
        assert!(d.propose(&[1, 2, 3, 4], 100).is_empty());
        assert!(d.propose(&[], 100).is_empty());
        // A draft that runs into the end of the context stops there; under --draft-min none.
        assert_eq!(d.propose(&[7, 8, 7], 100), vec![8, 7]);
        assert!(drafter(4, 3).propose(&[7, 8, 7], 100).is_empty());
        assert!(Drafts::default().drafter().unwrap().is_none());
    }

    #[test]
    fn limits_are_checked() {
        assert!(ngram(MAX_DRAFT, 1).validate().is_ok());
        assert!(ngram(MAX_DRAFT + 1, 1).validate().is_err());
        assert!(ngram(3, 4).validate().is_err());
        assert!(ngram(0, 0).validate().is_err());
    }

    #[test]
    fn a_replay_proposes_the_continuation_and_can_be_wrong() {
        let mut r = Replay {
            prompt: 2,
            tokens: vec![10, 11, 12, 13],
            max: 3,
            wrong_at: None,
        };
        assert_eq!(r.propose(&[1, 2, 10], 100), vec![11, 12, 13]);
        assert_eq!(r.propose(&[1, 2, 10, 11, 12], 100), vec![13]);
        assert_eq!(r.propose(&[1, 2, 10], 1), vec![11]);
        assert!(r.propose(&[1, 2, 10, 11, 12, 13], 100).is_empty());
        r.wrong_at = Some(1);
        assert_eq!(r.propose(&[1, 2, 10], 100), vec![11, 13, 13]);
    }
}
