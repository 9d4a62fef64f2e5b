//! One function per kernel, on device buffers. Each records its dispatches into the device's
//! current batch (nothing runs until `Gpu::flush` or a download), so a caller can encode a
//! whole forward pass and submit it once. Shapes follow the CPU ops of `backend::cpu`, which
//! every function here is tested against (`tests/tests/gpu_ops.rs`); in-place CPU ops are
//! in-place here too. Shape errors are programming errors and panic, as on the CPU.

use std::ops::Range;

use shaders::{kernel, Kernel, Spec, WeightFormat};

use super::context::{grid, Bind, Gpu};
use super::tensor::{GpuMatrix, GpuTensor};
use crate::backend::{AttnShape, CacheTypes, DeltaInputs, DeltaShape, KvType, STEP_ROWS};

/// Threads per workgroup of the element-wise and row kernels (their `WG` default).
const WG: usize = 64;

/// Rows of `x` per `matvec` workgroup (its `MT`): each weight row is streamed once for this
/// many rows of `x`.
pub const MATVEC_MAX_T: usize = 4;

/// Output tile of the `matmul` kernel.
const TILE: usize = 16;

fn k(name: &str) -> &'static Kernel {
    kernel(name).unwrap_or_else(|| panic!("no kernel {name}"))
}

fn f(x: f32) -> u32 {
    x.to_bits()
}

fn u(x: usize) -> u32 {
    u32::try_from(x).expect("size fits u32")
}

fn t_of(t: &GpuTensor) -> Bind<'_> {
    Bind::Tensor(t)
}

fn weight_spec(format: WeightFormat) -> Spec {
    Spec::new().with("W", format.define())
}

/// `out[t, c] = table[ids[t], c]`; `ids` are u32 token ids below `table.rows` (checked by the
/// caller: an id outside the table leaves its row unwritten).
pub fn embed(gpu: &Gpu, table: &GpuMatrix, ids: &GpuTensor) -> GpuTensor {
    let out = gpu.alloc(ids.len() * table.cols);
    if out.is_empty() {
        return out;
    }
    for b in &table.blocks {
        gpu.dispatch(
            k("embed"),
            "embed",
            &weight_spec(table.format),
            &[
                u(ids.len()),
                u(table.cols),
                u(table.stride),
                u(b.row0),
                u(b.rows),
            ],
            &[
                (1, Bind::Buffer(&b.buffer)),
                (2, t_of(ids)),
                (3, t_of(&out)),
            ],
            grid(out.len().div_ceil(WG)),
        );
    }
    out
}

/// Which matmul kernel to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulKernel {
    /// One workgroup per weight row and group of up to [`MATVEC_MAX_T`] rows of x, each
    /// weight read once for all of them (decode steps and verify passes).
    Vector,
    /// 16 x 16 output tiles (prefill).
    Tiled,
}

/// `out[t, o] = sum_i x[t, i] * w[o, i]` (a Linear layer), the kernel picked by the number of
/// rows of `x`. Below [`STEP_ROWS`] rows, `matvec`: it sums each row of `x` alone, in the same
/// order whatever the other rows, so a speculative verify pass gives every row its decode
/// step's products bit for bit ([`crate::Backend::rows_are_steps`]); the tiled kernel's sums
/// follow its tiles. From there on (prefill) the tiled kernel, which reuses each loaded weight
/// for 16 rows.
pub fn matmul(gpu: &Gpu, x: &GpuTensor, w: &GpuMatrix) -> GpuTensor {
    let t = x.len() / w.cols;
    let which = if t < STEP_ROWS {
        MatmulKernel::Vector
    } else {
        MatmulKernel::Tiled
    };
    matmul_with(gpu, x, w, which)
}

/// [`matmul`] with the kernel chosen by the caller, in as few row groups as the binding size
/// allows (see [`matmul_in_groups`]).
pub fn matmul_with(gpu: &Gpu, x: &GpuTensor, w: &GpuMatrix, which: MatmulKernel) -> GpuTensor {
    let row_bytes = 4 * w.rows.max(w.cols) as u64;
    let group = usize::try_from(gpu.max_binding() / row_bytes).unwrap_or(usize::MAX);
    matmul_in_groups(gpu, x, w, which, group.max(1))
}

