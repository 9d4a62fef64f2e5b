//! Pipelined split prefill: the helper runs the tail layers of every ubatch but the last, and
//! the result is bit-identical to the host alone, across ubatch sizes, split points, turns,
//! KV offload, and a helper that dies mid-batch.

use engine_core::generate::argmax;
use engine_core::helper::{Helper, HelperOptions};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::split::{prefill, SplitPlan};
use engine_core::host::Sequence;
use engine_core::link::{pair, Link, MemoryLink};
use engine_core::protocol::Configure;
use engine_core::{CpuBackend, Logits, Model};
use tests::{attach, fixtures_dir, Reference};

fn model(fixture: &str) -> Model {
    Model::load_dir(&fixtures_dir().join(fixture)).unwrap()
}

/// Two turns: prompt 1, `gen` greedy tokens, prompt 2, `gen` more. Returns all logits.
fn two_turns(
    m: &Model,
    st: &mut Sequence,
    p1: &[u32],
    p2: &[u32],
    gen: usize,
    plan: &SplitPlan,
) -> (Vec<Vec<f32>>, Vec<usize>) {
    let mut out = Vec::new();
    let mut on_helper = Vec::new();
    for p in [p1, p2] {
        let (mut logits, report) = prefill(m, &CpuBackend, st, p, plan).unwrap();
        assert_eq!(report.fallback, None);
        on_helper.push(report.on_helper);
        for _ in 0..gen {
            out.push(logits.clone());
            logits = st
                .forward(m, &CpuBackend, &[argmax(&logits)], Logits::Last, None)
                .unwrap();
        }
        out.push(logits);
    }
    (out, on_helper)
}

/// The T150 fixture's model and prompt, a split plan of `ubatch`-token ubatches, and the
/// host alone's logits for the prompt prefilled in those ubatches.
fn t150_alone(ubatch: usize) -> (Model, Vec<u32>, SplitPlan, Vec<f32>) {
    let m = model("tiny_fp32_T150");
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch,
        ..SplitPlan::default()
    };
    let (want, _) = prefill(
        &m,
        &CpuBackend,
        &mut Sequence::new(&m.config, 16),
        &prompt,
        &plan,
    )
    .unwrap();
    (m, prompt, plan, want)
}

/// A helper on this thread; `mem_budget` bytes of KV.
fn serve(m: &Model, mut link: MemoryLink, mem_budget: u64) {
    let opts = HelperOptions {
        mem_budget,
        max_frame: DEFAULT_MAX_FRAME,
    };
    Helper::new(m, &CpuBackend, opts).serve(&mut link);
}

#[test]
fn split_prefill_is_bit_identical_to_the_host_alone() {
    let m = model("tiny_fp32_T150");
    let r = Reference::load("tiny_fp32_T150");
    let prompt = r.ids("prompt_ids");
    let (p1, p2) = prompt.split_at(100);
    // (ubatch, split layer, page size, host KV budget)
    for (ubatch, split, page, budget) in [
        (32, 4, 16, None),
        (7, 4, 8, None),
        (64, 4, 64, None),
        (16, 4, 8, Some(24)),
        (33, 0, 16, Some(40)),
    ] {
        let plan = SplitPlan {
            min_tokens: 20,
            ubatch,
            ..SplitPlan::default()
        };
        let (want, _) = two_turns(&m, &mut Sequence::new(&m.config, page), p1, p2, 6, &plan);
        std::thread::scope(|scope| {
            let (host_end, helper_end) = pair();
            scope.spawn(|| serve(&m, helper_end, 1 << 30));
            let mut st = Sequence::new(&m.config, page);
            attach(&m, &mut st, host_end, split, page, budget);
            let (got, on_helper) = two_turns(&m, &mut st, p1, p2, 6, &plan);
            assert!(
                on_helper[0] > 0 && (on_helper[1] > 0 || p2.len() <= ubatch),
                "ubatch {ubatch}: the helper ran nothing ({on_helper:?})"
            );
            assert!(
                got == want,
                "ubatch {ubatch} split {split} page {page} budget {budget:?}: logits differ"
            );
        });
    }
    // And the reference's own greedy continuation of the whole prompt, split.
    std::thread::scope(|scope| {
        let (host_end, helper_end) = pair();
        scope.spawn(|| serve(&m, helper_end, 1 << 30));
        let mut st = Sequence::new(&m.config, 16);
        attach(&m, &mut st, host_end, 4, 16, None);
        let plan = SplitPlan {
            min_tokens: 20,
            ubatch: 40,
            ..SplitPlan::default()
        };
        let (mut logits, _) = prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
        let mut ids = Vec::new();
        for _ in 0..r.ids("gen_ids").len() {
            ids.push(argmax(&logits));
            logits = st
                .forward(&m, &CpuBackend, &[*ids.last().unwrap()], Logits::Last, None)
                .unwrap();
        }
        assert_eq!(ids, r.ids("gen_ids"));
    });
}

