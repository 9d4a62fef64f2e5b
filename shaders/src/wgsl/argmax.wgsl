// Greedy sampling on the device: out[r] = the index of the largest value of row r of x
// [rows, n]; ties go to the lowest index (torch's argmax). One workgroup per row.

struct Params {
    rows: u32,
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

const NONE: u32 = 0xffffffffu;

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

// (v, i) beats (bv, bi): larger, or equal with a lower index; anything beats no candidate.
fn beats(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return i != NONE && (bi == NONE || v > bv || (v == bv && i < bi));
}

@compute @workgroup_size(WG)
fn argmax(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = wid.x + wid.y * nwg.x;
    if row >= p.rows {
        return;
    }
    var bv = 0.0;
    var bi = NONE;
    for (var i = lid; i < p.n; i += WG) {
        let v = x[row * p.n + i];
        if beats(v, i, bv, bi) {
            bv = v;
            bi = i;
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s && beats(best_v[lid + s], best_i[lid + s], best_v[lid], best_i[lid]) {
            best_v[lid] = best_v[lid + s];
            best_i[lid] = best_i[lid + s];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        out[row] = best_i[0];
    }
}
