//! Typed messages and their encoding into frames (header, JSON metadata, raw tensors).
//!
//! `decode` trusts nothing: lengths are checked against the frame limit and against the
//! frame's real size before any tensor is decoded, every tensor's byte size is computed with
//! overflow checks from its declared shape, and each message's tensors must have the shapes
//! its metadata implies. Checks that need the model (hidden size, which layers exist) happen
//! where the message is used (`check_shapes`).

use std::collections::BTreeMap;

use crate::cache_types::{CacheTypes, KvType};
use crate::printable::{printable, printable_json};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::header::{HEADER_LEN, MAGIC, PROTOCOL_VERSION};
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
/// and the page size and cache types of the KV pages it may be sent (a helper that cannot
/// hold the types refuses).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Configure {
    pub first_layer: u32,
    pub end_layer: u32,
    pub page_size: u32,
    pub kv_types: CacheTypes,
}

/// The messages, one entry each; the entry is all there is to a message's encoding, so adding
/// a message is adding an entry (and, for a request a helper serves, its handler in
/// `helper/requests.rs`). From the entries come [`MsgType`], [`Message`], `Message::msg_type`,
/// the metadata and tensors `encode` writes and what `decode` reads and checks. An entry's doc
/// comment goes on both enums; its code is the header's byte 3. Its payload takes one of four
/// forms:
///
/// - `Name(Type) = code`: the metadata is `Type`'s own JSON object, no tensors.
/// - `Name(Type) under key = code`: the metadata is `{"key": Type}`, no tensors.
/// - `Name = code`: the metadata is `{}`, no tensors.
/// - `Name { field: Type, .. } [tensor, list per field, ..] = code, check expr`: the fields
///   are the metadata, in order; the tensors, if any, follow in wire order: `tensor` is one
///   [`WireTensor`], `list per field` is a `Vec<(WireTensor, WireTensor)>` with one pair per
///   entry of the metadata list `field`. `check`, a `Result<(), String>` over the fields and
///   tensors by name, runs once they are decoded; its error refuses the frame
///   (`ProtocolError::Tensors`).
///
/// A message without tensors must carry no data. Every message decodes by `decode`'s checks
/// first: the frame limit, the lengths, then each tensor's description against the data.
macro_rules! messages {
    ($(
        $(#[$doc:meta])*
        $name:ident
        $(($tuple:ty) $(under $key:ident)?)?
        $({ $($field:ident: $fty:ty),* $(,)? } $([$($tensor:ident $(per $list:ident)?),* $(,)?])?)?
        = $code:literal
        $(, check $check:expr)?;
    )*) => {
        /// What a frame carries. The code is the header's byte 3.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum MsgType {
            $($(#[$doc])* $name = $code,)*
        }

        impl MsgType {
            pub const ALL: &'static [MsgType] = &[$(MsgType::$name),*];

            pub fn from_code(code: u8) -> Option<MsgType> {
                match code {
                    $($code => Some(MsgType::$name),)*
                    _ => None,
                }
            }

            /// A stable name, used as the key of per-type byte counts.
            pub fn name(self) -> &'static str {
                match self {
                    $(MsgType::$name => stringify!($name),)*
                }
            }
        }

        #[derive(Clone, Debug, PartialEq)]
        pub enum Message {
            $(
                $(#[$doc])*
                $name
                $(($tuple))?
                $({
                    $($field: $fty,)*
                    $($($tensor: form!(@type $($list)?),)*)?
                })?,
            )*
        }

        /// The metadata of each message that is not a type of its own, as decoded.
        mod meta {
            use super::*;

            $(form!(@meta $name $(($tuple) $(under $key)?)? $({ $($field: $fty),* })?);)*
        }

        impl Message {
            pub fn msg_type(&self) -> MsgType {
                match self {
                    $(Message::$name { .. } => MsgType::$name,)*
                }
            }

            /// The metadata and the tensors, in wire order.
            fn parts(&self) -> (serde_json::Value, Vec<&WireTensor>) {
                match self {
                    $(
                        form!(@pattern body, $name
                            $(($tuple))? $({ $($field),* } $([$($tensor),*])?)?)
                        => form!(@parts body
                            $(($tuple) $(under $key)?)?
                            $({ $($field),* } $([$($tensor $(per $list)?),*])?)?),
                    )*
                }
            }

            /// The message of a frame of type `payload.msg`, checked.
            fn from_payload(payload: Payload<'_>) -> Result<Message, ProtocolError> {
                Ok(match payload.msg {
                    $(
                        MsgType::$name => form!(@decode payload, $name
                            $(($tuple) $(under $key)?)?
                            $({ $($field),* } $([$($tensor $(per $list)?),*])?)?
                            $(check $check)?),
                    )*
                })
            }
        }
    };
}

/// One piece of `messages!`'s code for one message, by the form of its entry.
macro_rules! form {
    // The Rust type of a tensor field.
    (@type) => { WireTensor };
    (@type $list:ident) => { Vec<(WireTensor, WireTensor)> };

    // The decoded metadata's struct, for the forms that need one.
    (@meta $name:ident ($tuple:ty)) => {};
    (@meta $name:ident ($tuple:ty) under $key:ident) => {
        #[derive(Deserialize)]
        pub(super) struct $name {
            pub(super) $key: $tuple,
        }
    };
    (@meta $name:ident) => {
        #[derive(Deserialize)]
        pub(super) struct $name {}
    };
    (@meta $name:ident { $($field:ident: $fty:ty),* }) => {
        #[derive(Deserialize)]
        pub(super) struct $name {
            $(pub(super) $field: $fty,)*
        }
    };

    // A pattern binding the message's contents (by reference).
    (@pattern $body:ident, $name:ident ($tuple:ty)) => { Message::$name($body) };
    (@pattern $body:ident, $name:ident) => { Message::$name };
    (@pattern $body:ident, $name:ident { $($field:ident),* } $([$($tensor:ident),*])?) => {
        Message::$name { $($field,)* $($($tensor,)*)? }
    };

    // Metadata and tensors for `encode`.
    (@parts $body:ident ($tuple:ty)) => { (json($body), Vec::new()) };
    (@parts $body:ident ($tuple:ty) under $key:ident) => {
        (object([(stringify!($key), json($body))]), Vec::new())
    };
    (@parts $body:ident) => { (object([]), Vec::new()) };
    (@parts $body:ident { $($field:ident),* } $([$($tensor:ident $(per $list:ident)?),*])?) => {
        (
            object([$((stringify!($field), json($field))),*]),
            std::iter::empty()
                $($(.chain(form!(@wire $tensor $($list)?)))*)?
                .collect(),
        )
    };
    (@wire $tensor:ident) => { [$tensor] };
    (@wire $tensor:ident $list:ident) => { $tensor.iter().flat_map(|(a, b)| [a, b]) };

    // The message decoded from a payload (and checked).
    (@decode $p:ident, $name:ident ($tuple:ty)) => { Message::$name($p.plain::<$tuple>()?) };
    (@decode $p:ident, $name:ident ($tuple:ty) under $key:ident) => {
        Message::$name($p.plain::<meta::$name>()?.$key)
    };
    (@decode $p:ident, $name:ident) => {{
        $p.plain::<meta::$name>()?;
        Message::$name
    }};
    (@decode $p:ident, $name:ident { $($field:ident),* }) => {{
        let meta::$name { $($field),* } = $p.plain()?;
        Message::$name { $($field),* }
    }};
    (@decode $p:ident, $name:ident { $($field:ident),* }
        [$($tensor:ident $(per $list:ident)?),*] $(check $check:expr)?) => {{
        let (meta::$name { $($field),* }, mut tensors) = $p.with_tensors()?;
        let count = [$(form!(@count $($list)?)),*]
            .into_iter()
            .try_fold(0usize, |n, more| n.checked_add(more?));
        tensors.expect_count(count.unwrap_or(usize::MAX))?;
        $(let $tensor: form!(@type $($list)?) = form!(@take tensors $($list)?);)*
        $($check.map_err(|reason| $p.tensors_err(reason))?;)?
        Message::$name { $($field,)* $($tensor,)* }
    }};
    (@count) => { Some(1) };
    (@count $list:ident) => { $list.len().checked_mul(2) };
    (@take $r:ident) => { $r.take() };
    (@take $r:ident $list:ident) => { $list.iter().map(|_| ($r.take(), $r.take())).collect() };
}

messages! {
    /// Either side's introduction: version, model name and digest, role, memory, backends,
    /// frame limit.
    Hello(Intro) = 1;
    /// The helper accepts a host's Hello.
    Welcome(Intro) = 2;
    /// The host assigns layers and page geometry to the helper.
    Configure(Configure) = 3;
    /// Residual rows entering the helper's layers for one ubatch.
    ///
    /// Residual rows `[rows, hidden]` entering layer `first_layer` for positions `pos ..`;
    /// `want_state` asks for the DeltaNet states after this chunk (the batch's last for the
    /// helper).
    PrefillChunk { seq: u64, pos: u64, want_state: bool } [residual] = 4,
    check values(&[&residual]).and(ensure(residual.shape.len() == 2, || {
        format!("residual must be [rows, hidden], got {:?}", residual.shape)
    }));
    /// New KV rows of the helper's full layers (and DeltaNet state at batch end).
    ///
    /// The helper's new KV rows `[rows, kv_heads * head_dim]` per full-attention layer it runs
    /// (`kv_layers[i]` owns `kv[i]`), and at batch end its DeltaNet states (`delta_layers[i]`
    /// owns `states[i] = (s [v_heads, dk, dv], conv [kernel - 1, conv_dim])`).
    ChunkState {
        seq: u64,
        pos: u64,
        kv_layers: Vec<u32>,
        delta_layers: Vec<u32>,
    } [kv per kv_layers, states per delta_layers] = 5,
    check kv.iter().try_for_each(|(k, v)| rows(k, v))
        .and(states.iter().try_for_each(|(s, c)| values(&[s, c])));
    /// KV rows the helper keeps for a layer.
    ///
    /// KV rows `[rows, kv_heads * head_dim]` of one layer at positions `start ..`.
    KvAppend { seq: u64, layer: u32, start: u64 } [k, v] = 6, check rows(&k, &v);
    /// Drop positions at and after a length (a rewind).
    KvTruncate { seq: u64, len: u64 } = 7;
    /// Ask for KV rows back.
    KvFetch { seq: u64, layer: u32, start: u64, len: u64 } = 8;
    /// KV rows, answering KvFetch.
    KvRows { seq: u64, layer: u32, start: u64 } [k, v] = 9, check rows(&k, &v);
    /// A decode step's queries for one full-attention layer.
    ///
    /// Scaled queries `[t, q_heads, head_dim]` of one layer at absolute `positions`, over the
    /// helper's pages below position `end` (the ones the host has handed over).
    AttnQuery { seq: u64, layer: u32, positions: Vec<u64>, end: u64 } [q] = 10,
    check values(&[&q]).and(ensure(q.shape.len() == 3 && q.shape[0] == positions.len(), || {
        format!(
            "q must be [positions ({}), heads, head_dim], got {:?}",
            positions.len(),
            q.shape
        )
    }));
    /// Per-page (o, m, l) partials answering AttnQuery.
    ///
    /// One partial per page the helper holds, in page order: `o [pages, t * q_heads, head_dim]`,
    /// `m` and `l` `[pages, t * q_heads]`; `page_starts[i]` is page i's first position.
    AttnPartials { seq: u64, layer: u32, page_starts: Vec<u64> } [o, m, l] = 11,
    check partials(page_starts.len(), &o, &m, &l);
    /// Counters of a peer.
    ///
    /// They sit under their own key so no counter name can collide with `tensors`.
    Stats(BTreeMap<String, u64>) under counters = 12;
    /// Liveness probe.
    Ping { nonce: u64 } = 13;
    /// Answer to Ping.
    Pong { nonce: u64 } = 14;
    /// A request without a payload answer completed.
    Ack = 15;
    /// A request failed; the message says why.
    Error { code: String, message: String } = 16;
    /// Orderly close.
    Bye { reason: String } = 17;
}

impl Message {
    pub fn error(code: &str, message: impl Into<String>) -> Message {
        Message::Error {
            code: code.to_string(),
            message: message.into(),
        }
    }
}

/// `Ok` if `ok`, else the reason `why` gives.
fn ensure(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(why())
    }
}

/// Values (residuals, queries, partials, states) travel as f32: only KV rows are compact.
fn values(tensors: &[&WireTensor]) -> Result<(), String> {
    match tensors.iter().find(|t| t.dtype() != KvType::F32) {
        Some(t) => Err(format!(
            "values travel as f32, got a tensor of {}",
            t.dtype().name()
        )),
        None => Ok(()),
    }
}

/// `k` and `v` rows: rank 2, same shape.
fn rows(k: &WireTensor, v: &WireTensor) -> Result<(), String> {
    ensure(k.shape.len() == 2 && k.shape == v.shape, || {
        format!(
            "k and v must be [rows, width] of one shape, got {:?} and {:?}",
            k.shape, v.shape
        )
    })
}

/// One partial per page: `o [pages, rows, head_dim]`, `m` and `l` `[pages, rows]`.
fn partials(pages: usize, o: &WireTensor, m: &WireTensor, l: &WireTensor) -> Result<(), String> {
    values(&[o, m, l])?;
    let ok = o.shape.len() == 3
        && o.shape[0] == pages
        && m.shape == o.shape[..2]
        && l.shape == o.shape[..2];
    ensure(ok, || {
        format!(
            "partials of {pages} pages must be o [pages, rows, head_dim], m and l [pages, rows]; got {:?}, {:?}, {:?}",
            o.shape, m.shape, l.shape
        )
    })
}

/// Metadata as JSON.
fn json<T: Serialize>(t: T) -> serde_json::Value {
    serde_json::to_value(t).expect("metadata serialises")
}

/// A JSON object of `fields`, in order (as a struct of them serialises).
fn object<const N: usize>(fields: [(&str, serde_json::Value); N]) -> serde_json::Value {
    serde_json::Value::Object(fields.into_iter().map(|(k, v)| (k.into(), v)).collect())
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
            if !d.whole_blocks() {
                return Err(err(format!(
                    "tensor {i} of shape {:?} is not whole {} blocks",
                    d.shape,
                    d.dtype.name()
                )));
            }
            let elems = d
                .bytes()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n <= data.len() - at)
                .ok_or_else(|| {
                    err(format!(
                        "tensor {i} of shape {:?} does not fit the {} data bytes left",
                        d.shape,
                        data.len() - at
                    ))
                })?;
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

/// A frame's metadata: the message's fields and the tensors' descriptions.
#[derive(Deserialize)]
struct Meta<T> {
    #[serde(flatten)]
    body: T,
    #[serde(default)]
    tensors: Vec<TensorDesc>,
}

/// A frame's metadata and data, for the message type its header names.
struct Payload<'a> {
    msg: MsgType,
    meta: &'a [u8],
    data: &'a [u8],
}

