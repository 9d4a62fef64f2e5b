// Weight storage, shared by the kernels that read a weight matrix (binding 1).
// W == 0: f32. W == 1: f16 pairs packed in u32, read with unpack2x16float (works on every
// adapter). W == 2: native f16 (needs the shader-f16 feature). Both f16 forms use one buffer
// layout: row-major halves, rows padded to an even length, so a row starts on a u32.
// `weight(e)` is element e of the bound block, widened to f32.
#if W == 2
enable f16;
#endif

#if W == 0
@group(0) @binding(1) var<storage, read> w: array<f32>;

fn weight(e: u32) -> f32 {
    return w[e];
}
#elif W == 1
@group(0) @binding(1) var<storage, read> w: array<u32>;

fn weight(e: u32) -> f32 {
    let pair = unpack2x16float(w[e >> 1u]);
    return select(pair.x, pair.y, (e & 1u) == 1u);
}
#else
@group(0) @binding(1) var<storage, read> w: array<f16>;

fn weight(e: u32) -> f32 {
    return f32(w[e]);
}
#endif
