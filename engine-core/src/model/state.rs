//! Per-sequence state: a paged KV cache per full-attention layer, recurrent + conv state per
//! DeltaNet layer. The KV grows with the context; the DeltaNet state has a fixed size. Both live
//! in the backend that runs the sequence (on a GPU host, on the device): they leave it only
//! when they cross the link.

use std::ops::Range;

use crate::backend::{Act, Backend};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::{Away, PagedKv};
use crate::host::page_file::PageFile;
use crate::host::remote::{AttendRate, HelperClient};
use crate::host::telemetry::{self, Telemetry};

/// Pages sent from the page file to a helper that lacks them, per forward pass at most: a
/// helper that joins (or comes back) mid-sequence catches up a little after every pass, so
/// no pass waits for the whole re-fill.
const REFILL_PAGES: usize = 8;

/// Attention replies a helper gives before the placement judges it (a few steps' worth, so
/// one slow reply does not decide).
const JUDGE_AFTER_REPLIES: u64 = 16;

/// How much longer than this host would take for its pages the host may block for a helper
/// before it is set aside. Wide: the measurements are noisy, the page file's reads are not
/// counted in the host's speed, and a link's fixed cost per query outweighs a small model's
/// pages while costing little. What it is for is an order of magnitude: a tab on a software
/// GPU slowed a host 12x.
const SLOW_MARGIN: f64 = 8.0;

