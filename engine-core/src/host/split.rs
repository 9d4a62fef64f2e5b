//! Pipelined split prefill: a long prompt streams in ubatches through the host's layers
//! `[0, L)` and the helper's `[L, N)`. The host never waits for the helper to start the next
//! ubatch; the helper returns each ubatch's new KV rows of its full-attention layers and, after
//! the batch's second-to-last ubatch, its DeltaNet states. The last ubatch runs wholly on the
//! host (its first L layers while the helper finishes, the rest once the helper's state is
//! merged), so vocabulary-sized logits never cross the link.
//!
//! The helper keeps a mirror of its layers across turns; before a batch the host pushes only
//! the rows and state it produced since the mirror's watermark. If the helper fails mid-batch
//! the host reruns its layers for the whole batch from the residuals it kept, and the request
//! completes with the same tokens.

use crate::backend::{Act, Backend};
use crate::cache_types::Encoded;
use crate::kv::RowsRead;
use std::ops::Range;

use super::Sequence;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::host::remote::unexpected;
use crate::host::telemetry::{Device, Event};
use crate::model::{LayerState, Logits, Model, Pass, State};
use crate::protocol::{Message, WireTensor};

/// How prompts are split between host and helper.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Prompts of at most this many tokens run on the host alone (the link would cost more
    /// than it saves).
    pub min_tokens: usize,
    /// Tokens per ubatch.
    pub ubatch: usize,
    /// Ubatches starting at or past this position run in staggered pairs: the host runs one
    /// while the helper attends the other's queries over the old pages it holds.
    pub interleave_from: usize,
}

impl Default for SplitPlan {
    fn default() -> Self {
        SplitPlan {
            min_tokens: 512,
            ubatch: 256,
            interleave_from: 65536,
        }
    }
}

/// What happened to a split prefill.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SplitReport {
    pub ubatches: usize,
    /// Ubatches whose tail layers ran on the helper, and their rows.
    pub on_helper: usize,
    pub rows_on_helper: usize,
    /// Ubatches run in staggered pairs past `interleave_from` that waited on the helper's pages.
    pub interleaved: usize,
    /// KV rows pushed to bring the helper's mirror up to date (with the DeltaNet states, when
    /// `mirror_synced`).
    pub synced_rows: usize,
    pub mirror_synced: bool,
    /// Why the host had to run the batch alone, if it did.
    pub fallback: Option<String>,
}

/// Prefill `tokens` at `seq.state.pos` in ubatches of `plan.ubatch`, with the prefill helper as the
/// plan says, and return the last row's logits. Below `plan.interleave_from` a long enough
/// prompt streams through a layer pipeline with the helper; from there on ubatches run in
/// staggered pairs. Every ubatch computes exactly what it would on the host alone with the
/// same ubatch size, so the logits are the same bits.
pub fn prefill(
    model: &Model,
    be: &dyn Backend,
    seq: &mut Sequence,
    tokens: &[u32],
    plan: &SplitPlan,
) -> Result<(Vec<f32>, SplitReport)> {
    prefill_rows(model, be, seq, tokens, plan, None)
}

