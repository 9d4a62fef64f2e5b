//! The disk tier: every KV page that leaves the host is also in the sequence's page file, so a
//! helper lost at any point (the handshake done, mid split prefill, syncing its mirror,
//! holding pages during decode, being re-filled) costs time, never tokens. The link is cut
//! after every possible number of operations in turn, and every run must give the host
//! alone's logits bit for bit.

use engine_core::helper::{Helper, HelperOptions};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::split::prefill;
use engine_core::host::Sequence;
use engine_core::link::pair;
use engine_core::protocol::Configure;
use engine_core::{CpuBackend, Logits, Model};
use tests::{conversation, conversation_plan, fixtures_dir, page_file, Fuse, Reference};

const PAGE: usize = 8;
const BUDGET: usize = 16;

/// A helper running the tail layers (from 4 of 8) on a thread of `scope`, reached through a
/// link cut after `fuse` operations (attached only if the handshake got through); returns
/// the operations counter.
fn attach<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    m: &'s Model,
    st: &mut Sequence,
    fuse: usize,
) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    let (host_end, mut helper_end) = pair();
    let opts = HelperOptions {
        mem_budget: 1 << 30,
        max_frame: DEFAULT_MAX_FRAME,
    };
    scope.spawn(move || Helper::new(m, &CpuBackend, opts).serve(&mut helper_end));
    let link = Fuse::new(host_end, fuse);
    let ops = link.ops.clone();
    let cfg = Configure {
        first_layer: 4,
        end_layer: 8,
        page_size: PAGE as u32,
        kv_types: engine_core::backend::CacheTypes::F32,
    };
    // Cut during the handshake: no helper, the sequence runs on the host alone.
    if let Ok(client) = HelperClient::connect(Box::new(link), m, cfg, DEFAULT_MAX_FRAME) {
        st.placement.attach(client);
        st.placement.host_kv_tokens = Some(BUDGET);
    }
    ops
}

fn setup() -> (Model, Vec<u32>, Vec<f32>) {
    let m = Model::load_dir(&fixtures_dir().join("tiny_fp32_T150")).unwrap();
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    let alone = conversation(
        &m,
        &mut Sequence::new(&m.config, PAGE),
        &prompt,
        &mut |_| {},
    );
    (m, prompt, alone)
}

/// Cut points from 0 to past the last operation of an uncut run, `runs` of them at most.
fn cuts(total: usize, runs: usize) -> impl Iterator<Item = usize> {
    (0..=total + 1).step_by((total / runs).max(1))
}

#[test]
fn a_helper_lost_at_any_point_costs_time_not_tokens() {
    let (m, prompt, alone) = setup();
    let total = std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, PAGE);
        st.placement.spill = Some(page_file());
        let ops = attach(scope, &m, &mut st, usize::MAX);
        let got = conversation(&m, &mut st, &prompt, &mut |_| {});
        assert!(got == alone, "uncut: logits differ from the host alone's");
        assert!(st.state.remote_kv_len() > 0 && st.placement.helper_lost.is_none());
        ops.load(std::sync::atomic::Ordering::Relaxed)
    });
    let (mut lost, mut runs) = (0, 0);
    for cut in cuts(total, 24) {
        runs += 1;
        std::thread::scope(|scope| {
            let mut st = Sequence::new(&m.config, PAGE);
            st.placement.spill = Some(page_file());
            attach(scope, &m, &mut st, cut);
            let got = conversation(&m, &mut st, &prompt, &mut |_| {});
            assert!(got == alone, "cut after {cut} of {total}: logits differ");
            lost += usize::from(st.placement.helper_lost.is_some());
        });
    }
    eprintln!("{lost} of {runs} runs cut over {total} link operations lost their helper");
    assert!(lost > 16, "only {lost} of {runs} runs lost their helper");
}

#[test]
fn a_new_helper_is_refilled_from_the_page_file_and_may_be_lost_too() {
    let (m, prompt, alone) = setup();
    // The first helper is lost during the first prompt; a second joins after the first steps.
    for second_cut in [usize::MAX, 0, 3, 9, 20, 40, 80] {
        std::thread::scope(|scope| {
            let mut st = Sequence::new(&m.config, PAGE);
            st.placement.spill = Some(page_file());
            attach(scope, &m, &mut st, 30);
            let mut joined = false;
            let got = conversation(&m, &mut st, &prompt, &mut |st| {
                assert!(st.placement.helpers.is_empty() && st.placement.helper_lost.is_some());
                attach(scope, &m, st, second_cut);
                joined = true;
            });
            assert!(joined);
            assert!(
                got == alone,
                "second helper cut after {second_cut}: logits differ"
            );
            if second_cut == usize::MAX {
                assert!(
                    !st.placement.helpers.is_empty() && st.placement.pages_all_on_helpers(),
                    "the second helper was not re-filled"
                );
            }
        });
    }
}

