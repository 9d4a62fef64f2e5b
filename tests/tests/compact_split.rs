//! Compact KV pages across a split: with the same cache types on both sides, a host that
//! moves pages to a helper (and its page file), runs its prefill split with the helper and
//! rewinds into a page that left gets the host alone's logits bit for bit, at every type. The
//! pages cross the link and reach the disk as the bytes they are stored in, and a helper
//! refuses rows of another type or types it cannot hold.

use engine_core::backend::{CacheTypes, KvType};
use engine_core::helper::{Helper, HelperOptions};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::split::prefill;
use engine_core::host::Sequence;
use engine_core::link::{pair, Link};
use engine_core::protocol::{decode, encode, Configure, Message, WireTensor};
use engine_core::{CpuBackend, Logits, Model};
use tests::{attach, fixtures_dir, page_file, spawn_helper, tiny256};

const PAGE: usize = 8;
const BUDGET: usize = 16;

fn types(k: KvType, v: KvType) -> CacheTypes {
    CacheTypes { k, v }
}

/// A first prompt, a checkpoint inside a page, a second prompt (split with the helper, if
/// one is attached) and greedy steps, then a rewind to the checkpoint (whose page has left
/// the host by then) and other steps from there: every logit seen, and the positions that
/// had left the host when it rewound.
fn session(m: &Model, st: &mut Sequence, prompt: &[u32]) -> (Vec<f32>, usize) {
    let be = &CpuBackend;
    let plan = tests::conversation_plan();
    let (first, _) = prefill(m, be, st, &prompt[..43], &plan).unwrap();
    let cp = st.state.checkpoint(be);
    let (mut logits, _) = prefill(m, be, st, &prompt[43..], &plan).unwrap();
    let mut all = [first.clone(), logits.clone()].concat();
    let mut step = |st: &mut Sequence, logits: &mut Vec<f32>, bump: u32| {
        let next = (engine_core::generate::argmax(logits) + bump) % 1024;
        *logits = st.forward(m, be, &[next], Logits::Last, None).unwrap();
        all.extend_from_slice(logits);
    };
    for _ in 0..6 {
        step(st, &mut logits, 0);
    }
    let left = st.state.remote_kv_len();
    st.rewind(be, &cp).unwrap();
    logits = first;
    for _ in 0..6 {
        step(st, &mut logits, 1);
    }
    (all, left)
}

#[test]
fn a_split_with_compact_pages_is_bit_identical_to_the_host_alone() {
    let m = tiny256();
    let prompt: Vec<u32> = (0..100).map(|i| (i * 37 + 11) % 1024).collect();
    let be = &CpuBackend;
    // Every compact type as keys and as values, with and without a page file.
    for (types, disk) in [
        (types(KvType::Q8_0, KvType::Q8_0), true),
        (types(KvType::Q4_0, KvType::F16), false),
        (types(KvType::F16, KvType::Q4_0), true),
    ] {
        let fresh = || Sequence::typed(&m.config, PAGE, types, be).unwrap();
        let (alone, _) = session(&m, &mut fresh(), &prompt);
        std::thread::scope(|scope| {
            let mut st = fresh();
            // Rows a rewind needs back come from the page file, else from the helper.
            st.placement.spill = disk.then(page_file);
            // The helper runs every layer of the split prefill and holds pages past 16.
            attach(
                &m,
                &mut st,
                spawn_helper(scope, &m, be),
                0,
                PAGE,
                Some(BUDGET),
            );
            let (got, left) = session(&m, &mut st, &prompt);
            assert!(
                left > 43,
                "{types}: the checkpoint's page had not left the host"
            );
            assert!(
                st.placement.helper_lost.is_none(),
                "{types}: the helper was lost"
            );
            assert!(
                got == alone,
                "{types}: split logits differ from the host alone's"
            );
        });
    }
}

