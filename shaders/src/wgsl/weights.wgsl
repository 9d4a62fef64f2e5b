// Weight storage, shared by the kernels that read a weight matrix (binding 1).
// W == 0: f32. W == 1: f16 pairs packed in u32, read with unpack2x16float (works on every
// adapter). W == 2: native f16 (needs the shader-f16 feature). W == 3: llama.cpp's Q8_0,
// blocks of 32 weights as 9 words (8 words of signed bytes, weight i of the block in byte
// i % 4 of word i / 4, then the block's scale as f32 bits), dequantised as they are read.
// W == 4 .. 8: llama.cpp's Q4_0, Q5_0, Q4_K, Q5_K and Q6_K, re-packed at upload (engine-core's
// backend/gpu/packing.rs) into words: f16 scales widened to f32 (exact), k-quant sub-block
// scales and mins unpacked to bytes, and each weight's level split into its low four bits,
// eight weights a word (weight 8k + n in nibble n of nibble word k), and its high bits (Q5:
// one a weight, 32 a word; Q6_K: two a weight, 16 a word), so 8 consecutive weights are one
// nibble word and part of one high-bit word. Per block, in words:
//   Q4_0 (32):  d | 4 nibble words                                                    = 5
//   Q5_0 (32):  d | 4 nibble words | fifth bits                                       = 6
//   Q4_K (256): d | dmin | 8 scale bytes (2) | 8 min bytes (2) | 32 nibble words      = 38
//   Q5_K (256): Q4_K's 38 | 8 words of fifth bits                                     = 46
//   Q6_K (256): d | 16 signed scale bytes (4) | 32 nibble words | 16 bit-pair words   = 53
// Each weight is ggml's value (quant.rs's `dequantise_into`, bit for bit, in its order):
// every product is exact in f32 (an f16 scale's 11 significant bits times integers `sc * q`
// of at most 12 bits), so only Q4_K's and Q5_K's final `(d * sc) * q - dmin * m` rounds, once,
// whether or not a compiler fuses it into an fma.
// Every format pads rows to a multiple of 8 elements (registry.rs's `row_stride`; quantised
// rows are whole blocks), so 8 consecutive elements of a row are one or two vector loads (a
// few words of one block for the quantised formats).
// `weight(e)` is element e of the bound block, widened to f32; `weight8(e)` (e a multiple of
// 8) is elements e .. e + 8.
#if W == 2
enable f16;
#endif

struct Eight {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// Nibbles n .. n + 4 of `word` (nibble n in bits 4n .. 4n + 3).
fn nibbles(word: u32, n: u32) -> vec4<u32> {
    return (vec4<u32>(word) >> (vec4<u32>(0u, 4u, 8u, 12u) + 4u * n)) & vec4<u32>(15u);
}

// Bits n .. n + 4 of `word`.
fn bits1(word: u32, n: u32) -> vec4<u32> {
    return (vec4<u32>(word) >> (vec4<u32>(0u, 1u, 2u, 3u) + n)) & vec4<u32>(1u);
}

// Bit pairs n .. n + 4 of `word` (pair n in bits 2n, 2n + 1).
fn bits2(word: u32, n: u32) -> vec4<u32> {
    return (vec4<u32>(word) >> (vec4<u32>(0u, 2u, 4u, 6u) + 2u * n)) & vec4<u32>(3u);
}

#if W == 0
@group(0) @binding(1) var<storage, read> w: array<vec4<f32>>;

fn weight(e: u32) -> f32 {
    return w[e >> 2u][e & 3u];
}

fn weight8(e: u32) -> Eight {
    let i = e >> 2u;
    return Eight(w[i], w[i + 1u]);
}
#elif W == 1
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;

fn weight(e: u32) -> f32 {
    return unpack2x16float(w[e >> 3u][(e >> 1u) & 3u])[e & 1u];
}

fn weight8(e: u32) -> Eight {
    let q = w[e >> 3u];
    return Eight(
        vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
        vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)),
    );
}
#elif W == 3
@group(0) @binding(1) var<storage, read> w: array<u32>;

// Byte `byte` of `word` as a signed integer, widened to f32.
fn q8(word: u32, byte: u32) -> f32 {
    return f32(extractBits(bitcast<i32>(word), byte * 8u, 8u));
}

fn weight(e: u32) -> f32 {
    let base = (e >> 5u) * 9u;
    let i = e & 31u;
    return bitcast<f32>(w[base + 8u]) * q8(w[base + (i >> 2u)], i & 3u);
}

fn weight8(e: u32) -> Eight {
    let base = (e >> 5u) * 9u;
    let i = (e & 31u) >> 2u;
    let d = bitcast<f32>(w[base + 8u]);
    let a = w[base + i];
    let b = w[base + i + 1u];
    return Eight(
        vec4<f32>(d * q8(a, 0u), d * q8(a, 1u), d * q8(a, 2u), d * q8(a, 3u)),
        vec4<f32>(d * q8(b, 0u), d * q8(b, 1u), d * q8(b, 2u), d * q8(b, 3u)),
    );
}
#elif W == 4
@group(0) @binding(1) var<storage, read> w: array<u32>;

fn weight(e: u32) -> f32 {
    let base = (e >> 5u) * 5u;
    let i = e & 31u;
    let q = extractBits(w[base + 1u + (i >> 3u)], (i & 7u) * 4u, 4u);
    return bitcast<f32>(w[base]) * (f32(q) - 8.0);
}

