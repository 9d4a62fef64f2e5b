//! Turning logits into tokens: the sampler (greedy, or temperature with top-k / top-p / min-p
//! filters and a seeded RNG) and the prefill-then-decode loop shared by every front end, with
//! speculative steps where drafts are asked for.

use std::collections::VecDeque;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::backend::{Act, Backend};
use crate::draft::{DraftKind, Drafter, Drafts, MtpDrafts, MAX_DRAFT};
use crate::error::{Error, Result};
use crate::host::split::{self, RowSink, SplitPlan, SplitReport};
use crate::host::Sequence;
use crate::model::{Logits, Model};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax; ties go to the lowest id, as torch's argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one.
    pub min_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::Invalid(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::Invalid(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        Ok(())
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

pub struct Sampler {
    params: SamplingParams,
    rng: SmallRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = SmallRng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng })
    }

    /// Filters apply after temperature scaling, in the order top-k, top-p, min-p (as HF does).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit_desc);
        let max = cand[0].1 / p.temperature;
        let mut probs: Vec<f32> = cand
            .iter()
            .map(|c| (c.1 / p.temperature - max).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &x) in probs.iter().enumerate() {
                cum += x;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let floor = p.min_p * probs[0];
        keep = probs[..keep]
            .iter()
            .take_while(|&&x| x >= floor)
            .count()
            .max(1);
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &x) in probs[..keep].iter().enumerate() {
            if r < x {
                return cand[i].0;
            }
            r -= x;
        }
        cand[keep - 1].0
    }
}

/// One sequence being generated: prefill the prompt, then draw tokens one at a time. A drawn
/// token is fed to the model only when the next one is asked for, so the last token of a
/// generation costs no forward pass.
///
/// With drafts ([`Self::with_drafts`]) feeding a token is a speculative step: the drafted
/// tokens ride along in the same forward pass (each row computed as its own decode step
/// would be: [`crate::backend::STEP_ROWS`]), the sampler draws from each row's logits in
/// turn, and the drafts are kept while they match its draws. A mismatch rewinds the sequence
/// to its checkpoint from before the pass and feeds the kept tokens again, so the state, the
/// logits and every token are those of plain decoding: greedy, bit for bit; sampled, the same
/// distribution (a draft is one token, so drawing and comparing is the lossless rule
/// `min(1, p/q)` with the residual drawn from).
pub struct Generation<'a> {
    model: &'a Model,
    backend: &'a dyn Backend,
    pub seq: &'a mut Sequence,
    /// Borrowed, so that a server's redo after a lost helper goes on with its draws.
    sampler: &'a mut Sampler,
    stop: Vec<u32>,
    logits: Vec<f32>,
    pending: Option<u32>,
    speculation: Speculation<'a>,
    /// Every token consumed or to be (from the sequence's first position where the MTP head
    /// drafts): the n-gram drafter's context.
    context: Vec<u32>,
    /// Drafts kept by the last step, returned before anything is drawn.
    ready: VecDeque<u32>,
    /// The sampler's draw at a step's first mismatch: the next token.
    drawn: Option<u32>,
    /// Tokens the caller may still take (`None`: no limit), so no draft runs past it.
    room: Option<usize>,
    pub stats: DraftStats,
}

/// Where a generation's drafts come from.
enum Speculation<'a> {
    None,
    /// A drafter that proposes from the tokens alone (n-gram lookup, a replay).
    Tokens(Box<dyn Drafter + Send + 'a>),
    /// The MTP head, which drafts from the main model's final rows.
    Mtp(MtpDrafts),
}

/// What speculation did: drafted tokens, those kept, and the passes that checked them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DraftStats {
    pub drafted: usize,
    pub accepted: usize,
    pub steps: usize,
    /// Steps whose mismatch made the kept tokens be fed again.
    pub replays: usize,
}

impl<'a> Generation<'a> {
    pub fn new(
        model: &'a Model,
        backend: &'a dyn Backend,
        seq: &'a mut Sequence,
        sampler: &'a mut Sampler,
        stop: Vec<u32>,
    ) -> Self {
        Generation {
            model,
            backend,
            seq,
            sampler,
            stop,
            logits: Vec::new(),
            pending: None,
            speculation: Speculation::None,
            context: Vec::new(),
            ready: VecDeque::new(),
            drawn: None,
            room: None,
            stats: DraftStats::default(),
        }
    }

