//! The requests a greeted host makes, one handler per message: each checks everything the
//! host sent against the assignment, what is held and the limits before it changes anything.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use super::limits::{check_reply, prefill_bytes, Cost, F32, REPLY_SLACK};
use super::{Held, Helper, Refusal, MAX_SEQS};
use crate::backend::KvPage;
use crate::backend::{AttnShape, Backend};
use crate::cache_types::Encoded;
use crate::host::split::ChunkPayload;
use crate::kv::{download_partials, NoPagesAway, PagedKv};
use crate::model::LayerState;
use crate::protocol::{Configure, Message, MsgType, WireTensor};
use crate::{LayerKind, State};

/// A `ChunkState` request: the host's rows and states for this helper's mirror.
struct MirrorSync {
    seq: u64,
    pos: u64,
    kv_layers: Vec<u32>,
    kv: Vec<(WireTensor, WireTensor)>,
    delta_layers: Vec<u32>,
    states: Vec<(WireTensor, WireTensor)>,
}

impl Helper<'_> {
    /// Routes one request of a greeted host to the method that serves its kind.
    pub(super) async fn handle(&self, s: &mut Held, msg: Message) -> Result<Message, Refusal> {
        match msg {
            Message::Configure(cfg) => self.on_configure(s, cfg).await,
            Message::Ping { nonce } => Ok(Message::Pong { nonce }),
            Message::Stats(_) => Ok(s.stats()),
            Message::KvAppend {
                seq,
                layer,
                start,
                k,
                v,
            } => self.on_kv_append(s, seq, layer, start, k, v),
            Message::AttnQuery {
                seq,
                layer,
                positions,
                end,
                q,
            } => self.on_attn_query(s, seq, layer, positions, end, q).await,
            Message::PrefillChunk {
                seq,
                pos,
                want_state,
                residual,
            } => {
                self.on_prefill_chunk(s, seq, pos, want_state, residual)
                    .await
            }
            Message::ChunkState {
                seq,
                pos,
                kv_layers,
                kv,
                delta_layers,
                states,
            } => self.on_chunk_state(
                s,
                MirrorSync {
                    seq,
                    pos,
                    kv_layers,
                    kv,
                    delta_layers,
                    states,
                },
            ),
            Message::KvFetch {
                seq,
                layer,
                start,
                len,
            } => self.on_kv_fetch(s, seq, layer, start, len).await,
            Message::KvTruncate { seq, len } => on_kv_truncate(self.backend, s, seq, len),
            other => {
                s.configured(other.msg_type())?;
                Err(Refusal(
                    "unsupported",
                    format!("{:?} is not served by this helper", other.msg_type()),
                ))
            }
        }
    }

    /// A new assignment starts from nothing: rows held were laid out for the old one.
    async fn on_configure(&self, s: &mut Held, cfg: Configure) -> Result<Message, Refusal> {
        let n = self.model().config.num_hidden_layers as u32;
        if cfg.first_layer > cfg.end_layer || cfg.end_layer > n || cfg.page_size == 0 {
            return Err(Refusal(
                "configure",
                format!(
                    "layers {}..{} of {n} with page size {}",
                    cfg.first_layer, cfg.end_layer, cfg.page_size
                ),
            ));
        }
        let (types, c) = (cfg.kv_types, &self.model().config);
        if let Err(e) = types.check_head(c.head_dim) {
            return Err(Refusal("configure", format!("cache types {types}: {e}")));
        }
        let row = c.num_key_value_heads * c.head_dim;
        if [types.k, types.v]
            .iter()
            .any(|&t| !self.backend.holds_kv(t, row))
        {
            return Err(Refusal(
                "configure",
                format!(
                    "this helper's {} backend cannot hold this model's KV pages (rows of {row} \
                     values) as {types}: run the host with other --cache-type-k / \
                     --cache-type-v, or this helper on its CPU",
                    self.backend.name()
                ),
            ));
        }
        s.seqs.clear();
        s.configure = None;
        s.layers = None;
        s.layers = self
            .load(cfg.first_layer as usize..cfg.end_layer as usize)
            .await
            .map_err(|e| Refusal("configure", format!("loading the assigned layers: {e}")))?;
        s.configure = Some(cfg);
        Ok(Message::Ack)
    }

    /// A KV page the host hands over: stored with its page boundaries.
    fn on_kv_append(
        &self,
        s: &mut Held,
        seq: u64,
        layer: u32,
        start: u64,
        k: WireTensor,
        v: WireTensor,
    ) -> Result<Message, Refusal> {
        let cfg = s.configured(MsgType::KvAppend)?;
        // Positions index 32-bit tables on a GPU; no context comes near that.
        if start.saturating_add(k.shape[0] as u64) > u64::from(u32::MAX) {
            return Err(Refusal(
                "shape",
                format!("a KV page at {start} is beyond 32 bits of positions"),
            ));
        }
        self.check_full_layer(layer)?;
        let c = &self.model().config;
        let page_size = cfg.page_size as usize;
        let width = c.num_key_value_heads * c.head_dim;
        let rows = k.shape[0];
        if k.shape[1] != width
            || rows == 0
            || rows > page_size
            || !(start as usize).is_multiple_of(page_size)
        {
            return Err(Refusal(
                "shape",
                format!(
                    "KV page at {start} of shape {:?}: expected a page start and \
                     [1..={page_size}, {width}]",
                    k.shape
                ),
            ));
        }
        check_types(&cfg, &k, &v)?;
        // A page start: the page is new here unless (part of) it is held already.
        let held = held_kv(s, seq, layer).is_ok_and(|kv| kv.has_page_at(start as usize));
        let pages = if held { 0 } else { self.page_bytes(&cfg) };
        let cost = Cost { pages, work: 0 };
        self.check_budget(s, seq, &cfg, &format!("a KV page at {start}"), cost)?;
        let st = self.seq_state(&mut s.seqs, seq, &cfg)?;
        append_rows(
            self.backend,
            kv_of(st, layer)?,
            layer,
            start as usize,
            (k.data, v.data),
        )?;
        Ok(Message::Ack)
    }

    /// Attention of the host's queries over the pages held for `layer` below `end`: one
    /// partial per page, for the host to merge with its own.
    async fn on_attn_query(
        &self,
        s: &mut Held,
        seq: u64,
        layer: u32,
        positions: Vec<u64>,
        end: u64,
        q: WireTensor,
    ) -> Result<Message, Refusal> {
        s.configured(MsgType::AttnQuery)?;
        self.check_full_layer(layer)?;
        let shape = self.attn_shape();
        if q.shape[1..] != [shape.q_heads, shape.head_dim] {
            return Err(Refusal(
                "shape",
                format!(
                    "queries {:?}: expected [t, {}, {}]",
                    q.shape, shape.q_heads, shape.head_dim
                ),
            ));
        }
        // Positions index 32-bit tables on a GPU; no context comes near that.
        if let Some(&p) = positions.iter().find(|&&p| p > u64::from(u32::MAX)) {
            return Err(Refusal(
                "shape",
                format!("query position {p} is beyond 32 bits"),
            ));
        }
        let kv = held_kv(s, seq, layer)?;
        if end as usize > kv.len() {
            return Err(Refusal(
                "missing",
                format!(
                    "layer {layer}: asked to attend up to {end}, this helper holds {}",
                    kv.len()
                ),
            ));
        }
        let pages: Vec<&KvPage> = kv
            .pages()
            .iter()
            .filter(|p| (p.start as u64) < end)
            .map(|p| &**p)
            .collect();
        let rows = positions.len() * shape.q_heads;
        // A small query over many pages asks for many partials: the reply must fit a frame,
        // and nothing is computed (or allocated) for one that would not.
        let reply = pages.len() * rows * (shape.head_dim + 2) * F32 + REPLY_SLACK;
        check_reply(s, reply as u64, || {
            format!(
                "the partials of {} pages for {rows} query rows",
                pages.len()
            )
        })?;
        let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        let q = self.backend.upload(q.values());
        let parts = self.backend.attend_pages(shape, &q, &pos, &pages);
        let (o, m, l) = download_partials(self.backend, &parts).await;
        let n = pages.len();
        Ok(Message::AttnPartials {
            seq,
            layer,
            page_starts: pages.iter().map(|p| p.start as u64).collect(),
            o: WireTensor::f32(vec![n, rows, shape.head_dim], o),
            m: WireTensor::f32(vec![n, rows], m),
            l: WireTensor::f32(vec![n, rows], l),
        })
    }

    fn attn_shape(&self) -> AttnShape {
        let c = &self.model().config;
        AttnShape {
            q_heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        }
    }

    /// The host's residual rows at `pos` run through this helper's layers; the reply carries
    /// the KV rows they made (and with `want_state` the DeltaNet states) for the host's copy.
    async fn on_prefill_chunk(
        &self,
        s: &mut Held,
        seq: u64,
        pos: u64,
        want_state: bool,
        residual: WireTensor,
    ) -> Result<Message, Refusal> {
        let cfg = s.configured(MsgType::PrefillChunk)?;
        let c = &self.model().config;
        let layers = cfg.first_layer as usize..cfg.end_layer as usize;
        if layers.is_empty() {
            return Err(Refusal(
                "configure",
                "no prefill layers are assigned to this helper".into(),
            ));
        }
        if residual.shape[1] != c.hidden_size {
            return Err(Refusal(
                "shape",
                format!(
                    "residual {:?}: expected [rows, {}]",
                    residual.shape, c.hidden_size
                ),
            ));
        }
        let rows = residual.shape[0];
        let full = self.full_layers(&cfg);
        check_mirror_at(s, seq, pos, &full)?;
        let (reply, work) = prefill_bytes(c, &cfg, pos, rows, want_state);
        check_reply(s, reply, || {
            format!("the KV rows and states of a {rows}-row chunk")
        })?;
        let pages = self.page_growth(s, &cfg, seq, &full, pos + rows as u64);
        let what = format!("a prefill chunk of {rows} rows at {pos}");
        self.check_budget(s, seq, &cfg, &what, Cost { pages, work })?;
        let st = self.seq_state(&mut s.seqs, seq, &cfg)?;
        let mut x = self.backend.upload(residual.values());
        s.layers
            .as_deref()
            .unwrap_or(self.model())
            .run_layers(
                self.backend,
                st,
                &mut NoPagesAway,
                &mut x,
                pos as usize,
                layers.clone(),
                None,
            )
            .map_err(|e| Refusal("prefill", e.to_string()))?;
        st.pos += rows;
        let pos = pos as usize;
        let read = ChunkPayload::read(self.backend, c, st, layers, pos..pos + rows, want_state)
            .map_err(|e| Refusal("prefill", e.to_string()))?;
        Ok(read.await.into_message(seq, pos))
    }

    /// The assigned layers of `kind`.
    fn layers_of(&self, cfg: &Configure, kind: LayerKind) -> Vec<u32> {
        let c = &self.model().config;
        (cfg.first_layer..cfg.end_layer)
            .filter(|&l| c.layer_types[l as usize] == kind)
            .collect()
    }

    fn full_layers(&self, cfg: &Configure) -> Vec<u32> {
        self.layers_of(cfg, LayerKind::FullAttention)
    }

    /// The host brings this helper's mirror up to date: rows and states it produced since the
    /// mirror's watermark. Everything is checked before anything changes, so a refused sync
    /// leaves the mirror as it was.
    fn on_chunk_state(&self, s: &mut Held, sync: MirrorSync) -> Result<Message, Refusal> {
        let cfg = s.configured(MsgType::ChunkState)?;
        let rows = self.check_sync(s, &cfg, &sync)?;
        let end = sync.pos + rows as u64;
        let pages = self.page_growth(s, &cfg, sync.seq, &sync.kv_layers, end);
        let what = format!("a mirror sync of rows {}..{end}", sync.pos);
        self.check_budget(s, sync.seq, &cfg, &what, Cost { pages, work: 0 })?;
        let st = self.seq_state(&mut s.seqs, sync.seq, &cfg)?;
        let pos = sync.pos as usize;
        for (&l, (k, v)) in sync.kv_layers.iter().zip(sync.kv) {
            append_rows(self.backend, kv_of(st, l)?, l, pos, (k.data, v.data))?;
        }
        for (&l, (sv, conv)) in sync.delta_layers.iter().zip(sync.states) {
            if let LayerState::DeltaNet(d) = &mut st.layers[l as usize] {
                d.s = self.backend.upload(sv.values());
                d.conv = self.backend.upload(conv.values());
            }
        }
        st.pos = pos + rows;
        Ok(Message::Ack)
    }

    /// Whether `sync` fits this helper's layers and continues what it holds; returns the rows
    /// it brings per layer. Every piece carries all full layers' rows; the last also all
    /// DeltaNet states.
    fn check_sync(&self, s: &Held, cfg: &Configure, sync: &MirrorSync) -> Result<usize, Refusal> {
        let c = &self.model().config;
        let rows = sync.kv.first().map_or(0, |(k, _)| k.shape[0]);
        let width = c.num_key_value_heads * c.head_dim;
        if sync.kv.iter().any(|(k, _)| k.shape != [rows, width]) {
            return Err(Refusal(
                "shape",
                format!("mirror rows must all be [{rows}, {width}]"),
            ));
        }
        for (k, v) in &sync.kv {
            check_types(cfg, k, v)?;
        }
        if sync.kv_layers != self.full_layers(cfg)
            || !(sync.delta_layers.is_empty()
                || sync.delta_layers == self.layers_of(cfg, LayerKind::LinearAttention))
        {
            return Err(Refusal(
                "layer",
                format!(
                    "a mirror sync must cover exactly this helper's layers {}..{}",
                    cfg.first_layer, cfg.end_layer
                ),
            ));
        }
        let (seq, pos) = (sync.seq, sync.pos);
        let end = pos
            .checked_add(rows as u64)
            .ok_or_else(|| Refusal("order", format!("mirror position {pos} is out of range")))?;
        match s.seqs.get(&seq) {
            Some(st) => {
                for &l in &sync.kv_layers {
                    let have = kv_len(st, l);
                    if pos > have as u64 || have as u64 > end {
                        return Err(Refusal(
                            "order",
                            format!("layer {l}: rows {pos}..{end} do not continue the {have} held"),
                        ));
                    }
                }
            }
            None if pos != 0 => {
                return Err(Refusal(
                    "order",
                    format!("sequence {seq} is new here: a sync must start at 0, not {pos}"),
                ))
            }
            None => {}
        }
        let (state_len, conv_len) = c.delta_state_len();
        for (&l, (sv, conv)) in sync.delta_layers.iter().zip(&sync.states) {
            if sv.len() != state_len || conv.len() != conv_len {
                return Err(Refusal(
                    "shape",
                    format!("layer {l}: not a DeltaNet state of this model"),
                ));
            }
        }
        Ok(rows)
    }

    /// KV rows `start .. start + len` of `layer`, copied back to the host.
    async fn on_kv_fetch(
        &self,
        s: &mut Held,
        seq: u64,
        layer: u32,
        start: u64,
        len: u64,
    ) -> Result<Message, Refusal> {
        s.configured(MsgType::KvFetch)?;
        self.check_full_layer(layer)?;
        let kv = held_kv(s, seq, layer)?;
        let width = kv.row_width();
        let reply = len
            .saturating_mul(self.model().config.kv_row_bytes(kv.types()) as u64)
            .saturating_add(REPLY_SLACK as u64);
        check_reply(s, reply, || format!("{len} KV rows of layer {layer}"))?;
        let (k, v) = kv
            .rows(self.backend, start as usize, len as usize)
            .map_err(|e| Refusal("missing", e.to_string()))?
            .await;
        Ok(Message::KvRows {
            seq,
            layer,
            start,
            k: WireTensor::new(vec![len as usize, width], k),
            v: WireTensor::new(vec![len as usize, width], v),
        })
    }

    /// The state of sequence `seq`, made on first use with DeltaNet state for the assigned
    /// layers only (`check_budget` counted it); at most `MAX_SEQS` per session, since every
    /// sequence costs memory whether or not its pages arrive.
    fn seq_state<'s>(
        &self,
        seqs: &'s mut BTreeMap<u64, State>,
        seq: u64,
        cfg: &Configure,
    ) -> Result<&'s mut State, Refusal> {
        let held = seqs.len();
        match seqs.entry(seq) {
            Entry::Occupied(st) => Ok(st.into_mut()),
            Entry::Vacant(_) if held >= MAX_SEQS => Err(Refusal(
                "memory",
                format!("this helper serves at most {MAX_SEQS} sequences per host"),
            )),
            Entry::Vacant(new) => {
                let runs = cfg.first_layer as usize..cfg.end_layer as usize;
                let c = &self.model().config;
                Ok(new.insert(State::for_layers(
                    c,
                    cfg.page_size as usize,
                    runs,
                    cfg.kv_types,
                )))
            }
        }
    }

    fn check_full_layer(&self, layer: u32) -> Result<(), Refusal> {
        match self.model().config.layer_types.get(layer as usize) {
            Some(LayerKind::FullAttention) => Ok(()),
            Some(LayerKind::LinearAttention) => Err(Refusal(
                "layer",
                format!("layer {layer} is a DeltaNet layer, it has no KV"),
            )),
            None => Err(Refusal(
                "layer",
                format!(
                    "layer {layer} does not exist (the model has {})",
                    self.model().config.num_hidden_layers
                ),
            )),
        }
    }
}

