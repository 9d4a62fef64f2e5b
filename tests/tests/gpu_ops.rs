//! Every GPU op (engine-core `backend::gpu::ops`) against the CPU reference op on seeded random
//! inputs, several shapes with odd sizes, f32 and f16 weights (bf16 converted at load). Runs on
//! whatever adapter wgpu finds; in CI that is lavapipe (software Vulkan), so shapes stay tiny.
//! With no adapter at all the tests fail: install mesa-vulkan-drivers.
//!
//! Errors are relative to the largest magnitude of the reference output. Run with
//! `--nocapture` to see the measured maxima.

use std::future::Future;
use std::ops::Range;
use std::pin::pin;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use engine_core::backend::cpu::{self, attention::attend_page as cpu_attend};
use engine_core::backend::gpu::ops::{self, GpuDeltaInputs, GpuKvPage, GpuPartials, MatmulKernel};
use engine_core::backend::gpu::{Gpu, GpuBackend, GpuMatrix, GpuOptions, GpuTensor, WeightFormat};
use engine_core::backend::{Act, AttnShape, Backend, DeltaInputs, DeltaShape, STEP_ROWS};
use engine_core::backend::{KvPage, Merger, PageRows, Partials};
use engine_core::tensor::{DType, Data, Matrix};
use tests::Rng;

/// f32 ops (and f16 weights, compared with the CPU on the same f16 values).
const TOL_F32: f32 = 1e-5;
/// f16 weights against the CPU op on the original f32 weights.
const TOL_F16: f32 = 1e-3;

fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let g = Gpu::with_options(&GpuOptions::default()).unwrap_or_else(|e| {
            panic!(
                "{e}\nThe GPU op tests need a Vulkan adapter: apt-get install mesa-vulkan-drivers"
            )
        });
        eprintln!(
            "GPU adapter: {} (shader-f16: {})",
            g.adapter_name(),
            g.has_f16()
        );
        g
    })
}

fn down(t: &GpuTensor) -> Vec<f32> {
    gpu().download_f32(t).unwrap()
}

/// max |got - want| / max |want|, asserted below `tol`; prints the measurement.
fn check(what: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    let err = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
        / scale;
    eprintln!("{what}: max rel err {err:.2e}");
    assert!(err <= tol, "{what}: relative error {err:e} > {tol:e}");
    err
}

fn matrix(rows: usize, cols: usize, vals: &[f32], dtype: DType) -> Matrix {
    Matrix {
        rows,
        cols,
        data: Data::from_f32(vals, dtype),
    }
}

fn cpu_matmul(x: &[f32], w: &Matrix) -> Vec<f32> {
    let mut out = vec![0.0; x.len() / w.cols * w.rows];
    cpu::matmul::matmul(x, w, &mut out);
    out
}

/// Weight storage on the CPU side, device format, tolerance: f32 as is; f16 weights exactly
/// as the CPU sees them; bf16 converted to f16 (exact in range) and to f32.
fn weight_cases() -> Vec<(DType, WeightFormat, f32)> {
    let mut cases = vec![
        (DType::F32, WeightFormat::F32, TOL_F32),
        (DType::F16, WeightFormat::F16Packed, TOL_F32),
        (DType::BF16, WeightFormat::F16Packed, TOL_F32),
        (DType::BF16, WeightFormat::F32, TOL_F32),
        (DType::F32, WeightFormat::F16Packed, TOL_F16),
    ];
    if gpu().has_f16() {
        cases.push((DType::F16, WeightFormat::F16, TOL_F32));
        cases.push((DType::F32, WeightFormat::F16, TOL_F16));
    }
    cases
}

#[test]
fn matmul_matches_cpu_for_every_weight_format_and_kernel() {
    let g = gpu();
    let mut rng = Rng(1);
    for (t, rows, cols) in [
        (1, 7, 5),
        (3, 33, 17),
        (5, 19, 40),
        (20, 37, 29),
        (2, 64, 130),
        // Wider than one pass of matvec's 64 threads x 8 columns, with a tail.
        (6, 3, 1100),
    ] {
        let x = rng.vec(t * cols);
        let wv = rng.vec(rows * cols);
        let xg = g.upload_f32(&x);
        for (dtype, format, tol) in weight_cases() {
            let w = matrix(rows, cols, &wv, dtype);
            // The reference: the CPU op on the weights as stored on the CPU, except when the
            // device rounds f32 weights to f16 (then the f32 weights, at the f16 tolerance).
            let want = cpu_matmul(&x, &w);
            let wg = g.upload_matrix(&w, format).unwrap();
            for which in [MatmulKernel::Vector, MatmulKernel::Tiled] {
                let got = down(&ops::matmul_with(g, &xg, &wg, which));
                check(
                    &format!(
                        "matmul {which:?} t={t} {rows}x{cols} {dtype:?}->{}",
                        format.name()
                    ),
                    &got,
                    &want,
                    tol,
                );
            }
            check(
                &format!(
                    "matmul auto t={t} {rows}x{cols} {dtype:?}->{}",
                    format.name()
                ),
                &down(&ops::matmul(g, &xg, &wg)),
                &want,
                tol,
            );
        }
    }
}