fn weight8(e: u32) -> Eight {
    let base = (e >> 5u) * 5u;
    let d = bitcast<f32>(w[base]);
    let q = w[base + 1u + ((e & 31u) >> 3u)];
    return Eight(d * (vec4<f32>(nibbles(q, 0u)) - 8.0), d * (vec4<f32>(nibbles(q, 4u)) - 8.0));
}
#elif W == 5
@group(0) @binding(1) var<storage, read> w: array<u32>;

fn weight(e: u32) -> f32 {
    let base = (e >> 5u) * 6u;
    let i = e & 31u;
    let q = extractBits(w[base + 1u + (i >> 3u)], (i & 7u) * 4u, 4u)
        | (extractBits(w[base + 5u], i, 1u) << 4u);
    return bitcast<f32>(w[base]) * (f32(q) - 16.0);
}

fn weight8(e: u32) -> Eight {
    let base = (e >> 5u) * 6u;
    let i = e & 31u;
    let d = bitcast<f32>(w[base]);
    let q = w[base + 1u + (i >> 3u)];
    let h = w[base + 5u] >> i;
    let lo = nibbles(q, 0u) | (bits1(h, 0u) << vec4<u32>(4u));
    let hi = nibbles(q, 4u) | (bits1(h, 4u) << vec4<u32>(4u));
    return Eight(d * (vec4<f32>(lo) - 16.0), d * (vec4<f32>(hi) - 16.0));
}
#elif W == 8
@group(0) @binding(1) var<storage, read> w: array<u32>;

// Sub-block j's (of 16 weights) scale `d * sc` (exact), sc a signed byte.
fn q6_scale(base: u32, j: u32) -> f32 {
    let sc = extractBits(bitcast<i32>(w[base + 1u + (j >> 2u)]), (j & 3u) * 8u, 8u);
    return bitcast<f32>(w[base]) * f32(sc);
}

fn weight(e: u32) -> f32 {
    let base = (e >> 8u) * 53u;
    let i = e & 255u;
    let q = extractBits(w[base + 5u + (i >> 3u)], (i & 7u) * 4u, 4u)
        | (extractBits(w[base + 37u + (i >> 4u)], (i & 15u) * 2u, 2u) << 4u);
    return q6_scale(base, i >> 4u) * (f32(q) - 32.0);
}

fn weight8(e: u32) -> Eight {
    let base = (e >> 8u) * 53u;
    let i = e & 255u;
    let q = w[base + 5u + (i >> 3u)];
    let h = w[base + 37u + (i >> 4u)] >> ((i & 15u) * 2u);
    let lo = nibbles(q, 0u) | (bits2(h, 0u) << vec4<u32>(4u));
    let hi = nibbles(q, 4u) | (bits2(h, 4u) << vec4<u32>(4u));
    let d = q6_scale(base, i >> 4u);
    return Eight(d * (vec4<f32>(lo) - 32.0), d * (vec4<f32>(hi) - 32.0));
}
#elif W == 2
@group(0) @binding(1) var<storage, read> w: array<vec4<f16>>;

fn weight(e: u32) -> f32 {
    return f32(w[e >> 2u][e & 3u]);
}

fn weight8(e: u32) -> Eight {
    let i = e >> 2u;
    return Eight(vec4<f32>(w[i]), vec4<f32>(w[i + 1u]));
}
#else
// W == 6 (Q4_K) or 7 (Q5_K).
@group(0) @binding(1) var<storage, read> w: array<u32>;
#if W == 6
const BLOCK_WORDS: u32 = 38u;
#else
const BLOCK_WORDS: u32 = 46u;
#endif

// Sub-block j's (of 32 weights) scale `d * sc` and min `dmin * m` (both exact), as ggml's
// dequantize_row_q{4,5}_K computes them.
fn k4_scale_min(base: u32, j: u32) -> vec2<f32> {
    let sc = extractBits(w[base + 2u + (j >> 2u)], (j & 3u) * 8u, 8u);
    let m = extractBits(w[base + 4u + (j >> 2u)], (j & 3u) * 8u, 8u);
    return vec2<f32>(bitcast<f32>(w[base]) * f32(sc), bitcast<f32>(w[base + 1u]) * f32(m));
}

fn weight(e: u32) -> f32 {
    let base = (e >> 8u) * BLOCK_WORDS;
    let i = e & 255u;
    var q = extractBits(w[base + 6u + (i >> 3u)], (i & 7u) * 4u, 4u);
#if W == 7
    q |= extractBits(w[base + 38u + (i >> 5u)], i & 31u, 1u) << 4u;
#endif
    let dm = k4_scale_min(base, i >> 5u);
    return dm.x * f32(q) - dm.y;
}

fn weight8(e: u32) -> Eight {
    let base = (e >> 8u) * BLOCK_WORDS;
    let i = e & 255u;
    let q = w[base + 6u + (i >> 3u)];
    var lo = nibbles(q, 0u);
    var hi = nibbles(q, 4u);
#if W == 7
    let h = w[base + 38u + (i >> 5u)] >> (i & 31u);
    lo |= bits1(h, 0u) << vec4<u32>(4u);
    hi |= bits1(h, 4u) << vec4<u32>(4u);
#endif
    let dm = k4_scale_min(base, i >> 5u);
    return Eight(dm.x * vec4<f32>(lo) - dm.y, dm.x * vec4<f32>(hi) - dm.y);
}
#endif