/// Forwards frames to a real helper until `frames` have gone to it, then drops the link:
/// a helper that vanishes mid-batch.
fn dying_helper(m: &Model, mut host_side: MemoryLink, frames: usize) {
    let (mut to_helper, helper_end) = pair();
    std::thread::scope(move |scope| {
        scope.spawn(move || serve(m, helper_end, 1 << 30));
        for _ in 0..frames {
            let Ok(f) = host_side.recv() else { break };
            to_helper.send(f).unwrap();
            let reply = to_helper.recv().unwrap();
            host_side.send(reply).unwrap();
        }
        // Vanish: close both links (the helper's session then ends too).
        drop(to_helper);
        drop(host_side);
    });
}

/// With or without a host KV budget (one that has not moved any page yet), the host detaches
/// the dead helper, keeps its whole KV, and decodes on: the same logits as the host alone.
#[test]
fn a_helper_that_dies_mid_batch_costs_time_not_tokens() {
    let m = model("tiny_fp32_T150");
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch: 16,
        ..SplitPlan::default()
    };
    let mut alone = Sequence::new(&m.config, 16);
    let (want, _) = prefill(&m, &CpuBackend, &mut alone, &prompt, &plan).unwrap();
    let next = argmax(&want);
    let want_next = alone
        .forward(&m, &CpuBackend, &[next], Logits::Last, None)
        .unwrap();
    // 2 frames: Hello and Configure; then it dies after 0, 1 or 4 ubatches.
    for (frames, budget) in [(2, None), (3, None), (6, None), (3, Some(1000))] {
        std::thread::scope(|scope| {
            let (host_end, relay) = pair();
            scope.spawn(|| dying_helper(&m, relay, frames));
            let mut st = Sequence::new(&m.config, 16);
            attach(&m, &mut st, host_end, 4, 16, budget);
            let (got, report) = prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
            assert!(
                report.fallback.is_some(),
                "after {frames} frames the helper should have failed"
            );
            assert!(
                got == want,
                "after {frames} frames: logits differ from the host alone"
            );
            assert!(st.placement.helpers.is_empty());
            let got_next = st
                .forward(&m, &CpuBackend, &[next], Logits::Last, None)
                .unwrap_or_else(|e| panic!("budget {budget:?}: decoding after the loss: {e}"));
            assert!(got_next == want_next, "budget {budget:?}: decode differs");
        });
    }
}

/// Turn 1, checkpoint, turn 2a, rewind, turn 2b: the same logits as turn 1 then turn 2b on the
/// host alone, with the cut inside a page that lives on the helper and on a page boundary.
#[test]
fn rewinding_an_edited_turn_matches_a_run_that_never_had_it() {
    let m = model("tiny_fp32_T150");
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let (p1, rest) = prompt.split_at(70);
    let (p2a, p2b) = rest.split_at(40);
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch: 16,
        ..SplitPlan::default()
    };
    let turn = |st: &mut Sequence, p: &[u32]| -> Vec<Vec<f32>> {
        let (mut logits, _) = prefill(&m, &CpuBackend, st, p, &plan).unwrap();
        let mut out = Vec::new();
        for _ in 0..5 {
            out.push(logits.clone());
            logits = st
                .forward(&m, &CpuBackend, &[argmax(&logits)], Logits::Last, None)
                .unwrap();
        }
        out.push(logits);
        out
    };
    // (page size, budget): turn 1 ends at 75, inside page 64..80 on the helper (budget 8), or
    // at a boundary of pages of 25 (75 = 3 x 25).
    for (page, budget) in [(16, 8), (25, 10)] {
        let mut host = Sequence::new(&m.config, page);
        let want = [turn(&mut host, p1), turn(&mut host, p2b)].concat();
        std::thread::scope(|scope| {
            let (host_end, helper_end) = pair();
            scope.spawn(|| serve(&m, helper_end, 1 << 30));
            let mut st = Sequence::new(&m.config, page);
            attach(&m, &mut st, host_end, 4, page, Some(budget));
            let mut got = turn(&mut st, p1);
            let cp = st.state.checkpoint(&CpuBackend);
            turn(&mut st, p2a);
            st.rewind(&CpuBackend, &cp).unwrap();
            got.extend(turn(&mut st, p2b));
            assert!(
                got == want,
                "page {page} budget {budget}: logits after the rewind differ"
            );
        });
    }
}

