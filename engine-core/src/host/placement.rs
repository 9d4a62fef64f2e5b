//! Where each KV page of a host's sequence lives once it leaves this device: on one of its
//! helpers, in its page file (the disk tier, which keeps a copy of every page that left), or
//! both. The one place that decides where a page goes ([`Placement::place`]), moves pages out
//! past the host's budget ([`Placement::offload`]), re-fills helpers from the page file, sets
//! aside helpers slower than this host, and attends the pages that left for the model's
//! attention (the [`PageSource`] it asks).

use std::collections::BTreeMap;
use std::ops::Range;

use super::page_file::PageFile;
use super::remote::{AttendRate, HelperClient};
use super::telemetry::{self, Telemetry};
use crate::backend::{Act, AttnShape, Backend, KvPage, PageRows};
use crate::cache_types::Encoded;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kv::{PagePartials, PageSource, PagedKv};
use crate::model::{LayerState, Refills, State};

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

/// Pages read back from the disk at once at most, in bytes of K and V: a long sequence's
/// spilled pages are read and attended a group at a time, never all in memory together (their
/// partials are kept for the merge, as those of pages in memory are).
const DISK_GROUP_BYTES: usize = 64 << 20;

/// Who holds each page of one full-attention layer that left this device, in page order: a
/// helper's id (see `HelperClient::id`), or `None` for the page file alone. A helper's pages
/// of one layer need not be contiguous: pages spread over several helpers interleave.
#[derive(Debug, Default)]
pub struct Holders {
    page_size: usize,
    by_page: Vec<Option<u32>>,
}

impl Holders {
    /// No page of `page_size` positions has left yet.
    pub fn new(page_size: usize) -> Holders {
        Holders {
            page_size,
            by_page: Vec::new(),
        }
    }

    /// Who holds the page that left at `start`: a helper's id, or `None` for the page file
    /// alone (and for a page that did not leave).
    pub fn holder(&self, start: usize) -> Option<u32> {
        self.by_page.get(start / self.page_size).copied().flatten()
    }

    /// Starts of the pages that left and are on helper `id`, oldest first.
    pub fn pages_on(&self, id: u32) -> Vec<usize> {
        self.by_page
            .iter()
            .enumerate()
            .filter(|(_, h)| **h == Some(id))
            .map(|(i, _)| i * self.page_size)
            .collect()
    }

    /// Pages that left and are on a helper (not the page file alone).
    pub fn helper_pages(&self) -> usize {
        self.by_page.iter().filter(|h| h.is_some()).count()
    }

    /// Pages that left and are on helper `id`.
    pub fn count_on(&self, id: u32) -> usize {
        self.by_page.iter().filter(|h| **h == Some(id)).count()
    }

    /// Positions `0 .. n` all on helper `id` (a helper that mirrors this layer holds its
    /// pages as one prefix).
    pub fn prefix_on(&self, id: u32) -> usize {
        self.by_page.iter().take_while(|h| **h == Some(id)).count() * self.page_size
    }

    /// Positions that left (whole pages).
    pub fn left(&self) -> usize {
        self.by_page.len() * self.page_size
    }

    /// The start of the oldest page that left this device and is on no helper: the next to
    /// re-fill a helper with.
    pub fn next_refill(&self) -> Option<usize> {
        self.by_page
            .iter()
            .position(Option::is_none)
            .map(|i| i * self.page_size)
    }

    /// Whether every page that left is on a helper (none waits in the page file alone).
    pub fn all_on_helpers(&self) -> bool {
        self.by_page.iter().all(Option::is_some)
    }

    /// The next page left: on helper `holder`, or (for `None`) in the page file alone.
    pub fn push(&mut self, holder: Option<u32>) {
        self.by_page.push(holder);
    }

    /// Helper `id` is gone: its pages are on the disk only.
    fn lose_helper(&mut self, id: u32) {
        for h in self.by_page.iter_mut().filter(|h| **h == Some(id)) {
            *h = None;
        }
    }

    /// Helper `id` now also holds the page at `start` (re-filled from the page file).
    fn helper_took(&mut self, start: usize, id: u32) {
        if let Some(h) = self.by_page.get_mut(start / self.page_size) {
            *h = Some(id);
        }
    }
}