/// Quantised blocks on the device (weights.wgsl's `W == 3 ..= 8`: Q8_0, Q4_0, Q5_0, Q4_K, Q5_K,
/// Q6_K) give the CPU's product of the blocks' values: the same blocks dequantised as read, in
/// both kernels, whole and in row blocks; and the embedding gather gives the CPU's dequantised
/// rows exactly. The k-quants' rows are super-blocks of 256, so matvec's threads read 8 weights
/// of a super-block at a time (768 columns: more than one pass of its 64 threads).
#[test]
fn quantised_weights_match_the_cpu_in_both_kernels_and_the_gather() {
    let g = gpu();
    let mut rng = Rng(21);
    let small = [(1, 7, 32), (3, 33, 64), (20, 37, 96), (6, 3, 1120)];
    let k = [(1, 7, 256), (3, 5, 512), (20, 9, 256), (6, 3, 768)];
    for (dtype, format, shapes) in [
        (DType::Q8_0, WeightFormat::Q8_0, small),
        (DType::Q4_0, WeightFormat::Q4_0, small),
        (DType::Q5_0, WeightFormat::Q5_0, small),
        (DType::Q4K, WeightFormat::Q4K, k),
        (DType::Q5K, WeightFormat::Q5K, k),
        (DType::Q6K, WeightFormat::Q6K, k),
    ] {
        let name = format.name();
        for (t, rows, cols) in shapes {
            let x = rng.vec(t * cols);
            let w = matrix(rows, cols, &rng.vec(rows * cols), dtype);
            // The CPU's product of the blocks' values as f32 (its own integer kernels round
            // the activations in decode; the GPU's keep them f32).
            let want = cpu_matmul(&x, &matrix(rows, cols, &w.data.to_f32_vec(), DType::F32));
            let xg = g.upload_f32(&x);
            let whole = g.upload_matrix(&w, format).unwrap();
            let blocked = g
                .upload_matrix_blocked(&w, format, 2 * format.row_bytes(cols) as u64)
                .unwrap();
            assert_eq!(blocked.blocks(), rows.div_ceil(2));
            for wg in [&whole, &blocked] {
                for which in [MatmulKernel::Vector, MatmulKernel::Tiled] {
                    check(
                        &format!(
                            "{name} {which:?} t={t} {rows}x{cols} in {} blocks",
                            wg.blocks()
                        ),
                        &down(&ops::matmul_with(g, &xg, wg, which)),
                        &want,
                        TOL_F32,
                    );
                }
            }
            let ids: Vec<u32> = (0..rows as u32).rev().collect();
            let mut rows_want = vec![0.0; rows * cols];
            for (i, &id) in ids.iter().enumerate() {
                w.row_f32(id as usize, &mut rows_want[i * cols..(i + 1) * cols]);
            }
            let got = down(&ops::embed(g, &blocked, &g.upload_u32(&ids)));
            assert!(
                got.iter()
                    .zip(&rows_want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} embed {rows}x{cols}: the gathered rows differ from the CPU's"
            );
        }
        // A quantised matrix is never re-rounded into another device format, nor floats (or
        // another quantised type) into a quantised one.
        let (len, _) = format.block().unwrap();
        let q = matrix(2, len, &rng.vec(2 * len), dtype);
        assert!(g.upload_matrix(&q, WeightFormat::F32).is_err());
        let f = matrix(2, len, &rng.vec(2 * len), DType::F32);
        assert!(g.upload_matrix(&f, format).is_err());
        let other = if dtype == DType::Q8_0 {
            DType::Q4_0
        } else {
            DType::Q8_0
        };
        let o = matrix(2, 256, &rng.vec(512), other);
        assert!(g.upload_matrix(&o, format).is_err());
    }
    // Q4_1 (written by tether, no kernel yet) goes to the device in no format.
    let q41 = matrix(2, 32, &rng.vec(64), DType::Q4_1);
    for format in [WeightFormat::F32, WeightFormat::Q4_0, WeightFormat::Q8_0] {
        assert!(g.upload_matrix(&q41, format).is_err());
    }
}

