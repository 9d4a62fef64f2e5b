//! The whole model on the GPU backend (lavapipe in CI): the fp32 fixture's logits within 1e-4
//! and its greedy ids; a split run with a GPU host and a CPU helper, and the reverse, gives the
//! tokens of the host alone; a decode step reads back only attention partials and logits; the
//! storage ops under KV pages and checkpoints agree with the CPU backend.

use std::sync::OnceLock;

use engine_core::backend::gpu::{GpuBackend, GpuOptions};
use engine_core::backend::Act;
use engine_core::generate::argmax;
use engine_core::link::pair;
use engine_core::protocol::Configure;
use engine_core::remote::{HelperClient, DEFAULT_MAX_FRAME};
use engine_core::split::{prefill, SplitPlan};
use engine_core::{Backend, CpuBackend, LayerKind, Logits, Model};
use phone_ios::{Helper, HelperOptions};
use tests::{fixtures_dir, max_abs_diff, Reference};

fn gpu() -> &'static GpuBackend {
    static GPU: OnceLock<GpuBackend> = OnceLock::new();
    GPU.get_or_init(|| {
        GpuBackend::new(&GpuOptions::default()).unwrap_or_else(|e| {
            panic!("{e}\nThe GPU tests need a Vulkan adapter: apt-get install mesa-vulkan-drivers")
        })
    })
}

/// Prefill logits of every row, then `n` greedy steps: (all prefill logits, ids, step logits).
fn run(m: &Model, be: &dyn Backend, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut st = m.new_state(16);
    let all = m.forward(be, &mut st, prompt, Logits::All, None).unwrap();
    let v = m.config.vocab_size;
    let mut logits = all[all.len() - v..].to_vec();
    let (mut ids, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        ids.push(argmax(&logits));
        logits = m
            .forward(be, &mut st, &[*ids.last().unwrap()], Logits::Last, None)
            .unwrap();
        steps.extend_from_slice(&logits);
    }
    (all, ids, steps)
}

#[test]
fn the_fp32_fixture_runs_on_the_gpu() {
    let m = Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap();
    let r = Reference::load("tiny_fp32");
    let want = r.ids("gen_ids");
    let (all, ids, steps) = run(&m, gpu(), &r.ids("prompt_ids"), want.len());
    let (_, reference) = r.f32("prefill_logits");
    let err = max_abs_diff(&all, &reference);
    assert!(
        err < 1e-4,
        "GPU prefill logits differ from the fixture by {err}"
    );
    assert_eq!(ids, want);
    // The decode path too, against the CPU backend.
    let (_, cpu_ids, cpu_steps) = run(&m, &CpuBackend, &r.ids("prompt_ids"), want.len());
    assert_eq!(ids, cpu_ids);
    let err = max_abs_diff(&steps, &cpu_steps);
    assert!(
        err < 1e-4,
        "GPU decode logits differ from the CPU's by {err}"
    );
}

/// Split prefill (tail layers on the helper) and KV pages on the helper, with the host on one
/// backend and the helper on the other: the host-alone tokens.
#[test]
fn gpu_host_with_cpu_helper_and_the_reverse_give_the_same_tokens() {
    let m = &Model::load_dir(&fixtures_dir().join("tiny_fp32_T150")).unwrap();
    let r = Reference::load("tiny_fp32_T150");
    let prompt = r.ids("prompt_ids");
    let want = &r.ids("gen_ids")[..8];
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch: 32,
        interleave_from: 96,
    };
    let pairs: [(&dyn Backend, &dyn Backend); 2] = [(gpu(), &CpuBackend), (&CpuBackend, gpu())];
    for (host, helper) in pairs {
        std::thread::scope(|scope| {
            let (host_end, mut helper_end) = pair();
            scope.spawn(move || {
                let opts = HelperOptions {
                    mem_budget: 1 << 30,
                    max_frame: DEFAULT_MAX_FRAME,
                };
                Helper::new(m, helper, opts).serve(&mut helper_end)
            });
            let mut st = m.new_state(16);
            let cfg = Configure {
                first_layer: 4,
                end_layer: 8,
                page_size: 16,
            };
            st.remote =
                Some(HelperClient::connect(Box::new(host_end), m, cfg, DEFAULT_MAX_FRAME).unwrap());
            st.host_kv_tokens = Some(48);
            let (mut logits, report) = prefill(m, host, &mut st, &prompt, &plan).unwrap();
            assert!(report.on_helper > 0 && report.interleaved > 0, "{report:?}");
            let mut ids = Vec::new();
            for _ in 0..want.len() {
                ids.push(argmax(&logits));
                logits = m
                    .forward(host, &mut st, &[*ids.last().unwrap()], Logits::Last, None)
                    .unwrap();
            }
            assert!(st.remote_kv_len() > 0);
            assert_eq!(ids, want, "host {} helper {}", host.name(), helper.name());
        });
    }
}

