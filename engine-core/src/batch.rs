//! Several sequences in one step (continuous batching): each active sequence's decode row
//! rides in one pass over the weights with the others', and one sequence at a time prefills a
//! chunk of its prompt in a pass of its own, so a long prompt holds the others up for one
//! chunk at most. Requests join and leave between steps.
//!
//! Each answer is the one the request gets alone. A decode pass of fewer than
//! [`STEP_ROWS`] rows gives every row, bit for bit, what its own one-row step gives on a
//! backend whose kernels say so ([`Backend::rows_are_steps`]): the products are
//! batch-invariant there, every other op but the conv, the delta rule and attention works row
//! by row, and those three run sequence by sequence ([`Model::advance_spans`]). A prefill
//! chunk is one ubatch of the prompt (the split plan's), the ubatch a prefill alone runs, in
//! a pass of its own: mixed into the decode rows it would take the many-row kernels and
//! change their arithmetic. So a step that prefills reads the weights twice; a step that only
//! decodes reads them once for every sequence.

use crate::backend::{Backend, STEP_ROWS};
use crate::error::{Error, Result};
use crate::generate::Sampler;
use crate::host::split::{self, SplitPlan};
use crate::host::Sequence;
use crate::model::{Logits, Model, Pass, Span};

/// One request to run in the batch.
pub struct Request {
    /// The caller's name for it, in every event.
    pub id: u64,
    /// A fresh sequence, or one holding what the prompt's first `seq.state.pos` tokens made
    /// (a cached prefix, forked at one of `breaks` or at the prompt's end).
    pub seq: Sequence,
    /// The whole prompt, the tokens `seq` holds included.
    pub prompt: Vec<u32>,
    /// When `seq` holds the whole prompt: the logits of its last position, which the first
    /// token is drawn from.
    pub logits: Option<Vec<f32>>,
    /// Positions of the prompt where a prefill ubatch ends, ubatches starting again from each
    /// (a chat's message boundaries): the ubatch boundaries, and so the state at each break
    /// and the answer, are a function of the prompt and its breaks alone, whether the prefill
    /// starts from position 0 or from a prefix cached at a break.
    pub breaks: Vec<usize>,
    /// Where to fork the sequence for a prefix cache ([`Batch::take_forks`]): breaks, or
    /// the prompt's length (its end).
    pub fork_at: Vec<usize>,
    pub sampler: Sampler,
    /// Tokens that end the answer (not sent).
    pub stop: Vec<u32>,
    pub max_tokens: usize,
}

/// What a step did for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A token of the answer, its `n`-th (from 1), with the logits it was drawn from where
    /// the batch keeps them ([`Batch::keep_logits`]).
    Token {
        id: u64,
        token: u32,
        n: usize,
        logits: Option<Vec<f32>>,
    },
    /// The answer is complete; the request has left the batch.
    Done { id: u64, reason: Finish },
}

/// Why an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was drawn.
    Stop,
    /// `max_tokens` were sent.
    Length,
}

/// The rows one step ran for one request: its decode row, or a ubatch of its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRows {
    pub id: u64,
    pub rows: usize,
    pub prefill: bool,
}

/// A request's sequence as it stood at a break or at its prompt's end, with the prompt tokens
/// it holds: a prefix a later request may start from.
pub struct Fork {
    pub id: u64,
    pub tokens: Vec<u32>,
    /// The request's breaks below the fork: where its prefill restarted on the way there.
    pub breaks: Vec<usize>,
    pub seq: Sequence,
    /// At the prompt's end, the logits of its last position.
    pub logits: Option<Vec<f32>>,
}

/// A request in the batch.
struct Slot {
    id: u64,
    seq: Sequence,
    prompt: Vec<u32>,
    /// Strictly ascending, inside the prompt.
    breaks: Vec<usize>,
    fork_at: Vec<usize>,
    /// Prompt tokens fed so far.
    prefilled: usize,
    /// A sequence that joined holding the whole prompt: the logits its first token is drawn
    /// from, at the next step.
    cached_logits: Option<Vec<f32>>,
    sampler: Sampler,
    stop: Vec<u32>,
    max_tokens: usize,
    sent: usize,
    /// The token drawn last, fed by the next decode pass.
    drawn: Option<u32>,
    done: bool,
}

/// The active requests of a server, stepped together.
pub struct Batch<'m> {
    model: &'m Model,
    be: &'m dyn Backend,
    /// Prefill chunks are its ubatches.
    plan: SplitPlan,
    slots: Vec<Slot>,
    keep_logits: bool,
    forks: Vec<Fork>,
    /// What the last step ran, in the order it ran.
    last: Vec<StepRows>,
}

