// The gated delta rule (cpu/delta.rs), per value head h, state S [dk, dv] in f32:
//   S = S e^g;  delta = beta (v - S^T k);  S += k (outer) delta;  o = S^T q
// q, k [t, k_heads, dk]; v [t, v_heads, dv]; g, beta [t, v_heads]; state [v_heads, dk, dv];
// out [t, v_heads, dv]. Value head h reads key head h / (v_heads / k_heads), or h % k_heads
// when `tiled` (llama.cpp's value-head order: DeltaShape::key_head).
// Every column of S evolves on its own (k, q, g, beta are shared, v and the output are per
// column), so one thread owns one column of one head: no atomics, and only the chunked form,
// whose chunk-level coefficients are shared, needs workgroup memory.
//
// delta_recurrent: token by token (decode; any t).
// delta_chunked: chunks of CHUNK tokens in the WY form (prefill). Per chunk the workgroup
//   builds the decay-weighted k.k and q.k matrices and solves the unit lower-triangular
//   system T = (I - A)^-1 by forward substitution in workgroup memory; then each thread, for
//   its column c: ks = K S[:, c], qs = Q S[:, c] (S read once),
//   v_new = T diag(beta) (v[:, c] - diag(e^gc) ks), o = diag(e^gc) qs + QK v_new, and
//   S[:, c] = e^gc_last S[:, c] + K^T diag(e^(gc_last - gc)) v_new.
// Both run tokens t0 .. t_end of the inputs: the host dispatches a long sequence in spans
// (ops.rs's LOOP_BUDGET), the state carrying over in its buffer, so spans change no bit (the
// chunked form's spans start on a chunk boundary).