/// A GPU host's decode step submits once per full-attention layer (the partials of all its
/// pages, read together for the host's f64 merge) and once for the logits, and uploads only
/// the step's token, positions, RoPE table and merged attention rows: activations, DeltaNet
/// states and KV pages stay on the device.
#[test]
fn a_gpu_decode_step_reads_back_only_partials_and_logits() {
    // A device of its own: the counters are per device, and the other tests share gpu().
    let be = GpuBackend::new(&GpuOptions::default()).unwrap();
    let m = Model::load_dir(&fixtures_dir().join("tiny_fp32")).unwrap();
    let r = Reference::load("tiny_fp32");
    let c = &m.config;
    let full = c
        .layer_types
        .iter()
        .filter(|&&k| k == LayerKind::FullAttention)
        .count() as u64;
    let delta_state =
        (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4) as u64;
    // A 40-token prompt in pages of 16: every step attends three pages per layer.
    let mut st = m.new_state(16);
    let mut logits = m
        .forward(&be, &mut st, &r.ids("prompt_ids"), Logits::Last, None)
        .unwrap();
    let want = r.ids("gen_ids");
    for &id in &want[..4] {
        assert_eq!(argmax(&logits), id);
        let (submits, uploaded) = (be.gpu().submits(), be.gpu().uploaded_bytes());
        logits = m.forward(&be, &mut st, &[id], Logits::Last, None).unwrap();
        let submits = be.gpu().submits() - submits;
        let uploaded = be.gpu().uploaded_bytes() - uploaded;
        eprintln!("decode step: {submits} submissions, {uploaded} bytes uploaded");
        assert_eq!(submits, full + 1, "{full} full-attention layers + logits");
        assert!(
            uploaded < delta_state,
            "a decode step uploaded {uploaded} bytes (one DeltaNet state is {delta_state})"
        );
    }
}

/// What KV pages and checkpoints are made of, on both backends: rows written at offsets (a
/// truncated tail overwritten in place), pieces read back together, a copy that evolves
/// separately, and a host value (a fresh state) that the first op writing it takes over.
#[test]
fn storage_ops_agree_with_the_cpu_backend() {
    let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let run = |be: &dyn Backend| {
        let src = be.upload(x.clone());
        let mut page = be.alloc(10);
        be.write(&mut page, 0, &src, 0, 6);
        be.write(&mut page, 6, &src, 8, 4);
        // Truncated to 4 rows, then appended to.
        be.write(&mut page, 4, &src, 0, 2);
        let mut state = Act::Host(vec![1.0; 4]);
        let copy = be.duplicate(&state);
        be.add(&mut state, &be.upload(x[..4].to_vec()));
        let moved = matches!(state, Act::Device(_));
        let values = be.download_ranges(&[(&page, 0..6), (&state, 0..4), (&copy, 0..4)]);
        (values, moved)
    };
    let want: Vec<f32> = [
        &x[0..4],
        &x[0..2],
        &[1.0, 2.0, 3.0, 4.0],
        &[1.0, 1.0, 1.0, 1.0],
    ]
    .concat();
    assert_eq!(run(&CpuBackend), (want.clone(), false));
    assert_eq!(run(gpu()), (want, true));
}