/// [`matmul`] over at most `group` rows of `x` at a time. A row of logits is the vocabulary
/// wide (1 MB for Qwen3.5's 248320 tokens), so the logits of every prompt row (`tether eval`)
/// pass one binding (128 MiB on many devices) from about 135 rows: each group's rows of `x`
/// are copied out, multiplied, and their products copied into place (copies have no binding
/// limit).
pub fn matmul_in_groups(
    gpu: &Gpu,
    x: &GpuTensor,
    w: &GpuMatrix,
    which: MatmulKernel,
    group: usize,
) -> GpuTensor {
    assert_eq!(x.len() % w.cols, 0, "x is not [t, {}]", w.cols);
    let t = x.len() / w.cols;
    let out = gpu.alloc(t * w.rows);
    if t <= group {
        matmul_into(gpu, x, w, which, &out);
        return out;
    }
    for t0 in (0..t).step_by(group) {
        let n = group.min(t - t0);
        let rows = gpu.alloc(n * w.cols);
        gpu.copy(x, t0 * w.cols, &rows, 0, n * w.cols);
        let part = gpu.alloc(n * w.rows);
        matmul_into(gpu, &rows, w, which, &part);
        gpu.copy(&part, 0, &out, t0 * w.rows, n * w.rows);
    }
    out
}

/// `out = x w^T` by `which`: one dispatch per weight block, each writing its rows' columns.
fn matmul_into(gpu: &Gpu, x: &GpuTensor, w: &GpuMatrix, which: MatmulKernel, out: &GpuTensor) {
    let t = x.len() / w.cols;
    if out.is_empty() {
        return;
    }
    for b in &w.blocks {
        let params = [
            u(t),
            u(w.cols),
            u(w.stride),
            u(b.row0),
            u(b.rows),
            u(w.rows),
        ];
        let binds = [(1, Bind::Buffer(&b.buffer)), (2, t_of(x)), (3, t_of(out))];
        let spec = weight_spec(w.format);
        match which {
            MatmulKernel::Vector => gpu.dispatch(
                k("matmul"),
                "matvec",
                &spec,
                &params,
                &binds,
                grid(t.div_ceil(MATVEC_MAX_T) * b.rows),
            ),
            MatmulKernel::Tiled => gpu.dispatch(
                k("matmul"),
                "matmul",
                &spec,
                &params,
                &binds,
                [u(b.rows.div_ceil(TILE)), u(t.div_ceil(TILE))],
            ),
        }
    }
}

/// Norm of `rows` rows of `dim` values: one workgroup per row.
fn norm(
    gpu: &Gpu,
    entry: &'static str,
    x: &GpuTensor,
    dim: usize,
    params: [u32; 3],
    binds: &[(u32, Bind)],
) {
    if x.is_empty() {
        return;
    }
    assert_eq!(x.len() % dim, 0);
    let rows = x.len() / dim;
    gpu.dispatch(
        k("norm"),
        entry,
        &Spec::new(),
        &[u(rows), u(dim), params[0], params[1], params[2]],
        binds,
        grid(rows),
    );
}

/// Each row of `x` (row length `w.len()`) becomes `x * rsqrt(mean(x^2) + eps) * (w + offset)`:
/// offset 1 for a Qwen norm weight stored as an offset, 0 for a ready scale (the CPU op's).
/// q/k norm is this op over rows of head_dim.
pub fn rms_norm(gpu: &Gpu, x: &GpuTensor, w: &GpuTensor, eps: f32, offset: f32) {
    norm(
        gpu,
        "rms_norm",
        x,
        w.len(),
        [f(eps), f(offset), 0],
        &[(1, t_of(w)), (2, t_of(x))],
    );
}

