//! The GPU op layer at Qwen3.5-27B decode shapes: the matrix-vector product (16-bit and
//! quantised weights), decode attention
//! over KV pages and the delta-rule step, on whatever adapter wgpu picks (`WGPU_BACKEND` to
//! choose). Each iteration records the op `REPS` times (the delta step: once per DeltaNet layer
//! of the 27B, each on its own state) and reads one small result back, as a decode step does,
//! so one submit and one read-back are spread over many ops. Every op streams more than an
//! H200's 50 MB L2, so the bytes come from memory. Throughput is in bytes the ops must read:
//! weights for the product, K and V for attention, the recurrent state (read and written) for
//! the delta step; compare with the card's copy bandwidth (docs/PERFORMANCE.md says how to run
//! this on the lent H200). Timings on a software adapter (lavapipe) say nothing about a GPU.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use engine_core::backend::gpu::ops::{self, GpuDeltaInputs, GpuKvPage};
use engine_core::backend::gpu::{Gpu, GpuOptions, GpuTensor, WeightFormat};
use engine_core::backend::{AttnShape, DeltaShape};
use engine_core::tensor::{DType, Data, Matrix};

fn gpu() -> Gpu {
    let g = Gpu::with_options(&GpuOptions::default()).expect("a GPU adapter");
    eprintln!(
        "adapter: {} (shader-f16: {})",
        g.adapter_name(),
        g.has_f16()
    );
    g
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// Ops recorded per iteration.
const REPS: usize = 8;

/// Waits for everything recorded so far by reading `t` back.
fn wait(g: &Gpu, t: &GpuTensor) {
    g.download_f32(t).expect("read-back");
}

fn matvec(c: &mut Criterion) {
    let g = gpu();
    let mut group = c.benchmark_group("gpu_matvec");
    group.sample_size(10);
    let float = if g.has_f16() {
        WeightFormat::F16
    } else {
        WeightFormat::F16Packed
    };
    // The 27B's MLP up/gate projection and down projection, as 16-bit floats and in the
    // quantised formats with device kernels (a GGUF's blocks as they are read).
    for (dtype, format) in [
        (DType::F16, float),
        (DType::Q8_0, WeightFormat::Q8_0),
        (DType::Q4_0, WeightFormat::Q4_0),
        (DType::Q4K, WeightFormat::Q4K),
        (DType::Q6K, WeightFormat::Q6K),
    ] {
        for (rows, cols) in [(17408, 5120), (5120, 17408)] {
            let w = Matrix {
                rows,
                cols,
                data: Data::from_f32(&values(rows * cols, 1), dtype),
            };
            let gw = g.upload_matrix(&w, format).expect("weights fit");
            let x = g.upload_f32(&values(cols, 2));
            group.throughput(Throughput::Bytes(
                (REPS * rows * format.row_bytes(cols)) as u64,
            ));
            group.bench_function(
                BenchmarkId::new(format.name(), format!("{rows}x{cols}")),
                |b| {
                    b.iter(|| {
                        let outs: Vec<GpuTensor> =
                            (0..REPS).map(|_| ops::matmul(&g, &x, &gw)).collect();
                        wait(&g, &outs[REPS - 1])
                    })
                },
            );
        }
    }
    group.finish();
}

fn decode_attention(c: &mut Criterion) {
    let g = gpu();
    let mut group = c.benchmark_group("gpu_decode_attention");
    group.sample_size(10);
    // The 27B: 24 query heads, 4 KV heads of 256; pages of 4096 positions.
    let shape = AttnShape {
        q_heads: 24,
        kv_heads: 4,
        head_dim: 256,
    };
    let (page, row) = (4096, shape.kv_heads * shape.head_dim);
    // 8 pages are 268 MB of K and V, 32 pages (128k positions) 1 GB.
    for pages in [8usize, 32] {
        let kv: Vec<GpuKvPage> = (0..pages)
            .map(|p| GpuKvPage {
                start: p * page,
                len: page,
                k: g.upload_f32(&values(page * row, 3 + p as u32)),
                v: g.upload_f32(&values(page * row, 100 + p as u32)),
                types: engine_core::backend::CacheTypes::F32,
            })
            .collect();
        let q = g.upload_f32(&values(shape.q_heads * shape.head_dim, 4));
        let pos = g.upload_u32(&[(pages * page) as u32]);
        group.throughput(Throughput::Bytes(
            (REPS * pages * page * row * 2 * 4) as u64,
        ));
        group.bench_function(BenchmarkId::new("pages", pages), |b| {
            b.iter(|| {
                let outs: Vec<GpuTensor> = (0..REPS)
                    .map(|_| {
                        let parts: Vec<_> = kv
                            .iter()
                            .map(|p| {
                                ops::attend_page_split(
                                    &g,
                                    shape,
                                    &q,
                                    &pos,
                                    p,
                                    1.0,
                                    ops::DECODE_SPLIT,
                                )
                            })
                            .collect();
                        let refs: Vec<_> = parts.iter().collect();
                        ops::merge_partials(&g, shape.q_heads, shape.head_dim, &refs).o
                    })
                    .collect();
                wait(&g, &outs[REPS - 1])
            })
        });
    }
    group.finish();
}

fn delta_step(c: &mut Criterion) {
    let g = gpu();
    let mut group = c.benchmark_group("gpu_delta_step");
    group.sample_size(10);
    // The 27B's Gated DeltaNet: 16 key heads, 48 value heads, 128 x 128 state per value head.
    let s = DeltaShape {
        k_heads: 16,
        v_heads: 48,
        dk: 128,
        dv: 128,
        value_heads_tiled: false,
    };
    // One state per DeltaNet layer of the 27B (48 of 3 MiB).
    let states: Vec<GpuTensor> = (0..48)
        .map(|i| g.upload_f32(&values(s.v_heads * s.dk * s.dv, 50 + i)))
        .collect();
    let (q, k) = (
        g.upload_f32(&values(s.k_heads * s.dk, 6)),
        g.upload_f32(&values(s.k_heads * s.dk, 7)),
    );
    let v = g.upload_f32(&values(s.v_heads * s.dv, 8));
    let gate: Vec<f32> = values(s.v_heads, 9).iter().map(|x| -x.abs()).collect();
    let (gate, beta) = (g.upload_f32(&gate), g.upload_f32(&values(s.v_heads, 10)));
    group.throughput(Throughput::Bytes(
        (states.len() * s.v_heads * s.dk * s.dv * 4 * 2) as u64,
    ));
    group.bench_function("recurrent", |b| {
        b.iter(|| {
            let outs: Vec<GpuTensor> = states
                .iter()
                .map(|state| {
                    let x = GpuDeltaInputs {
                        q: &q,
                        k: &k,
                        v: &v,
                        g: &gate,
                        beta: &beta,
                    };
                    ops::delta_rule_recurrent(&g, s, x, state)
                })
                .collect();
            wait(&g, &outs[outs.len() - 1])
        })
    });
    group.finish();
}

criterion_group!(benches, matvec, decode_attention, delta_step);
criterion_main!(benches);
