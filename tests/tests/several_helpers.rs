//! Several helpers at once: the host spreads the pages that leave it over every attached
//! helper, queries each for its pages and merges all partials in page order, so the logits
//! are the host alone's bit for bit however many helpers there are, whichever of them is lost,
//! and whenever one joins.

use engine_core::helper::{Helper, HelperOptions};
use engine_core::host::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::host::Sequence;
use engine_core::link::pair;
use engine_core::protocol::Configure;

use engine_core::{CpuBackend, Model};
use tests::{conversation, fixtures_dir, page_file, Fuse, Reference};

const PAGE: usize = 8;
const BUDGET: usize = 16;
const LAYERS: u32 = 8;

/// A helper on a thread of `scope` offering `mem` bytes, reached through a link cut after
/// `fuse` operations; it runs the tail layers from 4 if `prefill`, else holds pages only.
fn attach<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    m: &'s Model,
    st: &mut Sequence,
    (mem, prefill, fuse): (u64, bool, usize),
) -> u32 {
    let (host_end, mut helper_end) = pair();
    let opts = HelperOptions {
        mem_budget: mem,
        max_frame: DEFAULT_MAX_FRAME,
    };
    scope.spawn(move || Helper::new(m, &CpuBackend, opts).serve(&mut helper_end));
    let cfg = Configure {
        first_layer: if prefill { 4 } else { LAYERS },
        end_layer: LAYERS,
        page_size: PAGE as u32,
        kv_types: st.state.kv_types(),
    };
    let link = Box::new(Fuse::new(host_end, fuse));
    let client = HelperClient::connect(link, m, cfg, DEFAULT_MAX_FRAME).unwrap();
    st.placement.host_kv_tokens = Some(BUDGET);
    st.placement.attach(client)
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

/// Pages of the head layer (3; layer 7 is the prefill helper's) on each helper, by id.
fn head_pages(st: &Sequence, ids: &[u32]) -> Vec<usize> {
    let Some(held) = st.placement.holders(3) else {
        panic!("layer 3 is full attention")
    };
    ids.iter().map(|&id| held.count_on(id)).collect()
}

#[test]
fn pages_spread_over_three_helpers_give_the_host_alone_logits() {
    let (m, prompt, alone) = setup();
    std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, PAGE);
        // Offers of 1, 2 and 1 GiB: before any answer, shares follow the offers.
        let ids = [
            attach(scope, &m, &mut st, (1 << 30, true, usize::MAX)),
            attach(scope, &m, &mut st, (2 << 30, false, usize::MAX)),
            attach(scope, &m, &mut st, (1 << 30, false, usize::MAX)),
        ];
        let got = conversation(&m, &mut st, &prompt, &mut |_| {});
        assert!(
            got == alone,
            "logits with three helpers differ from the host alone's"
        );
        let on = head_pages(&st, &ids);
        assert!(on.iter().all(|&n| n > 0), "a helper holds no page: {on:?}");
        assert!(st.placement.pages_all_on_helpers());
        // The prefill helper holds its layers' pages as one prefix, and only it does.
        assert!(st.placement.holds_all_pages_of(ids[0], 4..8));
        assert!(st
            .placement
            .helpers
            .iter()
            .all(|h| h.pages_per_sec().is_some()));
    });
}

#[test]
fn a_helper_lost_among_several_costs_time_not_tokens() {
    let (m, prompt, alone) = setup();
    for (lost, fuse) in [(1usize, 40usize), (0, 60), (2, 25)] {
        std::thread::scope(|scope| {
            let mut st = Sequence::new(&m.config, PAGE);
            st.placement.spill = Some(page_file());
            let mut fuses = [usize::MAX; 3];
            fuses[lost] = fuse;
            let ids: Vec<u32> = (0..3)
                .map(|i| attach(scope, &m, &mut st, (1 << 30, i == 0, fuses[i])))
                .collect();
            let got = conversation(&m, &mut st, &prompt, &mut |_| {});
            assert!(
                got == alone,
                "helper {lost} cut after {fuse}: logits differ"
            );
            assert!(
                st.placement.helper_lost.is_some(),
                "helper {lost} was not lost"
            );
            let left: Vec<u32> = st.placement.helpers.iter().map(|h| h.id).collect();
            assert!(!left.contains(&ids[lost]) && left.len() == 2, "{left:?}");
        });
    }
}

#[test]
fn a_helper_that_joins_mid_session_takes_new_pages() {
    let (m, prompt, alone) = setup();
    std::thread::scope(|scope| {
        let mut st = Sequence::new(&m.config, PAGE);
        st.placement.spill = Some(page_file());
        let first = attach(scope, &m, &mut st, (1 << 30, true, usize::MAX));
        let mut second = None;
        let got = conversation(&m, &mut st, &prompt, &mut |st| {
            assert_eq!(head_pages(st, &[first])[0], st.state.remote_kv_len() / PAGE);
            second = Some(attach(scope, &m, st, (1 << 30, false, usize::MAX)));
        });
        assert!(got == alone, "logits differ after a helper joined");
        let on = head_pages(&st, &[first, second.unwrap()]);
        assert!(on[1] > 0, "the helper that joined holds no page: {on:?}");
    });
}
