//! The helper runtime: serves one host at a time over any `Link`. It holds the KV pages a host
//! gives it, with their page boundaries, and answers attention queries with one partial per
//! page, computed by the same backend code the host would have used: with the same backend on
//! both sides, the host's merge is bit-identical to attending over the pages itself.
//!
//! A frame that does not decode gets an `Error` frame and ends the session (the peer is not
//! speaking our protocol); a well-formed request that cannot be served (wrong layer, rows out
//! of order, over the memory budget) gets an `Error` reply and the session goes on with all
//! stored state intact.

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
use engine_core::{LayerKind, Model, State};

/// Sequences one host may keep on this helper at once.
const MAX_SEQS: usize = 64;

/// Bytes a reply's header and metadata may take beside its tensors.
const REPLY_SLACK: usize = 4096;

pub struct HelperOptions {
    /// Bytes of KV pages and DeltaNet state (of the assigned layers, per sequence) this helper
    /// keeps at most.
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

/// Memory the budget covers: KV rows and the DeltaNet states of the assigned layers.
fn held_bytes(seqs: &BTreeMap<u64, State>) -> u64 {
    seqs.values()
        .map(|s| (s.kv_bytes() + s.delta_bytes()) as u64)
        .sum()
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

    /// The bytes of KV rows a request adds (`rows` in each of `layers` layers), if they fit the
    /// budget beside what the session holds; a new sequence then checks its DeltaNet state on
    /// top of them (`seq_state`).
    fn charge_rows(&self, s: &Session, rows: usize, layers: usize) -> Result<u64, Refusal> {
        let c = &self.model().config;
        let bytes = (rows * layers * c.num_key_value_heads * c.head_dim * 8) as u64;
        let (used, budget) = (held_bytes(&s.seqs), self.opts.mem_budget);
        if used + bytes > budget {
            return Err(Refusal(
                "memory",
                format!("{used} + {bytes} bytes exceeds this helper's budget of {budget}"),
            ));
        }
        Ok(bytes)
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
        let adds = self.charge_rows(s, rows, 1)?;
        let st = self.seq_state(&mut s.seqs, seq, &cfg, adds)?;
        append_rows(
            self.backend,
            kv_of(st, layer)?,
            layer,
            start as usize,
            k.data,
            v.data,
        )?;
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
        self.check_partials_fit(pages.len(), rows, shape.head_dim)?;
        let pos: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        let q = self.backend.upload(q.data);
        let parts = self.backend.attend_pages(shape, &q, &pos, &pages);
        let (o, m, l) = download_partials(self.backend, &parts);
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

    /// A small query over many pages asks for many partials: the reply must fit a frame, and
    /// nothing is computed (or allocated) for one that would not.
    fn check_partials_fit(
        &self,
        pages: usize,
        rows: usize,
        head_dim: usize,
    ) -> Result<(), Refusal> {
        let reply = pages * rows * (head_dim + 2) * 4 + REPLY_SLACK;
        if reply > self.opts.max_frame {
            return Err(Refusal(
                "size",
                format!(
                    "the partials of {pages} pages for {rows} query rows take {reply} bytes, \
                     past the frame limit of {}",
                    self.opts.max_frame
                ),
            ));
        }
        Ok(())
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
        let adds = self.charge_rows(s, rows, full.len())?;
        check_mirror_at(s, seq, pos, &full)?;
        let st = self.seq_state(&mut s.seqs, seq, &cfg, adds)?;
        let mut x = self.backend.upload(residual.data);
        s.layers
            .as_deref()
            .unwrap_or(self.model())
            .run_layers(self.backend, st, &mut x, pos as usize, layers.clone(), None)
            .map_err(|e| Refusal("prefill", e.to_string()))?;
        st.pos += rows;
        let pos = pos as usize;
        ChunkPayload::read(self.backend, c, st, layers, pos..pos + rows, want_state)
            .map(|p| p.into_message(seq, pos))
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
        let adds = self.charge_rows(s, rows, sync.kv_layers.len())?;
        let st = self.seq_state(&mut s.seqs, sync.seq, &cfg, adds)?;
        let pos = sync.pos as usize;
        for (&l, (k, v)) in sync.kv_layers.iter().zip(sync.kv) {
            append_rows(self.backend, kv_of(st, l)?, l, pos, k.data, v.data)?;
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
        let end = (pos as usize)
            .checked_add(rows)
            .ok_or_else(|| Refusal("order", format!("mirror position {pos} is out of range")))?;
        match s.seqs.get(&seq) {
            Some(st) => {
                for &l in &sync.kv_layers {
                    let have = kv_len(st, l);
                    if pos as usize > have || have > end {
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
        let (k, v) = kv
            .rows(self.backend, start as usize, len as usize)
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
    /// layers only, which counts against the memory budget together with the `adds` bytes of
    /// KV rows the request brings; at most `MAX_SEQS` per session, since every sequence costs
    /// memory whether or not its pages arrive.
    fn seq_state<'s>(
        &self,
        seqs: &'s mut BTreeMap<u64, State>,
        seq: u64,
        cfg: &Configure,
        adds: u64,
    ) -> Result<&'s mut State, Refusal> {
        if !seqs.contains_key(&seq) {
            if seqs.len() >= MAX_SEQS {
                return Err(Refusal(
                    "memory",
                    format!("this helper serves at most {MAX_SEQS} sequences per host"),
                ));
            }
            let c = &self.model().config;
            let runs = cfg.first_layer as usize..cfg.end_layer as usize;
            let need = State::delta_bytes_for(c, runs.clone()) as u64;
            let (used, budget) = (held_bytes(seqs), self.opts.mem_budget);
            if used + adds + need > budget {
                return Err(Refusal(
                    "memory",
                    format!(
                        "sequence {seq} needs {need} bytes of DeltaNet state for layers {runs:?} \
                         and {adds} of KV rows; {used} of this helper's budget of {budget} are \
                         in use"
                    ),
                ));
            }
            seqs.insert(seq, State::for_layers(c, cfg.page_size as usize, runs));
        }
        Ok(seqs.get_mut(&seq).expect("made above"))
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
/// held (the mirror may have computed rows the host later hands over as a page).
fn append_rows(
    be: &dyn Backend,
    kv: &mut PagedKv,
    layer: u32,
    start: usize,
    mut k: Vec<f32>,
    mut v: Vec<f32>,
) -> Result<(), Refusal> {
    let width = kv.row_width();
    let rows = k.len() / width;
    let have = kv.len();
    if start > have {
        return Err(Refusal(
            "order",
            format!("layer {layer}: rows at {start} would leave a gap after the {have} held"),
        ));
    }
    let skip = (have - start).min(rows);
    k.drain(..skip * width);
    v.drain(..skip * width);
    kv.append(be, &be.upload(k), &be.upload(v));
    Ok(())
}

fn send(link: &mut dyn Link, req: u32, msg: Message) -> Result<(), LinkError> {
    link.send(encode(req, &msg))
}

fn refuse(link: &mut dyn Link, req: u32, code: &str, message: String) -> SessionEnd {
    let _ = send(link, req, Message::error(code, message.clone()));
    SessionEnd::Refused(format!("{code}: {message}"))
}
