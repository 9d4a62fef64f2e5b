// Row norms, in place on x [rows, dim], one workgroup per row, f32 sums reduced in
// workgroup memory.
// rms_norm:       x * rsqrt(mean(x^2) + eps) * (w + offset)   (offset 1 for Qwen's 1 + w)
// gated_rms_norm: w * (x * rsqrt(mean(x^2) + eps)) * silu(z)  (DeltaNet's output norm)
// l2_norm:        x * rsqrt(sum(x^2) + eps) * scale

struct Params {
    rows: u32,
    dim: u32,
    eps: f32,
    offset: f32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read> z: array<f32>;

var<workgroup> partial: array<f32, WG>;

// Sum of squares of row `base`, the same value in every thread of the workgroup.
fn sum_squares(base: u32, lid: u32) -> f32 {
    var acc = 0.0;
    for (var i = lid; i < p.dim; i += WG) {
        let v = x[base + i];
        acc += v * v;
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

fn row_of(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

@compute @workgroup_size(WG)
fn rms_norm(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = row_of(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = row * p.dim;
    let inv = 1.0 / sqrt(sum_squares(base, lid) / f32(p.dim) + p.eps);
    for (var i = lid; i < p.dim; i += WG) {
        x[base + i] = x[base + i] * inv * (w[i] + p.offset);
    }
}

@compute @workgroup_size(WG)
fn gated_rms_norm(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = row_of(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = row * p.dim;
    let inv = 1.0 / sqrt(sum_squares(base, lid) / f32(p.dim) + p.eps);
    for (var i = lid; i < p.dim; i += WG) {
        x[base + i] = w[i] * (x[base + i] * inv) * silu(z[base + i]);
    }
}

@compute @workgroup_size(WG)
fn l2_norm(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = row_of(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = row * p.dim;
    let inv = 1.0 / sqrt(sum_squares(base, lid) + p.eps);
    for (var i = lid; i < p.dim; i += WG) {
        x[base + i] = x[base + i] * inv * p.scale;
    }
}
