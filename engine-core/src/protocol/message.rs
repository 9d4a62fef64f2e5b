//! Typed messages and their encoding into frames (header, JSON metadata, raw tensors).
//!
//! `decode` trusts nothing: lengths are checked against the frame limit and against the
//! frame's real size before any tensor is decoded, every tensor's byte size is computed with
//! overflow checks from its declared shape, and each message's tensors must have the shapes
//! its metadata implies. Checks that need the model (hidden size, which layers exist) happen
//! where the message is used (`check_shapes`).

use std::collections::BTreeMap;

use crate::printable::{printable, printable_json};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::header::{MsgType, HEADER_LEN, MAGIC, PROTOCOL_VERSION};
use super::tensor::{TensorDesc, WireTensor};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("frame of {have} bytes is shorter than its {need}-byte header or declared length")]
    Truncated { need: usize, have: usize },
    #[error("frame does not start with the magic bytes \"TH\"")]
    BadMagic,
    #[error("protocol version {got} is not supported (this build speaks {PROTOCOL_VERSION})")]
    Version { got: u8 },
    #[error("unknown message type {0}")]
    UnknownType(u8),
    #[error("frame of {len} bytes exceeds the agreed limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("frame has {extra} bytes after its declared payload")]
    TrailingBytes { extra: usize },
    #[error("{msg:?} metadata: {reason}")]
    Meta { msg: MsgType, reason: String },
    #[error("{msg:?}: {reason}")]
    Tensors { msg: MsgType, reason: String },
}

/// Which side of a link a peer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Host,
    Helper,
}

/// What a peer says of itself in `Hello` / `Welcome`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intro {
    pub version: u8,
    /// The model's name, for messages (`identity::ModelIdentity::name`).
    pub model: String,
    /// The model's digest (`identity::ModelIdentity::digest`); peers with different digests
    /// must not talk.
    pub model_digest: String,
    pub role: Role,
    /// Bytes of memory offered for KV pages and mirrored state (0 from a host).
    pub mem_offer: u64,
    pub backends: Vec<String>,
    /// Largest frame this peer accepts.
    pub max_frame: u64,
    /// What kind of device it is, for people: `native`, `tab` (a browser) or `phone`
    /// ([`device_kind`]); empty from a peer that predates it.
    #[serde(default)]
    pub device: String,
}

/// This build's kind of device, as [`Intro::device`] says it: the browser helper is a wasm32
/// build, the phone's is iOS, anything else a native process.
pub fn device_kind() -> &'static str {
    if cfg!(target_arch = "wasm32") {
        "tab"
    } else if cfg!(target_os = "ios") {
        "phone"
    } else {
        "native"
    }
}

