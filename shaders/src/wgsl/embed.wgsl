// Embedding gather: out[t, c] = table[ids[t], c], for the ids that fall in this block of
// table rows [row0, row0 + rows) (a table larger than one binding is split into row blocks,
// one dispatch each; other ids are left for their block's dispatch).

struct Params {
    tokens: u32,
    cols: u32,
    w_stride: u32,
    row0: u32,
    rows: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if i >= p.tokens * p.cols {
        return;
    }
    let id = ids[i / p.cols];
    if id < p.row0 || id - p.row0 >= p.rows {
        return;
    }
    out[i] = weight((id - p.row0) * p.w_stride + i % p.cols);
}
