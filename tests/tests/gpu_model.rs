//! The whole model on the GPU backend (lavapipe in CI): the fp32 fixture's logits within 1e-4
//! and its greedy ids; a split run with a GPU host and a CPU helper, and the reverse, gives the
//! tokens of the host alone; with the GPU on both sides, the host alone's logits bit for bit;
//! a decode step reads back only the logits; the storage ops under KV pages and checkpoints
//! agree with the CPU backend; attention over fewer than `STEP_ROWS` query rows gives each
//! its decode step's bits.

use engine_core::backend::gpu::{GpuBackend, GpuOptions};
use engine_core::backend::{Act, AttnShape, CacheTypes, KvPage, KvType};
use engine_core::generate::argmax;
use engine_core::host::split::{prefill, SplitPlan};
use engine_core::host::Sequence;
use engine_core::kv::PagedKv;
use engine_core::{Backend, CpuBackend, LayerKind, Logits, Model};
use tests::{attach, fixtures_dir, gpu, max_abs_diff, spawn_helper, Reference};

/// Prefill logits of every row, then `n` greedy steps: (all prefill logits, ids, step logits).
fn run(m: &Model, be: &dyn Backend, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut st = Sequence::new(&m.config, 16);
    let all = st.forward(m, be, prompt, Logits::All, None).unwrap();
    let v = m.config.vocab_size;
    let mut logits = all[all.len() - v..].to_vec();
    let (mut ids, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        ids.push(argmax(&logits));
        logits = st
            .forward(m, be, &[*ids.last().unwrap()], Logits::Last, None)
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
            let host_end = spawn_helper(scope, m, helper);
            let mut st = Sequence::new(&m.config, 16);
            attach(m, &mut st, host_end, 4, 16, Some(48));
            let (mut logits, report) = prefill(m, host, &mut st, &prompt, &plan).unwrap();
            assert!(report.on_helper > 0 && report.interleaved > 0, "{report:?}");
            let mut ids = Vec::new();
            for _ in 0..want.len() {
                ids.push(argmax(&logits));
                logits = st
                    .forward(m, host, &[*ids.last().unwrap()], Logits::Last, None)
                    .unwrap();
            }
            assert!(st.state.remote_kv_len() > 0);
            assert_eq!(ids, want, "host {} helper {}", host.name(), helper.name());
        });
    }
}

/// Both sides on the GPU: split prefill (tail layers on the helper, pages moving to it, then
/// interleaved pairs) and decode over the helper's pages give the logits of the GPU host
/// alone, bit for bit. The helper's page partials are merged on the host's device by the same
/// kernel, in the same order, as the host's own pages would have been.
/// With compact pages (packed on both devices, crossing the link as their bytes) as with
/// f32: the fixture at f16 (heads of 16), the tiny256 preset at q8_0 / q4_0.
#[test]
fn gpu_host_and_gpu_helper_match_the_gpu_host_alone_bit_for_bit() {
    let fixture = Model::load_dir(&fixtures_dir().join("tiny_fp32_T150")).unwrap();
    let prompt = Reference::load("tiny_fp32_T150").ids("prompt_ids");
    for types in [CacheTypes::F32, f16_pages()] {
        gpu_split_matches_the_host_alone(&fixture, &prompt, 4, types);
    }
    let synth = engine_core::source::LoadOptions {
        weight_dtype: "f32".into(),
        weight_seed: 5,
        ..Default::default()
    };
    let tiny256 = engine_core::source::load_model("tiny256", &synth).unwrap();
    let prompt: Vec<u32> = (0..150).map(|i| (i * 37 + 11) % 1024).collect();
    let types = CacheTypes {
        k: KvType::Q8_0,
        v: KvType::Q4_0,
    };
    gpu_split_matches_the_host_alone(&tiny256, &prompt, 0, types);
}

fn f16_pages() -> CacheTypes {
    CacheTypes {
        k: KvType::F16,
        v: KvType::F16,
    }
}

