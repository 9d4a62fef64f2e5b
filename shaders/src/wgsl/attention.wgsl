// Attention partials (o, m, l) of query rows over one KV page, in kv.rs's convention: per
// (query row, q head), o is normalised by l, m is the max scaled score, l the sum of
// exp(score - m); a row that sees no key gets m = -inf, l = 0, o = 0. Causal by absolute
// position: page key j (position start + j) is visible to row r iff start + j <= pos[r].
// GQA: q head h reads kv head h / (q_heads / kv_heads). q [t, q_heads, HEAD_DIM] is multiplied
// by `scale` as it is loaded; k, v are the page's rows [len, kv_heads * HEAD_DIM], read through
// k_at / v_at in the type the page stores them in (KT, VT).
// Softmax is online (running max and sum, rescaled per key tile), all in f32.
//
// attn_prefill: BQ query rows of one head per workgroup; their scaled queries sit in workgroup
//   memory, key tiles of BK are scored into workgroup memory, and each row's output is
//   accumulated by LANES threads, each owning every LANES-th dim. One dispatch runs the page's
//   keys key_begin .. key_end (the host cuts a long page into spans: ops.rs's LOOP_BUDGET); a
//   span that does not end the page leaves its running (unnormalised o, max, sum) in o, m, l,
//   where the next span resumes from them, so the cuts change no bit.
// attn_decode: one (row, head) per workgroup, the page's visible keys cut into `splits` ranges
//   of `split_len` (one workgroup each, so a long page keeps the device busy for one query);
//   split s writes partials at [s, t * q_heads, ...], merged afterwards by attn_merge.