/// Per row of `w.len()` values: `x = w * (x * rsqrt(mean(x^2) + eps)) * silu(z)`.
pub fn gated_rms_norm(gpu: &Gpu, x: &GpuTensor, z: &GpuTensor, w: &GpuTensor, eps: f32) {
    assert_eq!(x.len(), z.len());
    norm(
        gpu,
        "gated_rms_norm",
        x,
        w.len(),
        [f(eps), 0, 0],
        &[(1, t_of(w)), (2, t_of(x)), (3, t_of(z))],
    );
}

/// Each row of `dim` values becomes `x * rsqrt(sum(x^2) + eps) * scale`.
pub fn l2_norm(gpu: &Gpu, x: &GpuTensor, dim: usize, eps: f32, scale: f32) {
    norm(
        gpu,
        "l2_norm",
        x,
        dim,
        [f(eps), 0, f(scale)],
        &[(2, t_of(x))],
    );
}

/// The `[t, half, 2]` (cos, sin) table [`rope`] reads, for rows at `positions`: computed on the
/// host exactly as the CPU op does (GPU sin/cos lose accuracy far from zero).
pub fn rope_table(positions: &[usize], inv_freq: &[f32]) -> Vec<f32> {
    positions
        .iter()
        .flat_map(|&p| {
            inv_freq.iter().flat_map(move |fr| {
                let (s, c) = (p as f32 * fr).sin_cos();
                [c, s]
            })
        })
        .collect()
}

/// NeoX rotate-half RoPE, in place on `x` `[t, heads, head_dim]`, with the table of
/// [`rope_table`] (`t * half * 2` values; the first `2 * half` dims of each head rotate).
pub fn rope(gpu: &Gpu, x: &GpuTensor, head_dim: usize, cos_sin: &GpuTensor, t: usize) {
    if x.is_empty() {
        return;
    }
    let half = cos_sin.len() / (2 * t);
    let heads = x.len() / (t * head_dim);
    assert_eq!(x.len(), t * heads * head_dim);
    assert!(2 * half <= head_dim && cos_sin.len() == t * half * 2);
    gpu.dispatch(
        k("rope"),
        "rope",
        &Spec::new(),
        &[u(t), u(heads), u(head_dim), u(half)],
        &[(1, t_of(cos_sin)), (2, t_of(x))],
        grid((t * heads * half).div_ceil(WG)),
    );
}

/// An element-wise entry over `n` elements.
fn elementwise(gpu: &Gpu, entry: &'static str, n: usize, params: [u32; 4], binds: &[(u32, Bind)]) {
    if n == 0 {
        return;
    }
    gpu.dispatch(
        k("elementwise"),
        entry,
        &Spec::new(),
        &[u(n), params[0], params[1], params[2], params[3]],
        binds,
        grid(n.div_ceil(WG)),
    );
}

/// `a = entry(a, b)` element by element, in place.
fn binary(gpu: &Gpu, entry: &'static str, a: &GpuTensor, b: &GpuTensor) {
    assert_eq!(a.len(), b.len(), "{entry}: operands of different lengths");
    elementwise(gpu, entry, a.len(), [0; 4], &[(1, t_of(a)), (2, t_of(b))]);
}

/// `gate = silu(gate) * up` (SwiGLU).
pub fn silu_mul(gpu: &Gpu, gate: &GpuTensor, up: &GpuTensor) {
    binary(gpu, "silu_mul", gate, up);
}

/// `x = x * sigmoid(gate)` (the attention output gate).
pub fn sigmoid_mul(gpu: &Gpu, x: &GpuTensor, gate: &GpuTensor) {
    binary(gpu, "sigmoid_mul", x, gate);
}

/// `a = a + b` (residuals).
pub fn add(gpu: &Gpu, a: &GpuTensor, b: &GpuTensor) {
    binary(gpu, "add", a, b);
}

/// `a = a * s`.
pub fn scale(gpu: &Gpu, a: &GpuTensor, s: f32) {
    elementwise(gpu, "scale", a.len(), [0, 0, 0, f(s)], &[(1, t_of(a))]);
}