/// Below `STEP_ROWS` rows of x, `matmul` gives every row, bit for bit, its product alone (a
/// decode step's), for every weight format the device holds: what a speculative verify pass
/// needs (`Backend::rows_are_steps`). Float rows have a tail past whole groups of 8 columns;
/// quantised rows are three k-quant super-blocks (more than one pass of matvec's threads).
#[test]
fn matmul_gives_each_row_below_step_rows_its_product_alone() {
    let g = gpu();
    let mut rng = Rng(36);
    let floats = weight_cases().into_iter().map(|(d, f, _)| (d, f, 1100));
    let quantised = [
        (DType::Q8_0, WeightFormat::Q8_0),
        (DType::Q4_0, WeightFormat::Q4_0),
        (DType::Q5_0, WeightFormat::Q5_0),
        (DType::Q4K, WeightFormat::Q4K),
        (DType::Q5K, WeightFormat::Q5K),
        (DType::Q6K, WeightFormat::Q6K),
    ];
    let rows = 5;
    for (dtype, format, cols) in floats.chain(quantised.map(|(d, f)| (d, f, 768))) {
        let w = matrix(rows, cols, &rng.vec(rows * cols), dtype);
        let wg = g.upload_matrix(&w, format).unwrap();
        let x = rng.vec((STEP_ROWS - 1) * cols);
        let product = |x: &[f32]| bits(&down(&ops::matmul(g, &g.upload_f32(x), &wg)));
        let alone: Vec<Vec<u32>> = x.chunks(cols).map(product).collect();
        for t in 2..STEP_ROWS {
            let pass = product(&x[..t * cols]);
            for (i, want) in alone[..t].iter().enumerate() {
                assert!(
                    &pass[i * rows..][..rows] == want,
                    "{dtype:?} as {}: row {i} of {t} differs from its product alone",
                    format.name()
                );
            }
        }
    }
}

/// Rows of x in groups (what a product wider than one binding takes, such as every prompt
/// row's logits over a real vocabulary) give the product of one pass, bit for bit.
#[test]
fn rows_in_groups_give_the_product_of_one_pass() {
    let g = gpu();
    let mut rng = Rng(3);
    let (t, rows, cols) = (11, 21, 40);
    let xg = g.upload_f32(&rng.vec(t * cols));
    let w = matrix(rows, cols, &rng.vec(rows * cols), DType::F32);
    let wg = g.upload_matrix(&w, WeightFormat::F32).unwrap();
    for which in [MatmulKernel::Vector, MatmulKernel::Tiled] {
        let whole = down(&ops::matmul_with(g, &xg, &wg, which));
        for group in [1, 4, 10] {
            let grouped = down(&ops::matmul_in_groups(g, &xg, &wg, which, group));
            assert!(grouped == whole, "{which:?} in groups of {group}");
        }
    }
}

#[test]
fn weights_split_into_row_blocks_give_the_same_product() {
    let g = gpu();
    let mut rng = Rng(2);
    let (t, rows, cols) = (6, 23, 9);
    let x = rng.vec(t * cols);
    let xg = g.upload_f32(&x);
    for (dtype, format) in [
        (DType::F32, WeightFormat::F32),
        (DType::F16, WeightFormat::F16Packed),
    ] {
        let w = matrix(rows, cols, &rng.vec(rows * cols), dtype);
        let want = cpu_matmul(&x, &w);
        // 4 rows per block: blocks of 4, 4, ..., 3 rows.
        let block = (4 * format.row_bytes(cols)) as u64;
        let wg = g.upload_matrix_blocked(&w, format, block).unwrap();
        assert_eq!(wg.blocks(), rows.div_ceil(4));
        for which in [MatmulKernel::Vector, MatmulKernel::Tiled] {
            check(
                &format!(
                    "matmul {which:?} in {} blocks {}",
                    wg.blocks(),
                    format.name()
                ),
                &down(&ops::matmul_with(g, &xg, &wg, which)),
                &want,
                TOL_F32,
            );
        }
    }
}

#[test]
fn embedding_gather_matches_cpu_rows() {
    let g = gpu();
    let mut rng = Rng(3);
    let (vocab, cols) = (13, 7);
    let ids: Vec<u32> = vec![0, 12, 5, 5, 7, 1, 12];
    let ids_g = g.upload_u32(&ids);
    let vals = rng.vec(vocab * cols);
    for (dtype, format, _) in weight_cases() {
        let table = matrix(vocab, cols, &vals, dtype);
        let mut want = vec![0.0; ids.len() * cols];
        for (i, &id) in ids.iter().enumerate() {
            table.row_f32(id as usize, &mut want[i * cols..(i + 1) * cols]);
        }
        for block_rows in [vocab, 3] {
            let block = (block_rows * format.row_bytes(cols)) as u64;
            let tg: GpuMatrix = g.upload_matrix_blocked(&table, format, block).unwrap();
            let got = down(&ops::embed(g, &tg, &ids_g));
            // f32 -> f16 on the device rounds; everything else is an exact copy.
            let tol = if dtype == DType::F32 && format != WeightFormat::F32 {
                TOL_F16
            } else {
                0.0
            };
            check(
                &format!(
                    "embed {dtype:?}->{} in {} blocks",
                    format.name(),
                    tg.blocks()
                ),
                &got,
                &want,
                tol,
            );
        }
    }
}