/// [`prefill`] that hands every ubatch's final residual rows to `rows` as they are made
/// (the layer pipeline is then not used: it leaves the early ubatches' rows on the helper).
pub fn prefill_rows(
    model: &Model,
    be: &dyn Backend,
    seq: &mut Sequence,
    tokens: &[u32],
    plan: &SplitPlan,
    mut rows: Option<RowSink>,
) -> Result<(Vec<f32>, SplitReport)> {
    let ubatch = plan.ubatch.max(1);
    let start = seq.state.pos;
    let chunks: Vec<&[u32]> = tokens.chunks(ubatch).collect();
    let mut report = SplitReport {
        ubatches: chunks.len(),
        ..SplitReport::default()
    };
    let early = (0..chunks.len())
        .take_while(|i| start + i * ubatch < plan.interleave_from)
        .count();
    let (early, late) = chunks.split_at(early);
    let mut x = None;
    if !early.is_empty() {
        // A helper still being re-filled from the page file lacks rows its mirror needs.
        let pipeline = seq.placement.prefill_helper().is_some_and(|c| {
            c.prefill_layers.end == model.config.num_hidden_layers
                && !c.is_lost()
                && seq
                    .placement
                    .holds_all_pages_of(c.id, c.prefill_layers.clone())
        }) && tokens.len() > plan.min_tokens
            && early.len() > 1
            // The pipeline leaves the early ubatches' final rows on the helper.
            && rows.is_none();
        x = Some(if pipeline {
            pipelined(model, be, seq, early, &mut report)?
        } else {
            plain(model, be, seq, early, &mut rows)?
        });
    }
    if !late.is_empty() {
        x = Some(interleaved(model, be, seq, late, &mut report, &mut rows)?);
    }
    let x = x.ok_or_else(|| Error::Invalid("prefill needs at least one token".into()))?;
    Ok((model.head(be, x, Logits::Last)?, report))
}

/// Where a prefill hands each ubatch's final residual rows (before the final norm) and their
/// first position, as they are made: the MTP head's cache is filled from them.
pub type RowSink<'s> = &'s mut dyn FnMut(&Act, usize) -> Result<()>;

/// Ubatches one after another on the host (the helper only attends pages it holds); returns
/// the last one's final residual.
fn plain(
    model: &Model,
    be: &dyn Backend,
    seq: &mut Sequence,
    chunks: &[&[u32]],
    sink: &mut Option<RowSink>,
) -> Result<Act> {
    let mut x = None;
    let n = model.config.num_hidden_layers;
    for c in chunks {
        let (t0, pos) = (seq.placement.telemetry.now(), seq.state.pos);
        let mut rows = model.embed(be, c)?;
        seq.run_layers(model, be, &mut rows, pos, 0..n, None)?;
        if let Some(sink) = sink {
            sink(&rows, pos)?;
        }
        host_bar(seq, pos, c.len(), 0..n, t0);
        seq.state.pos += c.len();
        seq.offload(be)?;
        x = Some(rows);
    }
    Ok(x.expect("the caller passes at least one chunk"))
}

/// Ubatches in staggered pairs: whenever one stops at a full-attention layer for the helper's
/// pages, the host runs the other up to the same layer. Both stop at the same layers (pages
/// move between pairs only), so the second never overtakes the first and each sees exactly
/// the rows and state it would on the host alone. Returns the last ubatch's final residual.
fn interleaved(
    model: &Model,
    be: &dyn Backend,
    seq: &mut Sequence,
    chunks: &[&[u32]],
    report: &mut SplitReport,
    sink: &mut Option<RowSink>,
) -> Result<Act> {
    let mut x = None;
    for pair in chunks.chunks(2) {
        let (t0, mut pos) = (seq.placement.telemetry.now(), seq.state.pos);
        let mut passes = Vec::with_capacity(2);
        for c in pair {
            passes.push(Pass::new(
                model.embed(be, c)?,
                pos,
                0..model.config.num_hidden_layers,
            ));
            pos += c.len();
        }
        let mut waited = false;
        while passes.iter().any(|p| !p.is_done()) {
            for p in passes.iter_mut().filter(|p| !p.is_done()) {
                seq.advance(model, be, p, true)?;
                waited |= p.is_waiting();
            }
        }
        if waited {
            report.interleaved += pair.len();
        }
        if let Some(sink) = sink {
            let mut at = seq.state.pos;
            for p in &passes {
                sink(&p.x, at)?;
                at += p.x.len() / model.config.hidden_size;
            }
        }
        // One bar for the pair: its ubatches run by turns.
        let n = model.config.num_hidden_layers;
        host_bar(seq, seq.state.pos, pos - seq.state.pos, 0..n, t0);
        seq.state.pos = pos;
        seq.offload(be)?;
        x = passes.pop().map(|p| p.x);
    }
    Ok(x.expect("the caller passes at least one chunk"))
}