/// Columns `col0 .. col0 + width` of every row of `src` (rows of `stride` values), as a new
/// `[rows, width]` tensor: q and its gate from the q projection, q/k/v from the conv output.
pub fn copy_cols(
    gpu: &Gpu,
    src: &GpuTensor,
    stride: usize,
    col0: usize,
    width: usize,
) -> GpuTensor {
    assert!(col0 + width <= stride && src.len().is_multiple_of(stride));
    let out = gpu.alloc(src.len() / stride * width);
    elementwise(
        gpu,
        "copy_cols",
        out.len(),
        [u(width), u(stride), u(col0), 0],
        &[(1, t_of(src)), (3, t_of(&out))],
    );
    out
}

/// DeltaNet's gates, in place on rows of `heads` values: `a` becomes the log decay
/// `g = neg_a * softplus(a + dt_bias)` and `b` becomes `beta = sigmoid(b)`. `params` is
/// `[neg_a | dt_bias]` (`neg_a = -exp(A_log)`), `2 * heads` values.
pub fn delta_gates(gpu: &Gpu, a: &GpuTensor, b: &GpuTensor, params: &GpuTensor) {
    assert_eq!(a.len(), b.len());
    let heads = params.len() / 2;
    assert_eq!(a.len() % heads, 0);
    elementwise(
        gpu,
        "delta_gates",
        a.len(),
        [u(heads), 0, 0, 0],
        &[(1, t_of(a)), (2, t_of(b)), (4, t_of(params))],
    );
}

/// Depthwise causal conv then SiLU of `u` `[t, channels]`; returns the output and advances
/// `history` (`[kernel - 1, channels]`, the previous inputs). `weight` is `[channels, kernel]`
/// with tap `kernel - 1` on the current token. Serves prefill and a decode step (t = 1).
pub fn causal_conv_silu(
    gpu: &Gpu,
    u_in: &GpuTensor,
    history: &GpuTensor,
    weight: &GpuTensor,
    kernel: usize,
) -> GpuTensor {
    let c = weight.len() / kernel;
    assert_eq!(u_in.len() % c, 0);
    assert_eq!(history.len(), (kernel - 1) * c);
    let t = u_in.len() / c;
    let out = gpu.alloc(u_in.len());
    if out.is_empty() {
        return out;
    }
    let params = [u(t), u(c), u(kernel)];
    let spec = Spec::new();
    gpu.dispatch(
        k("conv"),
        "conv_silu",
        &spec,
        &params,
        &[
            (1, t_of(weight)),
            (2, t_of(u_in)),
            (3, t_of(history)),
            (4, t_of(&out)),
        ],
        grid(out.len().div_ceil(WG)),
    );
    if kernel > 1 {
        gpu.dispatch(
            k("conv"),
            "conv_history",
            &spec,
            &params,
            &[(2, t_of(u_in)), (3, t_of(history))],
            grid(c.div_ceil(WG)),
        );
    }
    out
}

/// Inputs of the delta rule on the device, laid out as on the host.
pub type GpuDeltaInputs<'a> = DeltaInputs<'a, GpuTensor>;

/// Tokens per chunk of [`delta_rule_chunked`] (workgroup memory holds three CHUNK^2 matrices:
/// 12 KiB at 32, under WebGPU's 16 KiB minimum).
pub const DELTA_CHUNK: usize = 32;

/// Loop iterations one invocation of a kernel may run, all its loops together. llvmpipe (the
/// software Vulkan driver behind lavapipe, which CI and GPU-less machines run) ends every loop
/// of an invocation once 65535 iterations have run in total (gallivm's
/// `LP_MAX_TGSI_LOOP_ITERATIONS`, shared by all the loops of a shader), silently: the results
/// are then wrong, not an error. Kernels whose loops grow with the sequence (the delta rule over
/// tokens, prefill attention over a page's keys) are dispatched in spans that each stay within
/// half that limit (the counts below are upper bounds written from the kernels' loops; a driver
/// that unrolls a loop only runs fewer). What a span carries to the next (the DeltaNet state,
/// attention's running max, sum and output) waits in its buffers between spans, so where the
/// spans are cut changes no bit. Other kernels loop over model dimensions only (a matmul's
/// columns, a norm's width, the vocabulary for argmax, the pages merged), far below it.
pub const LOOP_BUDGET: usize = 32768;

