//! KV-page offload: a host with a small KV budget moves its oldest pages to a helper and gets
//! the same tokens, and bit-identical logits, as the host alone.

use engine_core::helper::{Helper, HelperOptions, SessionEnd};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::Sequence;
use engine_core::link::{pair, Link};
use engine_core::protocol::{
    decode, encode, Configure, Intro, Message, Role, WireTensor, PROTOCOL_VERSION,
};
use engine_core::{CpuBackend, LayerKind, Logits, Model};
use tests::{attach, fixtures_dir, Reference};

fn model(fixture: &str) -> Model {
    Model::load_dir(&fixtures_dir().join(fixture)).unwrap()
}

fn opts() -> HelperOptions {
    HelperOptions {
        mem_budget: 1 << 30,
        max_frame: DEFAULT_MAX_FRAME,
    }
}

/// Prompt, then greedy decode of `n` tokens; with `budget`, pages past it go to a helper on
/// an in-memory link. Returns every step's logits (last prompt row first) and the ids.
fn run(
    m: &Model,
    prompt: &[u32],
    n: usize,
    page: usize,
    budget: Option<usize>,
    ubatch: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, page);
        if budget.is_some() {
            let (host_end, mut helper_end) = pair();
            scope.spawn(move || Helper::new(m, &CpuBackend, opts()).serve(&mut helper_end));
            // No layers on the helper: pages only.
            attach(
                m,
                &mut st,
                host_end,
                m.config.num_hidden_layers,
                page,
                budget,
            );
        }
        let mut logits = Vec::new();
        for chunk in prompt.chunks(ubatch) {
            logits = st
                .forward(m, &CpuBackend, chunk, Logits::Last, None)
                .unwrap();
        }
        let (mut all, mut ids) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let next = engine_core::generate::argmax(&logits);
            all.push(logits.clone());
            ids.push(next);
            logits = st
                .forward(m, &CpuBackend, &[next], Logits::Last, None)
                .unwrap();
        }
        if budget.is_some() {
            assert!(
                st.state.remote_kv_len() > 0,
                "the budget never pushed a page to the helper"
            );
        }
        drop(st); // closes the link, ending the helper's session
        (all, ids)
    })
}

#[test]
fn offloaded_pages_give_bit_identical_logits_and_reference_tokens() {
    for fixture in ["tiny_fp32", "tiny_fp32_T150"] {
        let m = model(fixture);
        let r = Reference::load(fixture);
        let prompt = r.ids("prompt_ids");
        let want = r.ids("gen_ids");
        for (page, budget, ubatch) in [(8, 16, 64), (7, 7, 5), (16, 32, 64), (1, 3, 32)] {
            let (host_logits, host_ids) = run(&m, &prompt, want.len(), page, None, ubatch);
            let (split_logits, split_ids) =
                run(&m, &prompt, want.len(), page, Some(budget), ubatch);
            assert_eq!(host_ids, want, "{fixture}: host alone");
            assert_eq!(
                split_ids, want,
                "{fixture} page {page} budget {budget} ubatch {ubatch}"
            );
            assert!(
                host_logits == split_logits,
                "{fixture} page {page} budget {budget}: logits not bit-identical"
            );
        }
    }
}