/// The host assigns the helper its part: layers `[first_layer, end_layer)` for split prefill,
/// and the page size of the KV pages it may be sent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Configure {
    pub first_layer: u32,
    pub end_layer: u32,
    pub page_size: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Hello(Intro),
    Welcome(Intro),
    Configure(Configure),
    /// Residual rows `[rows, hidden]` entering layer `first_layer` for positions `pos ..`;
    /// `want_state` asks for the DeltaNet states after this chunk (the batch's last for the
    /// helper).
    PrefillChunk {
        seq: u64,
        pos: u64,
        want_state: bool,
        residual: WireTensor,
    },
    /// The helper's new KV rows `[rows, kv_heads * head_dim]` per full-attention layer it runs
    /// (`kv_layers[i]` owns `kv[i]`), and at batch end its DeltaNet states (`delta_layers[i]`
    /// owns `states[i] = (s [v_heads, dk, dv], conv [kernel - 1, conv_dim])`).
    ChunkState {
        seq: u64,
        pos: u64,
        kv_layers: Vec<u32>,
        kv: Vec<(WireTensor, WireTensor)>,
        delta_layers: Vec<u32>,
        states: Vec<(WireTensor, WireTensor)>,
    },
    /// KV rows `[rows, kv_heads * head_dim]` of one layer at positions `start ..`.
    KvAppend {
        seq: u64,
        layer: u32,
        start: u64,
        k: WireTensor,
        v: WireTensor,
    },
    KvTruncate {
        seq: u64,
        len: u64,
    },
    KvFetch {
        seq: u64,
        layer: u32,
        start: u64,
        len: u64,
    },
    KvRows {
        seq: u64,
        layer: u32,
        start: u64,
        k: WireTensor,
        v: WireTensor,
    },
    /// Scaled queries `[t, q_heads, head_dim]` of one layer at absolute `positions`, over the
    /// helper's pages below position `end` (the ones the host has handed over).
    AttnQuery {
        seq: u64,
        layer: u32,
        positions: Vec<u64>,
        end: u64,
        q: WireTensor,
    },
    /// One partial per page the helper holds, in page order: `o [pages, t * q_heads, head_dim]`,
    /// `m` and `l` `[pages, t * q_heads]`; `page_starts[i]` is page i's first position.
    AttnPartials {
        seq: u64,
        layer: u32,
        page_starts: Vec<u64>,
        o: WireTensor,
        m: WireTensor,
        l: WireTensor,
    },
    Stats(BTreeMap<String, u64>),
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    Ack,
    Error {
        code: String,
        message: String,
    },
    Bye {
        reason: String,
    },
}

/// Metadata of each message type: the typed fields plus the tensor descriptions.
#[derive(Serialize, Deserialize)]
struct Meta<T> {
    #[serde(flatten)]
    body: T,
    #[serde(default)]
    tensors: Vec<TensorDesc>,
}

#[derive(Serialize, Deserialize)]
struct ChunkMeta {
    seq: u64,
    pos: u64,
    want_state: bool,
}

#[derive(Serialize, Deserialize)]
struct ChunkStateMeta {
    seq: u64,
    pos: u64,
    kv_layers: Vec<u32>,
    delta_layers: Vec<u32>,
}

#[derive(Serialize, Deserialize)]
struct LayerRows {
    seq: u64,
    layer: u32,
    start: u64,
}

#[derive(Serialize, Deserialize)]
struct Truncate {
    seq: u64,
    len: u64,
}

#[derive(Serialize, Deserialize)]
struct Fetch {
    seq: u64,
    layer: u32,
    start: u64,
    len: u64,
}

#[derive(Serialize, Deserialize)]
struct Query {
    seq: u64,
    layer: u32,
    positions: Vec<u64>,
    end: u64,
}

#[derive(Serialize, Deserialize)]
struct PartialsMeta {
    seq: u64,
    layer: u32,
    page_starts: Vec<u64>,
}

#[derive(Serialize, Deserialize)]
struct Nonce {
    nonce: u64,
}

#[derive(Serialize, Deserialize)]
struct ErrorMeta {
    code: String,
    message: String,
}

#[derive(Serialize, Deserialize)]
struct ByeMeta {
    reason: String,
}

#[derive(Serialize, Deserialize)]
struct Empty {}

/// Counters sit under their own key so no counter name can collide with `tensors`.
#[derive(Serialize, Deserialize)]
struct StatsMeta {
    counters: BTreeMap<String, u64>,
}

impl Message {
    pub fn msg_type(&self) -> MsgType {
        match self {
            Message::Hello(_) => MsgType::Hello,
            Message::Welcome(_) => MsgType::Welcome,
            Message::Configure(_) => MsgType::Configure,
            Message::PrefillChunk { .. } => MsgType::PrefillChunk,
            Message::ChunkState { .. } => MsgType::ChunkState,
            Message::KvAppend { .. } => MsgType::KvAppend,
            Message::KvTruncate { .. } => MsgType::KvTruncate,
            Message::KvFetch { .. } => MsgType::KvFetch,
            Message::KvRows { .. } => MsgType::KvRows,
            Message::AttnQuery { .. } => MsgType::AttnQuery,
            Message::AttnPartials { .. } => MsgType::AttnPartials,
            Message::Stats(_) => MsgType::Stats,
            Message::Ping { .. } => MsgType::Ping,
            Message::Pong { .. } => MsgType::Pong,
            Message::Ack => MsgType::Ack,
            Message::Error { .. } => MsgType::Error,
            Message::Bye { .. } => MsgType::Bye,
        }
    }

