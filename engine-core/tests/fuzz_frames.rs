//! Fuzzing the frame decoder: every frame comes from a peer, so `protocol::decode` and
//! `request_id` must turn any bytes into a message or an error (never a panic, never an
//! allocation sized by a length the frame announces), and what they accept must be a message
//! the rest of the engine can trust (tensor sizes that match their shapes, the shapes each
//! message promises).
//!
//! `scripts/fuzz` runs these with many more cases.

mod common;

use engine_core::cache_types::{CacheTypes, Encoded, KvType};
use engine_core::protocol::message::request_id;
use engine_core::protocol::{
    decode, encode, Configure, Intro, Message, MsgType, ProtocolError, Role, WireTensor,
    HEADER_LEN, MAGIC, PROTOCOL_VERSION,
};
use proptest::prelude::*;
use serde_json::Value;

use common::{cases, mutation};

const LIMIT: usize = 1 << 24;

fn arb_type() -> impl Strategy<Value = KvType> {
    proptest::sample::select(KvType::ALL.to_vec())
}

/// f32 values of any shape (values travel as f32; only KV rows are compact) with arbitrary
/// bytes (NaNs, infinities and subnormals included).
fn arb_values(rank: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = WireTensor> {
    proptest::collection::vec(0..5usize, rank).prop_flat_map(|shape| {
        let n = KvType::F32.row_bytes(shape.iter().product::<usize>());
        proptest::collection::vec(any::<u8>(), n).prop_map(move |bytes| {
            WireTensor::new(
                shape.clone(),
                Encoded {
                    ty: KvType::F32,
                    bytes,
                },
            )
        })
    })
}

/// `k` and `v` rows of one shape `[rows, width]`, each in any type.
fn arb_rows() -> impl Strategy<Value = (WireTensor, WireTensor)> {
    (0..4usize, 0..3usize, arb_type(), arb_type()).prop_flat_map(|(rows, blocks, kt, vt)| {
        let width = blocks * 32;
        let t = move |ty: KvType| {
            proptest::collection::vec(any::<u8>(), rows * ty.row_bytes(width))
                .prop_map(move |bytes| WireTensor::new(vec![rows, width], Encoded { ty, bytes }))
        };
        (t(kt), t(vt))
    })
}

fn text() -> impl Strategy<Value = String> {
    // Any unicode, quotes and backslashes included: the metadata is JSON.
    any::<String>()
}

fn arb_intro() -> impl Strategy<Value = Intro> {
    (
        any::<u8>(),
        text(),
        text(),
        any::<bool>(),
        any::<u64>(),
        proptest::collection::vec(text(), 0..3),
        any::<u64>(),
    )
        .prop_map(
            |(version, model, model_digest, helper, mem_offer, backends, max_frame)| Intro {
                version,
                model,
                model_digest,
                role: if helper { Role::Helper } else { Role::Host },
                mem_offer,
                backends,
                max_frame,
                device: device_kind(helper),
            },
        )
}

/// Every message type, with arbitrary field values.
fn arb_message() -> impl Strategy<Value = Message> {
    let ids = || proptest::collection::vec(any::<u64>(), 0..4);
    prop_oneof![
        arb_intro().prop_map(Message::Hello),
        arb_intro().prop_map(Message::Welcome),
        (any::<(u32, u32, u32)>(), arb_type(), arb_type()).prop_map(
            |((first_layer, end_layer, page_size), k, v)| {
                Message::Configure(Configure {
                    first_layer,
                    end_layer,
                    page_size,
                    kv_types: CacheTypes { k, v },
                })
            }
        ),
        (any::<(u64, u64, bool)>(), arb_values(2..=2)).prop_map(
            |((seq, pos, want_state), residual)| Message::PrefillChunk {
                seq,
                pos,
                want_state,
                residual
            }
        ),
        (
            any::<(u64, u64)>(),
            proptest::collection::vec((any::<u32>(), arb_rows()), 0..3),
            proptest::collection::vec((any::<u32>(), arb_values(0..=4), arb_values(0..=4)), 0..3),
        )
            .prop_map(|((seq, pos), kv, states)| Message::ChunkState {
                seq,
                pos,
                kv_layers: kv.iter().map(|(l, _)| *l).collect(),
                kv: kv.into_iter().map(|(_, rows)| rows).collect(),
                delta_layers: states.iter().map(|(l, _, _)| *l).collect(),
                states: states.into_iter().map(|(_, s, c)| (s, c)).collect(),
            }),
        (any::<(u64, u32, u64, bool)>(), arb_rows()).prop_map(
            |((seq, layer, start, append), (k, v))| if append {
                Message::KvAppend {
                    seq,
                    layer,
                    start,
                    k,
                    v,
                }
            } else {
                Message::KvRows {
                    seq,
                    layer,
                    start,
                    k,
                    v,
                }
            }
        ),
        any::<(u64, u64)>().prop_map(|(seq, len)| Message::KvTruncate { seq, len }),
        any::<(u64, u32, u64, u64)>().prop_map(|(seq, layer, start, len)| Message::KvFetch {
            seq,
            layer,
            start,
            len
        }),
        (any::<(u64, u32, u64)>(), ids(), 0..3usize, 0..3usize).prop_flat_map(
            |((seq, layer, end), positions, heads, dim)| {
                let n = positions.len() * heads * dim;
                proptest::collection::vec(any::<f32>(), n).prop_map(move |data| {
                    Message::AttnQuery {
                        seq,
                        layer,
                        positions: positions.clone(),
                        end,
                        q: WireTensor::f32(vec![positions.len(), heads, dim], data),
                    }
                })
            }
        ),
        (any::<(u64, u32)>(), ids(), 0..3usize, 0..3usize).prop_flat_map(
            |((seq, layer), page_starts, rows, dim)| {
                let pages = page_starts.len();
                let f = |n| proptest::collection::vec(any::<f32>(), n);
                (f(pages * rows * dim), f(pages * rows), f(pages * rows)).prop_map(
                    move |(o, m, l)| Message::AttnPartials {
                        seq,
                        layer,
                        page_starts: page_starts.clone(),
                        o: WireTensor::f32(vec![pages, rows, dim], o),
                        m: WireTensor::f32(vec![pages, rows], m),
                        l: WireTensor::f32(vec![pages, rows], l),
                    },
                )
            }
        ),
        // Counter names are arbitrary, `tensors` included.
        proptest::collection::btree_map(
            prop_oneof![Just("tensors".to_string()), text()],
            any::<u64>(),
            0..4
        )
        .prop_map(Message::Stats),
        any::<u64>().prop_map(|nonce| Message::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Message::Pong { nonce }),
        Just(Message::Ack),
        (text(), text()).prop_map(|(code, message)| Message::Error { code, message }),
        text().prop_map(|reason| Message::Bye { reason }),
    ]
}

fn tensors(msg: &Message) -> Vec<&WireTensor> {
    match msg {
        Message::PrefillChunk { residual, .. } => vec![residual],
        Message::ChunkState { kv, states, .. } => {
            kv.iter().chain(states).flat_map(|(a, b)| [a, b]).collect()
        }
        Message::KvAppend { k, v, .. } | Message::KvRows { k, v, .. } => vec![k, v],
        Message::AttnQuery { q, .. } => vec![q],
        Message::AttnPartials { o, m, l, .. } => vec![o, m, l],
        _ => vec![],
    }
}

/// What `decode` promises of a message it accepts; `Err` says which promise it broke.
fn trustworthy(msg: &Message) -> Result<(), String> {
    for t in tensors(msg) {
        let elems = t
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("shape {:?} overflows", t.shape))?;
        let ty = t.dtype();
        let whole = ty.block() == 1 || t.shape.last().is_some_and(|w| w % ty.block() == 0);
        let bytes = ty.checked_bytes(elems as u64);
        if t.shape.len() > 4 || !whole || bytes != Some(t.data.bytes.len() as u64) {
            return Err(format!(
                "shape {:?} of {} in {} bytes",
                t.shape,
                ty.name(),
                t.data.bytes.len()
            ));
        }
    }
    let rows = |k: &WireTensor, v: &WireTensor| k.shape.len() == 2 && k.shape == v.shape;
    let kv_rows: Vec<&WireTensor> = match msg {
        Message::ChunkState { kv, .. } => kv.iter().flat_map(|(k, v)| [k, v]).collect(),
        Message::KvAppend { k, v, .. } | Message::KvRows { k, v, .. } => vec![k, v],
        _ => vec![],
    };
    if let Some(t) = tensors(msg)
        .into_iter()
        .find(|t| t.dtype() != KvType::F32 && !kv_rows.iter().any(|r| std::ptr::eq(*r, *t)))
    {
        return Err(format!(
            "a value tensor of {} was accepted",
            t.dtype().name()
        ));
    }
    let ok = match msg {
        Message::PrefillChunk { residual, .. } => residual.shape.len() == 2,
        Message::ChunkState {
            kv_layers,
            kv,
            delta_layers,
            states,
            ..
        } => {
            kv.len() == kv_layers.len()
                && states.len() == delta_layers.len()
                && kv.iter().all(|(k, v)| rows(k, v))
        }
        Message::KvAppend { k, v, .. } | Message::KvRows { k, v, .. } => rows(k, v),
        Message::AttnQuery { positions, q, .. } => {
            q.shape.len() == 3 && q.shape[0] == positions.len()
        }
        Message::AttnPartials {
            page_starts,
            o,
            m,
            l,
            ..
        } => {
            o.shape.len() == 3
                && o.shape[0] == page_starts.len()
                && m.shape == o.shape[..2]
                && l.shape == o.shape[..2]
        }
        _ => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("tensors break the message's shape rules: {msg:?}"))
    }
}

