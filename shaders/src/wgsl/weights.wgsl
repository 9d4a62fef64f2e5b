// Weight storage, shared by the kernels that read a weight matrix (binding 1).
// W == 0: f32. W == 1: f16 pairs packed in u32, read with unpack2x16float (works on every
// adapter). W == 2: native f16 (needs the shader-f16 feature). Every format pads rows to a
// multiple of 8 elements (registry.rs's `row_stride`), so a row starts on 16 bytes and 8
// consecutive elements of a row are one or two vector loads.
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