/// Upper bound of the loop iterations of one `delta_chunked` invocation per chunk of
/// [`DELTA_CHUNK`] tokens with keys of `dk`: the chunk's gates, the k.k and q.k products
/// (`CHUNK^2 / WG` entries of `dk` each), the forward substitution (`CHUNK^2 / 2`), the state
/// read and write (`dk` rows of `CHUNK` each, twice) and the four per-token loops over the
/// chunk (`2 * CHUNK^2` at most).
fn delta_chunk_iterations(dk: usize) -> usize {
    let c = DELTA_CHUNK;
    c + (c * c).div_ceil(WG) * (dk + 1) + c * c / 2 + c + 2 * dk * (c + 1) + 2 * c * c + 4 * c
}

/// Upper bound of the loop iterations of one `delta_recurrent` invocation per token: two loops
/// over the `dk` rows of its state column.
fn delta_token_iterations(dk: usize) -> usize {
    2 * dk + 1
}

/// `entry` of the delta kernel over `span` tokens per dispatch (within [`LOOP_BUDGET`]).
fn delta(
    gpu: &Gpu,
    entry: &'static str,
    span: usize,
    s: DeltaShape,
    x: GpuDeltaInputs,
    state: &GpuTensor,
) -> GpuTensor {
    let t = x.g.len() / s.v_heads;
    assert_eq!(x.q.len(), t * s.k_heads * s.dk);
    assert_eq!(x.k.len(), x.q.len());
    assert_eq!(x.v.len(), t * s.v_heads * s.dv);
    assert_eq!(x.beta.len(), x.g.len());
    assert_eq!(state.len(), s.v_heads * s.dk * s.dv);
    let out = gpu.alloc(t * s.v_heads * s.dv);
    let spec = Spec::new().with("CHUNK", u(DELTA_CHUNK));
    for t0 in (0..t).step_by(span) {
        let t_end = (t0 + span).min(t);
        gpu.dispatch(
            k("delta"),
            entry,
            &spec,
            &[
                u(t0),
                u(t_end),
                u(s.k_heads),
                u(s.v_heads),
                u(s.dk),
                u(s.dv),
                u32::from(s.value_heads_tiled),
            ],
            &[
                (1, t_of(x.q)),
                (2, t_of(x.k)),
                (3, t_of(x.v)),
                (4, t_of(x.g)),
                (5, t_of(x.beta)),
                (6, t_of(state)),
                (7, t_of(&out)),
            ],
            grid(s.v_heads * s.dv.div_ceil(WG)),
        );
    }
    out
}

/// The gated delta rule token by token (decode); `state` `[v_heads, dk, dv]` is advanced;
/// returns `out` `[t, v_heads, dv]`.
pub fn delta_rule_recurrent(
    gpu: &Gpu,
    s: DeltaShape,
    x: GpuDeltaInputs,
    state: &GpuTensor,
) -> GpuTensor {
    let span = (LOOP_BUDGET / delta_token_iterations(s.dk)).max(1);
    delta(gpu, "delta_recurrent", span, s, x, state)
}

/// The same function in chunks of [`DELTA_CHUNK`] tokens (WY form; prefill).
pub fn delta_rule_chunked(
    gpu: &Gpu,
    s: DeltaShape,
    x: GpuDeltaInputs,
    state: &GpuTensor,
) -> GpuTensor {
    // Whole chunks per span, so the chunking is the one of a single dispatch.
    let span = DELTA_CHUNK * (LOOP_BUDGET / delta_chunk_iterations(s.dk)).max(1);
    delta(gpu, "delta_chunked", span, s, x, state)
}

