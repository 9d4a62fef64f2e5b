//! The wire protocol: every message survives a round trip, and no malformed frame panics or
//! allocates by a length it announces.

use engine_core::cache_types::{CacheTypes, Encoded, KvType};
use engine_core::protocol::{
    decode, encode, Configure, Intro, Message, MsgType, ProtocolError, Role, WireTensor, HEADER_LEN,
};
use proptest::prelude::*;

const LIMIT: usize = 1 << 24;

/// A tensor of `shape` in `ty` (a compact type's last dimension is whole blocks): values
/// encoded as a page or a link would.
fn tensor(ty: KvType, shape: Vec<usize>, seed: u32) -> WireTensor {
    let n = shape.iter().product::<usize>();
    let data: Vec<f32> = (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .collect();
    WireTensor::new(shape, Encoded::of(ty, &data))
}

fn arb_kv_type() -> impl Strategy<Value = KvType> {
    proptest::sample::select(KvType::ALL.to_vec())
}

fn arb_message() -> impl Strategy<Value = Message> {
    let intro =
        (any::<u64>(), any::<bool>(), "[a-z0-9]{0,16}").prop_map(|(mem, helper, fp)| Intro {
            version: 1,
            model: format!("model {fp}"),
            model_digest: fp,
            role: if helper { Role::Helper } else { Role::Host },
            mem_offer: mem,
            backends: vec!["cpu".into()],
            max_frame: 1 << 20,
            device: if helper { "tab" } else { "native" }.into(),
        });
    prop_oneof![
        intro.clone().prop_map(Message::Hello),
        intro.prop_map(Message::Welcome),
        (any::<(u32, u32, u32)>(), arb_kv_type(), arb_kv_type()).prop_map(|((a, b, c), k, v)| {
            Message::Configure(Configure {
                first_layer: a,
                end_layer: b,
                page_size: c,
                kv_types: CacheTypes { k, v },
            })
        }),
        (
            any::<u64>(),
            any::<u64>(),
            1..5usize,
            1..9usize,
            any::<u32>()
        )
            .prop_map(|(seq, pos, rows, w, s)| Message::PrefillChunk {
                seq,
                pos,
                want_state: seq % 2 == 0,
                residual: tensor(KvType::F32, vec![rows, w], s)
            }),
        (any::<u64>(), 0..3usize, 0..3usize, 1..4usize, any::<u32>()).prop_map(
            |(seq, nkv, nd, rows, s)| {
                Message::ChunkState {
                    seq,
                    pos: 7,
                    kv_layers: (0..nkv as u32).collect(),
                    kv: (0..nkv)
                        .map(|i| {
                            (
                                tensor(KvType::Q8_0, vec![rows, 32], s + i as u32),
                                tensor(KvType::F16, vec![rows, 32], s),
                            )
                        })
                        .collect(),
                    delta_layers: (0..nd as u32).map(|x| x + 10).collect(),
                    states: (0..nd)
                        .map(|i| {
                            (
                                tensor(KvType::F32, vec![2, 3, 3], s ^ i as u32),
                                tensor(KvType::F32, vec![3, 5], s),
                            )
                        })
                        .collect(),
                }
            }
        ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            1..6usize,
            any::<u32>(),
            any::<bool>(),
            arb_kv_type(),
            arb_kv_type(),
        )
            .prop_map(|(seq, layer, start, rows, s, append, kt, vt)| {
                let (k, v) = (
                    tensor(kt, vec![rows, 64], s),
                    tensor(vt, vec![rows, 64], !s),
                );
                if append {
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
            }),
        (any::<u64>(), any::<u64>()).prop_map(|(seq, len)| Message::KvTruncate { seq, len }),
        (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(seq, layer, start, len)| Message::KvFetch {
                seq,
                layer,
                start,
                len
            }
        ),
        (
            any::<u64>(),
            any::<u32>(),
            proptest::collection::vec(any::<u64>(), 1..4),
            any::<u32>()
        )
            .prop_map(|(seq, layer, positions, s)| {
                let q = tensor(KvType::F32, vec![positions.len(), 2, 4], s);
                Message::AttnQuery {
                    seq,
                    layer,
                    positions,
                    end: 64,
                    q,
                }
            }),
        (any::<u64>(), 1..4usize, 1..5usize, any::<u32>()).prop_map(|(seq, pages, rows, s)| {
            Message::AttnPartials {
                seq,
                layer: 3,
                page_starts: (0..pages as u64).map(|p| p * 64).collect(),
                o: tensor(KvType::F32, vec![pages, rows, 4], s),
                m: tensor(KvType::F32, vec![pages, rows], s + 1),
                l: tensor(KvType::F32, vec![pages, rows], s + 2),
            }
        }),
        proptest::collection::btree_map("[a-z_]{1,8}", any::<u64>(), 0..4).prop_map(Message::Stats),
        any::<u64>().prop_map(|nonce| Message::Ping { nonce }),
        any::<u64>().prop_map(|nonce| Message::Pong { nonce }),
        Just(Message::Ack),
        // Printable text (no control or format characters): a peer's other text is decoded
        // escaped (a_peers_text_is_decoded_printable).
        ("[a-z_]{1,8}", "\\PC{0,20}").prop_map(|(code, message)| Message::Error { code, message }),
        "\\PC{0,20}".prop_map(|reason| Message::Bye { reason }),
    ]
}

proptest! {
    #[test]
    fn every_message_round_trips(msg in arb_message(), req in any::<u32>()) {
        let frame = encode(req, &msg);
        prop_assert_eq!(decode(&frame, LIMIT), Ok((req, msg)));
    }

    /// Whatever bytes arrive, decoding returns (an error), it never panics.
    #[test]
    fn mutated_frames_never_panic(msg in arb_message(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut frame = encode(1, &msg);
        for (at, byte) in flips {
            let i = at % frame.len();
            frame[i] ^= byte;
        }
        let _ = decode(&frame, LIMIT);
    }

    #[test]
    fn every_truncation_is_an_error(msg in arb_message()) {
        let frame = encode(9, &msg);
        for cut in 0..frame.len() {
            prop_assert!(decode(&frame[..cut], LIMIT).is_err());
        }
    }
}

fn kv_append() -> Vec<u8> {
    encode(
        5,
        &Message::KvAppend {
            seq: 1,
            layer: 3,
            start: 0,
            k: tensor(KvType::F32, vec![2, 4], 1),
            v: tensor(KvType::F32, vec![2, 4], 2),
        },
    )
}

/// Rewrite a frame's metadata (keeping its data section) and fix the header's lengths.
fn with_meta(frame: &[u8], edit: impl Fn(&mut serde_json::Value)) -> Vec<u8> {
    let meta_len = u32::from_le_bytes(frame[8..12].try_into().unwrap()) as usize;
    let mut meta: serde_json::Value =
        serde_json::from_slice(&frame[HEADER_LEN..HEADER_LEN + meta_len]).unwrap();
    edit(&mut meta);
    let meta = serde_json::to_vec(&meta).unwrap();
    let mut out = frame[..HEADER_LEN].to_vec();
    out[8..12].copy_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(&meta);
    out.extend_from_slice(&frame[HEADER_LEN + meta_len..]);
    out
}

#[test]
fn oversized_frame_is_refused_before_decoding() {
    let frame = kv_append();
    assert_eq!(
        decode(&frame, 40),
        Err(ProtocolError::TooLarge {
            len: frame.len(),
            limit: 40
        })
    );
}

#[test]
fn header_problems_are_named() {
    let frame = kv_append();
    let mut bad = frame.clone();
    bad[0] = b'X';
    assert_eq!(decode(&bad, LIMIT), Err(ProtocolError::BadMagic));
    let mut bad = frame.clone();
    bad[2] = 9;
    assert_eq!(decode(&bad, LIMIT), Err(ProtocolError::Version { got: 9 }));
    let mut bad = frame.clone();
    bad[3] = 200;
    assert_eq!(decode(&bad, LIMIT), Err(ProtocolError::UnknownType(200)));
    let mut bad = frame.clone();
    bad.push(0);
    assert_eq!(
        decode(&bad, LIMIT),
        Err(ProtocolError::TrailingBytes { extra: 1 })
    );
}

#[test]
fn a_huge_declared_shape_is_an_error_not_an_allocation() {
    let bad = with_meta(&kv_append(), |m| {
        m["tensors"][0]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 30])
    });
    let err = decode(&bad, LIMIT).unwrap_err().to_string();
    assert!(err.contains("does not fit"), "{err}");
}

/// A compact row must be whole blocks: 2 rows of 16 q8_0 values (whose 32 bytes of data
/// would be one block's worth and more) are refused, not read as a block split in two.
#[test]
fn compact_rows_that_end_inside_a_block_are_an_error() {
    let bad = with_meta(&kv_append(), |m| {
        m["tensors"][0]["dtype"] = "q8_0".into();
        m["tensors"][0]["shape"] = serde_json::json!([2, 16]);
    });
    let err = decode(&bad, LIMIT).unwrap_err().to_string();
    assert!(err.contains("is not whole q8_0 blocks"), "{err}");
}

#[test]
fn wrong_dtype_is_an_error() {
    let bad = with_meta(&kv_append(), |m| m["tensors"][0]["dtype"] = "f64".into());
    let err = decode(&bad, LIMIT).unwrap_err();
    assert!(
        matches!(
            err,
            ProtocolError::Meta {
                msg: MsgType::KvAppend,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn tensors_must_match_the_message() {
    // k and v of different shapes.
    let bad = with_meta(&kv_append(), |m| {
        m["tensors"][0]["shape"] = serde_json::json!([4, 2]);
    });
    assert!(decode(&bad, LIMIT)
        .unwrap_err()
        .to_string()
        .contains("k and v"));
    // Data bytes that no tensor describes.
    let bad = with_meta(&kv_append(), |m| {
        m["tensors"][1]["shape"] = serde_json::json!([1, 4]);
    });
    assert!(decode(&bad, LIMIT)
        .unwrap_err()
        .to_string()
        .contains("not described"));
    // A query whose row count differs from its positions.
    let q = encode(
        1,
        &Message::AttnQuery {
            seq: 0,
            layer: 3,
            positions: vec![1, 2],
            end: 0,
            q: tensor(KvType::F32, vec![2, 2, 4], 0),
        },
    );
    let bad = with_meta(&q, |m| m["positions"] = serde_json::json!([1]));
    assert!(decode(&bad, LIMIT)
        .unwrap_err()
        .to_string()
        .contains("positions"));
    // Values travel as f32: a compact query is refused whole.
    let q16 = encode(
        1,
        &Message::AttnQuery {
            seq: 0,
            layer: 3,
            positions: vec![1, 2],
            end: 0,
            q: tensor(KvType::F16, vec![2, 2, 4], 0),
        },
    );
    assert!(decode(&q16, LIMIT)
        .unwrap_err()
        .to_string()
        .contains("values travel as f32, got a tensor of f16"));
}

/// A peer's text (an error's message, a model name, a stats key) is decoded printable: escape
/// codes and newlines come out as `\u{..}`, so printing it cannot draw on a terminal.
#[test]
fn a_peers_text_is_decoded_printable() {
    let sent = Message::error("busy", "no\n\x1b[2K\rpairing code: 111-111");
    let (_, got) = decode(&encode(7, &sent), LIMIT).unwrap();
    assert_eq!(
        got,
        Message::error("busy", "no\\u{a}\\u{1b}[2K\\u{d}pairing code: 111-111")
    );
    let stats = Message::Stats([("a\x1bb".to_string(), 1u64)].into_iter().collect());
    let long = Message::Bye {
        reason: "\x1b".repeat(5000),
    };
    let (_, got) = decode(&encode(7, &long), LIMIT).unwrap();
    let Message::Bye { reason } = got else {
        panic!("{got:?}")
    };
    assert!(
        reason.starts_with("\\u{1b}") && reason.len() < 5000,
        "{reason}"
    );
    let (_, got) = decode(&encode(7, &stats), LIMIT).unwrap();
    assert_eq!(
        got,
        Message::Stats([("a\\u{1b}b".to_string(), 1u64)].into_iter().collect())
    );
}