/// Where a host's sequence's pages that left it are, and the helpers and page file that hold
/// them. A [`super::Sequence`] pairs it with the sequence's [`State`].
pub struct Placement {
    /// The helpers this sequence's oldest KV pages go to once the host's budget is full,
    /// spread over them by [`Placement::place`]; at most one of them also runs the tail layers
    /// of a split prefill ([`Placement::prefill_helper`]). Attached with
    /// [`Placement::attach`].
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
    /// Why the last helper set aside as slower than this host was: its pages are attended
    /// from the page file (callers report it).
    pub helper_set_aside: Option<String>,
    /// This host's own attention speed (pages per second), measured where its backend's
    /// ops are timed on return: what a helper is compared with.
    pub host_rate: AttendRate,
    /// Where this sequence's ubatches, transfers and page moves are reported (nowhere by
    /// default).
    pub telemetry: Telemetry,
    page_size: usize,
    /// Per layer: who holds the pages that left (`None` for a DeltaNet layer).
    holders: Vec<Option<Holders>>,
    /// Attention queries under way on helpers, by ticket ([`PageSource::begin`]).
    in_flight: BTreeMap<u64, AwayAttention>,
    next_ticket: u64,
}

/// One helper's share of an attention under way: its request and the pages it was asked for.
struct HelperShare {
    id: u32,
    req: u32,
    starts: Vec<usize>,
}

/// The helpers' shares of one layer's attention, and what the page file needs to stand in
/// for one that never answers.
struct AwayAttention {
    layer: usize,
    shape: AttnShape,
    rows: usize,
    shares: Vec<HelperShare>,
    /// The scaled queries as sent and their positions, kept only when a page file can stand
    /// in for a helper that never answers.
    asked: Option<(Vec<f32>, Vec<usize>)>,
}

impl Placement {
    /// Nothing left yet, for a model of config `c` whose pages hold `page_size` positions.
    pub fn new(c: &ModelConfig, page_size: usize) -> Placement {
        let holders = c
            .layer_types
            .iter()
            .map(|k| (*k == LayerKind::FullAttention).then(|| Holders::new(page_size)))
            .collect();
        Placement {
            helpers: Vec::new(),
            spill: None,
            host_kv_tokens: None,
            helper_lost: None,
            helper_set_aside: None,
            host_rate: AttendRate::default(),
            telemetry: Telemetry::default(),
            page_size,
            holders,
            in_flight: BTreeMap::new(),
            next_ticket: 0,
        }
    }

    /// Positions per KV page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Who holds the pages of layer `layer` that left (`None` for a DeltaNet layer).
    pub fn holders(&self, layer: usize) -> Option<&Holders> {
        self.holders.get(layer).and_then(Option::as_ref)
    }

    fn every_layer(&self) -> impl Iterator<Item = &Holders> {
        self.holders.iter().flatten()
    }