/// The layer pipeline over `chunks` (more than one): the host runs layers `[0, L)` of each
/// ubatch and hands the residual on; the helper runs the rest of all but the last, which the
/// host finishes itself. Returns the last ubatch's final residual.
fn pipelined(
    model: &Model,
    be: &dyn Backend,
    seq: &mut Sequence,
    chunks: &[&[u32]],
    report: &mut SplitReport,
) -> Result<Act> {
    let helper = seq
        .placement
        .prefill_helper()
        .expect("the caller checked for a helper");
    let (tail, id) = (helper.prefill_layers.clone(), helper.id);
    let n = model.config.num_hidden_layers;
    let start = seq.state.pos;
    let ubatch = chunks[0].len();
    let total: usize = chunks.iter().map(|c| c.len()).sum();
    let at = |i: usize| start + i * ubatch;
    let (last, head) = chunks.split_last().expect("more than one chunk");
    // Layer-L residuals of the ubatches handed to the helper (read to the host to cross the
    // link), kept until the batch completes so the host can redo them alone.
    let mut sent: Vec<Vec<f32>> = Vec::with_capacity(head.len());
    let mut reqs = Vec::with_capacity(head.len());
    let mut x_last = model.embed(be, last)?;
    let mut last_head_done = false;
    // Replies taken off the link so far; a refused batch drains the rest.
    let mut replies = Replies::new(model, &tail, start, head.len());
    let pipelined = (|| -> Result<()> {
        if let Some(rows) = sync_mirror(be, &model.config, seq)? {
            report.synced_rows = rows;
            report.mirror_synced = true;
        }
        for (i, c) in head.iter().enumerate() {
            let t0 = seq.placement.telemetry.now();
            let mut x = model.embed(be, c)?;
            seq.run_layers(model, be, &mut x, at(i), 0..tail.start, None)?;
            let x = be.download_owned(x);
            host_bar(seq, at(i), c.len(), 0..tail.start, t0);
            let bytes = x.len() * size_of::<f32>();
            sent.push(x.clone());
            let msg = Message::PrefillChunk {
                seq: seq.placement.prefill_helper().expect("checked above").seq(),
                pos: at(i) as u64,
                want_state: i + 1 == head.len(),
                residual: WireTensor::f32(vec![c.len(), model.config.hidden_size], x),
            };
            reqs.push(
                seq.placement
                    .prefill_helper_mut()
                    .expect("checked above")
                    .send(&msg)?,
            );
            replies.handed_on(seq, bytes);
            // Back-pressure: a helper slower than the host holds a bounded queue.
            while reqs.len() - replies.taken > MAX_IN_FLIGHT {
                replies.take(be, seq, reqs[replies.taken], head[replies.taken].len())?;
            }
        }
        // The host's share of the last ubatch overlaps the helper's work on the ones before.
        let t0 = seq.placement.telemetry.now();
        seq.run_layers(model, be, &mut x_last, at(head.len()), 0..tail.start, None)?;
        host_bar(seq, at(head.len()), last.len(), 0..tail.start, t0);
        last_head_done = true;
        while replies.taken < reqs.len() {
            replies.take(be, seq, reqs[replies.taken], head[replies.taken].len())?;
        }
        replies.finish(be, seq)
    })();
    match pipelined {
        Ok(()) => {
            report.on_helper = head.len();
            report.rows_on_helper =
                sent.iter().map(|x| x.len()).sum::<usize>() / model.config.hidden_size;
            seq.placement
                .prefill_helper_mut()
                .expect("checked above")
                .mirror_pos = at(head.len());
        }
        // A failure of this host (its page file, its backend) is not the helper's: the
        // batch cannot be redone here either.
        Err(e @ (Error::Io { .. } | Error::Invalid(_))) => return Err(e),
        Err(e) => {
            report.fallback = Some(e.to_string());
            // A refusal leaves a working helper: take its outstanding replies off the link,
            // cut its mirror back to the batch start, and keep it. Anything else: it is gone.
            let kept = matches!(e, Error::Refused { .. })
                && seq.placement.prefill_helper_mut().is_some_and(|client| {
                    reqs[replies.taken.min(reqs.len())..]
                        .iter()
                        .all(|&r| !matches!(client.reply(r), Err(Error::Remote(_))))
                        && client.truncate(start).is_ok()
                });
            // Without a page file, pages the helper held are lost with it.
            let holds_pages = seq.placement.pages_on(id) > 0 && seq.placement.spill.is_none();
            if !kept {
                seq.placement.helper_lost = Some(e.to_string());
                seq.placement.lose_helper(id);
            }
            if holds_pages && !kept {
                return Err(Error::Remote(format!(
                    "{e}; the helper held this sequence's oldest KV pages, so it cannot go on"
                )));
            }
            // Rerun the batch here: drop any rows the helper's replies added, run the tail
            // layers over the kept residuals, then whole ubatches that were never sent.
            for l in tail.clone() {
                if let LayerState::Attention(kv) = &mut seq.state.layers[l] {
                    kv.truncate(be, start)?;
                }
            }
            let kept = sent.len();
            for (i, x) in sent.drain(..).enumerate() {
                seq.run_layers(model, be, &mut be.upload(x), at(i), tail.clone(), None)?;
            }
            for (i, c) in head.iter().enumerate().skip(kept) {
                let mut x = model.embed(be, c)?;
                seq.run_layers(model, be, &mut x, at(i), 0..n, None)?;
            }
            if !last_head_done {
                seq.run_layers(model, be, &mut x_last, at(head.len()), 0..tail.start, None)?;
            }
        }
    }
    let t0 = seq.placement.telemetry.now();
    seq.run_layers(model, be, &mut x_last, at(head.len()), tail.start..n, None)?;
    host_bar(seq, at(head.len()), last.len(), tail.start..n, t0);
    seq.state.pos = start + total;
    seq.offload(be)?;
    Ok(x_last)
}