/// KV rows of positions `start .. start + len` on the device: `k`, `v` `[len, kv_heads *
/// head_dim]` (backend's `KvPage`), stored as `types` say (f32 values, or f16 pairs packed in
/// words).
pub struct GpuKvPage {
    pub start: usize,
    pub len: usize,
    pub k: GpuTensor,
    pub v: GpuTensor,
    pub types: CacheTypes,
}

/// The attention kernel's `KT` / `VT` for rows stored as `ty`.
fn kv_define(ty: KvType) -> u32 {
    match ty {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Q8_0 => 2,
        KvType::Q4_0 => 3,
    }
}

/// Words of a device buffer holding `values` values stored as `ty`.
fn kv_words(ty: KvType, values: usize) -> usize {
    match ty {
        KvType::F32 => values,
        ty => ty.row_bytes(values).div_ceil(4),
    }
}

/// Values one thread of `pack_rows` packs into whole words: two f16, or a pair of q8_0 or
/// q4_0 blocks (68 or 36 bytes).
pub fn packed_values(ty: KvType) -> usize {
    match ty {
        KvType::F32 => 1,
        KvType::F16 => 2,
        KvType::Q8_0 | KvType::Q4_0 => 64,
    }
}

/// Values `span` of `src` written as `ty` into `dst` from value `at` on: rows written into a
/// page that stores them packed, as ggml's rows (f16 pairs; q8_0 and q4_0 blocks quantised as
/// ggml's reference quantisers do), the bytes the host and the link hold. `at` and the span
/// are whole [`packed_values`].
pub fn pack_rows(
    gpu: &Gpu,
    ty: KvType,
    src: &GpuTensor,
    span: Range<usize>,
    (dst, at): (&GpuTensor, usize),
) {
    let per = packed_values(ty);
    let entry = match ty {
        KvType::F16 => "pack_f16",
        KvType::Q8_0 => "pack_q8_0",
        KvType::Q4_0 => "pack_q4_0",
        KvType::F32 => unreachable!("f32 rows are values, not packed"),
    };
    assert!(
        at.is_multiple_of(per) && span.len().is_multiple_of(per),
        "{} rows fill whole words",
        ty.name()
    );
    let (words, n) = (kv_words(ty, at), span.len() / per);
    assert!(
        span.end <= src.len() && words + kv_words(ty, span.len()) <= dst.len(),
        "pack_rows out of bounds"
    );
    elementwise(
        gpu,
        entry,
        n,
        [u(words), 0, u(span.start), 0],
        &[(1, t_of(src)), (5, t_of(dst))],
    );
}

/// Attention partials of `rows` (query row, head) pairs, backend's `Partials` on the device:
/// `o` `[rows, head_dim]` normalised by `l`, `m` the max scaled score, `l` the exp-sum; a row
/// that saw no key has `m = -inf, l = 0, o = 0`.
pub struct GpuPartials {
    pub rows: usize,
    pub head_dim: usize,
    pub o: GpuTensor,
    pub m: GpuTensor,
    pub l: GpuTensor,
}

impl GpuPartials {
    fn alloc(gpu: &Gpu, rows: usize, head_dim: usize) -> GpuPartials {
        GpuPartials {
            rows,
            head_dim,
            o: gpu.alloc(rows * head_dim),
            m: gpu.alloc(rows),
            l: gpu.alloc(rows),
        }
    }
}

/// Query rows per `attn_prefill` workgroup (its `BQ`).
pub const PREFILL_ROWS: usize = 8;

/// Keys per workgroup when few query rows (decode) attend a page: a page of 512 keys keeps
/// 8 workgroups per (row, head) busy instead of one.
pub const DECODE_SPLIT: usize = 64;

/// Key ranges of `attn_decode`: `parts` ranges of `len` keys.
struct Split {
    parts: usize,
    len: usize,
}

/// Keys per `attn_prefill` score tile (its `BK`).
const PREFILL_KEYS: usize = 32;