#[test]
fn norms_match_cpu() {
    let g = gpu();
    let mut rng = Rng(4);
    for (rows, dim) in [(3, 7), (5, 64), (1, 130), (9, 16)] {
        let x = rng.vec(rows * dim);
        let w = rng.vec(dim);
        let eps = 1e-6;
        // rms_norm with a Qwen offset weight (1 + w) and with a plain scale.
        for offset in [1.0f32, 0.0] {
            let scale: Vec<f32> = w.iter().map(|v| v + offset).collect();
            let mut want = x.clone();
            cpu::rms_norm(&mut want, &scale, eps);
            let xg = g.upload_f32(&x);
            ops::rms_norm(g, &xg, &g.upload_f32(&w), eps, offset);
            check(
                &format!("rms_norm {rows}x{dim} offset {offset}"),
                &down(&xg),
                &want,
                TOL_F32,
            );
        }
        let z = rng.vec(rows * dim);
        let mut want = x.clone();
        cpu::gated_rms_norm(&mut want, &z, &w, eps);
        let xg = g.upload_f32(&x);
        ops::gated_rms_norm(g, &xg, &g.upload_f32(&z), &g.upload_f32(&w), eps);
        check(
            &format!("gated_rms_norm {rows}x{dim}"),
            &down(&xg),
            &want,
            TOL_F32,
        );

        let mut want = x.clone();
        cpu::l2_norm(&mut want, dim, 1e-6, 0.25);
        let xg = g.upload_f32(&x);
        ops::l2_norm(g, &xg, dim, 1e-6, 0.25);
        check(&format!("l2_norm {rows}x{dim}"), &down(&xg), &want, TOL_F32);
    }
}

#[test]
fn rope_matches_cpu_including_far_positions() {
    let g = gpu();
    let mut rng = Rng(5);
    for (t, heads, head_dim, half, p0) in
        [(3, 2, 16, 2, 0), (5, 3, 16, 8, 7), (2, 1, 32, 4, 200_000)]
    {
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / 1e7f32.powf((2 * i) as f32 / (2 * half) as f32))
            .collect();
        let positions: Vec<usize> = (p0..p0 + t).collect();
        let x = rng.vec(t * heads * head_dim);
        let mut want = x.clone();
        cpu::rope(&mut want, head_dim, &positions, &inv_freq);
        let xg = g.upload_f32(&x);
        let table = g.upload_f32(&ops::rope_table(&positions, &inv_freq));
        ops::rope(g, &xg, head_dim, &table, t);
        check(
            &format!(
                "rope t={t} heads={heads} hd={head_dim} rot={} pos {p0}..",
                2 * half
            ),
            &down(&xg),
            &want,
            TOL_F32,
        );
    }
}

#[test]
fn elementwise_ops_match_cpu() {
    let g = gpu();
    let mut rng = Rng(6);
    for n in [1, 63, 1001] {
        let a = rng.vec(n).iter().map(|v| v * 8.0).collect::<Vec<_>>();
        let b = rng.vec(n).iter().map(|v| v * 8.0).collect::<Vec<_>>();
        let (ag, bg) = (g.upload_f32(&a), g.upload_f32(&b));
        let mut want = a.clone();
        cpu::silu_mul(&mut want, &b);
        ops::silu_mul(g, &ag, &bg);
        check(&format!("silu_mul n={n}"), &down(&ag), &want, TOL_F32);

        let ag = g.upload_f32(&a);
        let mut want = a.clone();
        cpu::sigmoid_mul(&mut want, &b);
        ops::sigmoid_mul(g, &ag, &bg);
        check(&format!("sigmoid_mul n={n}"), &down(&ag), &want, TOL_F32);

        let ag = g.upload_f32(&a);
        ops::add(g, &ag, &bg);
        ops::scale(g, &ag, -0.5);
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| (x + y) * -0.5).collect();
        check(&format!("add+scale n={n}"), &down(&ag), &want, 0.0);
    }
}

#[test]
fn copy_cols_splits_interleaved_heads() {
    let g = gpu();
    let mut rng = Rng(7);
    // q projection output [t, heads, 2 * hd] -> q and gate [t * heads, hd].
    let (rows, hd) = (5 * 3, 6);
    let qg = rng.vec(rows * 2 * hd);
    let src = g.upload_f32(&qg);
    for (col0, name) in [(0, "q"), (hd, "gate")] {
        let want = cpu::copy_cols(&qg, 2 * hd, col0, hd);
        check(
            &format!("copy_cols {name}"),
            &down(&ops::copy_cols(g, &src, 2 * hd, col0, hd)),
            &want,
            0.0,
        );
    }
}

#[test]
fn delta_gates_match_cpu() {
    let g = gpu();
    let mut rng = Rng(8);
    let (t, heads) = (7, 5);
    let a: Vec<f32> = rng.vec(t * heads).iter().map(|v| v * 30.0).collect();
    let b: Vec<f32> = rng.vec(t * heads).iter().map(|v| v * 6.0).collect();
    let neg_a: Vec<f32> = rng.vec(heads).iter().map(|v| -(v * 2.0).exp()).collect();
    let dt_bias = rng.vec(heads);
    let params = [neg_a, dt_bias].concat();
    let (mut want_g, mut want_beta) = (a.clone(), b.clone());
    cpu::delta_gates(&mut want_g, &mut want_beta, &params);
    let (ag, bg) = (g.upload_f32(&a), g.upload_f32(&b));
    ops::delta_gates(g, &ag, &bg, &g.upload_f32(&params));
    check("delta_gates g", &down(&ag), &want_g, TOL_F32);
    check("delta_gates beta", &down(&bg), &want_beta, TOL_F32);
}

