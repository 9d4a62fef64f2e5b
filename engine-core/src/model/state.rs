//! Per-sequence state: a paged KV cache per full-attention layer, recurrent + conv state per
//! DeltaNet layer. The KV grows with the context; the DeltaNet state has a fixed size. Both live
//! in the backend that runs the sequence (on a GPU host, on the device): they leave it only
//! when they cross the link.

use std::ops::Range;

use crate::backend::{Act, Backend};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::{Away, PagedKv};
use crate::page_file::PageFile;
use crate::remote::HelperClient;

/// Pages sent from the page file to a helper that lacks them, per forward pass at most: a
/// helper that joins (or comes back) mid-sequence catches up a little after every pass, so
/// no pass waits for the whole re-fill.
const REFILL_PAGES: usize = 8;

/// A fresh state is zeros on the host; a device backend moves it to the device the first time
/// an op advances it, and it stays there.
#[derive(Debug)]
pub struct DeltaState {
    /// Recurrent state `[v_heads, dk, dv]`.
    pub s: Act,
    /// The last `kernel - 1` conv inputs `[kernel - 1, conv_dim]`.
    pub conv: Act,
}

impl DeltaState {
    /// A copy that evolves separately, in the same backend.
    fn duplicate(&self, be: &dyn Backend) -> DeltaState {
        DeltaState {
            s: be.duplicate(&self.s),
            conv: be.duplicate(&self.conv),
        }
    }
}

/// A point a sequence can return to: the DeltaNet states at `pos` (KV rows are simply cut).
/// The recurrent state cannot be rewound by position, so a session takes one where a rewind
/// may land (the end of each turn). The copies stay in the backend that took them.
#[derive(Debug)]
pub struct Checkpoint {
    pub pos: usize,
    delta: Vec<(usize, DeltaState)>,
}

#[derive(Debug)]
pub enum LayerState {
    Attention(PagedKv),
    DeltaNet(DeltaState),
    /// A DeltaNet layer this device never runs (a helper's, outside the layers it is
    /// assigned): no state, so a helper that holds only KV pages spends no memory on
    /// recurrent state. Running the layer on this state is an error.
    Elsewhere,
}

pub struct State {
    /// Positions consumed so far (the next token's position).
    pub pos: usize,
    pub layers: Vec<LayerState>,
    /// Where this sequence's oldest KV pages go once the host's budget is full.
    pub remote: Option<HelperClient>,
    /// The disk tier: a copy of every page that leaves this device, written before it leaves,
    /// so a lost helper's pages are attended from here (and re-fill the next helper).
    pub spill: Option<PageFile>,
    /// KV positions per layer kept on this device when a helper or page file takes pages;
    /// whole pages past it move out after every forward pass.
    pub host_kv_tokens: Option<usize>,
    /// The helper refused a page for lack of memory: no more pages are offered to it (a round
    /// trip each); they go to the page file only, or stay here without one, rather than fail
    /// the sequence.
    pub remote_full: bool,
    /// Why the last helper of this sequence was lost, if one was: the sequence went on from
    /// the page file (callers report it).
    pub helper_lost: Option<String>,
}

impl State {
    pub fn new(c: &ModelConfig, page_size: usize) -> State {
        State::for_layers(c, page_size, 0..c.layer_types.len())
    }