/// Equality that holds for NaN values too (their bit patterns may not survive f16).
fn same(a: &Message, b: &Message) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

/// Checks an accepted frame: its request id is the header's, it keeps decode's promises, and
/// it encodes to a frame that decodes to the same message.
fn check_accepted(frame: &[u8], req: u32, msg: &Message) -> Result<(), TestCaseError> {
    prop_assert_eq!(Some(req), request_id(frame));
    trustworthy(msg).map_err(TestCaseError::fail)?;
    let again = encode(req, msg);
    let (req2, msg2) = decode(&again, usize::MAX)
        .map_err(|e| TestCaseError::fail(format!("re-encoded {msg:?} does not decode: {e}")))?;
    prop_assert_eq!(req2, req);
    prop_assert!(same(&msg2, msg), "{:?} came back as {:?}", msg, msg2);
    Ok(())
}

/// `request_id` as the header layout defines it.
fn header_id(frame: &[u8]) -> Option<u32> {
    (frame.len() >= HEADER_LEN && frame[..2] == MAGIC)
        .then(|| u32::from_le_bytes(frame[4..8].try_into().unwrap()))
}

/// A frame with a valid header of type `code` around `meta` and `data`; `lens` overrides the
/// declared metadata and data lengths.
fn frame(code: u8, req: u32, meta: &[u8], data: &[u8], lens: Option<(u32, u32)>) -> Vec<u8> {
    let (m, d) = lens.unwrap_or((meta.len() as u32, data.len() as u32));
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&[PROTOCOL_VERSION, code]);
    f.extend_from_slice(&req.to_le_bytes());
    f.extend_from_slice(&m.to_le_bytes());
    f.extend_from_slice(&d.to_le_bytes());
    f.extend_from_slice(meta);
    f.extend_from_slice(data);
    f
}