#[test]
fn causal_conv_matches_cpu_for_prefill_and_step() {
    let g = gpu();
    let mut rng = Rng(9);
    let (channels, kernel) = (13, 4);
    let weight = rng.vec(channels * kernel);
    let wg = g.upload_f32(&weight);
    let mut history = rng.vec((kernel - 1) * channels);
    let hg = g.upload_f32(&history);
    // A prefill of 9, one of 2 (shorter than the history) and single steps, chained.
    for t in [9, 2, 1, 1] {
        let u = rng.vec(t * channels);
        let mut want = u.clone();
        cpu::causal_conv_silu(&mut want, &mut history, &weight, kernel);
        let out = ops::causal_conv_silu(g, &g.upload_f32(&u), &hg, &wg, kernel);
        check(&format!("conv t={t} out"), &down(&out), &want, TOL_F32);
        check(&format!("conv t={t} history"), &down(&hg), &history, 0.0);
    }
}

fn l2_normalise(x: &mut [f32], d: usize, scale: f32) {
    for row in x.chunks_mut(d) {
        let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        row.iter_mut().for_each(|v| *v = *v / n * scale);
    }
}

/// Both forms of the delta rule on `t` tokens of seeded inputs against the CPU's, from a
/// random state: outputs and the advanced state.
fn check_delta(s: DeltaShape, t: usize, rng: &mut Rng) {
    let g = gpu();
    let mut q = rng.vec(t * s.k_heads * s.dk);
    let mut k = rng.vec(t * s.k_heads * s.dk);
    l2_normalise(&mut q, s.dk, 1.0 / (s.dk as f32).sqrt());
    l2_normalise(&mut k, s.dk, 1.0);
    let v = rng.vec(t * s.v_heads * s.dv);
    // Mostly slow decay, so that the state after hundreds of tokens still remembers many.
    let gate: Vec<f32> = (0..t * s.v_heads).map(|_| -0.2 * rng.uniform()).collect();
    let beta: Vec<f32> = (0..t * s.v_heads).map(|_| rng.uniform()).collect();
    let s0 = rng.vec(s.v_heads * s.dk * s.dv);
    let up = |x: &[f32]| g.upload_f32(x);
    let (qg, kg, vg, gg, bg) = (up(&q), up(&k), up(&v), up(&gate), up(&beta));
    let inputs = || GpuDeltaInputs {
        q: &qg,
        k: &kg,
        v: &vg,
        g: &gg,
        beta: &bg,
    };
    let cpu_in = || DeltaInputs::<[f32]> {
        q: &q,
        k: &k,
        v: &v,
        g: &gate,
        beta: &beta,
    };
    for chunked in [false, true] {
        let mut st = s0.clone();
        let mut want = vec![0.0; t * s.v_heads * s.dv];
        let state = g.upload_f32(&s0);
        let out = if chunked {
            cpu::delta::chunked(s, cpu_in(), &mut st, &mut want);
            ops::delta_rule_chunked(g, s, inputs(), &state)
        } else {
            cpu::delta::recurrent(s, cpu_in(), &mut st, &mut want);
            ops::delta_rule_recurrent(g, s, inputs(), &state)
        };
        let form = if chunked { "chunked" } else { "recurrent" };
        let what = format!(
            "delta {form} t={t} {}/{} heads dk={} dv={}",
            s.k_heads, s.v_heads, s.dk, s.dv
        );
        check(&format!("{what} out"), &down(&out), &want, TOL_F32);
        check(&format!("{what} state"), &down(&state), &st, TOL_F32);
    }
}

#[test]
fn delta_rule_matches_cpu_in_both_forms() {
    let mut rng = Rng(10);
    let shapes = [
        DeltaShape {
            k_heads: 2,
            v_heads: 4,
            dk: 16,
            dv: 24,
            value_heads_tiled: false,
        },
        DeltaShape {
            k_heads: 1,
            v_heads: 2,
            dk: 32,
            dv: 80,
            value_heads_tiled: false,
        }, // llama.cpp's value-head order (a GGUF's).
        DeltaShape {
            k_heads: 2,
            v_heads: 6,
            dk: 16,
            dv: 8,
            value_heads_tiled: true,
        },
    ];
    for s in shapes {
        for t in [1usize, 5, 33, 70] {
            check_delta(s, t, &mut rng);
        }
    }
}