struct Params {
    t0: u32,
    t_end: u32,
    k_heads: u32,
    v_heads: u32,
    dk: u32,
    dv: u32,
    tiled: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> g: array<f32>;
@group(0) @binding(5) var<storage, read> beta: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

// Workgroups take WG columns of one value head: the head is the workgroup's (from its id
// alone), the column the thread's. They are computed apart so the head stays uniform under
// WGSL's uniformity analysis, which follows values, not struct fields: an early return on a
// head taken from a struct that also holds the column is non-uniform control flow before a
// barrier, and Tint (Chrome's WebGPU) rejects the whole module, so neither entry point would
// run there (naga accepts it).
fn blocks_per_head() -> u32 {
    return (p.dv + WG - 1u) / WG;
}

fn head_of(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return (wid.x + wid.y * nwg.x) / blocks_per_head();
}

fn col_of(lid: u32, wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return ((wid.x + wid.y * nwg.x) % blocks_per_head()) * WG + lid;
}

// The key head value head h reads.
fn key_head(h: u32) -> u32 {
    if (p.tiled != 0u) {
        return h % p.k_heads;
    }
    return h / (p.v_heads / p.k_heads);
}

// Offset of token i's key-head row in q and k.
fn qk_row(i: u32, kh: u32) -> u32 {
    return (i * p.k_heads + kh) * p.dk;
}

fn v_index(i: u32, h: u32, col: u32) -> u32 {
    return (i * p.v_heads + h) * p.dv + col;
}

@compute @workgroup_size(WG)
fn delta_recurrent(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let h = head_of(wid, nwg);
    let col = col_of(lid, wid, nwg);
    if h >= p.v_heads || col >= p.dv {
        return;
    }
    let kh = key_head(h);
    let sb = h * p.dk * p.dv + col;
    for (var i = p.t0; i < p.t_end; i++) {
        let gi = i * p.v_heads + h;
        let decay = exp(g[gi]);
        let kb = qk_row(i, kh);
        var kv = 0.0;
        for (var r = 0u; r < p.dk; r++) {
            kv += state[sb + r * p.dv] * decay * k[kb + r];
        }
        let delta = (v[v_index(i, h, col)] - kv) * beta[gi];
        var o = 0.0;
        for (var r = 0u; r < p.dk; r++) {
            let s = state[sb + r * p.dv] * decay + k[kb + r] * delta;
            state[sb + r * p.dv] = s;
            o += s * q[kb + r];
        }
        out[v_index(i, h, col)] = o;
    }
}

// Chunk-level coefficients, shared by the workgroup's columns.
var<workgroup> gc: array<f32, CHUNK>;
var<workgroup> bt: array<f32, CHUNK>;
// A[i][j] = -beta_i (k_i . k_j) e^(gc_i - gc_j), j < i.
var<workgroup> a_raw: array<f32, CHUNK * CHUNK>;
// The strictly lower part of T = (I - A)^-1.
var<workgroup> tri: array<f32, CHUNK * CHUNK>;
// QK[i][j] = (q_i . k_j) e^(gc_i - gc_j), j <= i.
var<workgroup> qk: array<f32, CHUNK * CHUNK>;

@compute @workgroup_size(WG)
fn delta_chunked(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let h = head_of(wid, nwg);
    if h >= p.v_heads {
        return;
    }
    let kh = key_head(h);
    let col = col_of(lid, wid, nwg);
    let owns_col = col < p.dv;
    let sb = h * p.dk * p.dv + col;
    var qs: array<f32, CHUNK>;
    var ks: array<f32, CHUNK>;
    var vn: array<f32, CHUNK>;
    for (var c0 = p.t0; c0 < p.t_end; c0 += CHUNK) {
        let n = min(CHUNK, p.t_end - c0);
        if lid == 0u {
            var acc = 0.0;
            for (var i = 0u; i < n; i++) {
                let gi = (c0 + i) * p.v_heads + h;
                acc += g[gi];
                gc[i] = acc;
                bt[i] = beta[gi];
            }
        }
        workgroupBarrier();
        for (var e = lid; e < n * n; e += WG) {
            let i = e / n;
            let j = e % n;
            var kk = 0.0;
            var qkv = 0.0;
            if j <= i {
                let ki = qk_row(c0 + i, kh);
                let kj = qk_row(c0 + j, kh);
                for (var r = 0u; r < p.dk; r++) {
                    kk += k[ki + r] * k[kj + r];
                    qkv += q[ki + r] * k[kj + r];
                }
                let decay = exp(gc[i] - gc[j]);
                kk = -bt[i] * kk * decay;
                qkv *= decay;
            }
            a_raw[i * CHUNK + j] = select(0.0, kk, j < i);
            qk[i * CHUNK + j] = qkv;
        }
        workgroupBarrier();
        // Forward substitution, one row at a time: row i reads the raw row i and solved rows < i.
        for (var i = 1u; i < n; i++) {
            for (var j = lid; j < i; j += WG) {
                var sum = a_raw[i * CHUNK + j];
                for (var m = j + 1u; m < i; m++) {
                    sum += a_raw[i * CHUNK + m] * tri[m * CHUNK + j];
                }
                tri[i * CHUNK + j] = sum;
            }
            workgroupBarrier();
        }
        if owns_col {
            for (var i = 0u; i < n; i++) {
                qs[i] = 0.0;
                ks[i] = 0.0;
            }
            for (var r = 0u; r < p.dk; r++) {
                let s = state[sb + r * p.dv];
                for (var i = 0u; i < n; i++) {
                    let e = qk_row(c0 + i, kh) + r;
                    qs[i] += q[e] * s;
                    ks[i] += k[e] * s;
                }
            }
            for (var i = 0u; i < n; i++) {
                var u = 0.0;
                var ws = 0.0;
                for (var m = 0u; m <= i; m++) {
                    var tb = bt[m];
                    if m < i {
                        tb *= tri[i * CHUNK + m];
                    }
                    u += tb * v[v_index(c0 + m, h, col)];
                    ws += tb * exp(gc[m]) * ks[m];
                }
                vn[i] = u - ws;
            }
            for (var i = 0u; i < n; i++) {
                var o = exp(gc[i]) * qs[i];
                for (var m = 0u; m <= i; m++) {
                    o += qk[i * CHUNK + m] * vn[m];
                }
                out[v_index(c0 + i, h, col)] = o;
            }
            let last = gc[n - 1u];
            for (var m = 0u; m < n; m++) {
                ks[m] = exp(last - gc[m]) * vn[m];
            }
            let decay = exp(last);
            for (var r = 0u; r < p.dk; r++) {
                var s = state[sb + r * p.dv] * decay;
                for (var m = 0u; m < n; m++) {
                    s += k[qk_row(c0 + m, kh) + r] * ks[m];
                }
                state[sb + r * p.dv] = s;
            }
        }
        workgroupBarrier();
    }
}