fn meta_of(frame: &[u8]) -> (Value, &[u8]) {
    let meta_len = u32::from_le_bytes(frame[8..12].try_into().unwrap()) as usize;
    let meta = serde_json::from_slice(&frame[HEADER_LEN..HEADER_LEN + meta_len]).unwrap();
    (meta, &frame[HEADER_LEN + meta_len..])
}

/// Any JSON value, nested a few levels.
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        // Shape-like numbers: zero, small, and past every limit.
        prop_oneof![
            Just(0u64),
            1..8u64,
            Just(u32::MAX as u64 + 1),
            Just(u64::MAX)
        ]
        .prop_map(Value::from),
        text().prop_map(Value::from),
        prop_oneof![Just("f32"), Just("f16"), Just("bf16")].prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A metadata key: one the decoder looks for, most of the time.
fn key() -> impl Strategy<Value = String> {
    const KEYS: &[&str] = &[
        "seq",
        "pos",
        "want_state",
        "kv_layers",
        "delta_layers",
        "layer",
        "start",
        "len",
        "positions",
        "end",
        "page_starts",
        "nonce",
        "code",
        "message",
        "reason",
        "counters",
        "tensors",
        "dtype",
        "shape",
        "version",
        "model",
        "model_digest",
        "role",
        "mem_offer",
        "backends",
        "max_frame",
        "first_layer",
        "end_layer",
        "page_size",
    ];
    prop_oneof![
        4 => proptest::sample::select(KEYS).prop_map(str::to_string),
        1 => text(),
    ]
}

