//! Drafts for speculative decoding: tokens proposed cheaply, then checked by the model in one
//! forward pass of several rows ([`crate::generate::Generation`]), which keeps exactly the
//! tokens plain decoding would have drawn. Here the n-gram drafter (llama.cpp's `ngram`
//! speculation, "prompt lookup decoding"): text that repeats its context (code being edited,
//! a quoted document, a loop) is proposed from where it appeared before.

use std::borrow::Cow;

use crate::backend::{Backend, STEP_ROWS};
use crate::error::{Error, Result};
use crate::generate::argmax;
use crate::kv::PagedKv;
use crate::model::{Model, State};

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
    /// The checkpoint's multi-token-prediction head, chained: each draft the most likely
    /// token after the one before (`generate::MtpDrafts`).
    Mtp,
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

    /// An error where drafts are asked for on a backend that cannot keep plain decoding's
    /// tokens with them ([`Backend::rows_are_steps`]).
    pub fn check_backend(&self, be: &dyn Backend) -> Result<()> {
        if self.kind != DraftKind::None && !be.rows_are_steps() {
            return Err(Error::Invalid(format!(
                "--draft: the {} backend's pass over a draft is not yet its decode steps bit \
                 for bit, so drafts could change a token; use --backend cpu",
                be.name()
            )));
        }
        Ok(())
    }

    /// The token drafter these settings ask for (`None`: no speculation, or the MTP head's,
    /// which `Generation::with_drafts` keeps itself), once they are checked.
    pub fn drafter(self) -> Result<Option<Box<dyn Drafter + Send>>> {
        self.validate()?;
        Ok(match self.kind {
            DraftKind::None | DraftKind::Mtp => None,
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

/// Drafts from the checkpoint's multi-token-prediction head for one sequence. The head's
/// cache holds an entry for every position the sequence consumed but its last: position `p`'s
/// from the main model's final row at `p` and the token at `p + 1` (vLLM's layout). A draft
/// starts from the last position's final row and the token just drawn, and goes on from the
/// head's own output; once the model has checked it, the entries made from the head's own
/// rows are replaced by ones from the main model's rows of the kept tokens.
pub struct MtpDrafts {
    kv: PagedKv,
    /// The main model's final row at the sequence's last position (`None` before a prefill
    /// that handed its rows over).
    last: Option<Vec<f32>>,
    max: usize,
}

impl MtpDrafts {
    /// Up to `max` tokens a step, for `state`'s sequence (still empty: the head's cache
    /// follows it from its first position).
    pub fn new(model: &Model, state: &State, max: usize) -> Result<MtpDrafts> {
        if !model.has_mtp() {
            return Err(Error::Invalid(
                "--draft mtp: this model has no multi-token-prediction head (a checkpoint's \
                 mtp.* tensors, a GGUF's nextn block; a preset has one with --mtp)"
                    .into(),
            ));
        }
        if state.pos != 0 {
            return Err(Error::Invalid(
                "--draft mtp follows a sequence from its first position".into(),
            ));
        }
        // A model with no full-attention layer of its own still has the head's.
        let page = state.page_size().unwrap_or(256);
        Ok(MtpDrafts {
            kv: model.new_mtp_cache(page, state.kv_types()),
            last: None,
            max,
        })
    }

    /// The head's cache: an entry per position the sequence consumed but its last.
    pub fn cache(&self) -> &PagedKv {
        &self.kv
    }

    /// The main model's final row at the sequence's last position, where the next draft
    /// starts: what a checkpoint of the sequence keeps for [`Self::rewind`].
    pub fn last_row(&self) -> Option<&[f32]> {
        self.last.as_deref()
    }

    /// Follow the sequence back to position `pos` (a checkpoint's), whose last position's
    /// final row is `last` (`None` at position 0): the entries past it are cut.
    pub fn rewind(&mut self, be: &dyn Backend, pos: usize, last: Option<Vec<f32>>) -> Result<()> {
        if (pos > 0) != last.is_some() || pos > self.kv.len() + 1 {
            return Err(Error::Invalid(format!(
                "MTP drafts: a rewind to position {pos} for a head that holds {} positions",
                self.kv.len()
            )));
        }
        self.kv.truncate(be, pos.saturating_sub(1))?;
        self.last = last;
        Ok(())
    }

    /// Take the main model's final rows `hidden` (`[n, H]`) of positions `pos ..`, where
    /// `context[p]` is the token at position `p`: each row with a known next token becomes an
    /// entry of the head's cache; the last row, whose next token is still to be drawn, is
    /// where the next draft starts. A sequence that goes on after a generation (a server's
    /// next turn) pairs the row it ended with first.
    pub fn take_rows(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        hidden: &[f32],
        pos: usize,
        context: &[u32],
    ) -> Result<()> {
        let h = model.config.hidden_size;
        let start = pos.checked_sub(usize::from(self.last.is_some()));
        let Some(start) = start.filter(|&s| s == self.kv.len() && hidden.len() >= h) else {
            return Err(Error::Invalid(format!(
                "MTP drafts: rows from position {pos} for a head that holds {} positions",
                self.kv.len()
            )));
        };
        let hidden: Cow<[f32]> = match self.last.take() {
            Some(last) => [last, hidden.to_vec()].concat().into(),
            None => hidden.into(),
        };
        let (n, pos) = (hidden.len() / h, start);
        let paired = n.min(context.len().saturating_sub(pos + 1));
        if paired > 0 {
            let tokens = &context[pos + 1..pos + 1 + paired];
            model.mtp(be, &mut self.kv, (&hidden[..paired * h], tokens), pos)?;
        }
        self.last = match paired < n {
            true => Some(hidden[(n - 1) * h..].to_vec()),
            false => None,
        };
        Ok(())
    }

    /// The draft after `tok`, the token at position `pos` about to be fed: at most `room`
    /// tokens, each the head's most likely token after the one before. The entry for the
    /// position before `pos` is made even when `room` is 0.
    pub fn propose(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        tok: u32,
        pos: usize,
        room: usize,
    ) -> Result<Vec<u32>> {
        let Some(last) = self.last.take() else {
            return Err(Error::Invalid(
                "MTP drafts need the final rows of every position before: start the \
                 generation with its prefill"
                    .into(),
            ));
        };
        let (mut g, mut token) = (last, tok);
        let k = self.max.min(room);
        let mut draft = Vec::with_capacity(k);
        for j in 0..k.max(1) {
            let (out, logits) = model.mtp(be, &mut self.kv, (&g, &[token]), pos - 1 + j)?;
            if j < k {
                token = argmax(&logits);
                draft.push(token);
                g = out;
            }
        }
        Ok(draft)
    }

    /// After the model checked `[tok, draft..]` at positions `pos ..` and kept `kept` drafts:
    /// `hidden` holds the main model's final rows of those positions. The entries the draft
    /// made from the head's own rows give way to entries from the main model's.
    pub fn accept(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        hidden: &[f32],
        kept: &[u32],
        pos: usize,
    ) -> Result<()> {
        let h = model.config.hidden_size;
        self.kv.truncate(be, pos)?;
        if !kept.is_empty() {
            model.mtp(be, &mut self.kv, (&hidden[..kept.len() * h], kept), pos)?;
        }
        let at = kept.len() * h;
        self.last = Some(hidden[at..at + h].to_vec());
        Ok(())
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