    /// Attach a connected, configured helper: it takes pages from the next pass on, and pages
    /// waiting in the page file a few per pass. Returns its id.
    pub fn attach(&mut self, mut client: HelperClient) -> u32 {
        // Unique in the process, not just in this sequence: a server that replaces its
        // sequence keeps telling helpers (and their metrics) apart.
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
        for h in self.holders.iter_mut().flatten() {
            h.lose_helper(id);
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
        self.holders[layers]
            .iter()
            .flatten()
            .all(|h| h.prefix_on(id) == h.left())
    }

    /// Pages on helper `id`, over all layers.
    pub fn pages_on(&self, id: u32) -> usize {
        self.every_layer().map(|h| h.count_on(id)).sum()
    }

    /// Whether every page that left this device is on a helper.
    pub fn pages_all_on_helpers(&self) -> bool {
        self.every_layer().all(Holders::all_on_helpers)
    }

    /// Move the oldest whole KV pages of every full-attention layer of `state` out until at
    /// most `host_kv_tokens` positions per layer stay here (a partial page never moves): each
    /// to the page file first, then to a helper that takes it ([`Placement::place`]). Then
    /// re-fill helpers a little from the page file with pages no helper holds (a helper joined
    /// late, one was lost, or one refused a page before). `be` reads each page to the host.
    /// Returns the number of pages moved per layer. Reports where every page now is to
    /// [`Placement::telemetry`].
    pub fn offload(&mut self, be: &dyn Backend, state: &mut State) -> Result<usize> {
        let moved = self.move_pages(be, state)?;
        self.telemetry
            .emit(|at_ms| telemetry::pages(at_ms, &state.layers, self));
        Ok(moved)
    }

    fn move_pages(&mut self, be: &dyn Backend, state: &mut State) -> Result<usize> {
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
        for (i, layer) in state.layers.iter_mut().enumerate() {
            let LayerState::Attention(kv) = layer else {
                continue;
            };
            let mut n = 0;
            while let Some((start, len)) = page_to_move(kv, host_tokens) {
                let rows = pollster::block_on(kv.rows(be, start, len)?);
                if let Some(disk) = self.spill.as_mut() {
                    disk.write(i, start, kv.row_width(), (&rows.0, &rows.1))?;
                }
                let holder = self.place(i, start, kv.row_width(), rows)?;
                if holder.is_none() && self.spill.is_none() {
                    // Refused, with no disk tier: the page stays here, past the budget.
                    break;
                }
                kv.drop_oldest_page();
                if let Some(h) = self.holders[i].as_mut() {
                    h.push(holder);
                }
                n += 1;
                moved = moved.max(n);
            }
        }
        self.refill(state)?;
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
        let Some(layer) = self.every_layer().next() else {
            return;
        };
        let slow: Vec<(u32, String)> = self
            .helpers
            .iter()
            .filter(|h| !h.slow && h.mean_wait().1 >= JUDGE_AFTER_REPLIES)
            .filter_map(|h| {
                let (held, (wait, _)) = (layer.count_on(h.id) as f64, h.mean_wait());
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

    /// Hand the page of layer `i` at `start` (rows `k`, `v` of `width` values) to a helper:
    /// the id of the one that took it, or `None` if none did. The one place that decides
    /// where a page goes:
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
        width: usize,
        rows: (Encoded, Encoded),
    ) -> Result<Option<u32>> {
        let Some(held) = self.holders(i) else {
            return Ok(None);
        };
        let takes = |h: &&HelperClient| h.takes_pages();
        let candidates: Vec<u32> = match self.prefill_helper() {
            Some(p) if p.prefill_layers.contains(&i) => Some(p)
                .filter(takes)
                .filter(|p| held.prefix_on(p.id) == start)
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
                    .map(|h| ((held.count_on(h.id) + 1) as f64 / weight(h).max(1e-9), h.id))
                    .collect();
                ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                ranked.into_iter().map(|(_, id)| id).collect()
            }
        };
        let last = candidates.len().saturating_sub(1);
        let mut rows = Some(rows);
        for (n, id) in candidates.into_iter().enumerate() {
            // A copy only for a helper that may refuse it before another is asked.
            let rows = match n == last {
                true => rows.take().unwrap_or_default(),
                false => rows.clone().unwrap_or_default(),
            };
            if self.give(id, i, start, width, rows)? {
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
        rows: (Encoded, Encoded),
    ) -> Result<bool> {
        let has_disk = self.spill.is_some();
        let Some(helper) = self.helpers.iter_mut().find(|h| h.id == id) else {
            return Ok(false);
        };
        match helper.store(i, start, width, rows) {
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
    fn refill(&mut self, state: &State) -> Result<()> {
        if !self.helpers.iter().any(HelperClient::takes_pages) {
            return Ok(());
        }
        for _ in 0..REFILL_PAGES {
            let next = self
                .holders
                .iter()
                .enumerate()
                .filter_map(|(i, h)| h.as_ref()?.next_refill().map(|s| (s, i)))
                .min();
            let (Some((start, i)), Some(disk)) = (next, self.spill.as_ref()) else {
                return Ok(());
            };
            let LayerState::Attention(kv) = &state.layers[i] else {
                return Ok(());
            };
            let rows = disk.read(i, start)?;
            let Some(id) = self.place(i, start, kv.row_width(), rows)? else {
                return Ok(());
            };
            if let Some(h) = self.holders[i].as_mut() {
                h.helper_took(start, id);
            }
        }
        Ok(())
    }

    /// Cut every page that left `state` back to position `len` (a rewind): the helpers' and
    /// the page file's too. Returns, per full-attention layer whose cut falls inside a page
    /// that left, that page's rows below `len` (from the page file, else its helper), so the
    /// page lives on the host again with its boundaries unchanged. On error nothing of
    /// `state` has changed; a helper that fails the cut with a page file behind it is lost.
    pub fn cut_pages(&mut self, state: &State, len: usize) -> Result<Refills> {
        let mut refills = BTreeMap::new();
        // Where the pages that left are cut: at the start of the page `len` falls into.
        let mut cut = len;
        for (i, l) in state.layers.iter().enumerate() {
            let (LayerState::Attention(kv), Some(held)) = (l, self.holders(i)) else {
                continue;
            };
            if len < kv.remote_len() {
                let start = len / kv.page_size() * kv.page_size();
                cut = start;
                let holder = held.holder(start);
                if len > start {
                    let (k, v) = page_rows(
                        self.spill.as_ref(),
                        self.helpers.iter_mut().find(|h| Some(h.id) == holder),
                        (i, start),
                        len - start,
                        kv.row_width(),
                    )?;
                    // Check the rows before anything changes, here or on the helper.
                    let (width, types) = (kv.row_width(), kv.types());
                    let fits = |x: &Encoded, ty| x.ty == ty && x.rows(width) == Some(len - start);
                    if !fits(&k, types.k) || !fits(&v, types.v) {
                        return Err(Error::Remote(format!(
                            "layer {i}: the rows of the page at {start} came back the wrong size"
                        )));
                    }
                    refills.insert(i, (k, v));
                }
            }
        }
        let ids: Vec<u32> = self.helpers.iter().map(|h| h.id).collect();
        for id in ids {
            let held = self
                .every_layer()
                .any(|h| h.pages_on(id).last().is_some_and(|&p| p >= cut));
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
        for h in self.holders.iter_mut().flatten() {
            h.by_page.truncate(cut.min(h.left()) / h.page_size);
        }
        Ok(refills)
    }
}

/// The oldest local page of `kv`, if it is whole and past the budget of `host_tokens`.
fn page_to_move(kv: &PagedKv, host_tokens: usize) -> Option<(usize, usize)> {
    (kv.local_len() > host_tokens)
        .then(|| kv.oldest_full_page().map(|p| (p.start, p.len)))
        .flatten()
}

impl PageSource for Placement {
    /// The queries for the helpers' pages go out first (read to the host once, then); the
    /// pages only the page file holds are attended here at once.
    fn begin(
        &mut self,
        be: &dyn Backend,
        layer: usize,
        shape: AttnShape,
        q: &Act,
        positions: &[usize],
        (left, page_size): (usize, usize),
    ) -> Result<(Vec<PagePartials>, Option<u64>)> {
        let Some(held) = self.holders.get(layer).and_then(Option::as_ref) else {
            return Ok((Vec::new(), None));
        };
        let mut sent: Option<Vec<f32>> = None;
        let mut shares = Vec::new();
        for client in self.helpers.iter_mut().filter(|c| !c.is_lost()) {
            let starts = held.pages_on(client.id);
            let Some(&newest) = starts.last() else {
                continue;
            };
            let q_host = sent.get_or_insert_with(|| be.download(q)).clone();
            // The helper attends every page it holds below `end`: exactly these.
            let end = newest + page_size;
            match client.attend_send(layer, shape, q_host, positions, end, starts.len()) {
                Ok(req) => shares.push(HelperShare {
                    id: client.id,
                    req,
                    starts,
                }),
                // The disk holds the same pages; without it the error stands.
                Err(_) if self.spill.is_some() => {}
                Err(e) => return Err(e),
            }
        }
        let on_helpers: std::collections::BTreeSet<usize> =
            shares.iter().flat_map(|s| s.starts.clone()).collect();
        let from_disk: Vec<usize> = (0..left)
            .step_by(page_size)
            .filter(|s| !on_helpers.contains(s))
            .collect();
        let mut done = Vec::new();
        if !from_disk.is_empty() {
            let disk = self.spill.as_ref().ok_or_else(|| {
                Error::Remote(
                    "this sequence's oldest KV pages were on a helper that is gone, and no \
                     page file holds them"
                        .into(),
                )
            })?;
            done = attend_from_disk(
                be,
                shape,
                q,
                positions,
                (disk, layer, page_size),
                &from_disk,
            )?;
        }
        if shares.is_empty() {
            return Ok((done, None));
        }
        let asked = self
            .spill
            .is_some()
            .then(|| (sent.unwrap_or_default(), positions.to_vec()));
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.in_flight.insert(
            ticket,
            AwayAttention {
                layer,
                shape,
                rows: positions.len() * shape.q_heads,
                shares,
                asked,
            },
        );
        Ok((done, Some(ticket)))
    }

    /// A helper that fails to answer (lost, or refusing) is replaced by the page file: the
    /// same pages, attended here, give the same partials.
    fn finish(&mut self, be: &dyn Backend, ticket: u64) -> Result<Vec<PagePartials>> {
        let away = self
            .in_flight
            .remove(&ticket)
            .ok_or_else(|| Error::Invalid(format!("no attention {ticket} is under way")))?;
        let (rows, d) = (away.rows, away.shape.head_dim);
        let mut parts = Vec::new();
        for share in away.shares {
            let starts: Vec<u64> = share.starts.iter().map(|&s| s as u64).collect();
            let answer = match self.helpers.iter_mut().find(|h| h.id == share.id) {
                Some(client) => client.attend_reply(share.req, rows, d, &starts),
                None => Err(Error::Remote(
                    "a helper attending this sequence's oldest pages is gone".into(),
                )),
            };
            match (answer, self.spill.as_ref(), &away.asked) {
                (Ok(theirs), _, _) => parts.extend(
                    share
                        .starts
                        .into_iter()
                        .zip(theirs.into_iter().map(Into::into)),
                ),
                (Err(_), Some(disk), Some((q, positions))) => parts.extend(attend_from_disk(
                    be,
                    away.shape,
                    &be.upload(q.clone()),
                    positions,
                    (disk, away.layer, self.page_size),
                    &share.starts,
                )?),
                (Err(e), _, _) => return Err(e),
            }
        }
        Ok(parts)
    }

    fn attended_here(&mut self, pages: usize, took: std::time::Duration) {
        self.host_rate.add(pages, took);
    }
}

/// One partial per page of `layer` at `starts` (whole pages of `page_size`), read back from
/// the page file a group at a time and attended on `be` exactly as pages held in memory are.
fn attend_from_disk(
    be: &dyn Backend,
    shape: AttnShape,
    q: &Act,
    positions: &[usize],
    (disk, layer, page_size): (&PageFile, usize, usize),
    starts: &[usize],
) -> Result<Vec<PagePartials>> {
    let width = shape.kv_heads * shape.head_dim;
    let mut parts = Vec::with_capacity(starts.len());
    let mut group = Vec::new();
    let mut group_bytes = 0;
    for (n, &start) in starts.iter().enumerate() {
        let (k, v) = disk.read(layer, start)?;
        if k.rows(width) != Some(page_size) || v.rows(width) != Some(page_size) {
            return Err(Error::Invalid(format!(
                "the page file's page of layer {layer} at {start} is not {page_size} rows"
            )));
        }
        group_bytes += k.bytes.len() + v.bytes.len();
        group.push(KvPage {
            start,
            len: page_size,
            k: PageRows::arrived(be, k),
            v: PageRows::arrived(be, v),
            frozen: None,
        });
        if group_bytes >= DISK_GROUP_BYTES || n + 1 == starts.len() {
            let refs: Vec<&KvPage> = group.iter().collect();
            let got = be.attend_pages(shape, q, positions, &refs);
            parts.extend(group.iter().map(|p| p.start).zip(got));
            group.clear();
            group_bytes = 0;
        }
    }
    Ok(parts)
}

/// The first `rows` rows (of `width` values) of K and V of the page of layer `layer` at
/// `start`, which left this device: from the page file if it holds them, else the helper.
fn page_rows(
    disk: Option<&PageFile>,
    remote: Option<&mut HelperClient>,
    (layer, start): (usize, usize),
    rows: usize,
    width: usize,
) -> Result<(Encoded, Encoded)> {
    if let Some(disk) = disk.filter(|d| d.holds(layer, start)) {
        let (mut k, mut v) = disk.read(layer, start)?;
        k.truncate(rows, width);
        v.truncate(rows, width);
        return Ok((k, v));
    }
    let remote = remote.ok_or_else(|| {
        Error::Invalid("the KV pages to rewind into are on a helper that is gone".into())
    })?;
    remote.fetch(layer, start, rows)
}