/// Report that `layers` of the ubatch of `tokens` at `pos` ran on the host since `t0`.
fn host_bar(seq: &Sequence, pos: usize, tokens: usize, layers: Range<usize>, t0: f64) {
    seq.placement.telemetry.emit(|end_ms| Event::Ubatch {
        device: Device::Host,
        pos,
        tokens,
        layers: [layers.start, layers.end],
        start_ms: t0,
        end_ms,
    });
}

fn full_layers(model: &Model, layers: &std::ops::Range<usize>) -> Vec<usize> {
    layers
        .clone()
        .filter(|&l| model.config.layer_types[l] == LayerKind::FullAttention)
        .collect()
}

/// Bring the helper's mirror of its layers up to `seq.state.pos`: the KV rows the host produced
/// since the watermark (rows already handed over as pages are there) and the DeltaNet states.
/// Returns the KV rows pushed, or `None` if the mirror was current. `be` reads them to the host.
fn sync_mirror(be: &dyn Backend, c: &ModelConfig, seq: &mut Sequence) -> Result<Option<usize>> {
    let client = seq
        .placement
        .prefill_helper()
        .expect("a helper is attached");
    let (from, to) = (client.mirror_pos, seq.state.pos);
    if from >= to && !client.mirror_stale {
        return Ok(None);
    }
    let tail = client.prefill_layers.clone();
    // Rows already handed over as pages are on the helper (a pipeline runs only once it holds
    // every page of these layers that left: `Placement::holds_all_pages_of`).
    let mut rows_from = None;
    let mut row_bytes = 0;
    for l in tail.clone() {
        if let (LayerState::Attention(cache), Some(pages)) =
            (&seq.state.layers[l], seq.placement.holders(l))
        {
            let held = from.max(pages.prefix_on(client.id));
            rows_from = Some(rows_from.map_or(held, |r: usize| r.min(held)));
            row_bytes += 2 * cache.row_width() * 4;
        }
    }
    let rows_from = rows_from.unwrap_or(from);
    // Pieces that stay well inside the frame limit (a long decode can leave hundreds of MB
    // behind the watermark); the DeltaNet states ride with the last piece.
    let per_piece = (client.max_frame() / 2 / row_bytes.max(1)).max(1);
    let mut at = rows_from;
    loop {
        let end = (at + per_piece).min(to);
        let last = end == to;
        let payload = pollster::block_on(ChunkPayload::read(
            be,
            c,
            &seq.state,
            tail.clone(),
            at..end,
            last,
        )?);
        let client = seq
            .placement
            .prefill_helper_mut()
            .expect("a helper is attached");
        let seq = client.seq();
        let req = client.send(&payload.into_message(seq, at))?;
        match client.reply(req)? {
            Message::Ack => {}
            other => return Err(unexpected("Ack", &other)),
        }
        if last {
            client.mirror_pos = to;
            client.mirror_stale = false;
            return Ok(Some(to - rows_from));
        }
        at = end;
    }
}