/// A change to a valid frame's metadata, kept valid JSON (the header's lengths follow).
#[derive(Clone, Debug)]
enum MetaEdit {
    /// Set a key (one the message has, most of the time) to any value.
    Set(String, Value),
    Remove(String),
    /// Give tensor `i` (modulo their number) another shape, with any dimensions.
    Shape(usize, Vec<u64>),
    /// Give tensor `i` another dtype.
    Dtype(usize, Value),
    /// Give tensor `i` a shape of the same size: its dimensions reversed (or not), then
    /// `ones` dimensions of 1 added (so the data still fits, and only the shape rules can
    /// refuse it).
    Reshape(usize, bool, usize),
}

fn meta_edit() -> impl Strategy<Value = MetaEdit> {
    let dim = prop_oneof![
        0..6u64,
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 62),
        Just(u64::MAX),
        any::<u64>()
    ];
    prop_oneof![
        3 => (key(), arb_json()).prop_map(|(k, v)| MetaEdit::Set(k, v)),
        1 => key().prop_map(MetaEdit::Remove),
        3 => (any::<usize>(), proptest::collection::vec(dim, 0..6))
            .prop_map(|(i, s)| MetaEdit::Shape(i, s)),
        1 => (any::<usize>(), arb_json()).prop_map(|(i, d)| MetaEdit::Dtype(i, d)),
        3 => (any::<usize>(), any::<bool>(), 0..4usize)
            .prop_map(|(i, rev, ones)| MetaEdit::Reshape(i, rev, ones)),
    ]
}

/// Tensor description `i` (modulo their number) of a metadata object.
fn nth_tensor(map: &mut serde_json::Map<String, Value>, i: usize) -> Option<&mut Value> {
    let list = map.get_mut("tensors")?.as_array_mut()?;
    let n = list.len();
    list.get_mut(i % n.max(1))
}