/// Sequences long enough that one invocation running them whole would pass llvmpipe's 65535
/// loop iterations (ops.rs's LOOP_BUDGET): the fixtures' key width from 640 tokens on, and
/// the real model's (128) from about 170. Before the kernels ran in spans, the state (then
/// every later output) went wrong there on lavapipe.
#[test]
fn delta_rule_stays_exact_past_the_software_drivers_loop_limit() {
    let mut rng = Rng(13);
    let tiny = DeltaShape {
        k_heads: 2,
        v_heads: 4,
        dk: 16,
        dv: 16,
        value_heads_tiled: false,
    };
    let real_keys = DeltaShape {
        k_heads: 1,
        v_heads: 2,
        dk: 128,
        dv: 16,
        value_heads_tiled: false,
    };
    for (s, t) in [(tiny, 700), (tiny, 2100), (real_keys, 300)] {
        check_delta(s, t, &mut rng);
    }
}

/// The same rows as a host page (for the CPU reference) and a device page.
fn pages(start: usize, len: usize, k: Vec<f32>, v: Vec<f32>) -> (KvPage, GpuKvPage) {
    let g = gpu();
    let dev = GpuKvPage {
        start,
        len,
        k: g.upload_f32(&k),
        v: g.upload_f32(&v),
        types: engine_core::backend::CacheTypes::F32,
    };
    let host = KvPage {
        start,
        len,
        k: PageRows::Values(Act::Host(k)),
        v: PageRows::Values(Act::Host(v)),
        frozen: None,
    };
    (host, dev)
}

fn partials_of(p: &GpuPartials) -> Partials {
    Partials {
        head_dim: p.head_dim,
        o: down(&p.o),
        m: down(&p.m),
        l: down(&p.l),
    }
}

/// o, m, l within `tol`; rows that saw no key exactly as the CPU's (m = -inf, l = 0, o = 0).
fn check_partials(what: &str, got: &Partials, want: &Partials, tol: f32) {
    for (r, (&mg, &mw)) in got.m.iter().zip(&want.m).enumerate() {
        if mw == f32::NEG_INFINITY {
            let d = want.head_dim;
            assert!(
                mg == f32::NEG_INFINITY
                    && got.l[r] == 0.0
                    && got.o[r * d..(r + 1) * d].iter().all(|&x| x == 0.0),
                "{what}: row {r} saw no key but has m={mg} l={}",
                got.l[r]
            );
        }
    }
    let finite = |v: &[f32]| {
        v.iter()
            .map(|x| if x.is_finite() { *x } else { 0.0 })
            .collect::<Vec<_>>()
    };
    check(&format!("{what} o"), &got.o, &want.o, tol);
    check(&format!("{what} m"), &finite(&got.m), &finite(&want.m), tol);
    check(&format!("{what} l"), &got.l, &want.l, tol);
}

#[test]
fn attention_partials_match_cpu_per_page() {
    let g = gpu();
    let mut rng = Rng(11);
    for (q_heads, kv_heads, head_dim) in [(4, 2, 16), (3, 1, 32), (2, 2, 24)] {
        let shape = AttnShape {
            q_heads,
            kv_heads,
            head_dim,
        };
        let row = kv_heads * head_dim;
        // Query rows at positions 20..20+t against pages before, across and after them.
        for t in [1usize, 5, 11] {
            let q_pos: Vec<usize> = (20..20 + t).collect();
            let q: Vec<f32> = rng
                .vec(t * q_heads * head_dim)
                .iter()
                .map(|v| v * 2.0)
                .collect();
            let qg = g.upload_f32(&q);
            let pos_g = g.upload_u32(&q_pos.iter().map(|&p| p as u32).collect::<Vec<_>>());
            for (start, len) in [(0, 13), (14, 9), (18, 37), (31, 6), (0, 1)] {
                let (page, gp) = pages(start, len, rng.vec(len * row), rng.vec(len * row));
                let want = cpu_attend(shape, &q, &q_pos, &page);
                let what =
                    format!("attention {q_heads}/{kv_heads}x{head_dim} t={t} page {start}+{len}");
                let tiled = ops::attend_page(g, shape, &qg, &pos_g, &gp, 1.0);
                check_partials(
                    &format!("{what} tiled"),
                    &partials_of(&tiled),
                    &want,
                    TOL_F32,
                );
                let split = ops::attend_page_split(g, shape, &qg, &pos_g, &gp, 1.0, 4);
                check_partials(
                    &format!("{what} split"),
                    &partials_of(&split),
                    &want,
                    TOL_F32,
                );
            }
        }
    }
}

/// Pages long enough that one `attn_prefill` invocation over the whole page would pass
/// llvmpipe's loop limit (the real head width of 256 from about 960 keys, the fixtures' 16
/// from about 10000), with query rows at its end, inside it and before it.
#[test]
fn prefill_attention_over_long_pages_matches_cpu() {
    let g = gpu();
    let mut rng = Rng(14);
    for (q_heads, kv_heads, head_dim, len) in [(2, 1, 256, 1100), (4, 2, 16, 10300)] {
        let shape = AttnShape {
            q_heads,
            kv_heads,
            head_dim,
        };
        let row = kv_heads * head_dim;
        let q_pos: Vec<usize> = (len - 12..len + 1).chain([5, 500]).collect();
        let t = q_pos.len();
        let q = rng.vec(t * q_heads * head_dim);
        let (page, gp) = pages(0, len, rng.vec(len * row), rng.vec(len * row));
        let pos_g = g.upload_u32(&q_pos.iter().map(|&p| p as u32).collect::<Vec<_>>());
        let got = ops::attend_page(g, shape, &g.upload_f32(&q), &pos_g, &gp, 0.125);
        let scaled: Vec<f32> = q.iter().map(|v| v * 0.125).collect();
        let want = cpu_attend(shape, &scaled, &q_pos, &page);
        check_partials(
            &format!("attention {q_heads}/{kv_heads}x{head_dim} page of {len}"),
            &partials_of(&got),
            &want,
            TOL_F32,
        );
    }
}

