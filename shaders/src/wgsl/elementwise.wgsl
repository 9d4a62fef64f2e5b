// Element-wise ops on flat f32 arrays of n values, one thread per element.
// silu_mul:    a = silu(a) * b     (SwiGLU)
// sigmoid_mul: a = a * sigmoid(b)  (the attention output gate)
// add:         a = a + b           (residuals)
// scale:       a = a * s
// copy_cols:   dst[r, c] = a[r, col0 + c] for c < width (split q from its gate, q/k/v from
//              the conv output); a has rows of `stride`
// delta_gates: per value head h of a row of heads values, a = -exp(A_log[h]) *
//              softplus(a + dt_bias[h]) (the log decay g), b = sigmoid(b) (beta)
// pack_f16:    packed[width + i] = the f16 pair of a[col0 + 2i], a[col0 + 2i + 1], for i < n
//              (KV rows written into a page that stores them as f16: ggml's f16 rows, the
//              bytes the host and the link hold)
// pack_q8_0, pack_q4_0: pair i < n of 32-value blocks of a from col0 + 64i, quantised as
//              ggml's reference quantisers do (up to WGSL's rounding of divisions, f16
//              conversion and fused multiply-adds, which it leaves to the implementation:
//              docs/EXACTNESS.md), written as its block bytes into the words of packed from
//              width + i * (17 or 9) (two blocks fill whole words)

struct Params {
    n: u32,
    width: u32,
    stride: u32,
    col0: u32,
    s: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
// delta_gates: [neg_a | dt_bias], heads values each (heads = p.width).
@group(0) @binding(4) var<storage, read> gate_params: array<f32>;
@group(0) @binding(5) var<storage, read_write> packed: array<u32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

@compute @workgroup_size(WG)
fn silu_mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        let g = a[i];
        a[i] = g / (1.0 + exp(-g)) * b[i];
    }
}

@compute @workgroup_size(WG)
fn sigmoid_mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        a[i] = a[i] * sigmoid(b[i]);
    }
}

@compute @workgroup_size(WG)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        a[i] = a[i] + b[i];
    }
}

@compute @workgroup_size(WG)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        a[i] = a[i] * p.s;
    }
}

@compute @workgroup_size(WG)
fn copy_cols(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        dst[i] = a[(i / p.width) * p.stride + p.col0 + i % p.width];
    }
}

// torch's softplus (identity above 20); log(1 + e) loses e when e is tiny, so use its series.
fn softplus(v: f32) -> f32 {
    if v > 20.0 {
        return v;
    }
    let e = exp(v);
    if e < 1e-4 {
        return e - 0.5 * e * e;
    }
    return log(1.0 + e);
}

@compute @workgroup_size(WG)
fn delta_gates(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        let h = i % p.width;
        a[i] = gate_params[h] * softplus(a[i] + gate_params[p.width + h]);
        b[i] = sigmoid(b[i]);
    }
}

@compute @workgroup_size(WG)
fn pack_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i < p.n {
        let at = p.col0 + 2u * i;
        packed[p.width + i] = pack2x16float(vec2(a[at], a[at + 1u]));
    }
}

// The words of one pair of quantised blocks, filled a byte at a time.
var<private> pair: array<u32, 17>;

fn put_byte(at: u32, b: u32) {
    pair[at / 4u] |= (b & 0xffu) << ((at % 4u) * 8u);
}

fn put_half(at: u32, x: f32) {
    let h = pack2x16float(vec2(x, 0.0)) & 0xffffu;
    put_byte(at, h);
    put_byte(at + 1u, h >> 8u);
}

// C's roundf: halves away from zero (WGSL's round takes them to even).
fn round_away(x: f32) -> f32 {
    let t = trunc(x);
    return select(round(x), t + sign(x), abs(x - t) == 0.5);
}

fn inverse(d: f32) -> f32 {
    return select(0.0, 1.0 / d, d != 0.0);
}

@compute @workgroup_size(WG)
fn pack_q8_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i >= p.n {
        return;
    }
    for (var w = 0u; w < 17u; w++) {
        pair[w] = 0u;
    }
    for (var blk = 0u; blk < 2u; blk++) {
        let src = p.col0 + 64u * i + 32u * blk;
        var amax = 0.0;
        for (var j = 0u; j < 32u; j++) {
            amax = max(amax, abs(a[src + j]));
        }
        let d = amax / 127.0;
        let id = inverse(d);
        let base = 34u * blk;
        put_half(base, d);
        for (var j = 0u; j < 32u; j++) {
            put_byte(base + 2u + j, bitcast<u32>(i32(round_away(a[src + j] * id))));
        }
    }
    for (var w = 0u; w < 17u; w++) {
        packed[p.width + 17u * i + w] = pair[w];
    }
}

@compute @workgroup_size(WG)
fn pack_q4_0(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if i >= p.n {
        return;
    }
    for (var w = 0u; w < 9u; w++) {
        pair[w] = 0u;
    }
    for (var blk = 0u; blk < 2u; blk++) {
        let src = p.col0 + 64u * i + 32u * blk;
        // The first value of the largest magnitude, sign kept.
        var amax = 0.0;
        var most = 0.0;
        for (var j = 0u; j < 32u; j++) {
            let x = a[src + j];
            if abs(x) > amax {
                amax = abs(x);
                most = x;
            }
        }
        let d = most / -8.0;
        let id = inverse(d);
        let base = 18u * blk;
        put_half(base, d);
        for (var j = 0u; j < 16u; j++) {
            let lo = min(15u, u32(a[src + j] * id + 8.5));
            let hi = min(15u, u32(a[src + 16u + j] * id + 8.5));
            put_byte(base + 2u + j, lo | (hi << 4u));
        }
    }
    for (var w = 0u; w < 9u; w++) {
        packed[p.width + 9u * i + w] = pair[w];
    }
}