    pub fn error(code: &str, message: impl Into<String>) -> Message {
        Message::Error {
            code: code.to_string(),
            message: message.into(),
        }
    }

    /// The typed metadata and the tensors, in wire order.
    fn parts(&self) -> (serde_json::Value, Vec<&WireTensor>) {
        fn v<T: Serialize>(t: T) -> serde_json::Value {
            serde_json::to_value(t).expect("metadata serialises")
        }
        match self {
            Message::Hello(i) | Message::Welcome(i) => (v(i), vec![]),
            Message::Configure(c) => (v(c), vec![]),
            Message::PrefillChunk {
                seq,
                pos,
                want_state,
                residual,
            } => (
                v(ChunkMeta {
                    seq: *seq,
                    pos: *pos,
                    want_state: *want_state,
                }),
                vec![residual],
            ),
            Message::ChunkState {
                seq,
                pos,
                kv_layers,
                kv,
                delta_layers,
                states,
            } => (
                v(ChunkStateMeta {
                    seq: *seq,
                    pos: *pos,
                    kv_layers: kv_layers.clone(),
                    delta_layers: delta_layers.clone(),
                }),
                kv.iter().chain(states).flat_map(|(a, b)| [a, b]).collect(),
            ),
            Message::KvAppend {
                seq,
                layer,
                start,
                k,
                v: vv,
            }
            | Message::KvRows {
                seq,
                layer,
                start,
                k,
                v: vv,
            } => (
                v(LayerRows {
                    seq: *seq,
                    layer: *layer,
                    start: *start,
                }),
                vec![k, vv],
            ),
            Message::KvTruncate { seq, len } => (
                v(Truncate {
                    seq: *seq,
                    len: *len,
                }),
                vec![],
            ),
            Message::KvFetch {
                seq,
                layer,
                start,
                len,
            } => (
                v(Fetch {
                    seq: *seq,
                    layer: *layer,
                    start: *start,
                    len: *len,
                }),
                vec![],
            ),
            Message::AttnQuery {
                seq,
                layer,
                positions,
                end,
                q,
            } => (
                v(Query {
                    seq: *seq,
                    layer: *layer,
                    positions: positions.clone(),
                    end: *end,
                }),
                vec![q],
            ),
            Message::AttnPartials {
                seq,
                layer,
                page_starts,
                o,
                m,
                l,
            } => (
                v(PartialsMeta {
                    seq: *seq,
                    layer: *layer,
                    page_starts: page_starts.clone(),
                }),
                vec![o, m, l],
            ),
            Message::Stats(s) => (
                v(StatsMeta {
                    counters: s.clone(),
                }),
                vec![],
            ),
            Message::Ping { nonce } | Message::Pong { nonce } => {
                (v(Nonce { nonce: *nonce }), vec![])
            }
            Message::Ack => (v(Empty {}), vec![]),
            Message::Error { code, message } => (
                v(ErrorMeta {
                    code: code.clone(),
                    message: message.clone(),
                }),
                vec![],
            ),
            Message::Bye { reason } => (
                v(ByeMeta {
                    reason: reason.clone(),
                }),
                vec![],
            ),
        }
    }
}

