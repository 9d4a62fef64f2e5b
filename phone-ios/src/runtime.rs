//! The helper runtime: serves one host at a time over any `Link`. It holds the KV pages a host
//! gives it, with their page boundaries, and answers attention queries with one partial per
//! page, computed by the same backend code the host would have used: with the same backend on
//! both sides, the host's merge is bit-identical to attending over the pages itself.
//!
//! A frame that does not decode gets an `Error` frame and ends the session (the peer is not
//! speaking our protocol); a well-formed request that cannot be served (wrong layer, rows out
//! of order, over the memory budget, a reply past the frame limit) gets an `Error` reply and
//! the session goes on with all stored state intact. Every size a host sends is checked
//! against those limits before anything is allocated or computed for it.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use engine_core::backend::{AttnShape, Backend};
use engine_core::kv::{download_partials, KvPage, PagedKv};
use engine_core::link::{Link, LinkError};
use engine_core::model::LayerState;
use engine_core::protocol::{
    decode, encode, Configure, Intro, Message, MsgType, Role, WireTensor, PROTOCOL_VERSION,
};
use engine_core::split::ChunkPayload;
use engine_core::{LayerKind, Model, ModelConfig, State};

/// Sequences one host may keep on this helper at once.
const MAX_SEQS: usize = 64;

/// Bytes a reply's header and metadata may take beside its tensors.
const REPLY_SLACK: usize = 4096;

pub struct HelperOptions {
    /// Bytes this helper holds at most for one host: KV pages (whole, as allocated), DeltaNet
    /// state (of the assigned layers, per sequence), and while a prefill chunk runs its
    /// activations and reply. Other replies are bounded by the frame limit instead, so a
    /// helper whose pages fill its budget still answers queries over them.
    pub mem_budget: u64,
    pub max_frame: usize,
}

/// Why a session ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// The host said Bye.
    Bye,
    /// The link closed.
    Closed(String),
    /// The host was refused or broke the protocol; the message was sent to it as an Error.
    Refused(String),
}

/// Builds the layers a host assigns (and nothing else) from the helper's checkpoint.
pub type LoadLayers<'a> = dyn Fn(Range<usize>) -> engine_core::Result<Model> + Sync + 'a;

/// The weights a helper runs its share of a split prefill with.
pub enum Weights<'a> {
    /// A whole model, whatever layers a host assigns.
    Whole(&'a Model),
    /// Only the layers a host assigns, built when it configures the session; `identity`
    /// (config and the whole model's identity, no layers) answers the handshake.
    Assigned {
        identity: &'a Model,
        load: &'a LoadLayers<'a>,
    },
}

pub struct Helper<'a> {
    weights: Weights<'a>,
    /// The layers built for the last assignment, kept for the next host asking for them.
    assigned: Mutex<Option<Arc<Model>>>,
    backend: &'a dyn Backend,
    opts: HelperOptions,
}

struct Session {
    configure: Option<Configure>,
    /// The assigned layers (for `Weights::Assigned`).
    layers: Option<Arc<Model>>,
    /// Per sequence: the KV rows this helper holds (pages handed over by the host, and the
    /// mirror of its prefill layers) and, for those layers, the DeltaNet state.
    seqs: BTreeMap<u64, State>,
    counters: BTreeMap<String, u64>,
    /// The frame limit both sides announced: a reply past it would be refused by the host, so
    /// none is computed.
    max_frame: usize,
}

impl Session {
    /// The assignment, which every request on KV or layers needs first.
    fn configured(&self, what: MsgType) -> Result<Configure, Refusal> {
        self.configure
            .clone()
            .ok_or_else(|| Refusal("order", format!("{what:?} before Configure")))
    }