/// `m` on a GPU host with a GPU helper running its layers from `split` (split prefill, pages
/// moving to it, then interleaved pairs, decode over its pages) against the GPU host alone.
fn gpu_split_matches_the_host_alone(m: &Model, prompt: &[u32], split: usize, types: CacheTypes) {
    let (ubatch, page, steps) = (32, 16, 6);
    let decode = |st: &mut engine_core::host::Sequence, mut logits: Vec<f32>| {
        let mut all = logits.clone();
        for _ in 0..steps {
            logits = st
                .forward(m, gpu(), &[argmax(&logits)], Logits::Last, None)
                .unwrap();
            all.extend_from_slice(&logits);
        }
        all
    };
    // The reference: the host alone, one ubatch after another, no split code.
    let mut st = Sequence::typed(&m.config, page, types, gpu()).unwrap();
    let mut logits = Vec::new();
    for c in prompt.chunks(ubatch) {
        logits = st.forward(m, gpu(), c, Logits::Last, None).unwrap();
    }
    let want = decode(&mut st, logits);
    // The helper's own device, as on another machine.
    let helper = GpuBackend::new(&GpuOptions::default()).unwrap();
    let plan = SplitPlan {
        min_tokens: 20,
        ubatch,
        interleave_from: 96,
    };
    std::thread::scope(|scope| {
        let host_end = spawn_helper(scope, m, &helper);
        let mut st = Sequence::typed(&m.config, page, types, gpu()).unwrap();
        attach(m, &mut st, host_end, split, page, Some(48));
        let (logits, report) = prefill(m, gpu(), &mut st, prompt, &plan).unwrap();
        assert!(report.on_helper > 0 && report.interleaved > 0, "{report:?}");
        let got = decode(&mut st, logits);
        assert!(st.state.remote_kv_len() > 0);
        assert!(
            got == want,
            "{types}: split logits differ from the host alone's"
        );
    });
}

/// A GPU host's decode step submits once, for the logits, and uploads only the step's token,
/// positions and RoPE tables: activations, DeltaNet states, KV pages and attention partials
/// (merged on the device) stay there.
#[test]
fn a_gpu_decode_step_reads_back_only_the_logits() {
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
    // The token id, then per full-attention layer the RoPE tables of q and k (a cosine and a
    // sine per rotated pair) and the query position for attention; 4 bytes each.
    let step_uploads = 4 + full * (2 * c.rotary_dim() as u64 + 1) * 4;
    // A 40-token prompt in pages of 16: every step attends three pages per layer.
    let mut st = Sequence::new(&m.config, 16);
    let mut logits = st
        .forward(&m, &be, &r.ids("prompt_ids"), Logits::Last, None)
        .unwrap();
    let want = r.ids("gen_ids");
    for &id in &want[..4] {
        assert_eq!(argmax(&logits), id);
        let (submits, uploaded) = (be.gpu().submits(), be.gpu().uploaded_bytes());
        logits = st.forward(&m, &be, &[id], Logits::Last, None).unwrap();
        let submits = be.gpu().submits() - submits;
        let uploaded = be.gpu().uploaded_bytes() - uploaded;
        eprintln!("decode step: {submits} submissions, {uploaded} bytes uploaded");
        assert_eq!(submits, 1, "one submission for the logits");
        assert_eq!(uploaded, step_uploads, "token, RoPE tables, positions");
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

/// Compact pages packed on the GPU hold the bytes the CPU's pages hold (ggml's rows, the
/// blocks quantised on the device as ggml's reference quantisers do), whether written by the
/// device from its rows or arriving as bytes, and their attention partials match the CPU's
/// over the same pages; keys and values may differ in type.
#[test]
fn compact_pages_on_the_gpu_hold_the_cpus_bytes_and_attend_alike() {
    let shape = AttnShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    let (row, len, page) = (shape.kv_heads * shape.head_dim, 40, 16);
    let mut rng = tests::Rng(7);
    let mut values = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform() * 4.0 - 2.0).collect() };
    let (k, v) = (values(len * row), values(len * row));
    // STEP_ROWS rows: the CPU's gemm form, whose queries are not rounded to q8_0 as its
    // decode rows' are against q8_0 keys.
    let positions: Vec<usize> = (40 - engine_core::backend::STEP_ROWS..40).collect();
    let q = values(positions.len() * shape.q_heads * shape.head_dim);
    let types = |k, v| CacheTypes { k, v };
    for types in [
        f16_pages(),
        types(KvType::F16, KvType::F32),
        types(KvType::Q8_0, KvType::Q4_0),
        types(KvType::Q4_0, KvType::Q8_0),
    ] {
        let fill = |be: &dyn Backend| {
            let mut kv = PagedKv::new(page, shape.kv_heads, shape.head_dim, types);
            for (a, b) in [(0, 7), (7, len)] {
                let part = |x: &[f32]| be.upload(x[a * row..b * row].to_vec());
                kv.append(be, &part(&k), &part(&v));
            }
            kv
        };
        let (on_cpu, on_gpu) = (fill(&CpuBackend), fill(gpu()));
        let rows =
            |kv: &PagedKv, be: &dyn Backend| pollster::block_on(kv.rows(be, 0, len).unwrap());
        let cpu_rows = rows(&on_cpu, &CpuBackend);
        assert_eq!(rows(&on_gpu, gpu()), cpu_rows, "{types}: the pages' bytes");
        // Rows arriving as bytes (a link, the page file) land as the same bytes.
        let mut arrived = PagedKv::new(page, shape.kv_heads, shape.head_dim, types);
        arrived
            .append_encoded(gpu(), &cpu_rows.0, &cpu_rows.1)
            .unwrap();
        assert_eq!(
            rows(&arrived, gpu()),
            cpu_rows,
            "{types}: rows that arrived"
        );
        let attend = |kv: &PagedKv, be: &dyn Backend| {
            let pages: Vec<&KvPage> = kv.pages().iter().map(|p| &**p).collect();
            let parts = be.attend_pages(shape, &be.upload(q.clone()), &positions, &pages);
            let rows = positions.len() * shape.q_heads;
            be.download(&be.merge_partials(rows, shape.head_dim, parts))
        };
        let want = attend(&on_cpu, &CpuBackend);
        for (what, kv) in [("written", &on_gpu), ("arrived", &arrived)] {
            let got = attend(kv, gpu());
            let err = max_abs_diff(&got, &want);
            assert!(
                err < 1e-5,
                "{types} {what}: attention differs from the CPU's by {err}"
            );
        }
        // A page that arrives in a gap (a helper re-filled) with fewer rows than a page holds,
        // then rewound into and appended past those rows, takes them as a page it was
        // written whole would.
        let refill = |be: &dyn Backend| {
            let mut kv = PagedKv::new(page, shape.kv_heads, shape.head_dim, types);
            kv.skip_to(page).unwrap();
            let part = |x: &[f32], r: std::ops::Range<usize>| {
                be.upload(x[r.start * row..r.end * row].to_vec())
            };
            kv.append(be, &part(&k, page..page + 3), &part(&v, page..page + 3));
            let few = |x: &engine_core::cache_types::Encoded| {
                let mut x = x.clone();
                x.truncate(10, row);
                x
            };
            kv.fill_gap(be, 0, (few(&cpu_rows.0), few(&cpu_rows.1)))
                .unwrap();
            kv.truncate(be, 5).unwrap();
            kv.append(be, &part(&k, 5..len), &part(&v, 5..len));
            rows(&kv, be)
        };
        assert_eq!(
            refill(gpu()),
            refill(&CpuBackend),
            "{types}: a refilled page"
        );
        assert_eq!(refill(gpu()), cpu_rows, "{types}: a refilled page");
    }
}

