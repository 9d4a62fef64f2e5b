//! Bounded work on the helper: every size a host sends is checked against the session's limits
//! (memory budget, frame limit) before anything is allocated or computed. A refused request
//! gets an Error naming what was refused and why, and the session goes on: the next valid
//! request is answered as it would have been, with everything stored before intact.

use engine_core::helper::{prefill_bytes, Helper, HelperOptions};
use engine_core::host::remote::DEFAULT_MAX_FRAME;
use engine_core::link::{pair, Link, MemoryLink};
use engine_core::protocol::{decode, encode, Configure, Message, WireTensor};
use engine_core::{CpuBackend, LayerKind, Model};
use tests::{fixtures_dir, Rng};

/// The first layer the helper runs in the prefill tests (tiny_fp32: full attention at 7).
const SPLIT: u32 = 4;

fn model() -> Model {
    Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap()
}

/// A host's end of a session with a helper, greeted with `max_frame` and configured.
struct Host {
    link: MemoryLink,
    req: u32,
}

impl Host {
    fn ask(&mut self, msg: Message) -> Message {
        self.req += 1;
        self.link.send(encode(self.req, &msg)).unwrap();
        let (id, reply) = decode(&self.link.recv().unwrap(), 1 << 26).unwrap();
        assert_eq!(id, self.req, "replies come in request order");
        reply
    }