impl<'a> Payload<'a> {
    /// The metadata of a message without tensors, which must not carry data either.
    fn plain<T: DeserializeOwned>(&self) -> Result<T, ProtocolError> {
        let m: Meta<T> = meta(self.msg, self.meta)?;
        if !m.tensors.is_empty() {
            let n = m.tensors.len();
            return Err(self.tensors_err(format!("carries {n} tensors, expected none")));
        }
        if !self.data.is_empty() {
            let n = self.data.len();
            return Err(self.tensors_err(format!("{n} data bytes, expected none")));
        }
        Ok(m.body)
    }

    /// The metadata of a message with tensors, and its tensors, checked against the data.
    fn with_tensors<T: DeserializeOwned>(&self) -> Result<(T, TensorReader<'a>), ProtocolError> {
        let m: Meta<T> = meta(self.msg, self.meta)?;
        Ok((m.body, TensorReader::new(self.msg, m.tensors, self.data)?))
    }

    fn tensors_err(&self, reason: String) -> ProtocolError {
        ProtocolError::Tensors {
            msg: self.msg,
            reason,
        }
    }
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
    let payload = Payload {
        msg,
        meta: &frame[HEADER_LEN..HEADER_LEN + meta_len],
        data: &frame[HEADER_LEN + meta_len..],
    };
    Ok((req, Message::from_payload(payload)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tensor of `shape` whose every value is `n`: the `n`-th tensor on the wire.
    fn t(n: u8, shape: &[usize]) -> WireTensor {
        WireTensor::f32(shape.to_vec(), vec![f32::from(n); shape.iter().product()])
    }

    /// One message of type `ty` with every field set, its metadata as sent, and the values of
    /// its tensors in wire order. The match names every type: a new message needs one here.
    fn sample(ty: MsgType) -> (Message, &'static str, Vec<u8>) {
        let intro = |role| Intro {
            version: PROTOCOL_VERSION,
            model: "m".into(),
            model_digest: "d".into(),
            role,
            mem_offer: 5,
            backends: vec!["cpu".into()],
            max_frame: 6,
            device: "tab".into(),
        };
        match ty {
            MsgType::Hello => (
                Message::Hello(intro(Role::Host)),
                r#"{"backends":["cpu"],"device":"tab","max_frame":6,"mem_offer":5,"model":"m","model_digest":"d","role":"host","version":3}"#,
                vec![],
            ),
            MsgType::Welcome => (
                Message::Welcome(intro(Role::Helper)),
                r#"{"backends":["cpu"],"device":"tab","max_frame":6,"mem_offer":5,"model":"m","model_digest":"d","role":"helper","version":3}"#,
                vec![],
            ),
            MsgType::Configure => (
                Message::Configure(Configure {
                    first_layer: 1,
                    end_layer: 2,
                    page_size: 3,
                    kv_types: CacheTypes {
                        k: crate::cache_types::KvType::Q8_0,
                        v: crate::cache_types::KvType::F16,
                    },
                }),
                r#"{"end_layer":2,"first_layer":1,"kv_types":{"k":"q8_0","v":"f16"},"page_size":3}"#,
                vec![],
            ),
            MsgType::PrefillChunk => (
                Message::PrefillChunk {
                    seq: 1,
                    pos: 2,
                    want_state: true,
                    residual: t(1, &[2, 3]),
                },
                r#"{"pos":2,"seq":1,"tensors":[{"dtype":"f32","shape":[2,3]}],"want_state":true}"#,
                vec![1; 6],
            ),
            MsgType::ChunkState => (
                Message::ChunkState {
                    seq: 1,
                    pos: 2,
                    kv_layers: vec![3],
                    kv: vec![(t(1, &[1, 2]), t(2, &[1, 2]))],
                    delta_layers: vec![0, 1],
                    states: vec![(t(3, &[1]), t(4, &[2])), (t(5, &[3]), t(6, &[1]))],
                },
                r#"{"delta_layers":[0,1],"kv_layers":[3],"pos":2,"seq":1,"tensors":[{"dtype":"f32","shape":[1,2]},{"dtype":"f32","shape":[1,2]},{"dtype":"f32","shape":[1]},{"dtype":"f32","shape":[2]},{"dtype":"f32","shape":[3]},{"dtype":"f32","shape":[1]}]}"#,
                vec![1, 1, 2, 2, 3, 4, 4, 5, 5, 5, 6],
            ),
            MsgType::KvAppend => (
                Message::KvAppend {
                    seq: 1,
                    layer: 2,
                    start: 3,
                    k: t(1, &[1, 2]),
                    v: t(2, &[1, 2]),
                },
                r#"{"layer":2,"seq":1,"start":3,"tensors":[{"dtype":"f32","shape":[1,2]},{"dtype":"f32","shape":[1,2]}]}"#,
                vec![1, 1, 2, 2],
            ),
            MsgType::KvTruncate => (
                Message::KvTruncate { seq: 1, len: 2 },
                r#"{"len":2,"seq":1}"#,
                vec![],
            ),
            MsgType::KvFetch => (
                Message::KvFetch {
                    seq: 1,
                    layer: 2,
                    start: 3,
                    len: 4,
                },
                r#"{"layer":2,"len":4,"seq":1,"start":3}"#,
                vec![],
            ),
            MsgType::KvRows => (
                Message::KvRows {
                    seq: 1,
                    layer: 2,
                    start: 3,
                    k: t(1, &[2, 1]),
                    v: t(2, &[2, 1]),
                },
                r#"{"layer":2,"seq":1,"start":3,"tensors":[{"dtype":"f32","shape":[2,1]},{"dtype":"f32","shape":[2,1]}]}"#,
                vec![1, 1, 2, 2],
            ),
            MsgType::AttnQuery => (
                Message::AttnQuery {
                    seq: 1,
                    layer: 2,
                    positions: vec![3, 4],
                    end: 5,
                    q: t(1, &[2, 1, 3]),
                },
                r#"{"end":5,"layer":2,"positions":[3,4],"seq":1,"tensors":[{"dtype":"f32","shape":[2,1,3]}]}"#,
                vec![1; 6],
            ),
            MsgType::AttnPartials => (
                Message::AttnPartials {
                    seq: 1,
                    layer: 2,
                    page_starts: vec![0, 8],
                    o: t(1, &[2, 1, 3]),
                    m: t(2, &[2, 1]),
                    l: t(3, &[2, 1]),
                },
                r#"{"layer":2,"page_starts":[0,8],"seq":1,"tensors":[{"dtype":"f32","shape":[2,1,3]},{"dtype":"f32","shape":[2,1]},{"dtype":"f32","shape":[2,1]}]}"#,
                vec![1, 1, 1, 1, 1, 1, 2, 2, 3, 3],
            ),
            MsgType::Stats => (
                Message::Stats([("tensors".to_string(), 1)].into_iter().collect()),
                r#"{"counters":{"tensors":1}}"#,
                vec![],
            ),
            MsgType::Ping => (Message::Ping { nonce: 1 }, r#"{"nonce":1}"#, vec![]),
            MsgType::Pong => (Message::Pong { nonce: 2 }, r#"{"nonce":2}"#, vec![]),
            MsgType::Ack => (Message::Ack, "{}", vec![]),
            MsgType::Error => (
                Message::error("c", "m"),
                r#"{"code":"c","message":"m"}"#,
                vec![],
            ),
            MsgType::Bye => (
                Message::Bye { reason: "r".into() },
                r#"{"reason":"r"}"#,
                vec![],
            ),
        }
    }

    /// Every message type's frame, byte for byte (header, metadata, tensors in order), and its
    /// way back to the same message: a field or tensor the description lost would show here.
    #[test]
    fn every_message_has_its_wire_form_and_round_trips() {
        for (code, &ty) in (1u8..).zip(MsgType::ALL) {
            let (msg, meta, values) = sample(ty);
            assert_eq!(msg.msg_type(), ty);
            assert_eq!(ty as u8, code, "{ty:?}");
            assert_eq!(MsgType::from_code(code), Some(ty));
            assert_eq!(ty.name(), format!("{ty:?}"));
            let data: Vec<u8> = values
                .into_iter()
                .flat_map(|n| f32::from(n).to_le_bytes())
                .collect();
            let frame = encode(0x0403_0201, &msg);
            let head = [
                &b"TH"[..],
                &[PROTOCOL_VERSION, code, 1, 2, 3, 4],
                &(meta.len() as u32).to_le_bytes(),
                &(data.len() as u32).to_le_bytes(),
            ]
            .concat();
            assert_eq!(frame[..HEADER_LEN], head, "{ty:?}");
            let (sent_meta, sent_data) = frame[HEADER_LEN..].split_at(meta.len());
            assert_eq!(std::str::from_utf8(sent_meta), Ok(meta), "{ty:?}");
            assert_eq!(sent_data, data, "{ty:?}");
            assert_eq!(decode(&frame, 1 << 20), Ok((0x0403_0201, msg)));
        }
        assert_eq!(MsgType::from_code(MsgType::ALL.len() as u8 + 1), None);
        assert_eq!(MsgType::from_code(0), None);
    }
}
