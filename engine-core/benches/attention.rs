//! CPU attention of one decode query over a KV page: what a decode step pays per attention
//! layer and page at depth, for each cache type, and what a verify pass of 1 + 4 rows pays
//! (`cargo bench -p engine-core --bench attention`). Throughput counts the page's bytes as
//! stored.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use engine_core::backend::cpu::attention::attend_page;
use engine_core::backend::cpu::frozen;
use engine_core::backend::frozen::FrozenPage;
use engine_core::backend::AttnShape;
use engine_core::backend::{KvPage, KvType, Merger, PageRows};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(0x85EB_CA6B);
            (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// One decode row at the end of a 4096-key page of Qwen3.5-0.8B's attention layers (8 query
/// heads over 2 KV heads of 256), for every KV type.
fn decode(c: &mut Criterion) {
    rows_at_the_end(c, "cpu_decode_attention", 1);
}

/// A speculative verify pass of 1 + 4 rows (consecutive positions) at the end of the same
/// page: each row is computed as its decode step computes it.
fn verify(c: &mut Criterion) {
    rows_at_the_end(c, "cpu_verify_attention", 5);
}

fn rows_at_the_end(c: &mut Criterion, name: &str, rows: usize) {
    let mut group = c.benchmark_group(name);
    let shape = AttnShape {
        q_heads: 8,
        kv_heads: 2,
        head_dim: 256,
    };
    let row = shape.kv_heads * shape.head_dim;
    let len = 4096;
    for ty in KvType::ALL {
        let page = KvPage {
            start: 0,
            len,
            k: PageRows::host(ty, values(len * row, 1)),
            v: PageRows::host(ty, values(len * row, 2)),
            frozen: None,
        };
        let q = values(rows * shape.q_heads * shape.head_dim, 3);
        let q_pos: Vec<usize> = (len - rows..len).collect();
        group.throughput(Throughput::Bytes((len * ty.row_bytes(row) * 2) as u64));
        group.bench_function(BenchmarkId::new(ty.name(), len), |b| {
            b.iter(|| attend_page(shape, &q, &q_pos, &page))
        });
    }
    group.finish();
}

/// One decode row over a layer's 32k and 128k keys of the 0.8B shape: f16 pages of 4096
/// positions through the paged kernel, against the same keys frozen into pages of 16384
/// (`FrozenPage`, issue 39), each merged in page order. Throughput counts K and V at fp16.
fn frozen(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_frozen_decode_attention");
    group.sample_size(20);
    let shape = AttnShape {
        q_heads: 8,
        kv_heads: 2,
        head_dim: 256,
    };
    let row = shape.kv_heads * shape.head_dim;
    let q = values(shape.q_heads * shape.head_dim, 3);
    for keys in [32 * 1024, 128 * 1024] {
        let pages = |size: usize| -> Vec<KvPage> {
            (0..keys / size)
                .map(|p| KvPage {
                    start: p * size,
                    len: size,
                    k: PageRows::host(KvType::F16, values(size * row, 1 + p as u32)),
                    v: PageRows::host(KvType::F16, values(size * row, 1000 + p as u32)),
                    frozen: None,
                })
                .collect()
        };
        group.throughput(Throughput::Bytes((keys * row * 2 * 2) as u64));
        let paged = pages(4096);
        group.bench_function(BenchmarkId::new("paged_f16", keys), |b| {
            b.iter(|| {
                let mut m = Merger::new(shape.q_heads, shape.head_dim);
                for p in &paged {
                    m.add(&attend_page(shape, &q, &[keys], p));
                }
                m.finish()
            })
        });
        drop(paged);
        let frozen: Vec<FrozenPage> = pages(16384)
            .iter()
            .map(|p| FrozenPage::pack(shape.kv_heads, shape.head_dim, p))
            .collect();
        group.bench_function(BenchmarkId::new("frozen_f16", keys), |b| {
            b.iter(|| {
                let mut m = Merger::new(shape.q_heads, shape.head_dim);
                for p in &frozen {
                    m.add(&frozen::attend(p, shape, &q, keys));
                }
                m.finish()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode, verify, frozen);
criterion_main!(benches);