impl<'m> Batch<'m> {
    /// An empty batch; prompts prefill in `plan`'s ubatches (on the host: a batch's
    /// sequences keep their pages here).
    pub fn new(model: &'m Model, be: &'m dyn Backend, plan: SplitPlan) -> Result<Self> {
        if !be.rows_are_steps() {
            return Err(Error::Invalid(format!(
                "the {} backend has not shown that a row's arithmetic is the same in a pass \
                 of several: it runs one request at a time",
                be.name()
            )));
        }
        Ok(Batch {
            model,
            be,
            plan,
            slots: Vec::new(),
            keep_logits: false,
            forks: Vec::new(),
            last: Vec::new(),
        })
    }

    /// Every token event carries the logits it was drawn from (a client that asks for
    /// probabilities; the tests, which compare them with a request's run alone).
    pub fn keep_logits(mut self) -> Self {
        self.keep_logits = true;
        self
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes the requests' sequences hold (KV pages and DeltaNet states): zero once every
    /// request has left.
    pub fn state_bytes(&self) -> usize {
        let state = |s: &Slot| s.seq.state.kv_bytes() + s.seq.state.delta_bytes();
        self.slots.iter().map(state).sum()
    }

    /// Take `r` in: it prefills from the next step on, after the requests that came before.
    /// Refused (nothing else changes) if its id is taken, its prompt is empty or holds an id
    /// outside the vocabulary, it asks for no token, its sequence holds more than the prompt
    /// (or all of it without the logits) or stops short of it elsewhere than at a break (its
    /// ubatches would then start where its prefill from 0 does not), its breaks do not ascend,
    /// or it asks for a fork elsewhere than at a break or its end.
    pub fn join(&mut self, mut r: Request) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        if self.slots.iter().any(|s| s.id == r.id) {
            return Err(Error::Invalid(format!(
                "request {} is already in the batch",
                r.id
            )));
        }
        if r.prompt.is_empty() || r.max_tokens == 0 {
            return Err(Error::Invalid(
                "a request needs a prompt and room for one token at least".into(),
            ));
        }
        if let Some(&id) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange { id, vocab });
        }
        let held = r.seq.state.pos;
        let logits_ok = match &r.logits {
            None => held < r.prompt.len(),
            Some(l) => held == r.prompt.len() && l.len() == vocab,
        };
        if !logits_ok {
            return Err(Error::Invalid(format!(
                "a sequence holding {held} of {} prompt tokens needs {} logits",
                r.prompt.len(),
                if held == r.prompt.len() {
                    "its last position's"
                } else {
                    "no"
                }
            )));
        }
        if !r.breaks.windows(2).all(|w| w[0] < w[1]) {
            return Err(Error::Invalid(format!(
                "prefill breaks must ascend: {:?}",
                r.breaks
            )));
        }
        r.breaks.retain(|&b| b > 0 && b < r.prompt.len());
        let len = r.prompt.len();
        let at_break = |p: usize| r.breaks.contains(&p) || p == len;
        if (held > 0 && !at_break(held)) || !r.fork_at.iter().all(|&p| at_break(p)) {
            return Err(Error::Invalid(format!(
                "a sequence may hold, and fork at, only a break or the end of its prompt: holds \
                 {held}, forks at {:?}, breaks at {:?}",
                r.fork_at, r.breaks
            )));
        }
        self.slots.push(Slot {
            id: r.id,
            seq: r.seq,
            prompt: r.prompt,
            breaks: r.breaks,
            fork_at: r.fork_at,
            prefilled: held,
            cached_logits: r.logits,
            sampler: r.sampler,
            stop: r.stop,
            max_tokens: r.max_tokens,
            sent: 0,
            drawn: None,
            done: false,
        });
        Ok(())
    }

    /// Take request `id` out (a cancellation), returning its sequence; the others go on as
    /// if it had never been there.
    pub fn leave(&mut self, id: u64) -> Option<Sequence> {
        let i = self.slots.iter().position(|s| s.id == id)?;
        Some(self.slots.remove(i).seq)
    }

    /// One step: every request that has drawn a token feeds it (in passes of fewer than
    /// [`STEP_ROWS`] rows) and draws the next; then the oldest request still prefilling runs
    /// one ubatch of its prompt, and draws its first token when that was the last. Requests
    /// that finish leave. On error the sequences may have moved on part of a step, so every
    /// request leaves (the batch is empty, ready for new ones): the caller fails them all.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        let keep = self.keep_logits;
        self.last.clear();
        for slot in &mut self.slots {
            if let Some(logits) = slot.cached_logits.take() {
                slot.draw(&logits, &mut events, keep);
            }
        }
        let stepped = self
            .decode(&mut events, keep)
            .and_then(|()| self.prefill(&mut events, keep));
        match stepped {
            Ok(()) => {
                self.slots.retain(|s| !s.done);
                Ok(events)
            }
            Err(e) => {
                self.slots.clear();
                Err(e)
            }
        }
    }

    fn decode(&mut self, events: &mut Vec<Event>, keep: bool) -> Result<()> {
        let (model, be) = (self.model, self.be);
        let mut feeding: Vec<&mut Slot> = self
            .slots
            .iter_mut()
            .filter(|s| s.drawn.is_some())
            .collect();
        for group in feeding.chunks_mut(STEP_ROWS - 1) {
            let tokens: Vec<u32> = group.iter().map(|s| s.drawn.expect("filtered")).collect();
            self.last.extend(group.iter().map(|s| StepRows {
                id: s.id,
                rows: 1,
                prefill: false,
            }));
            let mut seqs: Vec<&mut Sequence> = group.iter_mut().map(|s| &mut s.seq).collect();
            let logits = decode_rows(model, be, &mut seqs, &tokens)?;
            let vocab = logits.len() / group.len();
            for (slot, row) in group.iter_mut().zip(logits.chunks_exact(vocab)) {
                slot.draw(row, events, keep);
            }
        }
        Ok(())
    }

    fn prefill(&mut self, events: &mut Vec<Event>, keep: bool) -> Result<()> {
        let Some(slot) = self.slots.iter_mut().find(|s| s.prefilled < s.prompt.len()) else {
            return Ok(());
        };
        let mut end = (slot.prefilled + self.plan.ubatch.max(1)).min(slot.prompt.len());
        if let Some(&b) = slot.breaks.iter().find(|&&b| b > slot.prefilled) {
            end = end.min(b);
        }
        let chunk = &slot.prompt[slot.prefilled..end];
        self.last.push(StepRows {
            id: slot.id,
            rows: chunk.len(),
            prefill: true,
        });
        let (logits, _) = split::prefill(self.model, self.be, &mut slot.seq, chunk, &self.plan)?;
        slot.prefilled = end;
        let last = end == slot.prompt.len();
        if slot.fork_at.contains(&end) {
            self.forks.push(Fork {
                id: slot.id,
                tokens: slot.prompt[..end].to_vec(),
                breaks: slot.breaks.iter().copied().filter(|&b| b < end).collect(),
                seq: slot.seq.fork(&self.model.config, self.be)?,
                logits: last.then(|| logits.clone()),
            });
        }
        if last {
            slot.draw(&logits, events, keep);
        }
        Ok(())
    }

    /// The rows the last step ran for each request, decode rows first (a request that drew
    /// its first token from cached logits ran none).
    pub fn last_step(&self) -> &[StepRows] {
        &self.last
    }

    /// The sequences forked at breaks and prompt ends since the last call (requests that
    /// asked for them, [`Request::fork`]), oldest first.
    pub fn take_forks(&mut self) -> Vec<Fork> {
        std::mem::take(&mut self.forks)
    }
}