#[test]
fn without_a_page_file_a_helper_lost_with_pages_fails_the_sequence_clearly() {
    let (m, prompt, _) = setup();
    std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, PAGE);
        attach(scope, &m, &mut st, 60);
        let be = &CpuBackend;
        let err = prefill(&m, be, &mut st, &prompt, &conversation_plan())
            .err()
            .or_else(|| (0..20).find_map(|_| st.forward(&m, be, &[1], Logits::Last, None).err()))
            .expect("the helper holding pages was lost without an error")
            .to_string();
        assert!(err.starts_with("helper:"), "{err}");
    });
}

/// A rewind (an edited turn) into pages only in the page file, while a helper that joined
/// late is still being re-filled: the pages come back from the page file, the helper is cut
/// back, the re-fill goes on, and every logit is the host alone's.
#[test]
fn a_rewind_into_pages_only_on_disk_while_a_new_helper_is_refilled() {
    let (m, prompt, _) = setup();
    let be = &CpuBackend;
    let run = |st: &mut Sequence, join: &mut dyn FnMut(&mut Sequence)| -> Vec<f32> {
        let mut all = prefill(&m, be, st, &prompt[..100], &conversation_plan())
            .unwrap()
            .0;
        let cp = st.state.checkpoint(be);
        all.extend(
            prefill(&m, be, st, &prompt[100..], &conversation_plan())
                .unwrap()
                .0,
        );
        join(st);
        all.extend(st.forward(&m, be, &[9], Logits::Last, None).unwrap());
        st.rewind(be, &cp).unwrap();
        let mut logits = prefill(&m, be, st, &[5, 6, 7], &conversation_plan())
            .unwrap()
            .0;
        for _ in 0..8 {
            all.extend_from_slice(&logits);
            let next = engine_core::generate::argmax(&logits);
            logits = st.forward(&m, be, &[next], Logits::Last, None).unwrap();
        }
        all
    };
    let alone = run(&mut Sequence::new(&m.config, PAGE), &mut |_| {});
    std::thread::scope(|scope| {
        // No helper at first: pages past the budget go to the page file only.
        let mut st = Sequence::new(&m.config, PAGE);
        st.placement.spill = Some(page_file());
        st.placement.host_kv_tokens = Some(BUDGET);
        let got = run(&mut st, &mut |st| {
            assert!(
                st.state.remote_kv_len() > 100,
                "{}",
                st.state.remote_kv_len()
            );
            attach(scope, &m, st, usize::MAX);
        });
        assert!(got == alone, "logits differ from the host alone's");
        let client = st.placement.helpers.first().expect("the helper stays");
        assert!(!client.is_lost());
        assert!(
            st.placement.pages_all_on_helpers(),
            "the re-fill did not finish"
        );
    });
}

/// A helper that refuses an attention query (its reply would pass the frame limit) is not
/// lost: the host attends those pages from the page file, with the same result.
#[test]
fn a_refused_query_is_answered_from_the_page_file() {
    let (m, prompt, _) = setup();
    let be = &CpuBackend;
    let run = |st: &mut Sequence| -> Vec<f32> {
        prompt
            .chunks(16)
            .flat_map(|c| st.forward(&m, be, c, Logits::Last, None).unwrap())
            .collect()
    };
    let alone = run(&mut Sequence::new(&m.config, PAGE));
    std::thread::scope(|scope| {
        let (host_end, mut helper_end) = pair();
        let mr = &m;
        scope.spawn(move || {
            // 16 KiB frames: 16 query rows over more than a few pages do not fit.
            let opts = HelperOptions {
                mem_budget: 1 << 30,
                max_frame: 16 << 10,
            };
            Helper::new(mr, &CpuBackend, opts).serve(&mut helper_end)
        });
        let mut st = Sequence::new(&m.config, PAGE);
        st.placement.spill = Some(page_file());
        // Pages only: no layer split, so no prefill chunk either.
        tests::attach(&m, &mut st, host_end, 8, PAGE, Some(BUDGET));
        assert!(run(&mut st) == alone, "logits differ from the host alone's");
        let client = st.placement.helpers.first().expect("the helper stays");
        assert!(!client.is_lost() && st.placement.helper_lost.is_none());
        assert!(st.state.remote_kv_len() > 100);
    });
}