/// The paged KV of a full-attention layer.
fn kv_of(st: &mut State, layer: u32) -> Result<&mut PagedKv, Refusal> {
    match st.layers.get_mut(layer as usize) {
        Some(LayerState::Attention(kv)) => Ok(kv),
        _ => Err(no_kv(layer)),
    }
}

fn no_kv(layer: u32) -> Refusal {
    Refusal("layer", format!("layer {layer} holds no KV on this helper"))
}

/// The KV of `layer` held for `seq`.
fn held_kv(s: &Held, seq: u64, layer: u32) -> Result<&PagedKv, Refusal> {
    let st = s
        .seqs
        .get(&seq)
        .ok_or_else(|| Refusal("missing", format!("no KV held for sequence {seq}")))?;
    match st.layers.get(layer as usize) {
        Some(LayerState::Attention(kv)) => Ok(kv),
        _ => Err(no_kv(layer)),
    }
}

/// KV rows held for `layer` (none for a layer without KV).
pub(super) fn kv_len(st: &State, layer: u32) -> usize {
    match st.layers.get(layer as usize) {
        Some(LayerState::Attention(kv)) => kv.len(),
        _ => 0,
    }
}

/// A prefill chunk must continue the mirror: at its position, with every full layer's KV rows
/// up to there (none to check when the helper's layers have no full-attention layer).
fn check_mirror_at(s: &Held, seq: u64, pos: u64, full: &[u32]) -> Result<(), Refusal> {
    let (at, held) = s.seqs.get(&seq).map_or((0, 0), |st| {
        let held = full.iter().map(|&l| kv_len(st, l)).max().unwrap_or(st.pos);
        (st.pos, held)
    });
    if pos as usize != at || held != at {
        return Err(Refusal(
            "order",
            format!("prefill chunk at {pos}, this helper's mirror is at {at} with {held} KV rows"),
        ));
    }
    Ok(())
}