struct Params {
    t: u32,
    q_heads: u32,
    kv_heads: u32,
    start: u32,
    len: u32,
    scale: f32,
    splits: u32,
    split_len: u32,
    key_begin: u32,
    key_end: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
// KT, VT: how the page stores keys and values: 0 f32; else ggml's rows as the host and the link
// hold their bytes, in little-endian u32 words: 1 f16, 2 q8_0 (blocks of 32: an f16 scale, 32
// int8; 34 bytes), 3 q4_0 (an f16 scale, 16 bytes of nibbles: low nibbles values 0-15, high
// 16-31; 18 bytes). A value is widened here, as the CPU widens it: scale times level, in f32.
#if KT == 0
@group(0) @binding(3) var<storage, read> k: array<f32>;
fn k_at(i: u32) -> f32 {
    return k[i];
}
#else
@group(0) @binding(3) var<storage, read> k: array<u32>;
fn k_at(i: u32) -> f32 {
    let at = packed_at(KT, i);
    return packed_value(KT, i, k[at.x / 4u], at.x, k[at.y / 4u], at.y);
}
#endif
#if VT == 0
@group(0) @binding(4) var<storage, read> v: array<f32>;
fn v_at(i: u32) -> f32 {
    return v[i];
}
#else
@group(0) @binding(4) var<storage, read> v: array<u32>;
fn v_at(i: u32) -> f32 {
    let at = packed_at(VT, i);
    return packed_value(VT, i, v[at.x / 4u], at.x, v[at.y / 4u], at.y);
}
#endif

// Byte offsets of value i of packed rows of type `ty`: (its scale, its level); f16 values are
// their own scale.
fn packed_at(ty: u32, i: u32) -> vec2<u32> {
    switch ty {
        case 1u: {
            return vec2(2u * i, 2u * i);
        }
        case 2u: {
            let base = (i / 32u) * 34u;
            return vec2(base, base + 2u + i % 32u);
        }
        default: {
            let base = (i / 32u) * 18u;
            return vec2(base, base + 2u + i % 16u);
        }
    }
}

// The byte at offset `at` of its word `w`.
fn byte_of(w: u32, at: u32) -> u32 {
    return (w >> ((at % 4u) * 8u)) & 0xffu;
}

// The f16 at even offset `at` of its word `w`, widened.
fn half_of(w: u32, at: u32) -> f32 {
    return unpack2x16float((w >> ((at % 4u) * 8u)) & 0xffffu).x;
}

// Value i of packed rows of type `ty`, from the words holding its scale and its level.
fn packed_value(ty: u32, i: u32, scale_word: u32, scale_at: u32, level_word: u32, level_at: u32) -> f32 {
    let d = half_of(scale_word, scale_at);
    switch ty {
        case 1u: {
            return d;
        }
        case 2u: {
            return d * f32(bitcast<i32>(byte_of(level_word, level_at) << 24u) >> 24u);
        }
        default: {
            let b = byte_of(level_word, level_at);
            let q = select(b & 0xfu, b >> 4u, i % 32u >= 16u);
            return f32(i32(q) - 8) * d;
        }
    }
}

@group(0) @binding(5) var<storage, read_write> o: array<f32>;
@group(0) @binding(6) var<storage, read_write> m: array<f32>;
@group(0) @binding(7) var<storage, read_write> l: array<f32>;

// Below every score; marks keys a row cannot see (a finite value: fast-math compilers may not
// honour infinities).
const NEG: f32 = -3.0e38;

// Page keys visible to query row `row`.
fn visible(row: u32) -> u32 {
    let end = pos[row] + 1u;
    if end <= p.start {
        return 0u;
    }
    return min(end - p.start, p.len);
}

fn kv_offset(h: u32) -> u32 {
    return (h / (p.q_heads / p.kv_heads)) * HEAD_DIM;
}

fn neg_inf() -> f32 {
    var bits = 0xff800000u;
    return bitcast<f32>(bits);
}

// Writes one thread's dims of a finished partial at `idx` (row * q_heads + head, plus the
// split's offset).
fn write_partial(idx: u32, d: u32, acc: f32, mx: f32, sum: f32, first: bool) {
    if sum > 0.0 {
        o[idx * HEAD_DIM + d] = acc / sum;
    } else {
        o[idx * HEAD_DIM + d] = 0.0;
    }
    if first {
        m[idx] = select(neg_inf(), mx, sum > 0.0);
        l[idx] = sum;
    }
}

const BQ: u32 = 8u;
const LANES: u32 = 8u;
const BK: u32 = 32u;
const DPT: u32 = (HEAD_DIM + LANES - 1u) / LANES;

var<workgroup> qs: array<f32, BQ * HEAD_DIM>;
var<workgroup> probs: array<f32, BQ * BK>;
var<workgroup> row_vis: array<u32, BQ>;
var<workgroup> row_m: array<f32, BQ>;
var<workgroup> row_l: array<f32, BQ>;
var<workgroup> row_alpha: array<f32, BQ>;
var<workgroup> n_keys: u32;

@compute @workgroup_size(64)
fn attn_prefill(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let wg = wid.x + wid.y * nwg.x;
    let h = wg % p.q_heads;
    let r0 = (wg / p.q_heads) * BQ;
    if r0 >= p.t {
        return;
    }
    let kv_off = kv_offset(h);
    let kv_row = p.kv_heads * HEAD_DIM;
    for (var i = lid; i < BQ * HEAD_DIM; i += 64u) {
        let row = r0 + i / HEAD_DIM;
        var x = 0.0;
        if row < p.t {
            x = q[(row * p.q_heads + h) * HEAD_DIM + i % HEAD_DIM] * p.scale;
        }
        qs[i] = x;
    }
    let r = lid / LANES;
    let lane = lid % LANES;
    let row = r0 + r;
    let resume = p.key_begin > 0u;
    if lid < BQ {
        var vis = 0u;
        var mx = NEG;
        var sum = 0.0;
        if r0 + lid < p.t {
            vis = visible(r0 + lid);
            if resume {
                mx = m[(r0 + lid) * p.q_heads + h];
                sum = l[(r0 + lid) * p.q_heads + h];
            }
        }
        row_vis[lid] = vis;
        row_m[lid] = mx;
        row_l[lid] = sum;
    }
    var acc: array<f32, DPT>;
    if resume && row < p.t {
        for (var c = 0u; c < DPT; c++) {
            let d = lane + c * LANES;
            if d < HEAD_DIM {
                acc[c] = o[(row * p.q_heads + h) * HEAD_DIM + d];
            }
        }
    }
    workgroupBarrier();
    if lid == 0u {
        var most = 0u;
        for (var i = 0u; i < BQ; i++) {
            most = max(most, row_vis[i]);
        }
        n_keys = min(most, p.key_end);
    }
    let keys = workgroupUniformLoad(&n_keys);
    for (var k0 = p.key_begin; k0 < keys; k0 += BK) {
        // Scores of the tile; NEG where the key is not visible to the row.
        for (var i = lid; i < BQ * BK; i += 64u) {
            let rr = i / BK;
            let key = k0 + i % BK;
            var s = NEG;
            if key < row_vis[rr] {
                s = 0.0;
                let kb = key * kv_row + kv_off;
                for (var d = 0u; d < HEAD_DIM; d++) {
                    s += qs[rr * HEAD_DIM + d] * k_at(kb + d);
                }
            }
            probs[i] = s;
        }
        workgroupBarrier();
        // Per row: new running max, rescale factor for what was accumulated, probabilities.
        if lid < BQ {
            let base = lid * BK;
            var mx = NEG;
            for (var j = 0u; j < BK; j++) {
                mx = max(mx, probs[base + j]);
            }
            var alpha = 1.0;
            if mx > NEG {
                let m_new = max(row_m[lid], mx);
                alpha = exp(row_m[lid] - m_new);
                var sum = 0.0;
                for (var j = 0u; j < BK; j++) {
                    let s = probs[base + j];
                    var e = 0.0;
                    if s > NEG {
                        e = exp(s - m_new);
                    }
                    probs[base + j] = e;
                    sum += e;
                }
                row_l[lid] = row_l[lid] * alpha + sum;
                row_m[lid] = m_new;
            } else {
                for (var j = 0u; j < BK; j++) {
                    probs[base + j] = 0.0;
                }
            }
            row_alpha[lid] = alpha;
        }
        workgroupBarrier();
        let alpha = row_alpha[r];
        let nk = min(BK, keys - k0);
        for (var c = 0u; c < DPT; c++) {
            let d = lane + c * LANES;
            if d < HEAD_DIM {
                var x = acc[c] * alpha;
                for (var j = 0u; j < nk; j++) {
                    x += probs[r * BK + j] * v_at((k0 + j) * kv_row + kv_off + d);
                }
                acc[c] = x;
            }
        }
        workgroupBarrier();
    }
    if row >= p.t {
        return;
    }
    let idx = row * p.q_heads + h;
    if p.key_end < p.len {
        // Not the page's last span: hand the running values on as they are.
        for (var c = 0u; c < DPT; c++) {
            let d = lane + c * LANES;
            if d < HEAD_DIM {
                o[idx * HEAD_DIM + d] = acc[c];
            }
        }
        if lane == 0u {
            m[idx] = row_m[r];
            l[idx] = row_l[r];
        }
        return;
    }
    for (var c = 0u; c < DPT; c++) {
        let d = lane + c * LANES;
        if d < HEAD_DIM {
            write_partial(idx, d, acc[c], row_m[r], row_l[r], lane == 0u && c == 0u);
        }
    }
}

const DW: u32 = 64u;
const DPT_DECODE: u32 = (HEAD_DIM + DW - 1u) / DW;

var<workgroup> qd: array<f32, HEAD_DIM>;
var<workgroup> red: array<f32, DW>;
var<workgroup> pw: array<f32, DW>;
var<workgroup> key_range: vec2<u32>;

// Tree reduction over the workgroup; every thread gets the result. `is_max` picks max or sum.
fn reduce(lid: u32, x: f32, is_max: bool) -> f32 {
    red[lid] = x;
    workgroupBarrier();
    for (var s = DW / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            if is_max {
                red[lid] = max(red[lid], red[lid + s]);
            } else {
                red[lid] = red[lid] + red[lid + s];
            }
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(DW)
fn attn_decode(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let wg = wid.x + wid.y * nwg.x;
    let split = wg % p.splits;
    let idx = wg / p.splits;
    if idx >= p.t * p.q_heads {
        return;
    }
    let row = idx / p.q_heads;
    let kv_off = kv_offset(idx % p.q_heads);
    let kv_row = p.kv_heads * HEAD_DIM;
    for (var d = lid; d < HEAD_DIM; d += DW) {
        qd[d] = q[idx * HEAD_DIM + d] * p.scale;
    }
    if lid == 0u {
        let begin = split * p.split_len;
        key_range = vec2(begin, max(begin, min(begin + p.split_len, visible(row))));
    }
    let range = workgroupUniformLoad(&key_range);
    var m_run = NEG;
    var l_run = 0.0;
    var acc: array<f32, DPT_DECODE>;
    for (var k0 = range.x; k0 < range.y; k0 += DW) {
        let key = k0 + lid;
        var s = NEG;
        if key < range.y {
            s = 0.0;
            let kb = key * kv_row + kv_off;
            for (var d = 0u; d < HEAD_DIM; d++) {
                s += qd[d] * k_at(kb + d);
            }
        }
        let m_new = max(m_run, reduce(lid, s, true));
        let alpha = exp(m_run - m_new);
        var e = 0.0;
        if key < range.y {
            e = exp(s - m_new);
        }
        pw[lid] = e;
        l_run = l_run * alpha + reduce(lid, e, false);
        m_run = m_new;
        let nk = min(DW, range.y - k0);
        for (var c = 0u; c < DPT_DECODE; c++) {
            let d = lid + c * DW;
            if d < HEAD_DIM {
                var x = acc[c] * alpha;
                for (var j = 0u; j < nk; j++) {
                    x += pw[j] * v_at((k0 + j) * kv_row + kv_off + d);
                }
                acc[c] = x;
            }
        }
        workgroupBarrier();
    }
    let out_idx = split * p.t * p.q_heads + idx;
    for (var c = 0u; c < DPT_DECODE; c++) {
        let d = lid + c * DW;
        if d < HEAD_DIM {
            write_partial(out_idx, d, acc[c], m_run, l_run, d == 0u);
        }
    }
}
