//! Linear-layer throughput at the Qwen3.5-0.8B shapes, in rayon's global pool (all cores unless
//! RAYON_NUM_THREADS says otherwise).
//!
//! Decode (one row of `x`, or a verify pass's few) is bound by reading the weights, so it is
//! reported in bytes of weights per second; prefill (512 rows) is compute bound, reported in
//! elements per second where one element is one FLOP (read "Gelem/s" as GFLOP/s).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use engine_core::backend::cpu::matmul::matmul;
use engine_core::backend::STEP_ROWS;
use engine_core::tensor::{DType, Data, Elems, Matrix};
use half::{bf16, f16};

/// Weights in [-0.125, 0.125), generated directly in the storage dtype: the 248320-row head is
/// 254 M elements, too many to build through an f32 copy quickly.
fn weights(rows: usize, cols: usize, dtype: DType) -> Matrix {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.25
    };
    let len = rows * cols;
    let data = match dtype {
        DType::BF16 => Data::BF16(Elems::Owned(
            (0..len).map(|_| bf16::from_f32(next())).collect(),
        )),
        DType::F16 => Data::F16(Elems::Owned(
            (0..len).map(|_| f16::from_f32(next())).collect(),
        )),
        DType::F32 => Data::F32(Elems::Owned((0..len).map(|_| next()).collect())),
        _ => Data::from_f32(&(0..len).map(|_| next()).collect::<Vec<f32>>(), dtype),
    };
    Matrix { rows, cols, data }
}

fn run(c: &mut Criterion, group: &str, t: usize, shapes: &[(usize, usize, DType)]) {
    let mut g = c.benchmark_group(group);
    g.sample_size(10);
    for &(rows, cols, dtype) in shapes {
        let w = weights(rows, cols, dtype);
        let x: Vec<f32> = (0..t * cols)
            .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
            .collect();
        let mut out = vec![0.0f32; t * rows];
        // Fewer rows than a step's limit are computed as decode rows: bound by the weights.
        g.throughput(if t < STEP_ROWS {
            Throughput::Bytes(w.nbytes() as u64)
        } else {
            Throughput::Elements((2 * t * rows * cols) as u64)
        });
        let id = BenchmarkId::new(dtype.name(), format!("t{t}_{rows}x{cols}"));
        g.bench_function(id, |b| b.iter(|| matmul(&x, &w, &mut out)));
    }
    g.finish();
}

fn gemv(c: &mut Criterion) {
    run(
        c,
        "gemv",
        1,
        &[
            (248320, 1024, DType::BF16),
            (3584, 1024, DType::BF16),
            (248320, 1024, DType::F16),
            (3584, 1024, DType::F16),
            (3584, 1024, DType::Q8_0),
            // In L2 (139 KB): the kernel's own speed, apart from memory.
            (128, 1024, DType::Q8_0),
            (1024, 3584, DType::Q8_0),
            (248320, 1024, DType::Q6K),
            (3584, 1024, DType::Q4K),
            (1024, 3584, DType::Q6K),
            (3584, 1024, DType::Q4_0),
        ],
    );
}

fn gemm(c: &mut Criterion) {
    run(
        c,
        "gemm",
        512,
        &[
            (3584, 1024, DType::BF16),
            (1024, 3584, DType::BF16),
            (3584, 1024, DType::F16),
            (1024, 3584, DType::F16),
            (3584, 1024, DType::Q8_0),
            (3584, 1024, DType::Q4K),
            (1024, 3584, DType::Q4K),
            (3584, 1024, DType::Q4_0),
        ],
    );
}

/// A speculative verify pass's few rows (one step and its drafts): read in bytes of weights per
/// second like decode, so that the rows beyond the first show what they add to one pass.
fn verify(c: &mut Criterion) {
    for t in [1, 2, 3, 4, 5, 9] {
        run(
            c,
            "verify",
            t,
            &[
                (3584, 1024, DType::Q4K),
                (1024, 3584, DType::Q6K),
                (3584, 1024, DType::Q8_0),
                (3584, 1024, DType::F16),
            ],
        );
    }
}

criterion_group!(benches, gemv, gemm, verify);
criterion_main!(benches);
