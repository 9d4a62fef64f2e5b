//! Conversation reuse: the tokens the engine's one sequence has consumed, and checkpoints of
//! its state at turn boundaries, so that a request extending the previous conversation
//! prefills only what is new.
//!
//! KV rows can be cut at any position, but the DeltaNet state is one fixed-size summary that
//! every token rewrites: it cannot be rewound by position, only restored from a copy taken at
//! that position. So a copy ([`Checkpoint`]) is taken at the end of every prompt's prefill
//! and, for a chat, where its history ends and the new turn begins (the next turn renders the
//! same history, but the end of this prompt may tokenise differently once the reply follows
//! it); the state as it stands at the end of a generation serves as one more (it is simply not
//! rewound). A new prompt restarts from the latest of these that it shares a prefix with;
//! `State::rewind` also cuts the helper's pages and mirror, so host and helper alike keep the
//! shared prefix.

use engine_core::host::Sequence;
use engine_core::model::Checkpoint;
use engine_core::{Backend, Result, State};

pub struct Conversation {
    /// Every token the state has consumed, in order: `tokens.len() == state.pos`.
    tokens: Vec<u32>,
    /// Ascending positions, all at most `tokens.len()`.
    saved: Vec<Saved>,
    /// The empty state, where an unrelated prompt starts again.
    origin: Checkpoint,
    /// Most checkpoints kept besides the origin (each is a copy of every DeltaNet state).
    keep: usize,
}

/// A prompt's end: the state there and the logits of its last position, so the very same
/// prompt again (a regenerated answer, a retry) needs no prefill at all; with MTP drafts, the
/// main model's final row there, where the head's next draft starts.
struct Saved {
    cp: Checkpoint,
    logits: Vec<f32>,
    last_row: Option<Vec<f32>>,
}

/// Where [`Conversation::restore`] left the state.
pub struct Restored {
    /// Prompt tokens reused; the caller prefills `prompt[reused..]`.
    pub reused: usize,
    /// The last prompt position's logits, when the whole prompt was reused.
    pub logits: Option<Vec<f32>>,
    /// Where the state was rewound to a checkpoint, the final row its last position gave
    /// (when one was kept): what the MTP head's drafts rewind to.
    pub last_row: Option<Vec<f32>>,
}

impl Conversation {
    /// `state` must be fresh (position 0); `be` is the backend that runs it (checkpoints are
    /// copies in that backend: on a GPU, on the device).
    pub fn new(be: &dyn Backend, state: &State, keep: usize) -> Conversation {
        Conversation {
            tokens: Vec::new(),
            saved: Vec::new(),
            origin: state.checkpoint(be),
            keep,
        }
    }

    /// Bring `seq` to the longest reusable prefix of `prompt` (non-empty). On error the
    /// sequence is unchanged.
    pub fn restore(
        &mut self,
        be: &dyn Backend,
        seq: &mut Sequence,
        prompt: &[u32],
    ) -> Result<Restored> {
        let common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        if common == self.tokens.len() && common < prompt.len() {
            // The prompt extends everything the state holds: nothing to rewind.
            return Ok(Restored {
                reused: common,
                logits: None,
                last_row: None,
            });
        }
        let (cp, logits, last_row) = match self.saved.iter().rev().find(|s| s.cp.pos <= common) {
            Some(s) => (
                &s.cp,
                (s.cp.pos == prompt.len()).then(|| s.logits.clone()),
                s.last_row.clone(),
            ),
            None => (&self.origin, None, None),
        };
        seq.rewind(be, cp)?;
        let pos = cp.pos;
        self.saved.retain(|s| s.cp.pos <= pos);
        self.tokens.truncate(pos);
        Ok(Restored {
            reused: pos,
            logits,
            last_row,
        })
    }

