// out[t, row0 + r] = sum_c x[t, c] * w[r, c] for the rows r of one weight block (a Linear layer
// without bias; a matrix larger than one binding is split into row blocks, one dispatch each).
// Accumulation is in f32 whatever the weight storage.
//
// `matvec`: few rows of x (decode). One workgroup per weight row and group of up to MT rows of
// x streams the weight row once: each thread takes 8 columns at a time (one or two vector
// loads, rows being padded to 8), and the WG threads reduce in workgroup memory.
// `matmul`: many rows of x (prefill). TILE x TILE outputs per workgroup; x and w tiles of
// TILE columns are staged in workgroup memory so each loaded value serves TILE products.

struct Params {
    t: u32,
    cols: u32,
    w_stride: u32,
    row0: u32,
    rows: u32,
    // Row length of `out` (all blocks' rows).
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// Rows of x per matvec workgroup (ops.rs's MATVEC_MAX_T).
const MT: u32 = 4u;

var<workgroup> partial: array<f32, MT * WG>;

fn x8(i: u32) -> Eight {
    return Eight(
        vec4<f32>(x[i], x[i + 1u], x[i + 2u], x[i + 3u]),
        vec4<f32>(x[i + 4u], x[i + 5u], x[i + 6u], x[i + 7u]),
    );
}

@compute @workgroup_size(WG)
fn matvec(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let id = wid.x + wid.y * nwg.x;
    let r = id % p.rows;
    let t0 = (id / p.rows) * MT;
    if t0 >= p.t {
        return;
    }
    let nt = min(MT, p.t - t0);
    let base = r * p.w_stride;
    let full = p.cols & ~7u;
    var acc: array<f32, MT>;
    for (var c = lid * 8u; c < full; c += WG * 8u) {
        let wv = weight8(base + c);
        for (var j = 0u; j < nt; j++) {
            let xv = x8((t0 + j) * p.cols + c);
            acc[j] += dot(wv.lo, xv.lo) + dot(wv.hi, xv.hi);
        }
    }
    for (var c = full + lid; c < p.cols; c += WG) {
        let wv = weight(base + c);
        for (var j = 0u; j < nt; j++) {
            acc[j] += x[(t0 + j) * p.cols + c] * wv;
        }
    }
    for (var j = 0u; j < MT; j++) {
        partial[j * WG + lid] = acc[j];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            for (var j = 0u; j < MT; j++) {
                partial[j * WG + lid] += partial[j * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if lid < nt {
        out[(t0 + lid) * p.n + p.row0 + r] = partial[lid * WG];
    }
}

const TILE: u32 = 16u;

var<workgroup> xs: array<array<f32, TILE>, TILE>;
var<workgroup> ws: array<array<f32, TILE>, TILE>;

// Workgroup (i, j) computes weight rows i*TILE.. against x rows j*TILE..; thread (a, b) owns
// weight row a and x row b of the tile.
@compute @workgroup_size(TILE, TILE)
fn matmul(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = wid.x * TILE + lid.x;
    let tt = wid.y * TILE + lid.y;
    // The rows this thread loads: x row (wid.y * TILE + lid.y), weight row (wid.x * TILE + lid.y).
    let load_r = wid.x * TILE + lid.y;
    var acc = 0.0;
    for (var c0 = 0u; c0 < p.cols; c0 += TILE) {
        let c = c0 + lid.x;
        var xv = 0.0;
        var wv = 0.0;
        if c < p.cols {
            if tt < p.t {
                xv = x[tt * p.cols + c];
            }
            if load_r < p.rows {
                wv = weight(load_r * p.w_stride + c);
            }
        }
        xs[lid.y][lid.x] = xv;
        ws[lid.y][lid.x] = wv;
        workgroupBarrier();
        for (var k = 0u; k < TILE; k++) {
            acc += xs[lid.y][k] * ws[lid.x][k];
        }
        workgroupBarrier();
    }
    if r < p.rows && tt < p.t {
        out[tt * p.n + p.row0 + r] = acc;
    }
}