/// And by how much per attention, at least, so that small absolute costs never decide.
const MIN_LOSS: f64 = 5e-3;

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
    /// The helpers this sequence's oldest KV pages go to once the host's budget is full,
    /// spread over them by [`State::place`]; at most one of them also runs the tail layers of
    /// a split prefill ([`State::prefill_helper`]). Attached with [`State::attach`].
    pub helpers: Vec<HelperClient>,
    /// The disk tier: a copy of every page that leaves this device, written before it leaves,
    /// so a lost helper's pages are attended from here (and re-fill the next helper).
    pub spill: Option<PageFile>,
    /// KV positions per layer kept on this device when a helper or page file takes pages;
    /// whole pages past it move out after every forward pass.
    pub host_kv_tokens: Option<usize>,
    /// Why the last helper of this sequence was lost, if one was: the sequence went on from
    /// the page file (callers report it).
    pub helper_lost: Option<String>,
    /// Why the last helper set aside as slower than this host was ([`State::place`]'s
    /// placement): its pages are attended from the page file (callers report it).
    pub helper_set_aside: Option<String>,
    /// This host's own attention speed (pages per second), measured where its backend's
    /// ops are timed on return: what a helper is compared with ([`State::place`]).
    pub host_rate: AttendRate,
    /// Where this sequence's ubatches, transfers and page moves are reported (nowhere by
    /// default).
    pub telemetry: Telemetry,
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
            helpers: Vec::new(),
            spill: None,
            host_kv_tokens: None,
            helper_lost: None,
            helper_set_aside: None,
            host_rate: AttendRate::default(),
            telemetry: Telemetry::default(),
        }
    }

    /// Attach a connected, configured helper: it takes pages from the next pass on, and pages
    /// waiting in the page file a few per pass. Returns its id.
    pub fn attach(&mut self, mut client: HelperClient) -> u32 {
        // Unique in the process, not just in this state: a server that replaces its sequence
        // keeps telling helpers (and their metrics) apart.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        client.id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = client.id;
        self.helpers.push(client);
        id
    }

    /// The helper that runs the tail layers of a split prefill (the first attached with
    /// prefill layers), if one is attached.
    pub fn prefill_helper(&self) -> Option<&HelperClient> {
        self.helpers.iter().find(|h| !h.prefill_layers.is_empty())
    }

    pub fn prefill_helper_mut(&mut self) -> Option<&mut HelperClient> {
        self.helpers
            .iter_mut()
            .find(|h| !h.prefill_layers.is_empty())
    }

    /// Forget helper `id`, gone. Its pages are attended from the page file from now on, and
    /// later pages go to the other helpers or there; without a page file and with no helper
    /// left, this host keeps its whole KV (no budget), and any pages the helper held are lost
    /// (the caller has checked there were none, or fails the sequence).
    pub fn lose_helper(&mut self, id: u32) {
        self.helpers.retain(|h| h.id != id);
        self.forget_pages_of(id);
        if self.spill.is_none() && self.helpers.is_empty() {
            self.host_kv_tokens = None;
        }
    }

    /// Every layer takes helper `id`'s pages as no longer held there: they are attended from
    /// the page file (and re-fill another helper).
    fn forget_pages_of(&mut self, id: u32) {
        for l in &mut self.layers {
            if let LayerState::Attention(kv) = l {
                kv.lose_helper(id);
            }
        }
    }

    /// Detach the helpers a request found gone, noting why.
    fn drop_lost_helpers(&mut self) {
        let lost: Vec<(u32, String)> = self
            .helpers
            .iter()
            .filter_map(|h| h.lost().map(|why| (h.id, why.to_string())))
            .collect();
        for (id, why) in lost {
            self.helper_lost = Some(why);
            self.lose_helper(id);
        }
    }

    /// Whether helper `id` holds every page that left of the full-attention layers among
    /// `layers` (none waits in the page file for a re-fill): only then can it mirror those
    /// layers in a split prefill.
    pub fn holds_all_pages_of(&self, id: u32, layers: Range<usize>) -> bool {
        self.layers[layers].iter().all(|l| match l {
            LayerState::Attention(kv) => kv.prefix_on(id) == kv.remote_len(),
            LayerState::DeltaNet(_) | LayerState::Elsewhere => true,
        })
    }

    /// Pages on helper `id`, over all layers.
    pub fn pages_on(&self, id: u32) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attention(kv) => kv.count_on(id),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => 0,
            })
            .sum()
    }

    /// Whether every page that left this device is on a helper.
    pub fn pages_all_on_helpers(&self) -> bool {
        self.layers.iter().all(|l| match l {
            LayerState::Attention(kv) => kv.all_on_helpers(),
            LayerState::DeltaNet(_) | LayerState::Elsewhere => true,
        })
    }

    /// Where layer `layer`'s pages that left this device are, for attention.
    pub fn away(&mut self, layer: usize) -> Away<'_> {
        Away {
            layer,
            helpers: &mut self.helpers,
            disk: self.spill.as_ref(),
            host_rate: Some(&mut self.host_rate),
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
                let holder = kv.holder(start);
                let rows = if len > start {
                    Some(page_rows(
                        self.spill.as_ref(),
                        self.helpers.iter_mut().find(|h| Some(h.id) == holder),
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
        let ids: Vec<u32> = self.helpers.iter().map(|h| h.id).collect();
        for id in ids {
            let held = self.layers.iter().any(|l| match l {
                LayerState::Attention(kv) => kv.pages_on(id).last().is_some_and(|&p| p >= cut),
                LayerState::DeltaNet(_) | LayerState::Elsewhere => false,
            });
            let helper = self.helpers.iter_mut().find(|h| h.id == id);
            match helper.map(|h| (h.truncate(cut), h)) {
                // Pages it held were freed: it may take pages again.
                Some((Ok(()), h)) => h.full &= !held,
                // A helper that fails here (gone, or answering out of protocol) may hold rows
                // past the cut: it must never be asked for them. The page file holds every
                // page it had, so the sequence goes on without it.
                Some((Err(e @ (Error::Remote(_) | Error::Refused { .. })), _))
                    if self.spill.is_some() =>
                {
                    self.helper_lost = Some(e.to_string());
                    self.lose_helper(id);
                }
                Some((Err(e), _)) => return Err(e),
                None => {}
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
    /// the page file first, then to a helper that takes it ([`State::place`]). Then re-fill
    /// helpers a little from the page file with pages no helper holds (a helper joined late,
    /// one was lost, or one refused a page before). `be` reads each page to the host. Returns
    /// the number of pages moved per layer. Reports where every page now is to
    /// [`State::telemetry`].
    pub fn offload(&mut self, be: &dyn Backend) -> Result<usize> {
        let moved = self.move_pages(be)?;
        self.telemetry
            .emit(|at_ms| telemetry::pages(at_ms, &self.layers));
        Ok(moved)
    }

    fn move_pages(&mut self, be: &dyn Backend) -> Result<usize> {
        self.drop_lost_helpers();
        self.set_aside_slow_helpers();
        let Some(host_tokens) = self.host_kv_tokens else {
            return Ok(0);
        };
        if self.helpers.is_empty() && self.spill.is_none() {
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
                if let Some(disk) = self.spill.as_mut() {
                    disk.write(i, start, kv.row_width(), &k, &v)?;
                }
                let holder = self.place(i, start, k, v)?;
                if holder.is_none() && self.spill.is_none() {
                    // Refused, with no disk tier: the page stays here, past the budget.
                    break;
                }
                if let LayerState::Attention(kv) = &mut self.layers[i] {
                    kv.drop_oldest_page(holder);
                }
                n += 1;
                moved = moved.max(n);
            }
        }
        self.refill()?;
        self.drop_lost_helpers();
        Ok(moved)
    }

    /// Helpers that make every step wait: a helper holding `h` of a layer's pages is worth its
    /// link only while the host, having done its own work, blocks for its reply less than it
    /// would take to attend those `h` pages itself. Once it has given [`JUDGE_AFTER_REPLIES`]
    /// replies and the host blocks for it longer than that by [`SLOW_MARGIN`] and [`MIN_LOSS`],
    /// its pages are attended here from the page file (which has them all) and it is offered
    /// no more (a tab on a software GPU cut a host's decode from 174 to 14 tok/s). Only with a
    /// page file, and where this host's attention is timed (see [`Backend::timed_on_return`]).
    fn set_aside_slow_helpers(&mut self) {
        let Some(host) = self.host_rate.per_sec().filter(|_| self.spill.is_some()) else {
            return;
        };
        let Some(kv) = self.layers.iter().find_map(|l| match l {
            LayerState::Attention(kv) => Some(kv),
            _ => None,
        }) else {
            return;
        };
        let slow: Vec<(u32, String)> = self
            .helpers
            .iter()
            .filter(|h| !h.slow && h.mean_wait().1 >= JUDGE_AFTER_REPLIES)
            .filter_map(|h| {
                let (held, (wait, _)) = (kv.count_on(h.id) as f64, h.mean_wait());
                let here = held / host;
                let slow = wait > SLOW_MARGIN * here && wait - here > MIN_LOSS;
                (held > 0.0 && slow).then(|| {
                    let why = format!(
                        "helper {} makes each attention wait {:.1} ms for {held} pages, which \
                         this host attends in {:.1} ms: its pages are attended here from the \
                         page file, and it is offered no more",
                        h.id,
                        wait * 1e3,
                        here * 1e3
                    );
                    (h.id, why)
                })
            })
            .collect();
        for (id, why) in slow {
            self.forget_pages_of(id);
            if let Some(h) = self.helpers.iter_mut().find(|h| h.id == id) {
                h.slow = true;
            }
            self.helper_set_aside = Some(why);
        }
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

    /// Hand the page of layer `i` at `start` (rows `k`, `v`) to a helper: the id of the one
    /// that took it, or `None` if none did. The one place that decides where a page goes:
    /// - a layer the prefill helper mirrors goes to it alone, and only in order (its mirror
    ///   already holds those rows, so the page costs it nothing, and its pages of the layer
    ///   stay one prefix, which the mirror's sync relies on);
    /// - any other page to the helper furthest below its share of the layer's pages, shares
    ///   in proportion to each helper's measured speed (pages attended per second, once every
    ///   helper has answered a query) or, before that, to the memory it offered. A helper that
    ///   refused a page for memory takes no more; one that fails is passed over (and
    ///   detached after the pass).
    pub fn place(
        &mut self,
        i: usize,
        start: usize,
        k: Vec<f32>,
        v: Vec<f32>,
    ) -> Result<Option<u32>> {
        let LayerState::Attention(kv) = &self.layers[i] else {
            return Ok(None);
        };
        let width = kv.row_width();
        let takes = |h: &&HelperClient| h.takes_pages();
        let candidates: Vec<u32> = match self.prefill_helper() {
            Some(p) if p.prefill_layers.contains(&i) => Some(p)
                .filter(takes)
                .filter(|p| kv.prefix_on(p.id) == start)
                .map(|p| p.id)
                .into_iter()
                .collect(),
            _ => {
                let live: Vec<&HelperClient> = self.helpers.iter().filter(takes).collect();
                let measured = live.iter().all(|h| h.pages_per_sec().is_some());
                let weight = |h: &HelperClient| match measured {
                    true => h.pages_per_sec().unwrap_or(1.0),
                    false => h.helper.mem_offer as f64,
                };
                let mut ranked: Vec<(f64, u32)> = live
                    .iter()
                    .map(|h| ((kv.count_on(h.id) + 1) as f64 / weight(h).max(1e-9), h.id))
                    .collect();
                ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                ranked.into_iter().map(|(_, id)| id).collect()
            }
        };
        let last = candidates.len().saturating_sub(1);
        let (mut k, mut v) = (Some(k), Some(v));
        for (n, id) in candidates.into_iter().enumerate() {
            // A copy only for a helper that may refuse it before another is asked.
            let (k, v) = match n == last {
                true => (k.take().unwrap_or_default(), v.take().unwrap_or_default()),
                false => (k.clone().unwrap_or_default(), v.clone().unwrap_or_default()),
            };
            if self.give(id, i, start, width, k, v)? {
                return Ok(Some(id));
            }
        }
        Ok(None)
    }

    /// Offer the page of layer `i` at `start` to helper `id`: whether it now holds it. A
    /// refusal for memory stops further offers to it; a lost helper is detached after this
    /// pass, and only a page file makes that survivable.
    fn give(
        &mut self,
        id: u32,
        i: usize,
        start: usize,
        width: usize,
        k: Vec<f32>,
        v: Vec<f32>,
    ) -> Result<bool> {
        let has_disk = self.spill.is_some();
        let Some(helper) = self.helpers.iter_mut().find(|h| h.id == id) else {
            return Ok(false);
        };
        match helper.store(i, start, width, k, v) {
            Ok(()) => Ok(true),
            Err(Error::Refused { code, .. }) if code == "memory" => {
                helper.full = true;
                Ok(false)
            }
            Err(Error::Remote(_)) if has_disk => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Send helpers up to [`REFILL_PAGES`] pages that no helper holds from the page file, the
    /// layer furthest behind first, so all layers catch up together.
    fn refill(&mut self) -> Result<()> {
        if !self.helpers.iter().any(HelperClient::takes_pages) {
            return Ok(());
        }
        for _ in 0..REFILL_PAGES {
            let next = self
                .layers
                .iter()
                .enumerate()
                .filter_map(|(i, l)| match l {
                    LayerState::Attention(kv) => kv.next_refill().map(|s| (s, i)),
                    LayerState::DeltaNet(_) | LayerState::Elsewhere => None,
                })
                .min();
            let (Some((start, i)), Some(disk)) = (next, self.spill.as_ref()) else {
                return Ok(());
            };
            let (k, v) = disk.read(i, start)?;
            let Some(id) = self.place(i, start, k, v)? else {
                return Ok(());
            };
            if let LayerState::Attention(kv) = &mut self.layers[i] {
                kv.helper_took(start, id);
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
        let layers = c.count_layers(runs, LayerKind::LinearAttention);
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