    /// Speculate with the drafts of `drafter` (`None`: decode one token a pass).
    pub fn with_drafter(mut self, drafter: Option<Box<dyn Drafter + Send + 'a>>) -> Self {
        self.speculation = match drafter {
            Some(d) => Speculation::Tokens(d),
            None => Speculation::None,
        };
        self
    }

    /// Speculate as `drafts` say (`--draft`): the MTP head's need a model that has one and a
    /// sequence this generation prefills from its first position.
    pub fn with_drafts(self, drafts: Drafts) -> Result<Self> {
        drafts.check_backend(self.backend)?;
        match drafts.kind {
            DraftKind::Mtp => {
                drafts.validate()?;
                let mtp = MtpDrafts::new(self.model, &self.seq.state, drafts.max)?;
                self.with_mtp(mtp)
            }
            _ => Ok(self.with_drafter(drafts.drafter()?)),
        }
    }

    /// Speculate with the MTP head's drafts `mtp`, which follow this generation's sequence
    /// (a server keeps them from turn to turn: [`Self::take_mtp`]).
    pub fn with_mtp(mut self, mtp: MtpDrafts) -> Result<Self> {
        Drafts {
            kind: DraftKind::Mtp,
            ..Drafts::default()
        }
        .check_backend(self.backend)?;
        self.speculation = Speculation::Mtp(mtp);
        Ok(self)
    }

    /// The MTP head's drafts, as they follow the sequence now; the generation drafts no more.
    pub fn take_mtp(&mut self) -> Option<MtpDrafts> {
        match std::mem::replace(&mut self.speculation, Speculation::None) {
            Speculation::Mtp(m) => Some(m),
            other => {
                self.speculation = other;
                None
            }
        }
    }

    /// At most `n` more tokens will be taken: drafts never run past them (a server's state then
    /// holds no token it did not send).
    pub fn limit(&mut self, n: usize) {
        self.room = Some(n);
    }

    /// Run the prompt in ubatches (split with the sequence's helper when `plan` says so); only
    /// the last row's logits are computed.
    pub fn prefill(&mut self, prompt: &[u32], plan: &SplitPlan) -> Result<SplitReport> {
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        let (model, be) = (self.model, self.backend);
        self.context.extend_from_slice(prompt);
        let (seq, context) = (&mut *self.seq, &self.context);
        let mut mtp = match &mut self.speculation {
            Speculation::Mtp(m) => Some(m),
            _ => None,
        };
        let has_mtp = mtp.is_some();
        // The MTP head's cache takes every prompt row as the prefill makes it.
        let mut take = |x: &Act, pos: usize| -> Result<()> {
            match mtp.as_deref_mut() {
                Some(m) => m.take_rows(model, be, &model.final_norm_rows(be, x)?, pos, context),
                None => Ok(()),
            }
        };
        let sink: Option<RowSink> = has_mtp.then_some(&mut take);
        let (logits, report) = split::prefill_rows(model, be, seq, prompt, plan, sink)?;
        self.logits = logits;
        self.pending = None;
        Ok(report)
    }

    /// Go on from a sequence the caller prefilled itself (a server's turn, from its
    /// conversation cache): `logits` are those of its last position, `context` every token it
    /// holds (what the n-gram drafter looks in).
    pub fn resume(&mut self, logits: Vec<f32>, context: Vec<u32>) {
        self.logits = logits;
        self.context = context;
        self.pending = None;
    }

    /// Every token the sequence has consumed, or will once the last one drawn is fed: a
    /// server's conversation cache records what a generation fed.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// The logits the last token was drawn from (after [`Self::prefill`], the prompt's last
    /// row's): a caller that checks a split against the host alone compares them.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// The next token, or `None` at a stop token.
    pub fn next_token(&mut self) -> Result<Option<u32>> {
        if self.ready.is_empty() {
            if let Some(tok) = self.pending.take() {
                self.feed(tok)?;
            }
        }
        let tok = match self.ready.pop_front() {
            Some(kept) => kept,
            None => {
                if self.logits.is_empty() {
                    return Err(Error::Invalid("next_token called before prefill".into()));
                }
                let tok = match self.drawn.take() {
                    Some(tok) => tok,
                    None => self.sampler.sample(&self.logits),
                };
                if self.stop.contains(&tok) {
                    return Ok(None);
                }
                self.pending = Some(tok);
                tok
            }
        };
        if let Some(room) = &mut self.room {
            *room = room.saturating_sub(1);
        }
        Ok(Some(tok))
    }