/// What a `ChunkState` carries: the KV rows of a range of positions of every full-attention
/// layer among some layers and, if asked, those layers' DeltaNet states. Both ends send one:
/// the helper answering a prefill chunk, the host syncing the helper's mirror.
pub struct ChunkPayload {
    pub kv_layers: Vec<u32>,
    pub kv: Vec<(WireTensor, WireTensor)>,
    pub delta_layers: Vec<u32>,
    pub states: Vec<(WireTensor, WireTensor)>,
}

impl ChunkPayload {
    /// Rows `rows` of the full-attention layers among `layers` and (with `with_states`) the
    /// DeltaNet states of the others, read from `be` in one go (one wait on a GPU). The read
    /// is recorded before this returns; the future waits for it ([`Backend::read_ranges`]).
    pub fn read(
        be: &dyn Backend,
        c: &ModelConfig,
        st: &State,
        layers: Range<usize>,
        rows: Range<usize>,
        with_states: bool,
    ) -> Result<impl std::future::Future<Output = ChunkPayload>> {
        let (mut kv_layers, mut delta_layers, mut read) =
            (Vec::new(), Vec::new(), RowsRead::default());
        let mut states_of = Vec::new();
        for l in layers {
            match &st.layers[l] {
                LayerState::Attention(kv) => {
                    kv_layers.push(l as u32);
                    read.kv(kv, rows.start, rows.len())?;
                }
                LayerState::DeltaNet(d) if with_states => {
                    delta_layers.push(l as u32);
                    states_of.push(d);
                }
                LayerState::DeltaNet(_) | LayerState::Elsewhere => {}
            }
        }
        for d in &states_of {
            read.values(&d.s, 0..d.s.len());
            read.values(&d.conv, 0..d.conv.len());
        }
        let read = read.start(be);
        let c = c.clone();
        Ok(async move {
            let pieces = read.await;
            ChunkPayload::unpack(&c, pieces, kv_layers, delta_layers, rows.len())
        })
    }