    /// Record tokens the state has just consumed.
    pub fn consumed(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Keep a copy of the state where it stands (a prompt's end, or its turn's start) with the
    /// logits and final row (MTP drafts only) its last position gave.
    pub fn checkpoint(
        &mut self,
        be: &dyn Backend,
        state: &State,
        logits: &[f32],
        last_row: Option<&[f32]>,
    ) {
        if self.keep == 0 || self.saved.last().is_some_and(|s| s.cp.pos == state.pos) {
            return;
        }
        if self.saved.len() == self.keep {
            self.saved.remove(0);
        }
        self.saved.push(Saved {
            cp: state.checkpoint(be),
            logits: logits.to_vec(),
            last_row: last_row.map(<[f32]>::to_vec),
        });
    }

    /// Forget everything, after a failure that may have left the state half-updated; `state`
    /// is the fresh one that replaces it.
    pub fn reset(&mut self, be: &dyn Backend, state: &State) {
        self.tokens.clear();
        self.saved.clear();
        self.origin = state.checkpoint(be);
    }

    pub fn origin(&self) -> &Checkpoint {
        &self.origin
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_core::synth::preset;
    use engine_core::CpuBackend;

    fn state() -> Sequence {
        let c = preset("tiny").unwrap();
        Sequence::new(&c, 16)
    }

    /// Pretend the state consumed `tokens` (positions only: no model is run here).
    fn feed(conv: &mut Conversation, st: &mut Sequence, tokens: &[u32]) {
        st.state.pos += tokens.len();
        conv.consumed(tokens);
    }

    #[test]
    fn reuse_the_longest_checkpointed_prefix() {
        let mut st = state();
        let mut conv = Conversation::new(&CpuBackend, &st.state, 4);
        let restore = |conv: &mut Conversation, st: &mut Sequence, p: &[u32]| {
            let r = conv.restore(&CpuBackend, st, p).unwrap();
            assert_eq!(st.state.pos, r.reused);
            (r.reused, r.logits)
        };
        assert_eq!(restore(&mut conv, &mut st, &[1, 2, 3]), (0, None));
        feed(&mut conv, &mut st, &[1, 2, 3]);
        conv.checkpoint(&CpuBackend, &st.state, &[0.5], Some(&[0.25]));
        feed(&mut conv, &mut st, &[9, 9]);
        // Extends everything held: no rewind.
        assert_eq!(restore(&mut conv, &mut st, &[1, 2, 3, 9, 9, 4]), (5, None));
        // Diverges inside the generated part: back to the prompt's end, with its final row.
        let r = conv
            .restore(&CpuBackend, &mut st, &[1, 2, 3, 8, 8])
            .unwrap();
        assert_eq!(
            (r.reused, r.logits, r.last_row),
            (3, None, Some(vec![0.25]))
        );
        // The same prompt again: wholly reused, with its logits.
        assert_eq!(
            restore(&mut conv, &mut st, &[1, 2, 3]),
            (3, Some(vec![0.5]))
        );
        // Shorter than the checkpoint: the origin.
        assert_eq!(restore(&mut conv, &mut st, &[1, 2]), (0, None));
        // Unrelated: the origin.
        feed(&mut conv, &mut st, &[5, 6]);
        assert_eq!(restore(&mut conv, &mut st, &[7]), (0, None));
    }

    #[test]
    fn checkpoints_are_bounded() {
        let mut st = state();
        let mut conv = Conversation::new(&CpuBackend, &st.state, 2);
        for t in 0..5 {
            feed(&mut conv, &mut st, &[t]);
            conv.checkpoint(&CpuBackend, &st.state, &[], None);
        }
        assert_eq!(
            conv.saved.iter().map(|s| s.cp.pos).collect::<Vec<_>>(),
            [4, 5]
        );
        // Position 3 was dropped: diverging at 3 falls back to the origin.
        assert_eq!(
            conv.restore(&CpuBackend, &mut st, &[0, 1, 2, 7])
                .unwrap()
                .reused,
            0
        );
    }
}