#[test]
fn attention_scale_is_applied_to_queries() {
    let g = gpu();
    let mut rng = Rng(12);
    let shape = AttnShape {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 16,
    };
    let (t, len) = (3, 10);
    let q = rng.vec(t * 2 * 16);
    let q_pos = [7usize, 8, 9];
    let (page, gp) = pages(0, len, rng.vec(len * 16), rng.vec(len * 16));
    let scale = 0.25;
    let scaled: Vec<f32> = q.iter().map(|v| v * scale).collect();
    let want = cpu_attend(shape, &scaled, &q_pos, &page);
    let got = ops::attend_page(
        g,
        shape,
        &g.upload_f32(&q),
        &g.upload_u32(&[7, 8, 9]),
        &gp,
        scale,
    );
    check_partials("attention scale", &partials_of(&got), &want, TOL_F32);
}

#[test]
fn merge_matches_the_cpu_merger() {
    let g = gpu();
    let mut rng = Rng(13);
    let shape = AttnShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let row = 2 * 16;
    let t = 5;
    let q_pos: Vec<usize> = (30..30 + t).collect();
    let q = rng.vec(t * 4 * 16);
    // Pages in order, the last one beyond every query (no key visible: skipped by the merge).
    let pages: Vec<KvPage> = [(0, 7), (7, 12), (19, 14), (33, 3), (36, 5)]
        .iter()
        .map(|&(start, len)| pages(start, len, rng.vec(len * row), rng.vec(len * row)).0)
        .collect();
    let mut merger = Merger::new(t * 4, 16);
    let mut parts = Vec::new();
    for p in &pages {
        let cpu = cpu_attend(shape, &q, &q_pos, p);
        merger.add(&cpu);
        parts.push(GpuPartials {
            rows: t * 4,
            head_dim: 16,
            o: g.upload_f32(&cpu.o),
            m: g.upload_f32(&cpu.m),
            l: g.upload_f32(&cpu.l),
        });
    }
    let want = merger.finish();
    let refs: Vec<&GpuPartials> = parts.iter().collect();
    let got = partials_of(&ops::merge_partials(g, t * 4, 16, &refs));
    check_partials("merge 5 pages", &got, &want, TOL_F32);
    // Only the invisible page: every row empty.
    let got = partials_of(&ops::merge_partials(g, t * 4, 16, &refs[4..]));
    check_partials(
        "merge empty",
        &got,
        &cpu_attend(shape, &q, &q_pos, &pages[4]),
        0.0,
    );
    // No partials at all: the same empty rows.
    let got = partials_of(&ops::merge_partials(g, t * 4, 16, &[]));
    check_partials("merge nothing", &got, &Partials::empty(t * 4, 16), 0.0);
}

/// A long context's decode merges hundreds of pages (128k positions in pages of 256 is 512):
/// the device's f32 merge stays within f32 tolerance of the f64 merger, with scores spread
/// over a wide range so most pages are rescaled.
#[test]
fn merging_hundreds_of_pages_in_f32_stays_close_to_the_f64_merger() {
    let g = gpu();
    let mut rng = Rng(15);
    let (rows, d, n) = (6, 32, 512);
    let mut merger = Merger::new(rows, d);
    let mut parts = Vec::new();
    for _ in 0..n {
        let p = Partials {
            head_dim: d,
            o: rng.vec(rows * d),
            m: rng.vec(rows).iter().map(|x| x * 20.0).collect(),
            l: rng
                .vec(rows)
                .iter()
                .map(|x| 1.0 + x.abs() * 300.0)
                .collect(),
        };
        merger.add(&p);
        parts.push(GpuPartials {
            rows,
            head_dim: d,
            o: g.upload_f32(&p.o),
            m: g.upload_f32(&p.m),
            l: g.upload_f32(&p.l),
        });
    }
    let refs: Vec<&GpuPartials> = parts.iter().collect();
    let got = partials_of(&ops::merge_partials(g, rows, d, &refs));
    check_partials("merge 512 pages", &got, &merger.finish(), TOL_F32);
}