/// Upper bound of the loop iterations of one `attn_prefill` invocation per tile of
/// [`PREFILL_KEYS`] keys: scoring `PREFILL_ROWS * PREFILL_KEYS / 64` (row, key) pairs of
/// `head_dim` products each, the row's max and exp-sum over the tile, and its
/// `head_dim / 8` dims each accumulating the tile's values.
fn prefill_tile_iterations(head_dim: usize) -> usize {
    let k = PREFILL_KEYS;
    1 + (PREFILL_ROWS * k).div_ceil(64) * (head_dim + 1)
        + 2 * k
        + 1
        + head_dim.div_ceil(8) * (k + 1)
}

/// Keys per `attn_prefill` dispatch: whole tiles within [`LOOP_BUDGET`], leaving room for the
/// loops before and after the tiles (loading the queries, resuming, writing).
fn prefill_span(head_dim: usize) -> usize {
    let fixed = 4 * head_dim + 2 * PREFILL_ROWS;
    PREFILL_KEYS * ((LOOP_BUDGET - fixed) / prefill_tile_iterations(head_dim)).max(1)
}

/// Upper bound of the loop iterations of one `attn_decode` invocation over `split_len` keys:
/// per 64 keys, one query's `head_dim` products, two reductions of 6 steps, and
/// `head_dim / 64` dims accumulating 64 values each.
fn decode_iterations(head_dim: usize, split_len: usize) -> usize {
    head_dim + split_len.div_ceil(64) * (1 + head_dim + 12 + head_dim.div_ceil(64) * 65)
}