/// A first turn too short to split leaves the helper's mirror far behind; with a small frame
/// limit the sync goes in several pieces and the result is still the host's, bit for bit.
#[test]
fn a_mirror_far_behind_syncs_in_pieces() {
    let m = model("tiny_fp32_T150");
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let (p1, p2) = prompt.split_at(70);
    let plan = SplitPlan {
        min_tokens: 60,
        ubatch: 16,
        ..SplitPlan::default()
    };
    let turns = |st: &mut Sequence| -> Vec<Vec<f32>> {
        let (a, r1) = prefill(
            &m,
            &CpuBackend,
            st,
            p1,
            &SplitPlan {
                min_tokens: 200,
                ubatch: 16,
                ..SplitPlan::default()
            },
        )
        .unwrap();
        let (b, r2) = prefill(&m, &CpuBackend, st, p2, &plan).unwrap();
        assert_eq!(r1.on_helper, 0);
        if !st.placement.helpers.is_empty() {
            assert!(r2.on_helper > 0 && r2.synced_rows == 70, "{r2:?}");
        }
        vec![a, b]
    };
    let want = turns(&mut Sequence::new(&m.config, 16));
    std::thread::scope(|scope| {
        let (host_end, helper_end) = pair();
        scope.spawn(|| serve(&m, helper_end, 1 << 30));
        let mut st = Sequence::new(&m.config, 16);
        let cfg = Configure {
            first_layer: 4,
            end_layer: 8,
            page_size: 16,
            kv_types: engine_core::backend::CacheTypes::F32,
        };
        // 16 KiB frames: 32 rows of this model's tail KV per sync piece.
        st.placement
            .attach(HelperClient::connect(Box::new(host_end), &m, cfg, 16 << 10).unwrap());
        assert!(turns(&mut st) == want);
    });
}

/// A helper that refuses (here: its memory budget is too small for the mirror) stays
/// tethered; the host runs the batch alone with the same result.
#[test]
fn a_refusing_helper_stays_tethered_and_the_host_does_the_batch() {
    let (m, prompt, plan, want) = t150_alone(16);
    std::thread::scope(|scope| {
        let (host_end, helper_end) = pair();
        scope.spawn(|| serve(&m, helper_end, 4096));
        let mut st = Sequence::new(&m.config, 16);
        attach(&m, &mut st, host_end, 4, 16, None);
        let (got, report) = prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
        let why = report.fallback.clone().unwrap_or_default();
        assert!(why.starts_with("helper refused: memory"), "{report:?}");
        assert!(got == want);
        st.placement
            .helpers
            .first_mut()
            .expect("still tethered")
            .ping()
            .unwrap();
    });
}

/// Past `interleave_from` ubatches run in staggered pairs while the helper attends the pages
/// it holds: the same bits as the host alone with the same ubatch, whether the prompt starts
/// below the threshold (layer pipeline first) or past it, with odd pair tails, and with or
/// without a layer split.
#[test]
fn interleaved_prefill_past_the_threshold_is_bit_identical() {
    let m = model("tiny_fp32_T150");
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let (p1, p2) = prompt.split_at(90);
    // (ubatch, interleave_from, split layer, page, host KV budget)
    for (ubatch, from, split, page, budget) in
        [(8, 40, 4, 8, 16), (7, 0, 8, 4, 9), (16, 100, 4, 16, 16)]
    {
        let plan = SplitPlan {
            min_tokens: 20,
            ubatch,
            interleave_from: from,
        };
        // The reference: plain forward passes, one ubatch after another, no split code.
        let mut host = Sequence::new(&m.config, page);
        let mut want = Vec::new();
        for p in [p1, p2] {
            let mut logits = Vec::new();
            for c in p.chunks(ubatch) {
                logits = host
                    .forward(&m, &CpuBackend, c, Logits::Last, None)
                    .unwrap();
            }
            for _ in 0..4 {
                want.push(logits.clone());
                logits = host
                    .forward(&m, &CpuBackend, &[argmax(&logits)], Logits::Last, None)
                    .unwrap();
            }
            want.push(logits);
        }
        std::thread::scope(|scope| {
            let (host_end, helper_end) = pair();
            scope.spawn(|| serve(&m, helper_end, 1 << 30));
            let mut st = Sequence::new(&m.config, page);
            attach(&m, &mut st, host_end, split, page, Some(budget));
            let mut got = Vec::new();
            let mut interleaved = 0;
            for p in [p1, p2] {
                let (mut logits, report) = prefill(&m, &CpuBackend, &mut st, p, &plan).unwrap();
                assert_eq!(report.fallback, None);
                interleaved += report.interleaved;
                for _ in 0..4 {
                    got.push(logits.clone());
                    logits = st
                        .forward(&m, &CpuBackend, &[argmax(&logits)], Logits::Last, None)
                        .unwrap();
                }
                got.push(logits);
            }
            assert!(
                interleaved > 0,
                "ubatch {ubatch} from {from}: nothing interleaved"
            );
            assert!(
                got == want,
                "ubatch {ubatch} from {from} split {split} page {page}: logits differ"
            );
        });
    }
}