    /// The refusal `msg` gets: its code and message.
    fn refusal(&mut self, msg: Message) -> (String, String) {
        match self.ask(msg) {
            Message::Error { code, message } => (code, message),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn held_bytes(&mut self) -> u64 {
        match self.ask(Message::Stats(Default::default())) {
            Message::Stats(s) => s["held_bytes"],
            other => panic!("expected stats, got {other:?}"),
        }
    }
}

/// Runs `body` against a helper for `m` with `mem_budget` bytes, greeted by a host announcing
/// `max_frame` and configured with `cfg`.
fn with_helper(
    m: &Model,
    mem_budget: u64,
    max_frame: usize,
    cfg: Configure,
    body: impl FnOnce(&mut Host),
) {
    std::thread::scope(|scope| {
        let (link, mut helper_end) = pair();
        let opts = HelperOptions {
            mem_budget,
            max_frame: DEFAULT_MAX_FRAME,
        };
        scope.spawn(move || Helper::new(m, &CpuBackend, opts).serve(&mut helper_end));
        let mut host = Host { link, req: 0 };
        let hello = engine_core::host::remote::hello(m, max_frame);
        assert!(matches!(host.ask(hello), Message::Welcome(_)));
        assert_eq!(host.ask(Message::Configure(cfg)), Message::Ack);
        body(&mut host);
    });
}

fn prefill_cfg(m: &Model, page_size: u32) -> Configure {
    Configure {
        first_layer: SPLIT,
        end_layer: m.config.num_hidden_layers as u32,
        page_size,
        kv_types: engine_core::backend::CacheTypes::F32,
    }
}

fn pages_only(m: &Model, page_size: u32) -> Configure {
    let n = m.config.num_hidden_layers as u32;
    Configure {
        first_layer: n,
        end_layer: n,
        page_size,
        kv_types: engine_core::backend::CacheTypes::F32,
    }
}

fn chunk(m: &Model, pos: u64, rows: usize) -> Message {
    let h = m.config.hidden_size;
    Message::PrefillChunk {
        seq: 0,
        pos,
        want_state: true,
        residual: WireTensor::f32(vec![rows, h], Rng(7 + pos).normal_vec(rows * h)),
    }
}

/// Bytes of one KV page of one layer: `page` rows of K and V.
fn page_bytes(m: &Model, page: u64) -> u64 {
    page * (m.config.num_key_value_heads * m.config.head_dim * 2 * 4) as u64
}

/// Bytes of DeltaNet state a sequence holds for the layers from `SPLIT` on.
fn state_bytes(m: &Model) -> u64 {
    let c = &m.config;
    let (s, conv) = c.delta_state_len();
    let layers = c.layer_types[SPLIT as usize..]
        .iter()
        .filter(|&&k| k == LayerKind::LinearAttention)
        .count();
    (layers * (s + conv) * 4) as u64
}

/// A chunk whose KV pages and DeltaNet state fit the budget but whose activations do not is
/// refused for memory before it runs, naming its rows and working memory; nothing is held for
/// it, and a smaller chunk is then answered exactly as by a helper without limits.
#[test]
fn a_prefill_chunk_whose_activations_do_not_fit_is_refused_and_the_session_goes_on() {
    let m = model();
    let cfg = prefill_cfg(&m, 16);
    let (big, small) = (64, 16);
    let work = |rows| prefill_bytes(&m.config, &cfg, 0, rows, true).1;
    // Four pages for the big chunk's rows in layer 7, but working memory for the small one.
    let budget = state_bytes(&m) + page_bytes(&m, 16) * 4 + work(small);
    let mut want = None;
    with_helper(&m, 1 << 30, DEFAULT_MAX_FRAME, cfg.clone(), |host| {
        want = Some(host.ask(chunk(&m, 0, small)));
    });
    with_helper(&m, budget, DEFAULT_MAX_FRAME, cfg.clone(), |host| {
        let (code, message) = host.refusal(chunk(&m, 0, big));
        assert_eq!(code, "memory", "{message}");
        for part in [
            "a prefill chunk of 64 rows at 0".to_string(),
            format!("{} bytes of working memory", work(big)),
            format!("budget of {budget} bytes"),
        ] {
            assert!(message.contains(&part), "{message}");
        }
        assert_eq!(host.held_bytes(), 0);
        let got = host.ask(chunk(&m, 0, small));
        assert!(matches!(got, Message::ChunkState { .. }), "{got:?}");
        assert_eq!(Some(got), want);
        assert_eq!(host.held_bytes(), state_bytes(&m) + page_bytes(&m, 16));
    });
}

/// A KV page counts whole from its first row (it is allocated whole), so a page size the
/// budget cannot hold is refused at the first row instead of allocating it; with room for two
/// pages, a one-row page and a full one, a third page is refused and both are still served.
#[test]
fn kv_pages_count_whole_against_the_budget() {
    let m = model();
    let rows = |n: usize, x: f32| WireTensor::f32(vec![n, 32], vec![x; n * 32]);
    let append = |seq: u64, start: u64, n: usize| Message::KvAppend {
        seq,
        layer: 3,
        start,
        k: rows(n, seq as f32),
        v: rows(n, -(seq as f32)),
    };
    let fetch = |seq: u64, len: u64| Message::KvFetch {
        seq,
        layer: 3,
        start: 0,
        len,
    };
    // One page of 2^32 - 1 rows would take a TiB.
    with_helper(
        &m,
        1 << 20,
        DEFAULT_MAX_FRAME,
        pages_only(&m, u32::MAX),
        |host| {
            let (code, message) = host.refusal(append(0, 0, 1));
            assert_eq!(code, "memory", "{message}");
            let page = page_bytes(&m, u32::MAX as u64);
            assert!(
                message.contains(&format!("{page} bytes of new KV pages")),
                "{message}"
            );
            assert_eq!(host.held_bytes(), 0);
        },
    );
    with_helper(
        &m,
        2 * page_bytes(&m, 4),
        DEFAULT_MAX_FRAME,
        pages_only(&m, 4),
        |host| {
            assert_eq!(host.ask(append(1, 0, 1)), Message::Ack);
            assert_eq!(host.held_bytes(), page_bytes(&m, 4));
            assert_eq!(host.ask(append(2, 0, 4)), Message::Ack);
            let (code, message) = host.refusal(append(2, 4, 4));
            assert_eq!(code, "memory", "{message}");
            assert_eq!(host.held_bytes(), 2 * page_bytes(&m, 4));
            for (seq, len) in [(1, 1), (2, 4)] {
                let want = Message::KvRows {
                    seq,
                    layer: 3,
                    start: 0,
                    k: rows(len, seq as f32),
                    v: rows(len, -(seq as f32)),
                };
                assert_eq!(host.ask(fetch(seq, len as u64)), want);
            }
        },
    );
}

/// Replies are bounded by the frame limit the host announced: a fetch of more rows than fit,
/// or a prefill chunk whose rows and states would not fit, is refused before anything is read
/// or run, and the rows stored stay.
#[test]
fn requests_whose_replies_pass_the_frame_limit_are_refused_before_any_work() {
    let m = model();
    let cfg = prefill_cfg(&m, 16);
    // The reply to an 8-row chunk fits exactly.
    let max_frame = prefill_bytes(&m.config, &cfg, 0, 8, true).0 as usize;
    let row_bytes = 32 * 2 * 4;
    let page = |start: u64| Message::KvAppend {
        seq: 0,
        layer: 3,
        start,
        k: WireTensor::f32(
            vec![4, 32],
            (0..128).map(|i| (start * 32 + i) as f32).collect(),
        ),
        v: WireTensor::f32(vec![4, 32], vec![0.5; 128]),
    };
    let fetch = |len: u64| Message::KvFetch {
        seq: 0,
        layer: 3,
        start: 0,
        len,
    };
    with_helper(&m, 1 << 30, max_frame, pages_only(&m, 4), |host| {
        for p in 0..4 {
            assert_eq!(host.ask(page(p * 4)), Message::Ack);
        }
        // Checked before the rows are looked up: u64::MAX rows would overflow any count.
        for len in [(max_frame / row_bytes) as u64, u64::MAX] {
            let (code, message) = host.refusal(fetch(len));
            assert_eq!(code, "size", "{message}");
            assert!(
                message.contains(&format!("{len} KV rows of layer 3"))
                    && message.contains(&format!("past the frame limit of {max_frame}")),
                "{message}"
            );
        }
        match host.ask(fetch(16)) {
            Message::KvRows { k, .. } => {
                assert_eq!(k.values(), (0..512).map(|i| i as f32).collect::<Vec<_>>())
            }
            other => panic!("{other:?}"),
        }
    });
    with_helper(&m, 1 << 30, max_frame, cfg, |host| {
        let (code, message) = host.refusal(chunk(&m, 0, 9));
        assert_eq!(code, "size", "{message}");
        assert!(message.contains("of a 9-row chunk"), "{message}");
        assert_eq!(host.held_bytes(), 0);
        assert!(matches!(
            host.ask(chunk(&m, 0, 8)),
            Message::ChunkState { .. }
        ));
    });
}

/// A mirror sync whose rows need more pages than the budget has left is refused for memory,
/// and the mirror stays where it was: the next chunk continues it.
#[test]
fn a_mirror_sync_past_the_budget_is_refused_and_the_mirror_is_kept() {
    let m = model();
    let c = &m.config;
    let cfg = prefill_cfg(&m, 4);
    let page = page_bytes(&m, 4);
    let work = prefill_bytes(c, &cfg, 0, 4, true).1;
    // One sequence, one page and a 4-row chunk's working memory, then one page more.
    let budget = state_bytes(&m) + page + work + page;
    // After the first chunk the budget has `work + page` left: a sync of more pages fails.
    let pages = (work + page) / page + 1;
    let rows = 4 * pages as usize;
    let width = c.num_key_value_heads * c.head_dim;
    let (s, conv) = c.delta_state_len();
    let delta: Vec<u32> = (SPLIT..c.num_hidden_layers as u32)
        .filter(|&l| c.layer_types[l as usize] == LayerKind::LinearAttention)
        .collect();
    let zeros = |n: usize| WireTensor::f32(vec![n], vec![0.0; n]);
    let sync = Message::ChunkState {
        seq: 0,
        pos: 4,
        kv_layers: vec![7],
        kv: vec![(
            WireTensor::f32(vec![rows, width], vec![0.25; rows * width]),
            WireTensor::f32(vec![rows, width], vec![0.5; rows * width]),
        )],
        delta_layers: delta.clone(),
        states: delta.iter().map(|_| (zeros(s), zeros(conv))).collect(),
    };
    with_helper(&m, budget, DEFAULT_MAX_FRAME, cfg, |host| {
        assert!(matches!(
            host.ask(chunk(&m, 0, 4)),
            Message::ChunkState { .. }
        ));
        let held = host.held_bytes();
        let (code, message) = host.refusal(sync);
        assert_eq!(code, "memory", "{message}");
        let what = format!("a mirror sync of rows 4..{}", 4 + rows);
        let need = format!("{} bytes of new KV pages", pages * page);
        assert!(
            message.contains(&what) && message.contains(&need),
            "{message}"
        );
        assert_eq!(host.held_bytes(), held);
        let next = host.ask(chunk(&m, 4, 2));
        assert!(
            matches!(next, Message::ChunkState { pos: 4, .. }),
            "{next:?}"
        );
    });
}
