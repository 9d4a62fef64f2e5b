//! Prompts past one ubatch, on every backend and every path, against the CPU backend's single
//! forward pass (itself exact against the fixtures): lengths around the GPU's delta-rule
//! chunks (32), attention's query-row blocks (8) and key tiles (32), every power of two up to
//! 2048, and past 640 (where lavapipe used to stop the delta rule's loops: ops.rs's
//! LOOP_BUDGET). Each path must give the prefill logits within [`TOL`] and the reference's
//! 64 greedy ids.
//!
//! Paths: the CPU in ubatches; the GPU in one pass and in ubatches; split prefill with KV
//! pages moving to a helper and interleaved pairs, with the GPU on the host, on the helper, and
//! on both. Ubatches of 100 tokens leave remainders in every chunk, tile and page (64).

use std::sync::OnceLock;

use engine_core::backend::gpu::{GpuBackend, GpuOptions};
use engine_core::generate::argmax;
use engine_core::host::split::{prefill, SplitPlan};
use engine_core::host::Sequence;
use engine_core::{Backend, CpuBackend, Logits, Model};
use tests::{attach, fixtures_dir, max_abs_diff, spawn_helper, Rng};

const LENGTHS: [usize; 8] = [1, 31, 33, 511, 513, 700, 1100, 2100];
/// Greedy steps after each prompt.
const STEPS: usize = 64;
/// Logits of any path against the CPU's single pass. The fixtures' 1e-4 holds to about 1100
/// tokens; over 2100 rows the CPU itself, in ubatches, parts from its single pass by 1.2e-4
/// (another order of summation), and the GPU by 1.4e-4.
const TOL: f32 = 2.5e-4;
const UBATCH: usize = 100;
const PAGE: usize = 64;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap())
}

/// A GPU backend of the test's own: tests run on threads of one process, and on a device
/// they shared each one's waits would also wait for the others' work (on lavapipe this made
/// the file five times slower).
fn gpu() -> GpuBackend {
    GpuBackend::new(&GpuOptions::default()).unwrap_or_else(|e| {
        panic!("{e}\nThe GPU tests need a Vulkan adapter: apt-get install mesa-vulkan-drivers")
    })
}

/// A seeded prompt of `len` ids.
fn prompt(len: usize) -> Vec<u32> {
    let mut rng = Rng(len as u64 + 1);
    let vocab = model().config.vocab_size as f32;
    (0..len).map(|_| (rng.uniform() * vocab) as u32).collect()
}

/// What a path produced for one prompt: prefill logits (every row, or the last only), then
/// the logits after each greedy step and the ids chosen.
struct Answer {
    prefill: Vec<f32>,
    ids: Vec<u32>,
    steps: Vec<Vec<f32>>,
}

/// `STEPS` greedy steps on `be` from the prefill's last row.
fn decode(be: &dyn Backend, st: &mut Sequence, prefill: Vec<f32>) -> Answer {
    let v = model().config.vocab_size;
    let mut logits = prefill[prefill.len() - v..].to_vec();
    let (mut ids, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        ids.push(argmax(&logits));
        logits = st
            .forward(model(), be, &[*ids.last().unwrap()], Logits::Last, None)
            .unwrap();
        steps.push(logits.clone());
    }
    Answer {
        prefill,
        ids,
        steps,
    }
}

/// The reference for each length: the CPU backend, one forward pass, one page.
fn reference(len: usize) -> &'static Answer {
    static REF: OnceLock<Vec<Answer>> = OnceLock::new();
    let all = REF.get_or_init(|| {
        LENGTHS
            .iter()
            .map(|&n| {
                let m = model();
                let mut st = Sequence::new(&m.config, 4096);
                let all = st
                    .forward(m, &CpuBackend, &prompt(n), Logits::All, None)
                    .unwrap();
                decode(&CpuBackend, &mut st, all)
            })
            .collect()
    });
    &all[LENGTHS.iter().position(|&n| n == len).unwrap()]
}