/// Fewer than `STEP_ROWS` query rows (a verify pass) get, row by row, the attention of their
/// decode steps bit for bit, at every KV type the GPU holds: in pages of 72, the rows before
/// position 64 see one 64-key range of a page that holds two for the later rows (a decode
/// step there has the one range), and the last row alone sees the second page.
#[test]
fn gpu_attention_rows_below_step_rows_are_their_decode_steps() {
    use engine_core::backend::STEP_ROWS;
    let shape = AttnShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    let (row, page) = (shape.kv_heads * shape.head_dim, 72);
    let positions: Vec<usize> = (58..58 + STEP_ROWS - 1).collect();
    let len = positions[positions.len() - 1] + 1;
    let mut rng = tests::Rng(36);
    let (k, v) = (rng.normal_vec(len * row), rng.normal_vec(len * row));
    let width = shape.q_heads * shape.head_dim;
    let q = rng.normal_vec(positions.len() * width);
    let be = gpu();
    let attend = |kv: &PagedKv, q: &[f32], positions: &[usize]| {
        let pages: Vec<&KvPage> = kv.pages().iter().map(|p| &**p).collect();
        let parts = be.attend_pages(shape, &be.upload(q.to_vec()), positions, &pages);
        let rows = positions.len() * shape.q_heads;
        bits(&be.download(&be.merge_partials(rows, shape.head_dim, parts)))
    };
    for types in [
        CacheTypes::F32,
        f16_pages(),
        CacheTypes {
            k: KvType::Q8_0,
            v: KvType::Q4_0,
        },
    ] {
        let mut kv = PagedKv::new(page, shape.kv_heads, shape.head_dim, types);
        kv.append(be, &be.upload(k.clone()), &be.upload(v.clone()));
        let pass = attend(&kv, &q, &positions);
        // Each row as its decode step, the last first: the cache then ends at its position.
        for (i, &p) in positions.iter().enumerate().rev() {
            kv.truncate(be, p + 1).unwrap();
            let step = attend(&kv, &q[i * width..][..width], &[p]);
            assert!(
                pass[i * width..][..width] == step[..],
                "{types}: row {i} (position {p}) differs from its decode step"
            );
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The GPU's compact kernels read q8_0 and q4_0 rows a pair of blocks (64 values) at a time:
/// a model whose KV row is not whole pairs is refused for those types, saying which it holds.
#[test]
fn the_gpu_refuses_compact_rows_it_cannot_read_and_says_what_it_holds() {
    let mut c = engine_core::synth::preset("tiny256").unwrap();
    (c.num_key_value_heads, c.head_dim) = (1, 32);
    let types = CacheTypes {
        k: KvType::F16,
        v: KvType::Q4_0,
    };
    let err = Sequence::typed(&c, 16, types, gpu())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("(rows of 32 values) as f32, f16 only, not q4_0"),
        "{err}"
    );
    assert!(Sequence::typed(&c, 16, types, &CpuBackend).is_ok());
}