/// Encode `msg` as one frame with request id `req`.
pub fn encode(req: u32, msg: &Message) -> Vec<u8> {
    let (mut meta, tensors) = msg.parts();
    let descs: Vec<TensorDesc> = tensors.iter().map(|t| t.desc()).collect();
    if let serde_json::Value::Object(map) = &mut meta {
        if !descs.is_empty() {
            map.insert(
                "tensors".into(),
                serde_json::to_value(&descs).expect("descriptors serialise"),
            );
        }
    }
    let meta = serde_json::to_vec(&meta).expect("metadata serialises");
    let data_len: usize = tensors.iter().map(|t| t.encoded_len()).sum();
    let mut out = Vec::with_capacity(HEADER_LEN + meta.len() + data_len);
    out.extend_from_slice(&MAGIC);
    out.push(PROTOCOL_VERSION);
    out.push(msg.msg_type() as u8);
    out.extend_from_slice(&req.to_le_bytes());
    out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(&(data_len as u32).to_le_bytes());
    out.extend_from_slice(&meta);
    for t in tensors {
        t.encode_into(&mut out);
    }
    out
}

/// The request id of a frame, read from its header without decoding the rest.
pub fn request_id(frame: &[u8]) -> Option<u32> {
    (frame.len() >= HEADER_LEN && frame[..2] == MAGIC).then(|| u32_at(frame, 4) as u32)
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// Tensor descriptions checked against the data section, then decoded one by one.
struct TensorReader<'a> {
    msg: MsgType,
    descs: Vec<(TensorDesc, Vec<usize>, &'a [u8])>,
    next: usize,
}

impl<'a> TensorReader<'a> {
    fn new(msg: MsgType, descs: Vec<TensorDesc>, data: &'a [u8]) -> Result<Self, ProtocolError> {
        let err = |reason: String| ProtocolError::Tensors { msg, reason };
        let mut out = Vec::with_capacity(descs.len().min(data.len() + 1));
        let mut at = 0usize;
        for (i, d) in descs.into_iter().enumerate() {
            if d.shape.len() > 4 {
                return Err(err(format!(
                    "tensor {i} has rank {} (at most 4)",
                    d.shape.len()
                )));
            }
            let elems = d
                .shape
                .iter()
                .try_fold(1u64, |acc, &x| acc.checked_mul(x))
                .and_then(|n| n.checked_mul(d.dtype.size() as u64))
                .filter(|&n| n <= (data.len() - at) as u64)
                .ok_or_else(|| {
                    err(format!(
                        "tensor {i} of shape {:?} does not fit the {} data bytes left",
                        d.shape,
                        data.len() - at
                    ))
                })? as usize;
            let shape = d.shape.iter().map(|&x| x as usize).collect();
            out.push((d, shape, &data[at..at + elems]));
            at += elems;
        }
        if at != data.len() {
            return Err(err(format!(
                "{} data bytes are not described by any tensor",
                data.len() - at
            )));
        }
        Ok(TensorReader {
            msg,
            descs: out,
            next: 0,
        })
    }

    fn expect_count(&self, n: usize) -> Result<(), ProtocolError> {
        if self.descs.len() != n {
            return Err(ProtocolError::Tensors {
                msg: self.msg,
                reason: format!("expected {n} tensors, found {}", self.descs.len()),
            });
        }
        Ok(())
    }

    fn take(&mut self) -> WireTensor {
        let (desc, shape, bytes) = &self.descs[self.next];
        self.next += 1;
        WireTensor::decode(desc, shape.clone(), bytes)
    }
}

/// A frame's metadata, with every string in it made safe to print (crate::printable): the
/// peer's text goes no further raw. Its errors may quote the peer's text too.
fn meta<T: DeserializeOwned>(msg: MsgType, bytes: &[u8]) -> Result<Meta<T>, ProtocolError> {
    let err = |e: serde_json::Error| ProtocolError::Meta {
        msg,
        reason: printable(&e.to_string()),
    };
    let value = serde_json::from_slice(bytes).map_err(err)?;
    serde_json::from_value(printable_json(value)).map_err(err)
}

fn shape_err(msg: MsgType, reason: String) -> ProtocolError {
    ProtocolError::Tensors { msg, reason }
}

/// `k` and `v` rows: rank 2, same shape.
fn check_rows(msg: MsgType, k: &WireTensor, v: &WireTensor) -> Result<(), ProtocolError> {
    if k.shape.len() != 2 || k.shape != v.shape {
        return Err(shape_err(
            msg,
            format!(
                "k and v must be [rows, width] of one shape, got {:?} and {:?}",
                k.shape, v.shape
            ),
        ));
    }
    Ok(())
}

/// Decode one frame. `max_frame` is the limit agreed in the handshake.
pub fn decode(frame: &[u8], max_frame: usize) -> Result<(u32, Message), ProtocolError> {
    if frame.len() > max_frame {
        return Err(ProtocolError::TooLarge {
            len: frame.len(),
            limit: max_frame,
        });
    }
    if frame.len() < HEADER_LEN {
        return Err(ProtocolError::Truncated {
            need: HEADER_LEN,
            have: frame.len(),
        });
    }
    if frame[..2] != MAGIC {
        return Err(ProtocolError::BadMagic);
    }
    if frame[2] != PROTOCOL_VERSION {
        return Err(ProtocolError::Version { got: frame[2] });
    }
    let msg = MsgType::from_code(frame[3]).ok_or(ProtocolError::UnknownType(frame[3]))?;
    let req = u32_at(frame, 4) as u32;
    let (meta_len, data_len) = (u32_at(frame, 8), u32_at(frame, 12));
    // Checked: on a 32-bit target (wasm) two u32 lengths can overflow usize.
    let need = HEADER_LEN
        .checked_add(meta_len)
        .and_then(|n| n.checked_add(data_len))
        .ok_or(ProtocolError::TooLarge {
            len: usize::MAX,
            limit: max_frame,
        })?;
    if frame.len() < need {
        return Err(ProtocolError::Truncated {
            need,
            have: frame.len(),
        });
    }
    if frame.len() > need {
        return Err(ProtocolError::TrailingBytes {
            extra: frame.len() - need,
        });
    }
    let meta_bytes = &frame[HEADER_LEN..HEADER_LEN + meta_len];
    let data = &frame[HEADER_LEN + meta_len..];
    let no_tensors = |descs: &[TensorDesc]| -> Result<(), ProtocolError> {
        if descs.is_empty() {
            Ok(())
        } else {
            Err(shape_err(
                msg,
                format!("carries {} tensors, expected none", descs.len()),
            ))
        }
    };
    // Messages without tensors must not carry data either.
    macro_rules! plain {
        ($t:ty) => {{
            let m: Meta<$t> = meta(msg, meta_bytes)?;
            no_tensors(&m.tensors)?;
            if !data.is_empty() {
                return Err(shape_err(
                    msg,
                    format!("{} data bytes, expected none", data.len()),
                ));
            }
            m.body
        }};
    }
    let message = match msg {
        MsgType::Hello => Message::Hello(plain!(Intro)),
        MsgType::Welcome => Message::Welcome(plain!(Intro)),
        MsgType::Configure => Message::Configure(plain!(Configure)),
        MsgType::KvTruncate => {
            let b = plain!(Truncate);
            Message::KvTruncate {
                seq: b.seq,
                len: b.len,
            }
        }
        MsgType::KvFetch => {
            let b = plain!(Fetch);
            Message::KvFetch {
                seq: b.seq,
                layer: b.layer,
                start: b.start,
                len: b.len,
            }
        }
        MsgType::Stats => Message::Stats(plain!(StatsMeta).counters),
        MsgType::Ping => Message::Ping {
            nonce: plain!(Nonce).nonce,
        },
        MsgType::Pong => Message::Pong {
            nonce: plain!(Nonce).nonce,
        },
        MsgType::Ack => {
            plain!(Empty);
            Message::Ack
        }
        MsgType::Error => {
            let b = plain!(ErrorMeta);
            Message::Error {
                code: b.code,
                message: b.message,
            }
        }
        MsgType::Bye => Message::Bye {
            reason: plain!(ByeMeta).reason,
        },
        MsgType::PrefillChunk => {
            let m: Meta<ChunkMeta> = meta(msg, meta_bytes)?;
            let mut r = TensorReader::new(msg, m.tensors, data)?;
            r.expect_count(1)?;
            let residual = r.take();
            if residual.shape.len() != 2 {
                return Err(shape_err(
                    msg,
                    format!("residual must be [rows, hidden], got {:?}", residual.shape),
                ));
            }
            Message::PrefillChunk {
                seq: m.body.seq,
                pos: m.body.pos,
                want_state: m.body.want_state,
                residual,
            }
        }
        MsgType::ChunkState => {
            let m: Meta<ChunkStateMeta> = meta(msg, meta_bytes)?;
            let b = m.body;
            let mut r = TensorReader::new(msg, m.tensors, data)?;
            let pairs = b.kv_layers.len().checked_add(b.delta_layers.len());
            r.expect_count(pairs.and_then(|p| p.checked_mul(2)).unwrap_or(usize::MAX))?;
            let kv: Vec<(WireTensor, WireTensor)> =
                b.kv_layers.iter().map(|_| (r.take(), r.take())).collect();
            for (k, v) in &kv {
                check_rows(msg, k, v)?;
            }
            let states = b
                .delta_layers
                .iter()
                .map(|_| (r.take(), r.take()))
                .collect();
            Message::ChunkState {
                seq: b.seq,
                pos: b.pos,
                kv_layers: b.kv_layers,
                kv,
                delta_layers: b.delta_layers,
                states,
            }
        }
        MsgType::KvAppend | MsgType::KvRows => {
            let m: Meta<LayerRows> = meta(msg, meta_bytes)?;
            let mut r = TensorReader::new(msg, m.tensors, data)?;
            r.expect_count(2)?;
            let (k, v) = (r.take(), r.take());
            check_rows(msg, &k, &v)?;
            let b = m.body;
            if msg == MsgType::KvAppend {
                Message::KvAppend {
                    seq: b.seq,
                    layer: b.layer,
                    start: b.start,
                    k,
                    v,
                }
            } else {
                Message::KvRows {
                    seq: b.seq,
                    layer: b.layer,
                    start: b.start,
                    k,
                    v,
                }
            }
        }
        MsgType::AttnQuery => {
            let m: Meta<Query> = meta(msg, meta_bytes)?;
            let mut r = TensorReader::new(msg, m.tensors, data)?;
            r.expect_count(1)?;
            let q = r.take();
            if q.shape.len() != 3 || q.shape[0] != m.body.positions.len() {
                return Err(shape_err(
                    msg,
                    format!(
                        "q must be [positions ({}), heads, head_dim], got {:?}",
                        m.body.positions.len(),
                        q.shape
                    ),
                ));
            }
            Message::AttnQuery {
                seq: m.body.seq,
                layer: m.body.layer,
                positions: m.body.positions,
                end: m.body.end,
                q,
            }
        }
        MsgType::AttnPartials => {
            let m: Meta<PartialsMeta> = meta(msg, meta_bytes)?;
            let mut r = TensorReader::new(msg, m.tensors, data)?;
            r.expect_count(3)?;
            let (o, mm, l) = (r.take(), r.take(), r.take());
            let pages = m.body.page_starts.len();
            let ok = o.shape.len() == 3
                && o.shape[0] == pages
                && mm.shape == o.shape[..2]
                && l.shape == o.shape[..2];
            if !ok {
                return Err(shape_err(
                    msg,
                    format!(
                        "partials of {pages} pages must be o [pages, rows, head_dim], m and l [pages, rows]; got {:?}, {:?}, {:?}",
                        o.shape, mm.shape, l.shape
                    ),
                ));
            }
            Message::AttnPartials {
                seq: m.body.seq,
                layer: m.body.layer,
                page_starts: m.body.page_starts,
                o,
                m: mm,
                l,
            }
        }
    };
    Ok((req, message))
}
