// NeoX rotate-half RoPE, in place on x [t, heads, head_dim], on the first 2 * half dims of
// each head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). cos and sin come from a table
// [t, half, 2] computed on the host: GPU sin/cos are only accurate near [-pi, pi], and
// position * frequency reaches 2.6e5 radians.

struct Params {
    t: u32,
    heads: u32,
    head_dim: u32,
    half: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> cs: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(WG)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = gid.x + gid.y * nwg.x * WG;
    if id >= p.t * p.heads * p.half {
        return;
    }
    let i = id % p.half;
    let head = id / p.half;
    let tt = head / p.heads;
    let base = head * p.head_dim;
    let c = cs[tt * p.half + i];
    let x1 = x[base + i];
    let x2 = x[base + i + p.half];
    x[base + i] = x1 * c.x - x2 * c.y;
    x[base + i + p.half] = x2 * c.x + x1 * c.y;
}