/// `attn_prefill` when `split` is `None` (in spans of [`prefill_span`] keys), else
/// `attn_decode` writing `split.parts` stacked partials.
fn attend(
    gpu: &Gpu,
    shape: AttnShape,
    q: &GpuTensor,
    q_pos: &GpuTensor,
    page: &GpuKvPage,
    scale: f32,
    split: Option<Split>,
) -> GpuPartials {
    let AttnShape {
        q_heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let t = q_pos.len();
    assert_eq!(q.len(), t * q_heads * d);
    let values = page.len * kv_heads * d;
    assert!(page.k.len() >= kv_words(page.types.k, values));
    assert!(page.v.len() >= kv_words(page.types.v, values));
    let rows = t * q_heads;
    let (entry, splits, split_len, groups, span) = match split {
        None => (
            "attn_prefill",
            1,
            page.len,
            grid(t.div_ceil(PREFILL_ROWS) * q_heads),
            prefill_span(d),
        ),
        Some(s) => {
            assert!(
                decode_iterations(d, s.len) <= LOOP_BUDGET,
                "decode split of {} keys past the loop budget",
                s.len
            );
            // One dispatch: each workgroup's loop is bounded by its split.
            let span = page.len.max(1);
            ("attn_decode", s.parts, s.len, grid(rows * s.parts), span)
        }
    };
    let out = GpuPartials::alloc(gpu, splits * rows, d);
    if rows == 0 {
        return out;
    }
    // An empty page still runs one span, which writes its rows as having seen no key.
    for key_begin in (0..page.len.max(1)).step_by(span) {
        gpu.dispatch(
            k("attention"),
            entry,
            &Spec::new()
                .with("HEAD_DIM", u(d))
                .with("KT", kv_define(page.types.k))
                .with("VT", kv_define(page.types.v)),
            &[
                u(t),
                u(q_heads),
                u(kv_heads),
                u(page.start),
                u(page.len),
                f(scale),
                u(splits),
                u(split_len),
                u(key_begin),
                u((key_begin + span).min(page.len)),
            ],
            &[
                (1, t_of(q)),
                (2, t_of(q_pos)),
                (3, t_of(&page.k)),
                (4, t_of(&page.v)),
                (5, t_of(&out.o)),
                (6, t_of(&out.m)),
                (7, t_of(&out.l)),
            ],
            groups,
        );
    }
    out
}

/// Partials of query rows `q` `[t, q_heads, head_dim]` (multiplied by `scale` as they are
/// read) at positions `q_pos` (u32) over one page, causal by absolute position: the tiled
/// kernel for many query rows (prefill).
pub fn attend_page(
    gpu: &Gpu,
    shape: AttnShape,
    q: &GpuTensor,
    q_pos: &GpuTensor,
    page: &GpuKvPage,
    scale: f32,
) -> GpuPartials {
    attend(gpu, shape, q, q_pos, page, scale, None)
}

/// The same partials for few query rows (decode steps, verify passes): the page's keys are
/// cut into ranges of `split_len`, one workgroup each, then merged. A row's ranges past its
/// visible keys are empty and the merge skips them, so its partials are those of its decode
/// step, however many keys the page holds for later rows of the pass.
pub fn attend_page_split(
    gpu: &Gpu,
    shape: AttnShape,
    q: &GpuTensor,
    q_pos: &GpuTensor,
    page: &GpuKvPage,
    scale: f32,
    split_len: usize,
) -> GpuPartials {
    assert!(split_len > 0);
    let splits = page.len.div_ceil(split_len).max(1);
    let split = Split {
        parts: splits,
        len: split_len,
    };
    let parts = attend(gpu, shape, q, q_pos, page, scale, Some(split));
    if splits == 1 {
        return parts;
    }
    merge_stacked(gpu, &parts, parts.rows / splits, splits)
}

/// Merges `parts` stacked partials of `rows` rows each (`stacked.rows = parts * rows`).
fn merge_stacked(gpu: &Gpu, stacked: &GpuPartials, rows: usize, parts: usize) -> GpuPartials {
    assert_eq!(stacked.rows, parts * rows);
    let d = stacked.head_dim;
    let out = GpuPartials::alloc(gpu, rows, d);
    if rows == 0 {
        return out;
    }
    gpu.dispatch(
        k("merge"),
        "attn_merge",
        &Spec::new(),
        &[u(rows), u(d), u(parts)],
        &[
            (1, t_of(&stacked.o)),
            (2, t_of(&stacked.m)),
            (3, t_of(&stacked.l)),
            (4, t_of(&out.o)),
            (5, t_of(&out.m)),
            (6, t_of(&out.l)),
        ],
        grid((rows * d).div_ceil(WG)),
    );
    out
}

/// Merges partials of `rows` (query row, head) pairs in the order given (kv.rs's `Merger`, in
/// f32 on the device); no partials merge into empty rows (`m = -inf, l = 0, o = 0`).
pub fn merge_partials(gpu: &Gpu, rows: usize, d: usize, parts: &[&GpuPartials]) -> GpuPartials {
    if parts.is_empty() {
        return GpuPartials {
            rows,
            head_dim: d,
            o: gpu.upload_f32(&vec![0.0; rows * d]),
            m: gpu.upload_f32(&vec![f32::NEG_INFINITY; rows]),
            l: gpu.upload_f32(&vec![0.0; rows]),
        };
    }
    let stacked = GpuPartials::alloc(gpu, parts.len() * rows, d);
    for (i, p) in parts.iter().enumerate() {
        assert!(
            p.rows == rows && p.head_dim == d,
            "partials of different shapes"
        );
        gpu.copy(&p.o, 0, &stacked.o, i * rows * d, rows * d);
        gpu.copy(&p.m, 0, &stacked.m, i * rows, rows);
        gpu.copy(&p.l, 0, &stacked.l, i * rows, rows);
    }
    merge_stacked(gpu, &stacked, rows, parts.len())
}

/// Greedy sampling: the index of the largest value of each row of `x` (rows of `n`), lowest
/// index on ties, as u32.
pub fn argmax(gpu: &Gpu, x: &GpuTensor, n: usize) -> GpuTensor {
    assert!(n > 0 && x.len().is_multiple_of(n));
    let rows = x.len() / n;
    let out = gpu.alloc(rows);
    if rows > 0 {
        gpu.dispatch(
            k("argmax"),
            "argmax",
            &Spec::new(),
            &[u(rows), u(n)],
            &[(1, t_of(x)), (2, t_of(&out))],
            grid(rows),
        );
    }
    out
}