    /// A state for a device that runs only `runs` of the layers: DeltaNet layers outside it
    /// are [`LayerState::Elsewhere`]. Every full-attention layer keeps a cache (a helper holds
    /// the pages of all of them).
    pub fn for_layers(c: &ModelConfig, page_size: usize, runs: Range<usize>) -> State {
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, k)| match k {
                LayerKind::LinearAttention if !runs.contains(&i) => LayerState::Elsewhere,
                LayerKind::FullAttention => LayerState::Attention(PagedKv::new(
                    page_size,
                    c.num_key_value_heads,
                    c.head_dim,
                )),
                LayerKind::LinearAttention => LayerState::DeltaNet(DeltaState {
                    s: Act::Host(vec![0.0; c.delta_state_len().0]),
                    conv: Act::Host(vec![0.0; c.delta_state_len().1]),
                }),
            })
            .collect();
        State {
            pos: 0,
            layers,
            remote: None,
            spill: None,
            host_kv_tokens: None,
            remote_full: false,
            helper_lost: None,
        }
    }

    /// Forget a helper that is gone. Its pages are attended from the page file from now on,
    /// and later pages go there within the same budget; without a page file this host keeps
    /// its whole KV (no budget), and any pages the helper held are lost (the caller has checked
    /// there were none, or fails the sequence).
    pub fn lose_helper(&mut self) {
        self.remote = None;
        self.remote_full = false;
        for l in &mut self.layers {
            if let LayerState::Attention(kv) = l {
                kv.lose_helper();
            }
        }
        if self.spill.is_none() {
            self.host_kv_tokens = None;
        }
    }

    /// Detach the helper if a request found it gone, noting why.
    fn drop_lost_helper(&mut self) {
        if let Some(why) = self.remote.as_ref().and_then(|r| r.lost()) {
            self.helper_lost = Some(why.to_string());
            self.lose_helper();
        }
    }

    /// Whether the helper holds every page that left this device (none wait in the page file
    /// for a re-fill): only then can it mirror the tail layers in a split prefill.
    pub fn helper_has_all_pages(&self) -> bool {
        self.layers.iter().all(|l| match l {
            LayerState::Attention(kv) => kv.helper_len() == kv.remote_len(),
            LayerState::DeltaNet(_) | LayerState::Elsewhere => true,
        })
    }

    /// Where layer `layer`'s pages that left this device are, for attention.
    pub fn away(&mut self, layer: usize) -> Away<'_> {
        Away {
            layer,
            helper: self.remote.as_mut(),
            disk: self.spill.as_ref(),
        }
    }

    /// Positions of every full-attention layer whose KV lives on the helper (pages move for
    /// all layers together, so one number describes them all).
    pub fn remote_kv_len(&self) -> usize {
        self.layers
            .iter()
            .find_map(|l| match l {
                LayerState::Attention(kv) => Some(kv.remote_len()),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => None,
            })
            .unwrap_or(0)
    }

    /// A copy of every DeltaNet state, taken by `be` (the backend running this sequence).
    pub fn checkpoint(&self, be: &dyn Backend) -> Checkpoint {
        let delta = self
            .layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match l {
                LayerState::DeltaNet(d) => Some((i, d.duplicate(be))),
                LayerState::Attention(_) | LayerState::Elsewhere => None,
            })
            .collect();
        Checkpoint {
            pos: self.pos,
            delta,
        }
    }

    /// Return to `cp` (an edited conversation): cut every KV cache (the helper's and the page
    /// file's too) back to its position and restore the DeltaNet states. Pages the cut falls
    /// into come back whole (from the page file, else the helper), so page boundaries, and so
    /// results, stay those of an uncut run. On error nothing here has changed. `cp` stays valid
    /// for another rewind.
    pub fn rewind(&mut self, be: &dyn Backend, cp: &Checkpoint) -> Result<()> {
        if cp.pos > self.pos
            || cp.delta.len()
                != self
                    .layers
                    .iter()
                    .filter(|l| matches!(l, LayerState::DeltaNet(_)))
                    .count()
        {
            return Err(Error::Invalid(format!(
                "cannot rewind from position {} to a checkpoint at {} of another sequence or the future",
                self.pos, cp.pos
            )));
        }
        let len = cp.pos;
        let mut refills = Vec::new();
        // Where the pages that left are cut: at the start of the page `len` falls into.
        let mut cut = len;
        for (i, l) in self.layers.iter().enumerate() {
            let LayerState::Attention(kv) = l else {
                continue;
            };
            if len < kv.remote_len() {
                let start = len / kv.page_size() * kv.page_size();
                cut = start;
                let rows = if len > start {
                    Some(page_rows(
                        self.spill.as_ref(),
                        self.remote.as_mut(),
                        (i, start),
                        len - start,
                        kv.row_width(),
                    )?)
                } else {
                    None
                };
                // Check the rows before anything changes, here or on the helper.
                if let Some((k, v)) = &rows {
                    if k.len() != (len - start) * kv.row_width() || v.len() != k.len() {
                        return Err(Error::Remote(format!(
                            "layer {i}: the rows of the page at {start} came back the wrong size"
                        )));
                    }
                }
                refills.push((i, rows));
            }
        }
        if let Some(remote) = self.remote.as_mut() {
            let held = self.layers.iter().any(|l| match l {
                LayerState::Attention(kv) => kv.helper_len() > cut,
                LayerState::DeltaNet(_) | LayerState::Elsewhere => false,
            });
            match remote.truncate(cut) {
                // Pages it held were freed: it may take pages again.
                Ok(()) => self.remote_full &= !held,
                // A helper that fails here (gone, or answering out of protocol) may hold rows
                // past the cut: it must never be asked for them. The page file holds every
                // page it had, so the sequence goes on without it.
                Err(e @ (Error::Remote(_) | Error::Refused { .. })) if self.spill.is_some() => {
                    self.helper_lost = Some(e.to_string());
                    self.lose_helper();
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(disk) = self.spill.as_mut() {
            disk.forget_from(cut)?;
        }
        let mut refills = refills.into_iter().peekable();
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let LayerState::Attention(kv) = l {
                let refill = match refills.peek() {
                    Some((j, _)) if *j == i => refills.next().and_then(|(_, r)| r),
                    _ => None,
                };
                kv.rewind(be, len, refill)?;
            }
        }
        for (i, d) in &cp.delta {
            self.layers[*i] = LayerState::DeltaNet(d.duplicate(be));
        }
        self.pos = len;
        Ok(())
    }

    /// Move the oldest whole KV pages of every full-attention layer out until at most
    /// `host_kv_tokens` positions per layer stay here (a partial page never moves): each to
    /// the page file first, then to the helper while it takes them. Then re-fill the helper a
    /// little from the page file if it lacks pages (it joined late, or refused one before).
    /// `be` reads each page to the host. Returns the number of pages moved per layer.
    pub fn offload(&mut self, be: &dyn Backend) -> Result<usize> {
        self.drop_lost_helper();
        let Some(host_tokens) = self.host_kv_tokens else {
            return Ok(0);
        };
        if self.remote.is_none() && self.spill.is_none() {
            return Err(Error::Invalid(
                "a host KV budget is set but no helper or page file takes pages".into(),
            ));
        }
        let mut moved = 0;
        for i in 0..self.layers.len() {
            let mut n = 0;
            while let Some((start, len)) = self.page_to_move(i, host_tokens) {
                let LayerState::Attention(kv) = &self.layers[i] else {
                    unreachable!("page_to_move found a KV page")
                };
                let (k, v) = pollster::block_on(kv.rows(be, start, len)?);
                let width = kv.row_width();
                let in_step = kv.helper_len() == kv.remote_len();
                if let Some(disk) = self.spill.as_mut() {
                    disk.write(i, start, width, &k, &v)?;
                }
                let on_helper = in_step && self.give_helper(i, start, width, k, v)?;
                if !on_helper && self.spill.is_none() {
                    // Refused, with no disk tier: the page stays here, past the budget.
                    break;
                }
                if let LayerState::Attention(kv) = &mut self.layers[i] {
                    kv.drop_oldest_page(on_helper);
                }
                n += 1;
                moved = moved.max(n);
            }
        }
        self.refill()?;
        self.drop_lost_helper();
        Ok(moved)
    }

    /// The oldest local page of layer `i`, if it is whole and past the budget.
    fn page_to_move(&self, i: usize, host_tokens: usize) -> Option<(usize, usize)> {
        match &self.layers[i] {
            LayerState::Attention(kv) if kv.local_len() > host_tokens => {
                kv.oldest_full_page().map(|p| (p.start, p.len))
            }
            _ => None,
        }
    }

    /// Offer the page of layer `i` at `start` to the helper, if one takes pages: whether it
    /// now holds it. A refusal for memory stops further offers; a lost helper is detached
    /// after this pass, and only a page file makes that survivable.
    fn give_helper(
        &mut self,
        i: usize,
        start: usize,
        width: usize,
        k: Vec<f32>,
        v: Vec<f32>,
    ) -> Result<bool> {
        let Some(remote) = self.remote.as_mut().filter(|r| !r.is_lost()) else {
            return Ok(false);
        };
        if self.remote_full {
            return Ok(false);
        }
        match remote.store(i, start, width, k, v) {
            Ok(()) => Ok(true),
            Err(Error::Refused { code, .. }) if code == "memory" => {
                self.remote_full = true;
                Ok(false)
            }
            Err(Error::Remote(_)) if self.spill.is_some() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Send the helper up to [`REFILL_PAGES`] pages it lacks from the page file, the layer
    /// furthest behind first, so all layers catch up together.
    fn refill(&mut self) -> Result<()> {
        let takes = self.remote.as_ref().is_some_and(|r| !r.is_lost()) && !self.remote_full;
        if !takes {
            return Ok(());
        }
        for _ in 0..REFILL_PAGES {
            let next = self
                .layers
                .iter()
                .enumerate()
                .filter_map(|(i, l)| match l {
                    LayerState::Attention(kv) => kv.next_refill().map(|s| (s, i, kv.row_width())),
                    LayerState::DeltaNet(_) | LayerState::Elsewhere => None,
                })
                .min();
            let (Some((start, i, width)), Some(disk)) = (next, self.spill.as_ref()) else {
                return Ok(());
            };
            let (k, v) = disk.read(i, start)?;
            if !self.give_helper(i, start, width, k, v)? {
                return Ok(());
            }
            if let LayerState::Attention(kv) = &mut self.layers[i] {
                kv.helper_took(start);
            }
        }
        Ok(())
    }

    pub(crate) fn check_matches(&self, c: &ModelConfig) -> Result<()> {
        let ok = self.layers.len() == c.layer_types.len()
            && self.layers.iter().zip(&c.layer_types).all(|(s, k)| {
                matches!(
                    (s, k),
                    (LayerState::Attention(_), LayerKind::FullAttention)
                        | (
                            LayerState::DeltaNet(_) | LayerState::Elsewhere,
                            LayerKind::LinearAttention
                        )
                )
            });
        if ok {
            Ok(())
        } else {
            Err(Error::Invalid(
                "sequence state was made for a different model".into(),
            ))
        }
    }

    /// Bytes held by KV caches.
    pub fn kv_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attention(kv) => kv.bytes(),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => 0,
            })
            .sum()
    }

    /// Bytes of DeltaNet state a [`State::for_layers`] with `runs` holds, known before making
    /// it (a helper checks its budget first).
    pub fn delta_bytes_for(c: &ModelConfig, runs: Range<usize>) -> usize {
        let (s, conv) = c.delta_state_len();
        let layers = c.layer_types[runs]
            .iter()
            .filter(|&&k| k == LayerKind::LinearAttention)
            .count();
        layers * (s + conv) * std::mem::size_of::<f32>()
    }

    /// Bytes held by DeltaNet states (recurrent and conv), a fixed amount per layer run here.
    pub fn delta_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::DeltaNet(d) => (d.s.len() + d.conv.len()) * std::mem::size_of::<f32>(),
                LayerState::Attention(_) | LayerState::Elsewhere => 0,
            })
            .sum()
    }
}

/// The first `rows` rows (of `width` values) of K and V of the page of layer `layer` at
/// `start`, which left this device: from the page file if it holds them, else the helper.
fn page_rows(
    disk: Option<&PageFile>,
    remote: Option<&mut HelperClient>,
    (layer, start): (usize, usize),
    rows: usize,
    width: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    if let Some(disk) = disk.filter(|d| d.holds(layer, start)) {
        let (mut k, mut v) = disk.read(layer, start)?;
        k.truncate(rows * width);
        v.truncate(rows * width);
        return Ok((k, v));
    }
    let remote = remote.ok_or_else(|| {
        Error::Invalid("the KV pages to rewind into are on a helper that is gone".into())
    })?;
    remote.fetch(layer, start, rows)
}