impl MetaEdit {
    fn apply(&self, meta: &mut Value) {
        let Value::Object(map) = meta else {
            unreachable!("encode writes an object")
        };
        match self {
            MetaEdit::Set(k, v) => {
                map.insert(k.clone(), v.clone());
            }
            MetaEdit::Remove(k) => {
                map.remove(k);
            }
            MetaEdit::Shape(i, shape) => {
                if let Some(Value::Object(t)) = nth_tensor(map, *i) {
                    t.insert("shape".into(), Value::from(shape.clone()));
                }
            }
            MetaEdit::Dtype(i, d) => {
                if let Some(Value::Object(t)) = nth_tensor(map, *i) {
                    t.insert("dtype".into(), d.clone());
                }
            }
            MetaEdit::Reshape(i, rev, ones) => {
                if let Some(Value::Array(shape)) =
                    nth_tensor(map, *i).and_then(|t| t.get_mut("shape"))
                {
                    if *rev {
                        shape.reverse();
                    }
                    shape.extend(std::iter::repeat_n(Value::from(1), *ones));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(2048))]

    /// A valid message survives encode and decode unchanged (NaN payloads aside), and its
    /// request id reads back from the header alone.
    #[test]
    fn valid_messages_round_trip(msg in arb_message(), req in any::<u32>()) {
        let frame = encode(req, &msg);
        prop_assert_eq!(request_id(&frame), Some(req));
        let (req2, back) = decode(&frame, frame.len())
            .map_err(|e| TestCaseError::fail(format!("{msg:?}: {e}")))?;
        prop_assert_eq!(req2, req);
        prop_assert!(same(&back, &msg), "{:?} came back as {:?}", msg, back);
        // The limit is inclusive, and checked first.
        prop_assert_eq!(
            decode(&frame, frame.len() - 1),
            Err(ProtocolError::TooLarge { len: frame.len(), limit: frame.len() - 1 })
        );
    }

    /// Random bytes: an error (or, rarely, a message that keeps every promise).
    #[test]
    fn random_bytes_are_refused_or_trustworthy(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
        magic in any::<bool>(),
        code in any::<u8>(),
    ) {
        let mut bytes = bytes;
        // Half the time past the magic, version and type checks, to reach the lengths.
        if magic && bytes.len() >= 4 {
            bytes[..2].copy_from_slice(&MAGIC);
            bytes[2] = PROTOCOL_VERSION;
            bytes[3] = code % (MsgType::ALL.len() as u8 + 2);
        }
        prop_assert_eq!(request_id(&bytes), header_id(&bytes));
        match decode(&bytes, LIMIT) {
            Ok((req, msg)) => check_accepted(&bytes, req, &msg)?,
            Err(ProtocolError::Truncated { need, have }) => {
                prop_assert_eq!(have, bytes.len());
                prop_assert!(need > have);
            }
            Err(_) => {}
        }
    }

    /// A valid frame with bytes flipped, cut or added: refused, or trustworthy.
    #[test]
    fn mutated_frames_are_refused_or_trustworthy(
        msg in arb_message(),
        edits in proptest::collection::vec(mutation(), 1..4),
    ) {
        let original = encode(7, &msg);
        let mut f = original.clone();
        for e in &edits {
            e.apply(&mut f);
        }
        let res = decode(&f, LIMIT);
        // A frame whose header is intact but whose length is not the one it declares.
        let header_intact = f.len() >= HEADER_LEN && f[..HEADER_LEN] == original[..HEADER_LEN];
        if header_intact && f.len() != original.len() {
            prop_assert!(
                res.is_err(),
                "a frame of {} bytes declaring {} was accepted",
                f.len(),
                original.len()
            );
        }
        if let Ok((req, msg)) = res {
            check_accepted(&f, req, &msg)?;
        }
    }

    /// The header's lengths say anything: larger or smaller than the frame, past the limit,
    /// past `usize` on 32 bits.
    #[test]
    fn declared_lengths_must_match_the_frame(
        msg in arb_message(),
        meta_len in prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>(), 0..64u32],
        data_len in prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>(), 0..64u32],
    ) {
        let f = encode(3, &msg);
        let (meta, data) = meta_of(&f);
        let meta = serde_json::to_vec(&meta).unwrap();
        let bad = frame(f[3], 3, &meta, data, Some((meta_len, data_len)));
        let need = HEADER_LEN as u64 + meta_len as u64 + data_len as u64;
        let res = decode(&bad, LIMIT);
        if need != bad.len() as u64 {
            prop_assert!(
                matches!(
                    res,
                    Err(ProtocolError::Truncated { .. } | ProtocolError::TrailingBytes { .. })
                ),
                "declared {need} bytes in a frame of {}: {res:?}", bad.len()
            );
        } else if let Ok((req, msg)) = res {
            check_accepted(&bad, req, &msg)?;
        }
    }

    /// Valid JSON that is the wrong metadata: wrong types, missing or extra fields, tensor
    /// shapes and dtypes that do not match the data.
    #[test]
    fn edited_metadata_is_refused_or_trustworthy(
        msg in arb_message(),
        edits in proptest::collection::vec(meta_edit(), 1..4),
        extra in prop_oneof![
            3 => Just(Vec::new()),
            1 => proptest::collection::vec(any::<u8>(), 1..3),
        ],
    ) {
        let f = encode(11, &msg);
        let (mut meta, data) = meta_of(&f);
        for e in &edits {
            e.apply(&mut meta);
        }
        let mut data = data.to_vec();
        data.extend_from_slice(&extra);
        let bad = frame(f[3], 11, &serde_json::to_vec(&meta).unwrap(), &data, None);
        if let Ok((req, msg)) = decode(&bad, LIMIT) {
            check_accepted(&bad, req, &msg)?;
        }
    }

    /// Any JSON at all as the metadata of any message type, with data behind it.
    #[test]
    fn any_metadata_is_refused_or_trustworthy(
        code in 0..=(MsgType::ALL.len() as u8 + 1),
        meta in arb_json(),
        data in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let f = frame(code, 5, &serde_json::to_vec(&meta).unwrap(), &data, None);
        match decode(&f, LIMIT) {
            Ok((req, msg)) => check_accepted(&f, req, &msg)?,
            Err(ProtocolError::UnknownType(c)) => prop_assert!(MsgType::from_code(c).is_none()),
            Err(_) => {}
        }
    }
}

/// A device kind for a generated intro.
fn device_kind(helper: bool) -> String {
    if helper { "phone" } else { "native" }.into()
}