/// A link whose receiving end takes 2 ms per frame: a helper slower than its host.
struct Slow(MemoryLink);

impl Link for Slow {
    fn send(&mut self, frame: Vec<u8>) -> Result<(), engine_core::link::LinkError> {
        self.0.send(frame)
    }

    fn recv(&mut self) -> Result<Vec<u8>, engine_core::link::LinkError> {
        std::thread::sleep(std::time::Duration::from_millis(2));
        self.0.recv()
    }

    fn recv_timeout(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<Option<Vec<u8>>, engine_core::link::LinkError> {
        std::thread::sleep(std::time::Duration::from_millis(2));
        self.0.recv_timeout(timeout)
    }

    fn sender(&self) -> Box<dyn engine_core::link::LinkSender> {
        self.0.sender()
    }
}

/// A host faster than its helper does not queue a whole prompt's ubatches on it: it waits
/// for the oldest reply once 8 are in flight, and the result is the same bits.
#[test]
fn a_slow_helper_is_sent_a_bounded_window_of_ubatches() {
    let (m, prompt, plan, want) = t150_alone(4);
    std::thread::scope(|scope| {
        let (host_end, helper_end) = pair();
        scope.spawn(|| {
            let opts = HelperOptions {
                mem_budget: 1 << 30,
                max_frame: DEFAULT_MAX_FRAME,
            };
            Helper::new(&m, &CpuBackend, opts).serve(&mut Slow(helper_end));
        });
        let link = tests::Fuse::new(host_end, usize::MAX);
        let peak = link.peak.clone();
        let mut st = Sequence::new(&m.config, 16);
        attach(&m, &mut st, link, 4, 16, None);
        let (got, report) = prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
        assert!(report.on_helper > 30, "{report:?}");
        assert!(got == want, "logits differ from the host alone's");
        let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
        assert!((2..=9).contains(&peak), "{peak} requests in flight at once");
    });
}

/// Over a WebSocket, more chunks than a link's incoming queue holds are in flight at once (up
/// to the pipeline's window of 8, twice the queue): the bound holds back the host's writer
/// thread, never the host or the helper, so the prefill completes, bit-identical to the host
/// alone.
#[test]
fn a_pipeline_deeper_than_the_incoming_queue_completes_over_a_websocket() {
    use engine_core::link::ws::{connect, WsListener, INCOMING_FRAMES};
    let (m, prompt, plan, want) = t150_alone(4);
    let listener = WsListener::bind("127.0.0.1:0", DEFAULT_MAX_FRAME).unwrap();
    let url = format!("ws://{}/", listener.local_addr());
    std::thread::scope(|scope| {
        let (m, listener) = (&m, &listener);
        scope.spawn(move || {
            let mut link = listener.accept().unwrap();
            let opts = HelperOptions {
                mem_budget: 1 << 30,
                max_frame: DEFAULT_MAX_FRAME,
            };
            Helper::new(m, &CpuBackend, opts).serve(&mut link)
        });
        let mut st = Sequence::new(&m.config, 16);
        let link = connect(&url, DEFAULT_MAX_FRAME).unwrap();
        attach(m, &mut st, link, 4, 16, None);
        let (got, report) = prefill(m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
        assert_eq!(report.fallback, None);
        assert!(report.on_helper > 4 * INCOMING_FRAMES, "{report:?}");
        assert!(got == want, "logits differ from the host alone's");
    });
}

/// A synthetic model that is not whole L L L F cycles (6 layers: L L L F L L) split at 4: the
/// helper's layers hold no KV, so its mirror is only its position and DeltaNet state. It used
/// to refuse every chunk after the first (its order check read the mirror's position from KV
/// rows it has none of), and the host ran the batch alone.
#[test]
fn a_helper_whose_layers_hold_no_kv_takes_every_chunk() {
    let synth = engine_core::source::LoadOptions {
        layers: Some(6),
        weight_dtype: "f32".into(),
        weight_seed: 3,
        ..Default::default()
    };
    let m = engine_core::source::load_model("tiny", &synth).unwrap();
    let prompt: Vec<u32> = (0..90).map(|i| (i * 53 + 7) % 256).collect();
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch: 16,
        ..SplitPlan::default()
    };
    let (want, _) = prefill(
        &m,
        &CpuBackend,
        &mut Sequence::new(&m.config, 16),
        &prompt,
        &plan,
    )
    .unwrap();
    std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, 16);
        attach(
            &m,
            &mut st,
            tests::spawn_helper(scope, &m, &CpuBackend),
            4,
            16,
            None,
        );
        let (got, report) = prefill(&m, &CpuBackend, &mut st, &prompt, &plan).unwrap();
        assert_eq!(report.fallback, None);
        assert_eq!(report.on_helper, 5, "{report:?}");
        assert!(got == want, "logits differ from the host alone");
    });
}