    /// The pieces of one [`Self::read`], in the order it asked for them, as wire tensors.
    fn unpack(
        c: &ModelConfig,
        pieces: Vec<Encoded>,
        kv_layers: Vec<u32>,
        delta_layers: Vec<u32>,
        rows: usize,
    ) -> ChunkPayload {
        let mut pieces = pieces.into_iter();
        let mut take = |shape: Vec<usize>| {
            WireTensor::new(
                shape,
                pieces.next().expect("one piece per tensor asked for"),
            )
        };
        let width = c.num_key_value_heads * c.head_dim;
        let kv = kv_layers
            .iter()
            .map(|_| (take(vec![rows, width]), take(vec![rows, width])))
            .collect();
        let states = delta_layers
            .iter()
            .map(|_| {
                let s = take(vec![
                    c.linear_num_value_heads,
                    c.linear_key_head_dim,
                    c.linear_value_head_dim,
                ]);
                (s, take(vec![c.linear_conv_kernel_dim - 1, c.conv_dim()]))
            })
            .collect();
        ChunkPayload {
            kv_layers,
            kv,
            delta_layers,
            states,
        }
    }

    pub fn into_message(self, seq: u64, pos: usize) -> Message {
        Message::ChunkState {
            seq,
            pos: pos as u64,
            kv_layers: self.kv_layers,
            kv: self.kv,
            delta_layers: self.delta_layers,
            states: self.states,
        }
    }
}

/// Ubatches of a pipelined batch sent to the helper and not yet answered, at most: the
/// helper's queue (and the host's replies waiting to be read) stay bounded when the helper is
/// the slower side; the host waits for the oldest reply before it sends more.
const MAX_IN_FLIGHT: usize = 8;

/// The helper's replies to a pipelined batch, applied in order as they come: each ubatch's KV
/// rows of the tail's full layers, and after the last its DeltaNet states (applied only once
/// every reply checked out), all moved into `be`.
struct Replies {
    full: Vec<usize>,
    deltas: Vec<u32>,
    tail: Range<usize>,
    /// The position of the next reply's first row.
    pos: usize,
    /// Ubatches sent; replies taken off the link so far (bad ones included).
    sent: usize,
    taken: usize,
    final_states: Option<DeltaStates>,
    /// When each ubatch was handed to the helper, and when its latest reply came (the
    /// telemetry clock): a helper's bar starts at the later of its ubatch's hand-off and the
    /// end of its previous bar.
    handed_at: Vec<f64>,
    helper_free: f64,
}

/// DeltaNet layers and their (recurrent, conv) states, as a reply carries them.
type DeltaStates = (Vec<u32>, Vec<(WireTensor, WireTensor)>);

impl Replies {
    fn new(model: &Model, tail: &Range<usize>, start: usize, sent: usize) -> Replies {
        Replies {
            full: full_layers(model, tail),
            deltas: tail
                .clone()
                .filter(|&l| model.config.layer_types[l] == LayerKind::LinearAttention)
                .map(|l| l as u32)
                .collect(),
            tail: tail.clone(),
            pos: start,
            sent,
            taken: 0,
            final_states: None,
            handed_at: Vec::with_capacity(sent),
            helper_free: 0.0,
        }
    }

    /// An ubatch of `bytes` of residuals was just handed to the prefill helper.
    fn handed_on(&mut self, seq: &Sequence, bytes: usize) {
        let Some(id) = seq.placement.prefill_helper().map(|h| h.id) else {
            return;
        };
        self.handed_at.push(seq.placement.telemetry.now());
        seq.placement.telemetry.emit(|at_ms| Event::Transfer {
            from: Device::Host,
            to: Device::Helper(id),
            kind: "PrefillChunk",
            bytes,
            at_ms,
        });
    }

    /// Report the reply just taken: the helper's bar for the ubatch of `rows` at `pos`, and
    /// the `bytes` of rows and states it sent back.
    fn report(&mut self, seq: &Sequence, pos: usize, rows: usize, bytes: usize) {
        let (Some(id), true) = (
            seq.placement.prefill_helper().map(|h| h.id),
            seq.placement.telemetry.is_on(),
        ) else {
            return;
        };
        let end = seq.placement.telemetry.now();
        let handed = self.handed_at.get(self.taken - 1).copied().unwrap_or(end);
        let start = handed.max(self.helper_free);
        self.helper_free = end;
        let helper = Device::Helper(id);
        let tail = [self.tail.start, self.tail.end];
        seq.placement.telemetry.emit(|_| Event::Ubatch {
            device: helper,
            pos,
            tokens: rows,
            layers: tail,
            start_ms: start,
            end_ms: end,
        });
        seq.placement.telemetry.emit(|_| Event::Transfer {
            from: helper,
            to: Device::Host,
            kind: "ChunkState",
            bytes,
            at_ms: end,
        });
    }