/// Forget the rows of `seq` from `len` on (a host rewinding); nothing to do for a sequence
/// this helper does not hold.
fn on_kv_truncate(be: &dyn Backend, s: &mut Held, seq: u64, len: u64) -> Result<Message, Refusal> {
    s.configured(MsgType::KvTruncate)?;
    if let Some(st) = s.seqs.get_mut(&seq) {
        for l in &mut st.layers {
            if let LayerState::Attention(kv) = l {
                kv.truncate(be, len as usize)
                    .map_err(|e| Refusal("truncate", e.to_string()))?;
            }
        }
        st.pos = st.pos.min(len as usize);
    }
    Ok(Message::Ack)
}

/// KV rows must come in the cache types this helper was configured for.
fn check_types(cfg: &Configure, k: &WireTensor, v: &WireTensor) -> Result<(), Refusal> {
    let want = cfg.kv_types;
    if (k.dtype(), v.dtype()) == (want.k, want.v) {
        return Ok(());
    }
    Err(Refusal(
        "shape",
        format!(
            "KV rows of K {} / V {}: this helper was configured for {want}",
            k.dtype().name(),
            v.dtype().name()
        ),
    ))
}

/// Store rows for positions `start ..` (from the link) in `be`. Rows past what is held are
/// appended, after a gap of whole pages if they start at a later page (other helpers hold
/// those); a page in such a gap fills it; rows already held are skipped (the mirror may have
/// computed rows the host later hands over as a page). Anything else is refused, before
/// anything held changes.
fn append_rows(
    be: &dyn Backend,
    kv: &mut PagedKv,
    layer: u32,
    start: usize,
    (mut k, mut v): (Encoded, Encoded),
) -> Result<(), Refusal> {
    let order = |e: crate::Error| Refusal("order", format!("layer {layer}: {e}"));
    let shape = |e: crate::Error| Refusal("shape", format!("layer {layer}: {e}"));
    kv.checked_rows(&k, &v).map_err(shape)?;
    if start > kv.len() {
        kv.skip_to(start).map_err(order)?;
    } else if start < kv.len() && !kv.has_page_at(start / kv.page_size() * kv.page_size()) {
        return kv.fill_gap(be, start, (k, v)).map_err(order);
    }
    let width = kv.row_width();
    let skip = kv.len().saturating_sub(start);
    let (k_row, v_row) = (k.ty.row_bytes(width), v.ty.row_bytes(width));
    k.bytes.drain(..(skip * k_row).min(k.bytes.len()));
    v.bytes.drain(..(skip * v_row).min(v.bytes.len()));
    kv.append_encoded(be, &k, &v).map_err(shape)
}