/// `got` against the reference: prefill rows (all, or the last when `got` has one), the greedy
/// ids and every step's logits. Greedy ids may part only where the reference's top two were
/// within the tolerance of each other (a tie the backends may break either way); the steps
/// after that are not compared, as they continue different texts.
fn check(path: &str, len: usize, got: &Answer) {
    let want = reference(len);
    let v = model().config.vocab_size;
    let rows = &want.prefill[want.prefill.len() - got.prefill.len()..];
    let err = max_abs_diff(&got.prefill, rows);
    assert!(
        err <= TOL,
        "{path}, {len} tokens: prefill logits off by {err}"
    );
    let mut worst = err;
    for (i, (&id, &want_id)) in got.ids.iter().zip(&want.ids).enumerate() {
        if id != want_id {
            let before = if i == 0 {
                &want.prefill[want.prefill.len() - v..]
            } else {
                &want.steps[i - 1][..]
            };
            let gap = before[want_id as usize] - before[id as usize];
            assert!(
                gap <= 2.0 * TOL,
                "{path}, {len} tokens: greedy id {i} is {id}, the reference's {want_id} \
                 (ahead by {gap})"
            );
            eprintln!("{path}, {len} tokens: a tie at step {i} (gap {gap}), compared to there");
            return;
        }
        let err = max_abs_diff(&got.steps[i], &want.steps[i]);
        assert!(
            err <= TOL,
            "{path}, {len} tokens: step {i} logits off by {err}"
        );
        worst = worst.max(err);
    }
    eprintln!("{path}, {len} tokens: {STEPS} ids identical, logits within {worst:.1e}");
}

/// Prefill in ubatches of [`UBATCH`] with every row's logits, pages of [`PAGE`].
fn ubatches(be: &dyn Backend, len: usize) -> Answer {
    let m = model();
    let mut st = Sequence::new(&m.config, PAGE);
    let mut all = Vec::new();
    for c in prompt(len).chunks(UBATCH) {
        all.extend(st.forward(m, be, c, Logits::All, None).unwrap());
    }
    decode(be, &mut st, all)
}

#[test]
fn the_cpu_in_ubatches() {
    for len in LENGTHS {
        check("cpu, ubatches", len, &ubatches(&CpuBackend, len));
    }
}

#[test]
fn the_gpu_in_one_pass() {
    let (m, gpu) = (model(), gpu());
    for len in LENGTHS {
        let mut st = Sequence::new(&m.config, 4096);
        let all = st
            .forward(m, &gpu, &prompt(len), Logits::All, None)
            .unwrap();
        check("gpu, one pass", len, &decode(&gpu, &mut st, all));
    }
}

#[test]
fn the_gpu_in_ubatches() {
    let gpu = gpu();
    for len in LENGTHS {
        check("gpu, ubatches", len, &ubatches(&gpu, len));
    }
}

/// Split prefill: the helper runs layers 4.. of every ubatch but the last; past 256 positions
/// per layer the oldest pages move to it, and from position 600 ubatches run in interleaved
/// pairs; decode then attends the helper's pages through it.
fn split(host: &dyn Backend, helper: &dyn Backend, len: usize) -> Answer {
    let m = model();
    let plan = SplitPlan {
        min_tokens: 32,
        ubatch: UBATCH,
        interleave_from: 600,
    };
    std::thread::scope(|scope| {
        let host_end = spawn_helper(scope, m, helper);
        let mut st = Sequence::new(&m.config, PAGE);
        attach(m, &mut st, host_end, 4, PAGE, Some(256));
        let (last, report) = prefill(m, host, &mut st, &prompt(len), &plan).unwrap();
        assert_eq!(report.fallback, None);
        if len > 600 {
            assert!(report.on_helper > 0 && report.interleaved > 0, "{report:?}");
        }
        decode(host, &mut st, last)
    })
}

#[test]
fn split_prefill_with_a_gpu_host_and_a_cpu_helper() {
    let gpu = gpu();
    for len in LENGTHS {
        check("gpu host, cpu helper", len, &split(&gpu, &CpuBackend, len));
    }
}

#[test]
fn split_prefill_with_a_cpu_host_and_a_gpu_helper() {
    let gpu = gpu();
    for len in LENGTHS {
        check("cpu host, gpu helper", len, &split(&CpuBackend, &gpu, len));
    }
}

#[test]
fn split_prefill_with_the_gpu_on_both_sides() {
    // The helper's own device, as on another machine.
    let (host, helper) = (gpu(), gpu());
    for len in LENGTHS {
        check("gpu host, gpu helper", len, &split(&host, &helper, len));
    }
}