#[test]
fn helper_refuses_a_host_with_another_model() {
    let m = model("tiny_fp32");
    let other = model("tiny_bf16");
    std::thread::scope(|scope| {
        let (host_end, mut helper_end) = pair();
        let h = scope.spawn(move || Helper::new(&m, &CpuBackend, opts()).serve(&mut helper_end));
        let cfg = Configure {
            first_layer: 0,
            end_layer: 0,
            page_size: 4,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        let err = HelperClient::connect(Box::new(host_end), &other, cfg, DEFAULT_MAX_FRAME)
            .err()
            .unwrap()
            .to_string();
        // Both models by name: the fixtures' directories.
        assert!(
            err.contains("different model")
                && err.contains("tiny_fp32 here")
                && err.contains("tiny_bf16 on the host"),
            "{err}"
        );
        assert!(matches!(h.join().unwrap(), SessionEnd::Refused(e) if e.starts_with("model")));
    });
}

/// Sends `msg` as request `req` over `host` and waits for the reply.
fn ask(host: &mut impl Link, req: u32, msg: Message) -> Message {
    host.send(encode(req, &msg)).unwrap();
    decode(&host.recv().unwrap(), 1 << 24).unwrap().1
}

/// The helper's budget covers DeltaNet state, and a sequence holds it only for the layers the
/// helper runs: a pages-only helper holds none; a new sequence must fit with its first page
/// (pages are allocated whole) and the chunk's working memory (a budget one byte short refuses
/// it and holds nothing); a helper running layers 4.. refuses a second sequence whose state
/// would not fit, naming the bytes, and the first goes on.
#[test]
fn the_helper_budget_counts_the_deltanet_state_of_its_own_layers_only() {
    let m = model("tiny_fp32");
    let c = &m.config;
    let (s_len, conv_len) = c.delta_state_len();
    let split = 4;
    let runs = split..c.num_hidden_layers;
    let delta_layers = runs
        .clone()
        .filter(|&l| c.layer_types[l] == LayerKind::LinearAttention)
        .count();
    let need = (delta_layers * (s_len + conv_len) * 4) as u64;
    let kv_row = (c.num_key_value_heads * c.head_dim * 2 * 4) as u64;
    let assigned = |first_layer: usize| Configure {
        first_layer: first_layer as u32,
        end_layer: c.num_hidden_layers as u32,
        page_size: 4,
        kv_types: engine_core::backend::CacheTypes::F32,
    };
    // A two-row chunk at 0 or 2 sees one page either way.
    let work = engine_core::helper::prefill_bytes(c, &assigned(split), 0, 2, true).1;
    let first = need + 4 * kv_row + work;
    let stats = |reply: Message| match reply {
        Message::Stats(s) => (s["kv_bytes"], s["delta_state_bytes"]),
        other => panic!("expected stats, got {other:?}"),
    };
    // (first layer the helper runs, its budget): pages only; a budget one byte short of a new
    // sequence's state, its first page and a chunk's working memory; room for one sequence
    // and two chunks in its first page.
    for (first_layer, mem_budget) in [
        (c.num_hidden_layers, need + 64 * kv_row),
        (split, first - 1),
        (split, first),
    ] {
        std::thread::scope(|scope| {
            let (mut host, mut helper_end) = pair();
            let mr = &m;
            let budget = HelperOptions {
                mem_budget,
                max_frame: DEFAULT_MAX_FRAME,
            };
            scope.spawn(move || Helper::new(mr, &CpuBackend, budget).serve(&mut helper_end));
            let mut ask = |req: u32, msg: Message| ask(&mut host, req, msg);
            assert!(matches!(
                ask(0, engine_core::host::remote::hello(&m, 1 << 20)),
                Message::Welcome(_)
            ));
            assert_eq!(
                ask(1, Message::Configure(assigned(first_layer))),
                Message::Ack
            );
            if first_layer == c.num_hidden_layers {
                let rows = WireTensor::f32(vec![4, 32], vec![0.5; 4 * 32]);
                let page = Message::KvAppend {
                    seq: 0,
                    layer: 3,
                    start: 0,
                    k: rows.clone(),
                    v: rows,
                };
                assert_eq!(ask(2, page), Message::Ack);
                assert_eq!(
                    stats(ask(3, Message::Stats(Default::default()))),
                    (4 * kv_row, 0)
                );
                return;
            }
            let chunk = |seq: u64, pos: u64| Message::PrefillChunk {
                seq,
                pos,
                want_state: true,
                residual: WireTensor::f32(vec![2, c.hidden_size], vec![0.1; 2 * c.hidden_size]),
            };
            if mem_budget < first {
                assert!(
                    matches!(ask(2, chunk(0, 0)), Message::Error { code, .. } if code == "memory")
                );
                assert_eq!(stats(ask(3, Message::Stats(Default::default()))), (0, 0));
                return;
            }
            assert!(matches!(ask(2, chunk(0, 0)), Message::ChunkState { .. }));
            // Layer 7's two new rows and layers 4-6's states.
            assert_eq!(
                stats(ask(3, Message::Stats(Default::default()))),
                (2 * kv_row, need)
            );
            match ask(4, chunk(1, 0)) {
                Message::Error { code, message } => {
                    assert_eq!(code, "memory", "{message}");
                    assert!(
                        message.contains(&format!("needs {need} bytes")),
                        "{message}"
                    );
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
            assert!(matches!(ask(5, chunk(0, 2)), Message::ChunkState { .. }));
            assert_eq!(
                stats(ask(6, Message::Stats(Default::default()))),
                (4 * kv_row, need)
            );
        });
    }
}

#[test]
fn bad_requests_get_errors_and_leave_state_intact_bad_frames_end_the_session() {
    let m = model("tiny_fp32");
    std::thread::scope(|scope| {
        let (mut host, mut helper_end) = pair();
        let mr = &m;
        let h = scope.spawn(move || Helper::new(mr, &CpuBackend, opts()).serve(&mut helper_end));
        let mut ask = |req: u32, msg: Message| ask(&mut host, req, msg);
        assert!(matches!(
            ask(0, engine_core::host::remote::hello(&m, 1 << 20)),
            Message::Welcome(_)
        ));
        let rows =
            |n: usize| engine_core::protocol::WireTensor::f32(vec![n, 32], vec![0.5; n * 32]);
        let append = |layer: u32, start: u64| Message::KvAppend {
            seq: 0,
            layer,
            start,
            k: rows(4),
            v: rows(4),
        };
        // Before Configure: refused, named.
        assert!(matches!(ask(1, append(3, 0)), Message::Error { code, .. } if code == "order"));
        let cfg = Configure {
            first_layer: 0,
            end_layer: 0,
            page_size: 4,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        assert_eq!(ask(2, Message::Configure(cfg)), Message::Ack);
        assert_eq!(ask(3, append(3, 0)), Message::Ack);
        // Layer 2 is a DeltaNet layer, layer 99 does not exist, position 6 is not a page start.
        for (req, (layer, start, code)) in
            [(2u32, 4u64, "layer"), (99, 4, "layer"), (3, 6, "shape")]
                .into_iter()
                .enumerate()
        {
            match ask(10 + req as u32, append(layer, start)) {
                Message::Error { code: c, message } => assert_eq!(c, code, "{message}"),
                other => panic!("expected an error, got {other:?}"),
            }
        }
        // The stored page is intact: a query over it still answers with one page.
        let q = engine_core::protocol::WireTensor::f32(vec![1, 4, 16], vec![0.1; 64]);
        match ask(
            20,
            Message::AttnQuery {
                seq: 0,
                layer: 3,
                positions: vec![5],
                end: 4,
                q,
            },
        ) {
            Message::AttnPartials { page_starts, .. } => assert_eq!(page_starts, vec![0]),
            other => panic!("{other:?}"),
        }
        // A helper holding some of the pages (others hold the rest): a page past a gap of
        // whole pages is taken, and a page into the gap fills it, in page order.
        let query = |end: u64| Message::AttnQuery {
            seq: 0,
            layer: 3,
            positions: vec![13],
            end,
            q: engine_core::protocol::WireTensor::f32(vec![1, 4, 16], vec![0.1; 64]),
        };
        for (req, (start, pages)) in [(8u64, vec![0u64, 8]), (4, vec![0, 4, 8])]
            .into_iter()
            .enumerate()
        {
            assert_eq!(ask(30 + 2 * req as u32, append(3, start)), Message::Ack);
            match ask(31 + 2 * req as u32, query(12)) {
                Message::AttnPartials { page_starts, .. } => assert_eq!(page_starts, pages),
                other => panic!("{other:?}"),
            }
        }
        // A malformed frame ends the session with an error frame.
        host.send(b"garbage that is not a frame".to_vec()).unwrap();
        let (_, reply) = decode(&host.recv().unwrap(), 1 << 24).unwrap();
        assert!(matches!(reply, Message::Error { code, .. } if code == "bad_frame"));
        drop(host);
        assert!(matches!(h.join().unwrap(), SessionEnd::Refused(_)));
    });
}

/// A helper whose memory runs out refuses a page: the page stays on the host (past its budget)
/// and the sequence goes on, bit for bit the host alone's, instead of failing.
#[test]
fn a_page_the_helper_refuses_stays_on_the_host() {
    let m = model("tiny_fp32");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 256) as u32).collect();
    // Prompt, then two steps: the steps attend pages wherever they ended up.
    let steps = |st: &mut Sequence| -> Vec<f32> {
        st.forward(&m, &CpuBackend, &prompt, Logits::Last, None)
            .unwrap();
        [1u32, 2]
            .iter()
            .flat_map(|&t| {
                st.forward(&m, &CpuBackend, &[t], Logits::Last, None)
                    .unwrap()
            })
            .collect()
    };
    let alone = steps(&mut Sequence::new(&m.config, 4));
    std::thread::scope(|scope| {
        let (host_end, mut helper_end) = pair();
        // Room for three of the pages (1 KiB each: 4 rows of k and v, 32 wide).
        let tight = HelperOptions {
            mem_budget: 3 << 10,
            max_frame: DEFAULT_MAX_FRAME,
        };
        let mr = &m;
        scope.spawn(move || Helper::new(mr, &CpuBackend, tight).serve(&mut helper_end));
        let mut st = Sequence::new(&m.config, 4);
        attach(
            &m,
            &mut st,
            host_end,
            m.config.num_hidden_layers,
            4,
            Some(8),
        );
        let got = steps(&mut st);
        assert!(st.placement.helpers[0].full && st.state.remote_kv_len() > 0);
        assert!(got == alone, "logits differ from the host alone's");
    });
}

/// A query of a few rows over many pages asks for a reply many times its size: one that would
/// not fit the helper's frame limit is refused before anything is computed, and the pages stay.
#[test]
fn a_query_whose_partials_would_pass_the_frame_limit_is_refused() {
    let m = model("tiny_fp32");
    std::thread::scope(|scope| {
        let (mut host, mut helper_end) = pair();
        let mr = &m;
        let small = HelperOptions {
            mem_budget: 1 << 20,
            max_frame: 16 << 10,
        };
        scope.spawn(move || Helper::new(mr, &CpuBackend, small).serve(&mut helper_end));
        let mut ask = |req: u32, msg: Message| ask(&mut host, req, msg);
        assert!(matches!(
            ask(0, engine_core::host::remote::hello(&m, 1 << 20)),
            Message::Welcome(_)
        ));
        let cfg = Configure {
            first_layer: 0,
            end_layer: 0,
            page_size: 4,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        assert_eq!(ask(1, Message::Configure(cfg)), Message::Ack);
        let rows =
            |n: usize| engine_core::protocol::WireTensor::f32(vec![n, 32], vec![0.5; n * 32]);
        for page in 0..16u64 {
            let append = Message::KvAppend {
                seq: 0,
                layer: 3,
                start: page * 4,
                k: rows(4),
                v: rows(4),
            };
            assert_eq!(ask(2 + page as u32, append), Message::Ack);
        }
        // 8 rows of 4 heads over 16 pages: 36 KB of partials from a 2 KB query.
        let query = |t: usize| Message::AttnQuery {
            seq: 0,
            layer: 3,
            positions: (64..64 + t as u64).collect(),
            end: 64,
            q: engine_core::protocol::WireTensor::f32(vec![t, 4, 16], vec![0.1; t * 64]),
        };
        match ask(30, query(8)) {
            Message::Error { code, message } => {
                assert_eq!(code, "size");
                assert!(message.contains("past the frame limit"), "{message}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        // One row fits, over all 16 pages, still held.
        match ask(31, query(1)) {
            Message::AttnPartials { page_starts, .. } => assert_eq!(page_starts.len(), 16),
            other => panic!("{other:?}"),
        }
    });
}

/// A stand-in helper that completes the handshake and Configure, then vanishes.
fn helper_that_vanishes(m: &Model, mut link: impl Link) {
    for _ in 0..2 {
        let (req, msg) = decode(&link.recv().unwrap(), 1 << 24).unwrap();
        let reply = match msg {
            Message::Hello(_) => Message::Welcome(Intro {
                version: PROTOCOL_VERSION,
                model: m.identity.name.clone(),
                model_digest: m.identity.digest.clone(),
                role: Role::Helper,
                mem_offer: 1 << 30,
                backends: vec![],
                max_frame: 1 << 24,
                device: "native".into(),
            }),
            _ => Message::Ack,
        };
        link.send(encode(req, &reply)).unwrap();
    }
}

#[test]
fn a_vanished_helper_fails_the_request_with_a_clear_error() {
    let m = model("tiny_fp32");
    let (host_end, helper_end) = pair();
    let mr = &m;
    let client = std::thread::scope(|scope| {
        scope.spawn(move || helper_that_vanishes(mr, helper_end));
        let cfg = Configure {
            first_layer: 0,
            end_layer: 0,
            page_size: 4,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        HelperClient::connect(Box::new(host_end), mr, cfg, DEFAULT_MAX_FRAME).unwrap()
    });
    let mut st = Sequence::new(&m.config, 4);
    st.placement.attach(client);
    st.placement.host_kv_tokens = Some(2);
    let err = st
        .forward(
            &m,
            &CpuBackend,
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
            Logits::Last,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("helper: link closed"), "{err}");
}

/// A helper that makes every step wait (here: 50 ms each way on its link, against a host that
/// attends the tiny model's pages in microseconds) is set aside once measured: its pages are
/// attended from the page file, it is offered no more, the reason is reported, and the tokens
/// are the host alone's.
#[test]
fn a_helper_slower_than_the_host_is_set_aside_and_the_page_file_serves() {
    use engine_core::link::{LinkProfile, ShapedLink};
    let fixture = "tiny_fp32_T150";
    let (m, r) = (model(fixture), Reference::load(fixture));
    let (prompt, want) = (r.ids("prompt_ids"), r.ids("gen_ids"));
    let slow = LinkProfile {
        name: "slow".into(),
        bandwidth_bps: f64::INFINITY,
        latency: std::time::Duration::from_millis(50),
    };
    let m = &m;
    std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, 4);
        st.placement.spill = Some(tests::page_file());
        let (host_end, mut helper_end) = pair();
        scope.spawn(move || Helper::new(m, &CpuBackend, opts()).serve(&mut helper_end));
        let host_end = ShapedLink::new(host_end, slow);
        attach(m, &mut st, host_end, m.config.num_hidden_layers, 4, Some(8));
        let mut logits = st
            .forward(m, &CpuBackend, &prompt, Logits::Last, None)
            .unwrap();
        let on_helper = st.placement.pages_on(st.placement.helpers[0].id);
        assert!(on_helper > 0, "no page went to the helper");
        let mut ids = Vec::new();
        for _ in 0..want.len() {
            let next = engine_core::generate::argmax(&logits);
            ids.push(next);
            logits = st
                .forward(m, &CpuBackend, &[next], Logits::Last, None)
                .unwrap();
        }
        assert_eq!(ids, want, "the host alone's tokens");
        let helper = &st.placement.helpers[0];
        assert!(
            helper.slow,
            "never set aside ({on_helper} pages were on it)"
        );
        assert_eq!(st.placement.pages_on(helper.id), 0);
        let why = st.placement.helper_set_aside.clone().unwrap_or_default();
        assert!(
            why.contains(" ms for ") && why.contains("page file"),
            "{why}"
        );
        eprintln!("{why}");
    });
}