impl Slot {
    /// Draw the next token from `logits` (its sequence's last row's): sent, and fed by the
    /// next decode pass unless the answer ends with it (a stop token, or the last token asked
    /// for: never fed, as a generation alone never feeds its last).
    fn draw(&mut self, logits: &[f32], events: &mut Vec<Event>, keep: bool) {
        let token = self.sampler.sample(logits);
        self.drawn = None;
        if self.stop.contains(&token) {
            self.finish(Finish::Stop, events);
            return;
        }
        self.sent += 1;
        events.push(Event::Token {
            id: self.id,
            token,
            n: self.sent,
            logits: keep.then(|| logits.to_vec()),
        });
        match self.sent >= self.max_tokens {
            true => self.finish(Finish::Length, events),
            false => self.drawn = Some(token),
        }
    }

    fn finish(&mut self, reason: Finish, events: &mut Vec<Event>) {
        self.done = true;
        events.push(Event::Done {
            id: self.id,
            reason,
        });
    }
}

/// One decode row for each of `seqs` (fewer than [`STEP_ROWS`]), `tokens[i]` at
/// `seqs[i]`'s position, in one pass: the logits `[seqs, vocab]`, each row the bits its
/// sequence's own step gives on a backend whose rows are steps.
pub fn decode_rows(
    model: &Model,
    be: &dyn Backend,
    seqs: &mut [&mut Sequence],
    tokens: &[u32],
) -> Result<Vec<f32>> {
    if seqs.len() != tokens.len() || seqs.is_empty() || seqs.len() >= STEP_ROWS {
        return Err(Error::Invalid(format!(
            "a decode pass takes one token for each of 1 to {} sequences, not {} for {}",
            STEP_ROWS - 1,
            tokens.len(),
            seqs.len()
        )));
    }
    let x = model.embed(be, tokens)?;
    let mut pass = Pass::new(x, 0, 0..model.config.num_hidden_layers);
    let mut spans: Vec<Span> = seqs
        .iter_mut()
        .map(|s| Span {
            rows: 1,
            pos: s.state.pos,
            state: &mut s.state,
            source: &mut s.placement,
        })
        .collect();
    model.advance_spans(be, &mut spans, &mut pass, false, None)?;
    for s in seqs.iter_mut() {
        s.state.pos += 1;
        s.offload(be)?;
    }
    model.head(be, pass.x, Logits::All)
}