    /// Message counts and the bytes held.
    fn stats(&self) -> Message {
        let mut counters = self.counters.clone();
        let kv: usize = self.seqs.values().map(State::kv_bytes).sum();
        let delta: usize = self.seqs.values().map(State::delta_bytes).sum();
        counters.insert("kv_bytes".into(), kv as u64);
        counters.insert("delta_state_bytes".into(), delta as u64);
        counters.insert("held_bytes".into(), held_bytes(&self.seqs));
        Message::Stats(counters)
    }
}

/// A `ChunkState` request: the host's rows and states for this helper's mirror.
struct MirrorSync {
    seq: u64,
    pos: u64,
    kv_layers: Vec<u32>,
    kv: Vec<(WireTensor, WireTensor)>,
    delta_layers: Vec<u32>,
    states: Vec<(WireTensor, WireTensor)>,
}

/// Memory held between requests: KV pages, counted whole since a page is allocated at its full
/// size with its first row (`PagedKv::append`), and DeltaNet states.
fn held_bytes(seqs: &BTreeMap<u64, State>) -> u64 {
    seqs.values()
        .map(|s| {
            let pages: usize = s
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Attention(kv) => kv.pages().len() * page_bytes(kv),
                    LayerState::DeltaNet(_) | LayerState::Elsewhere => 0,
                })
                .sum();
            (pages + s.delta_bytes()) as u64
        })
        .sum()
}

fn page_bytes(kv: &PagedKv) -> usize {
    kv.page_size() * kv.row_width() * 2 * F32
}

const F32: usize = std::mem::size_of::<f32>();

/// What a request would add to the memory this helper holds, checked against the budget before
/// anything is allocated.
struct Cost {
    /// New KV pages, kept after the reply.
    pages: u64,
    /// A prefill chunk's activations and reply, freed once it is sent.
    work: u64,
}