/// A pages-only helper on a link that carries frames as bytes: what crosses for one page is
/// the page's stored bytes (a compact page costs its compact size on the wire).
#[test]
fn a_page_crosses_the_link_as_its_stored_bytes() {
    let m = tiny256();
    let be = &CpuBackend;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 1024).collect();
    let width = m.config.num_key_value_heads * m.config.head_dim;
    for ty in [KvType::F32, KvType::F16, KvType::Q8_0, KvType::Q4_0] {
        let types = types(ty, KvType::Q4_0);
        let mut host = Sequence::typed(&m.config, PAGE, types, be).unwrap();
        host.forward(&m, be, &prompt, Logits::Last, None).unwrap();
        let engine_core::model::LayerState::Attention(kv) = &host.state.layers[3] else {
            panic!("layer 3 is full attention")
        };
        let (k, v) = pollster::block_on(kv.rows(be, 0, PAGE).unwrap());
        assert_eq!(k.bytes.len(), PAGE * ty.row_bytes(width));
        let msg = Message::KvAppend {
            seq: 0,
            layer: 3,
            start: 0,
            k: WireTensor::new(vec![PAGE, width], k.clone()),
            v: WireTensor::new(vec![PAGE, width], v.clone()),
        };
        let frame = encode(1, &msg);
        let tensor_bytes = k.bytes.len() + v.bytes.len();
        assert!(
            frame.len() < tensor_bytes + 400,
            "{types}: {} bytes",
            frame.len()
        );
        let (_, back) = decode(&frame, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(back, msg, "{types}: the page round-trips byte for byte");
    }
}

/// One request to a helper session on `link`, its reply.
fn ask(link: &mut impl Link, req: u32, msg: Message) -> Message {
    link.send(encode(req, &msg)).unwrap();
    let frame = link.recv().unwrap();
    decode(&frame, DEFAULT_MAX_FRAME).unwrap().1
}

/// A helper configured for some types refuses rows of others and leaves what it holds as it
/// was; one asked to hold a type its model's heads cannot take refuses the configuration.
#[test]
fn a_helper_refuses_rows_and_types_it_cannot_hold() {
    let m = tiny256();
    let width = m.config.num_key_value_heads * m.config.head_dim;
    let opts = HelperOptions {
        mem_budget: 1 << 30,
        max_frame: DEFAULT_MAX_FRAME,
    };
    std::thread::scope(|scope| {
        let (mut host, mut helper_end) = pair();
        let m = &m;
        scope.spawn(move || Helper::new(m, &CpuBackend, opts).serve(&mut helper_end));
        let hello = engine_core::host::remote::hello(m, DEFAULT_MAX_FRAME);
        assert!(matches!(ask(&mut host, 1, hello), Message::Welcome(_)));
        let cfg = Configure {
            first_layer: 4,
            end_layer: 4,
            page_size: PAGE as u32,
            kv_types: types(KvType::Q8_0, KvType::F16),
        };
        assert_eq!(ask(&mut host, 2, Message::Configure(cfg)), Message::Ack);
        let rows = |ty: KvType| {
            let x: Vec<f32> = (0..PAGE * width).map(|i| (i as f32).sin()).collect();
            WireTensor::new(
                vec![PAGE, width],
                engine_core::cache_types::Encoded::of(ty, &x),
            )
        };
        let append = |k, v| Message::KvAppend {
            seq: 0,
            layer: 3,
            start: 0,
            k,
            v,
        };
        match ask(&mut host, 3, append(rows(KvType::F16), rows(KvType::F16))) {
            Message::Error { code, message } => assert!(
                code == "shape" && message.contains("configured for K q8_0 / V f16"),
                "{code}: {message}"
            ),
            other => panic!("{other:?}"),
        }
        let fetch = Message::KvFetch {
            seq: 0,
            layer: 3,
            start: 0,
            len: 1,
        };
        assert!(matches!(
            ask(&mut host, 4, fetch.clone()),
            Message::Error { .. }
        ));
        let good = append(rows(KvType::Q8_0), rows(KvType::F16));
        assert_eq!(ask(&mut host, 5, good.clone()), Message::Ack);
        match (ask(&mut host, 6, fetch), good) {
            (Message::KvRows { k, .. }, Message::KvAppend { k: sent, .. }) => {
                assert_eq!(k.data.ty, KvType::Q8_0);
                assert_eq!(k.data.bytes[..], sent.data.bytes[..k.data.bytes.len()]);
            }
            (other, _) => panic!("{other:?}"),
        }
        drop(host);
    });
    // The fixtures' tiny model has heads of 16 values: not whole q4_0 blocks.
    let tiny = Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap();
    std::thread::scope(|scope| {
        let link = spawn_helper(scope, &tiny, &CpuBackend);
        let cfg = Configure {
            first_layer: 8,
            end_layer: 8,
            page_size: PAGE as u32,
            kv_types: types(KvType::F16, KvType::Q4_0),
        };
        let err = HelperClient::connect(Box::new(link), &tiny, cfg, DEFAULT_MAX_FRAME)
            .err()
            .expect("the helper refuses the types")
            .to_string();
        assert!(err.contains("not whole 32-value blocks of q4_0"), "{err}");
    });
}