    /// Take the reply to request `req`, an ubatch of `len` rows, and append its KV rows.
    fn take(&mut self, be: &dyn Backend, seq: &mut Sequence, req: u32, len: usize) -> Result<()> {
        let reply = seq
            .placement
            .prefill_helper_mut()
            .expect("a helper is attached")
            .reply(req);
        self.taken += 1;
        let reply = reply?;
        let Message::ChunkState {
            pos: p,
            kv_layers,
            kv,
            delta_layers,
            states,
            ..
        } = reply
        else {
            return Err(unexpected("ChunkState", &reply));
        };
        let (pos, full) = (self.pos, &self.full);
        let layers: Vec<usize> = kv_layers.iter().map(|&l| l as usize).collect();
        if p as usize != pos || &layers != full {
            return Err(Error::Remote(format!(
                "chunk state for position {p} and layers {layers:?}, expected {pos} and {full:?}"
            )));
        }
        let rows = kv.first().map_or(len, |(k, _)| k.shape[0]);
        // Only the batch's last reply carries states, all of the tail's DeltaNet layers.
        let last = self.taken == self.sent;
        if rows != len
            || (last && delta_layers != self.deltas)
            || (!last && !delta_layers.is_empty())
        {
            return Err(Error::Remote(format!(
                "chunk state at {pos}: {rows} rows (expected {len}) and DeltaNet layers {delta_layers:?}"
            )));
        }
        let bytes = (kv.iter().chain(&states))
            .map(|(a, b)| a.encoded_len() + b.encoded_len())
            .sum::<usize>();
        self.report(seq, pos, rows, bytes);
        for (&l, (k, v)) in layers.iter().zip(kv) {
            let LayerState::Attention(cache) = &mut seq.state.layers[l] else {
                unreachable!("full layers")
            };
            if k.shape != [rows, cache.row_width()] || cache.len() != pos {
                return Err(Error::Remote(format!(
                    "layer {l}: KV rows {:?} at {pos} do not fit",
                    k.shape
                )));
            }
            cache
                .append_encoded(be, &k.data, &v.data)
                .map_err(|e| Error::Remote(format!("layer {l}: {e}")))?;
        }
        self.pos += rows;
        if last {
            self.final_states = Some((delta_layers, states));
        }
        Ok(())
    }

    /// Check and apply the DeltaNet states the last reply carried.
    fn finish(&mut self, be: &dyn Backend, seq: &mut Sequence) -> Result<()> {
        let (ids, states) = self
            .final_states
            .take()
            .ok_or_else(|| Error::Remote("the helper sent no DeltaNet states".into()))?;
        let mut checked = Vec::with_capacity(ids.len());
        for (&l, (s, conv)) in ids.iter().zip(states) {
            match seq.state.layers.get(l as usize) {
                Some(LayerState::DeltaNet(d))
                    if self.tail.contains(&(l as usize))
                        && d.s.len() == s.len()
                        && d.conv.len() == conv.len() =>
                {
                    checked.push((l as usize, s.values(), conv.values()))
                }
                _ => {
                    return Err(Error::Remote(format!(
                        "DeltaNet state for layer {l} does not fit"
                    )))
                }
            }
        }
        for (l, s, conv) in checked {
            if let LayerState::DeltaNet(d) = &mut seq.state.layers[l] {
                d.s = be.upload(s);
                d.conv = be.upload(conv);
            }
        }
        Ok(())
    }
}