/// A request that cannot be served: the reply is an Error frame with this code and message.
struct Refusal(&'static str, String);

impl<'a> Helper<'a> {
    /// A helper with a whole model.
    pub fn new(model: &'a Model, backend: &'a dyn Backend, opts: HelperOptions) -> Self {
        Helper::with_weights(Weights::Whole(model), backend, opts)
    }

    pub fn with_weights(
        weights: Weights<'a>,
        backend: &'a dyn Backend,
        opts: HelperOptions,
    ) -> Self {
        Helper {
            weights,
            assigned: Mutex::new(None),
            backend,
            opts,
        }
    }

    /// Config and identity: the model as the handshake knows it.
    fn model(&self) -> &Model {
        match &self.weights {
            Weights::Whole(m) => m,
            Weights::Assigned { identity, .. } => identity,
        }
    }

    /// The model that runs `layers` in this session, built now if the helper loads per
    /// assignment and does not hold those layers yet.
    fn load(&self, layers: Range<usize>) -> engine_core::Result<Option<Arc<Model>>> {
        let Weights::Assigned { load, .. } = &self.weights else {
            return Ok(None);
        };
        let mut held = self.assigned.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = held.as_ref().filter(|m| {
            let l = m.loaded_layers();
            l.start <= layers.start && layers.end <= l.end
        }) {
            return Ok(Some(m.clone()));
        }
        // Drop the old layers before building the new ones.
        *held = None;
        let m = Arc::new(load(layers)?);
        *held = Some(m.clone());
        Ok(Some(m))
    }

    fn intro(&self) -> Intro {
        Intro {
            version: PROTOCOL_VERSION,
            model: self.model().identity.name.clone(),
            model_digest: self.model().identity.digest.clone(),
            role: Role::Helper,
            mem_offer: self.opts.mem_budget,
            backends: vec![self.backend.name().to_string()],
            max_frame: self.opts.max_frame as u64,
        }
    }

    /// Serve one host until it says Bye, the link closes or the host breaks the protocol.
    pub fn serve(&self, link: &mut dyn Link) -> SessionEnd {
        let mut s = Session {
            configure: None,
            layers: None,
            seqs: BTreeMap::new(),
            counters: BTreeMap::new(),
            max_frame: self.opts.max_frame,
        };
        let mut greeted = false;
        loop {
            let frame = match link.recv() {
                Ok(f) => f,
                Err(LinkError::Closed(why)) => return SessionEnd::Closed(why),
                Err(e) => return SessionEnd::Closed(e.to_string()),
            };
            let (req, msg) = match decode(&frame, self.opts.max_frame) {
                Ok(m) => m,
                Err(e) => return refuse(link, 0, "bad_frame", e.to_string()),
            };
            *s.counters
                .entry(format!("{:?}", msg.msg_type()))
                .or_default() += 1;
            if !greeted {
                match msg {
                    Message::Hello(intro) => {
                        if intro.version != PROTOCOL_VERSION {
                            return refuse(
                                link,
                                req,
                                "version",
                                format!("protocol {} vs {PROTOCOL_VERSION}", intro.version),
                            );
                        }
                        let ours = &self.model().identity;
                        if intro.model_digest != ours.digest {
                            let why = format!(
                                "this helper runs a different model: {} here, {} on the host",
                                ours.name, intro.model
                            );
                            return refuse(link, req, "model", why);
                        }
                        greeted = true;
                        s.max_frame = s.max_frame.min(intro.max_frame as usize);
                        if send(link, req, Message::Welcome(self.intro())).is_err() {
                            return SessionEnd::Closed("while sending Welcome".into());
                        }
                        continue;
                    }
                    other => {
                        return refuse(
                            link,
                            req,
                            "handshake",
                            format!("expected Hello, got {:?}", other.msg_type()),
                        )
                    }
                }
            }
            let reply = match msg {
                Message::Bye { .. } => return SessionEnd::Bye,
                Message::Hello(_) => {
                    return refuse(link, req, "handshake", "Hello sent twice".into())
                }
                other => self
                    .handle(&mut s, other)
                    .unwrap_or_else(|Refusal(code, m)| Message::error(code, m)),
            };
            if send(link, req, reply).is_err() {
                return SessionEnd::Closed("while replying".into());
            }
        }
    }

    /// Routes one request of a greeted host to the method that serves its kind.
    fn handle(&self, s: &mut Session, msg: Message) -> Result<Message, Refusal> {
        match msg {
            Message::Configure(cfg) => self.on_configure(s, cfg),
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
            } => self.on_attn_query(s, seq, layer, positions, end, q),
            Message::PrefillChunk {
                seq,
                pos,
                want_state,
                residual,
            } => self.on_prefill_chunk(s, seq, pos, want_state, residual),
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
            } => self.on_kv_fetch(s, seq, layer, start, len),
            Message::KvTruncate { seq, len } => on_kv_truncate(s, seq, len),
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
    fn on_configure(&self, s: &mut Session, cfg: Configure) -> Result<Message, Refusal> {
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
        s.seqs.clear();
        s.configure = None;
        s.layers = None;
        s.layers = self
            .load(cfg.first_layer as usize..cfg.end_layer as usize)
            .map_err(|e| Refusal("configure", format!("loading the assigned layers: {e}")))?;
        s.configure = Some(cfg);
        Ok(Message::Ack)
    }

    /// Refuses `what` when its `cost`, with a new sequence's DeltaNet state, does not fit the
    /// budget beside what the session holds.
    fn check_budget(
        &self,
        s: &Session,
        seq: u64,
        cfg: &Configure,
        what: &str,
        cost: Cost,
    ) -> Result<(), Refusal> {
        let (used, budget) = (held_bytes(&s.seqs), self.opts.mem_budget);
        let runs = cfg.first_layer as usize..cfg.end_layer as usize;
        let state = match s.seqs.contains_key(&seq) {
            true => 0,
            false => State::delta_bytes_for(&self.model().config, runs.clone()) as u64,
        };
        let need = [state, cost.pages, cost.work]
            .into_iter()
            .fold(used, u64::saturating_add);
        if need <= budget {
            return Ok(());
        }
        let new = match state {
            0 => String::new(),
            _ => format!(
                " (sequence {seq} is new here and needs {state} bytes of DeltaNet state for \
                 layers {runs:?})"
            ),
        };
        Err(Refusal(
            "memory",
            format!(
                "{what}{new} needs {} bytes of new KV pages and {} bytes of working memory; \
                 {used} of this helper's budget of {budget} bytes are in use",
                cost.pages, cost.work
            ),
        ))
    }

    /// Bytes of the KV pages that `layers` of `seq` must add to hold positions up to `end`.
    fn page_growth(&self, s: &Session, cfg: &Configure, seq: u64, layers: &[u32], end: u64) -> u64 {
        let c = &self.model().config;
        let page = u64::from(cfg.page_size);
        let bytes = page * (c.num_key_value_heads * c.head_dim * 2 * F32) as u64;
        let want = end.div_ceil(page);
        layers
            .iter()
            .map(|&l| {
                let held = s.seqs.get(&seq).map_or(0, |st| kv_pages(st, l)) as u64;
                want.saturating_sub(held).saturating_mul(bytes)
            })
            .fold(0, u64::saturating_add)
    }

    /// A KV page the host hands over: stored with its page boundaries.
    fn on_kv_append(
        &self,
        s: &mut Session,
        seq: u64,
        layer: u32,
        start: u64,
        k: WireTensor,
        v: WireTensor,
    ) -> Result<Message, Refusal> {
        let cfg = s.configured(MsgType::KvAppend)?;
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
        check_continues(layer, start, held_kv(s, seq, layer).map_or(0, PagedKv::len))?;
        let pages = self.page_growth(s, &cfg, seq, &[layer], start + rows as u64);
        let cost = Cost { pages, work: 0 };
        self.check_budget(s, seq, &cfg, &format!("a KV page at {start}"), cost)?;
        let st = self.seq_state(&mut s.seqs, seq, &cfg)?;
        append_rows(
            self.backend,
            kv_of(st, layer)?,
            start as usize,
            k.data,
            v.data,
        );
        Ok(Message::Ack)
    }

    /// Attention of the host's queries over the pages held for `layer` below `end`: one
    /// partial per page, for the host to merge with its own.
    fn on_attn_query(
        &self,
        s: &mut Session,
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
        let q = self.backend.upload(q.data);
        let parts = self.backend.attend_pages(shape, &q, &pos, &pages);
        let (o, m, l) = pollster::block_on(download_partials(self.backend, &parts));
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
    fn on_prefill_chunk(
        &self,
        s: &mut Session,
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
        let mut x = self.backend.upload(residual.data);
        s.layers
            .as_deref()
            .unwrap_or(self.model())
            .run_layers(self.backend, st, &mut x, pos as usize, layers.clone(), None)
            .map_err(|e| Refusal("prefill", e.to_string()))?;
        st.pos += rows;
        let pos = pos as usize;
        ChunkPayload::read(self.backend, c, st, layers, pos..pos + rows, want_state)
            .map(|p| pollster::block_on(p).into_message(seq, pos))
            .map_err(|e| Refusal("prefill", e.to_string()))
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
    fn on_chunk_state(&self, s: &mut Session, sync: MirrorSync) -> Result<Message, Refusal> {
        let cfg = s.configured(MsgType::ChunkState)?;
        let rows = self.check_sync(s, &cfg, &sync)?;
        let end = sync.pos + rows as u64;
        let pages = self.page_growth(s, &cfg, sync.seq, &sync.kv_layers, end);
        let what = format!("a mirror sync of rows {}..{end}", sync.pos);
        self.check_budget(s, sync.seq, &cfg, &what, Cost { pages, work: 0 })?;
        let st = self.seq_state(&mut s.seqs, sync.seq, &cfg)?;
        let pos = sync.pos as usize;
        for (&l, (k, v)) in sync.kv_layers.iter().zip(sync.kv) {
            append_rows(self.backend, kv_of(st, l)?, pos, k.data, v.data);
        }
        for (&l, (sv, conv)) in sync.delta_layers.iter().zip(sync.states) {
            if let LayerState::DeltaNet(d) = &mut st.layers[l as usize] {
                d.s = self.backend.upload(sv.data);
                d.conv = self.backend.upload(conv.data);
            }
        }
        st.pos = pos + rows;
        Ok(Message::Ack)
    }

    /// Whether `sync` fits this helper's layers and continues what it holds; returns the rows
    /// it brings per layer. Every piece carries all full layers' rows; the last also all
    /// DeltaNet states.
    fn check_sync(
        &self,
        s: &Session,
        cfg: &Configure,
        sync: &MirrorSync,
    ) -> Result<usize, Refusal> {
        let c = &self.model().config;
        let rows = sync.kv.first().map_or(0, |(k, _)| k.shape[0]);
        let width = c.num_key_value_heads * c.head_dim;
        if sync.kv.iter().any(|(k, _)| k.shape != [rows, width]) {
            return Err(Refusal(
                "shape",
                format!("mirror rows must all be [{rows}, {width}]"),
            ));
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
            if sv.data.len() != state_len || conv.data.len() != conv_len {
                return Err(Refusal(
                    "shape",
                    format!("layer {l}: not a DeltaNet state of this model"),
                ));
            }
        }
        Ok(rows)
    }

    /// KV rows `start .. start + len` of `layer`, copied back to the host.
    fn on_kv_fetch(
        &self,
        s: &mut Session,
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
            .saturating_mul((width * 2 * F32) as u64)
            .saturating_add(REPLY_SLACK as u64);
        check_reply(s, reply, || format!("{len} KV rows of layer {layer}"))?;
        let (k, v) = kv
            .rows(self.backend, start as usize, len as usize)
            .map(pollster::block_on)
            .map_err(|e| Refusal("missing", e.to_string()))?;
        Ok(Message::KvRows {
            seq,
            layer,
            start,
            k: WireTensor::f32(vec![len as usize, width], k),
            v: WireTensor::f32(vec![len as usize, width], v),
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
                Ok(new.insert(State::for_layers(c, cfg.page_size as usize, runs)))
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

/// What a prefill chunk of `rows` rows at `pos` through `cfg`'s layers costs besides the KV
/// pages it adds: (the bytes of its reply, its working memory). The working memory is
/// estimated from above from the config, in f32: per row the residual and its per-layer
/// copies, a full-attention layer's projections, a DeltaNet layer's inputs and output and
/// the MLP's intermediate vectors (all counted although layers run one at a time); the
/// attention partials of every page the rows see, held together until they merge; and the
/// reply twice, read back from the backend and then encoded.
pub fn prefill_bytes(
    c: &ModelConfig,
    cfg: &Configure,
    pos: u64,
    rows: usize,
    want_state: bool,
) -> (u64, u64) {
    let (nh, hd) = (c.num_attention_heads, c.head_dim);
    let kv_width = c.num_key_value_heads * hd;
    let attention = 5 * nh * hd + 2 * kv_width;
    let deltanet = 3 * c.conv_dim() + 2 * c.linear_value_dim() + 2 * c.linear_num_value_heads;
    let per_row = 4 * c.hidden_size + attention + deltanet + 3 * c.intermediate_size;
    let rows = rows as u64;
    let pages_seen = (pos + rows).div_ceil(u64::from(cfg.page_size.max(1)));
    let partials = rows * (nh * (hd + 2)) as u64 * (pages_seen + 1);
    let count = |kind| {
        (cfg.first_layer..cfg.end_layer)
            .filter(|&l| c.layer_types.get(l as usize) == Some(&kind))
            .count() as u64
    };
    let (s_len, conv_len) = c.delta_state_len();
    let states = match want_state {
        true => count(LayerKind::LinearAttention) * ((s_len + conv_len) * F32) as u64,
        false => 0,
    };
    let kv_rows = rows * count(LayerKind::FullAttention) * (kv_width * 2 * F32) as u64;
    let reply = kv_rows + states + REPLY_SLACK as u64;
    let work = (rows * per_row as u64 + partials) * F32 as u64 + 2 * reply;
    (reply, work)
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
fn held_kv(s: &Session, seq: u64, layer: u32) -> Result<&PagedKv, Refusal> {
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
fn kv_len(st: &State, layer: u32) -> usize {
    match st.layers.get(layer as usize) {
        Some(LayerState::Attention(kv)) => kv.len(),
        _ => 0,
    }
}

/// A prefill chunk must continue the mirror: at its position, with every full layer's KV rows
/// up to there.
fn check_mirror_at(s: &Session, seq: u64, pos: u64, full: &[u32]) -> Result<(), Refusal> {
    let (at, held) = s.seqs.get(&seq).map_or((0, 0), |st| {
        let held = full.iter().map(|&l| kv_len(st, l)).max().unwrap_or(0);
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
fn on_kv_truncate(s: &mut Session, seq: u64, len: u64) -> Result<Message, Refusal> {
    s.configured(MsgType::KvTruncate)?;
    if let Some(st) = s.seqs.get_mut(&seq) {
        for l in &mut st.layers {
            if let LayerState::Attention(kv) = l {
                kv.truncate(len as usize)
                    .map_err(|e| Refusal("truncate", e.to_string()))?;
            }
        }
        st.pos = st.pos.min(len as usize);
    }
    Ok(Message::Ack)
}

/// Append rows for positions `start ..` (from the link) into `be`, skipping the ones already
/// held (the mirror may have computed rows the host later hands over as a page). The caller
/// checked that they leave no gap (`check_continues`).
fn append_rows(be: &dyn Backend, kv: &mut PagedKv, start: usize, mut k: Vec<f32>, mut v: Vec<f32>) {
    let width = kv.row_width();
    let rows = k.len() / width;
    let skip = kv.len().saturating_sub(start).min(rows);
    k.drain(..skip * width);
    v.drain(..skip * width);
    kv.append(be, &be.upload(k), &be.upload(v));
}

/// A reply of `bytes` must fit the frame limit; nothing is computed for one that would not.
fn check_reply(s: &Session, bytes: u64, what: impl FnOnce() -> String) -> Result<(), Refusal> {
    if bytes > s.max_frame as u64 {
        return Err(Refusal(
            "size",
            format!(
                "{} take {bytes} bytes, past the frame limit of {}",
                what(),
                s.max_frame
            ),
        ));
    }
    Ok(())
}

/// Rows arriving for positions `start ..` of `layer` must not leave a gap after the `have`
/// held.
fn check_continues(layer: u32, start: u64, have: usize) -> Result<(), Refusal> {
    if start > have as u64 {
        return Err(Refusal(
            "order",
            format!("layer {layer}: rows at {start} would leave a gap after the {have} held"),
        ));
    }
    Ok(())
}

/// Pages of KV held for `layer` (none for a layer without KV).
fn kv_pages(st: &State, layer: u32) -> usize {
    match st.layers.get(layer as usize) {
        Some(LayerState::Attention(kv)) => kv.pages().len(),
        _ => 0,
    }
}

fn send(link: &mut dyn Link, req: u32, msg: Message) -> Result<(), LinkError> {
    link.send(encode(req, &msg))
}

fn refuse(link: &mut dyn Link, req: u32, code: &str, message: String) -> SessionEnd {
    let _ = send(link, req, Message::error(code, message.clone()));
    SessionEnd::Refused(format!("{code}: {message}"))
}
