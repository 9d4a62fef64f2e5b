//! The host's distribution of a sequence: which helpers hold which of its KV pages, the page
//! file behind them, the split of prefill between host and helper, and the plan that decides
//! all of it. `model`, `kv` and `backend` know nothing of links: a sequence's [`crate::State`]
//! holds its pages, recurrent states and position, and attention asks this module's placement
//! for the partials of the pages that left this device.

pub mod calibrate;
pub mod minimum;
pub mod page_file;
pub mod placement;
pub mod plan;
pub mod remote;
pub mod split;
pub mod telemetry;

use std::ops::Range;

use crate::backend::{Act, Backend, CacheTypes, KvType};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{Checkpoint, Logits, Model, Pass, State};
use placement::Placement;

/// A host's sequence: its [`State`] (position, pages here, recurrent states) and the
/// [`Placement`] of the pages that left it. Every pass attends the pages that left through the
/// placement and ends by moving pages past the host's budget out.
pub struct Sequence {
    pub state: State,
    pub placement: Placement,
}

impl Sequence {
    /// A fresh sequence of a model of config `c`, in pages of `page_size` positions, all on
    /// this host until helpers or a page file are attached.
    pub fn new(c: &ModelConfig, page_size: usize) -> Sequence {
        Sequence {
            state: State::new(c, page_size),
            placement: Placement::new(c, page_size),
        }
    }

    /// A fresh sequence whose KV pages are stored as `types` (see [`State::typed`]), on a
    /// backend that attends them.
    pub fn typed(
        c: &ModelConfig,
        page_size: usize,
        types: CacheTypes,
        be: &dyn Backend,
    ) -> Result<Sequence> {
        let row = c.num_key_value_heads * c.head_dim;
        if let Some(ty) = [types.k, types.v]
            .into_iter()
            .find(|&t| !be.holds_kv(t, row))
        {
            let held: Vec<&str> = KvType::ALL
                .into_iter()
                .filter(|&t| be.holds_kv(t, row))
                .map(KvType::name)
                .collect();
            return Err(Error::Invalid(format!(
                "the {} backend holds this model's KV pages (rows of {row} values) as {} only, \
                 not {}: choose one of those with --cache-type-k / --cache-type-v",
                be.name(),
                held.join(", "),
                ty.name()
            )));
        }
        Ok(Sequence {
            state: State::typed(c, page_size, types)?,
            placement: Placement::new(c, page_size),
        })
    }

    /// A copy that evolves separately (see [`State::fork`]), on this host alone: a sequence
    /// some of whose pages left it is not forked.
    pub fn fork(&self, c: &ModelConfig, be: &dyn Backend) -> Result<Sequence> {
        Ok(Sequence {
            state: self.state.fork(be)?,
            placement: Placement::new(c, self.placement.page_size()),
        })
    }

    /// [`Model::forward`] for a host's sequence: run `tokens` at `state.pos ..`, then move
    /// the pages past the budget out; logits `[rows, vocab]` of the rows `logits` asks for.
    pub fn forward(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        tokens: &[u32],
        logits: Logits,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let x = self.residual(model, be, tokens, trace)?;
        model.head(be, x, logits)
    }

    /// [`Self::forward`] with every row's logits and its final row (after the final norm,
    /// on the host): `([tokens, hidden], [tokens, vocab])`, what the MTP head drafts from.
    pub fn forward_rows(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        tokens: &[u32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let x = self.residual(model, be, tokens, None)?;
        model.head_rows(be, x)
    }

    /// Every layer over `tokens` at `state.pos ..`, then the pages past the budget out: the
    /// final residual rows.
    fn residual(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        tokens: &[u32],
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Act> {
        let mut x = model.embed(be, tokens)?;
        let (pos, layers) = (self.state.pos, 0..model.config.num_hidden_layers);
        self.run_layers(model, be, &mut x, pos, layers, trace)?;
        self.state.pos += tokens.len();
        self.offload(be)?;
        Ok(x)
    }

    /// [`Model::run_layers`], with the pages that left attended where the placement says.
    pub fn run_layers(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        x: &mut Act,
        pos: usize,
        layers: Range<usize>,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let (state, source) = (&mut self.state, &mut self.placement);
        model.run_layers(be, state, source, x, pos, layers, trace)
    }

    /// [`Model::advance`], with the pages that left attended where the placement says.
    pub fn advance(
        &mut self,
        model: &Model,
        be: &dyn Backend,
        pass: &mut Pass,
        pause: bool,
    ) -> Result<()> {
        model.advance(be, &mut self.state, &mut self.placement, pass, pause, None)
    }

    /// Move the pages past the host's budget out (see [`Placement::offload`]).
    pub fn offload(&mut self, be: &dyn Backend) -> Result<usize> {
        self.placement.offload(be, &mut self.state)
    }

    /// Return to `cp` (an edited conversation): cut every KV cache (the helpers' and the page
    /// file's too) back to its position and restore the DeltaNet states. Pages the cut falls
    /// into come back whole (from the page file, else the helper), so page boundaries, and so
    /// results, stay those of an uncut run. On error nothing of the state has changed. `cp`
    /// stays valid for another rewind.
    pub fn rewind(&mut self, be: &dyn Backend, cp: &Checkpoint) -> Result<()> {
        self.state.check_checkpoint(cp)?;
        let refills = self.placement.cut_pages(&self.state, cp.pos)?;
        self.state.rewind(be, cp, refills)
    }
}
