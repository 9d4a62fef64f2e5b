// Weight storage, shared by the kernels that read a weight matrix (binding 1).
// W == 0: f32. W == 1: f16 pairs packed in u32, read with unpack2x16float (works on every
// adapter). W == 2: native f16 (needs the shader-f16 feature). W == 3: llama.cpp's Q8_0,
// blocks of 32 weights as 9 words (8 words of signed bytes, weight i of the block in byte
// i % 4 of word i / 4, then the block's scale as f32 bits), dequantised as they are read.
// Every format pads rows to a multiple of 8 elements (registry.rs's `row_stride`; Q8_0 rows
// are whole blocks), so 8 consecutive elements of a row are one or two vector loads (two
// words of one block for Q8_0).
// `weight(e)` is element e of the bound block, widened to f32; `weight8(e)` (e a multiple of
// 8) is elements e .. e + 8.
#if W == 2
enable f16;
#endif

struct Eight {
    lo: vec4<f32>,
    hi: vec4<f32>,
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
#else
@group(0) @binding(1) var<storage, read> w: array<vec4<f16>>;

fn weight(e: u32) -> f32 {
    return f32(w[e >> 2u][e & 3u]);
}

fn weight8(e: u32) -> Eight {
    let i = e >> 2u;
    return Eight(vec4<f32>(w[i]), vec4<f32>(w[i + 1u]));
}
#endif