    /// Feed `tok`, with a draft if there is one to check: afterwards the logits are those
    /// after the last token fed, and the drafts kept wait in `ready`.
    fn feed(&mut self, tok: u32) -> Result<()> {
        let (model, be) = (self.model, self.backend);
        let pos = self.seq.state.pos;
        self.context.push(tok);
        // `tok` itself was counted when drawn; each kept draft and the token after them count.
        let room = self.room.map_or(usize::MAX, |r| r.saturating_sub(1));
        let room = room.min(MAX_DRAFT);
        let draft = match &mut self.speculation {
            Speculation::None => Vec::new(),
            Speculation::Tokens(d) => d.propose(&self.context, room),
            Speculation::Mtp(m) => m.propose(model, be, tok, pos, room)?,
        };
        let mtp = matches!(self.speculation, Speculation::Mtp(_));
        if draft.is_empty() && !mtp {
            self.logits = self.seq.forward(model, be, &[tok], Logits::Last, None)?;
            return Ok(());
        }
        let before = (!draft.is_empty()).then(|| self.seq.state.checkpoint(be));
        let rows: Vec<u32> = std::iter::once(tok).chain(draft.iter().copied()).collect();
        // The MTP head drafts the next step from the final rows.
        let (hidden, all) = match mtp {
            true => self.seq.forward_rows(model, be, &rows)?,
            false => (
                Vec::new(),
                self.seq.forward(model, be, &rows, Logits::All, None)?,
            ),
        };
        let vocab = all.len() / rows.len();
        let row = |i: usize| &all[i * vocab..(i + 1) * vocab];
        let mut kept = 0;
        for (i, &d) in draft.iter().enumerate() {
            // A stop token is never fed: the check ends before it, and the next draw is free.
            if self.stop.contains(&d) {
                break;
            }
            let drawn = self.sampler.sample(row(i));
            if drawn != d {
                self.drawn = Some(drawn);
                break;
            }
            kept += 1;
        }
        if let Some(before) = before.filter(|_| kept < draft.len()) {
            self.seq.rewind(be, &before)?;
            self.seq
                .forward(model, be, &rows[..=kept], Logits::None, None)?;
            self.stats.replays += 1;
        }
        if let Speculation::Mtp(m) = &mut self.speculation {
            m.accept(model, be, &hidden, &draft[..kept], pos)?;
        }
        self.logits = row(kept).to_vec();
        self.context.extend_from_slice(&draft[..kept]);
        self.ready.extend(&draft[..kept]);
        if !draft.is_empty() {
            self.stats.steps += 1;
            self.stats.drafted += draft.len();
            self.stats.accepted += kept;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 7,
        }
    }

    #[test]
    fn greedy_takes_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let logits = [2.0, 1.9, 0.0, -5.0, 1.8];
        for _ in 0..200 {
            let t = Sampler::new(params(1.0, 2, 1.0, 0.0))
                .unwrap()
                .sample(&logits);
            assert!(t == 0 || t == 1);
        }
        // min_p 0.5: token 2 has p/p_max = e^-2 < 0.5, so only 0, 1, 4 remain.
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.5)).unwrap();
        for _ in 0..500 {
            assert!([0, 1, 4].contains(&s.sample(&logits)));
        }
        // top_p tiny keeps the single most likely token.
        let mut s = Sampler::new(params(1.0, 0, 1e-6, 0.0)).unwrap();
        assert!((0..50).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn same_seed_same_draws_and_frequencies_follow_softmax() {
        let logits = [0.0, (2.0f32).ln(), (3.0f32).ln()]; // probabilities 1/6, 2/6, 3/6
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params(1.0, 0, 1.0, 0.0)
            })
            .unwrap();
            (0..6000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = draw(1);
        assert_eq!(a, draw(1));
        let freq: Vec<f64> = (0..3)
            .map(|i| a.iter().filter(|&&t| t == i).count() as f64 / 6000.0)
            .collect();
        for (f, want) in freq.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            assert!((f - want).abs() < 0.03, "{freq:?}");
        }
    }

    #[test]
    fn bad_parameters_are_rejected() {
        assert!(Sampler::new(params(-1.0, 0, 1.0, 0.0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 0.0, 0.0)).is_err());
        assert!(Sampler::new(params(1.0, 0, 1.0, 2.0)).is_err());
    }
}