#[test]
fn argmax_matches_cpu_with_ties() {
    let g = gpu();
    let mut rng = Rng(14);
    for (rows, n) in [(1, 1), (3, 1000), (2, 4099)] {
        let mut x = rng.vec(rows * n);
        if n > 10 {
            // A tie at the maximum: the lower index wins.
            x[n - 1] = 5.0;
            x[n - 3] = 5.0;
        }
        let want: Vec<u32> = x.chunks(n).map(engine_core::generate::argmax).collect();
        let got = g
            .download_u32(&ops::argmax(g, &g.upload_f32(&x), n))
            .unwrap();
        assert_eq!(got, want, "argmax {rows}x{n}");
    }
}

#[test]
fn one_batch_of_many_dispatches_spans_uniform_chunks() {
    // 600 dispatches in one submission: more than one 64 KiB chunk of 256-byte params slots,
    // each dispatch reading the previous one's output.
    let g = gpu();
    let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
    let a = g.upload_f32(&x);
    let one = g.upload_f32(&[1.0; 37]);
    for i in 0..600 {
        if i % 2 == 0 {
            ops::add(g, &a, &one);
        } else {
            ops::scale(g, &a, 1.0);
        }
    }
    let want: Vec<f32> = x.iter().map(|v| v + 300.0).collect();
    check("600 dispatches", &down(&a), &want, 0.0);
}

#[test]
fn ranged_copies_and_reads_take_one_submission() {
    // A device of its own: the submission counter is per device, and other tests share gpu().
    let g = Gpu::with_options(&GpuOptions::default()).unwrap();
    let x: Vec<f32> = (0..20).map(|i| i as f32).collect();
    let src = g.upload_f32(&x);
    let dst = g.alloc(12);
    g.copy(&src, 3, &dst, 0, 5);
    g.copy(&src, 10, &dst, 5, 7);
    let before = g.submits();
    let got = g
        .download_ranges(&[(&dst, 0..12), (&src, 18..20), (&dst, 2..4)])
        .unwrap();
    assert_eq!(g.submits() - before, 1, "one submission for three pieces");
    let want = [&x[3..8], &x[10..17], &x[18..20], &x[5..7]].concat();
    assert_eq!(got, want);
}

/// The output of `read`, which must be ready on its first poll: natively a read-back waits for
/// the device then, so a caller that blocks on it never waits for a wake-up.
fn ready_at_once<T>(read: impl Future<Output = T>) -> T {
    match pin!(read).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a native read-back is pending after its first poll"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Pieces of several values, in an order that revisits them, with an empty one and a host
/// value (which the backend uploads).
fn pieces<'a>(a: &'a Act, b: &'a Act, c: &'a Act, h: &'a Act) -> Vec<(&'a Act, Range<usize>)> {
    vec![
        (a, 0..37),
        (b, 250..300),
        (c, 3..4),
        (a, 10..10),
        (h, 2..9),
        (c, 0..300),
        (b, 0..1),
        (a, 30..37),
    ]
}

#[test]
fn backend_reads_as_futures_match_downloads_and_keep_the_values_of_their_call() {
    // A device of its own: the submission counter is per device, and other tests share gpu().
    let be = GpuBackend::new(&GpuOptions::default()).unwrap_or_else(|e| {
        panic!("{e}\nThe GPU op tests need a Vulkan adapter: apt-get install mesa-vulkan-drivers")
    });
    let mut rng = Rng(15);
    let mut a = be.upload(rng.vec(37));
    let b = be.upload(rng.vec(300));
    // An op's output, only recorded (not yet submitted) when the reads start.
    let mut c = be.duplicate(&b);
    be.scale(&mut c, 0.5);
    let h = Act::Host(rng.vec(9));

    let want = be.download_ranges(&pieces(&a, &b, &c, &h));
    let before = be.gpu().submits();
    let old = be.read_ranges(&pieces(&a, &b, &c, &h));
    assert_eq!(
        be.gpu().submits() - before,
        1,
        "a read's copies are submitted when it starts, all in one submission"
    );
    // Later ops change `a` and `c`; a second read starts after them.
    be.scale(&mut a, -3.0);
    be.add(&mut c, &b);
    let new = be.read_ranges(&pieces(&a, &b, &c, &h));
    let after = be.download_ranges(&pieces(&a, &b, &c, &h));
    assert_ne!(
        bits(&after[..37]),
        bits(&want[..37]),
        "the later ops change a"
    );

    // Each read owns its staging buffer: the later one can be taken first.
    assert_eq!(bits(&ready_at_once(new)), bits(&after));
    assert_eq!(
        bits(&ready_at_once(old)),
        bits(&want),
        "a read sees the values of its call, not those of ops recorded after it"
    );
    assert!(ready_at_once(be.read_ranges(&[])).is_empty());
}

/// Mesa's lavapipe (what CI and machines without a GPU run these tests on) is a software
/// adapter, which a tab's `auto` and anything else choosing a backend must pass over; a real
/// GPU is not.
#[test]
fn a_software_adapter_is_known_as_one() {
    let name = gpu().adapter_name();
    assert_eq!(
        gpu().is_software(),
        name.to_ascii_lowercase().contains("llvmpipe"),
        "{name}"
    );
}
