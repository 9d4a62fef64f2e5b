// Exact merge of attention partials, in the order given (kv.rs's Merger, in f32):
// M = max m_i; o = sum o_i l_i e^(m_i - M) / sum l_i e^(m_i - M); l = sum l_i e^(m_i - M).
// Inputs are `parts` stacked partials: o [parts, rows, dim], m and l [parts, rows]. A part
// with l = 0 saw no key and is skipped; a row no part saw gets m = -inf, l = 0, o = 0. A row
// only one part saw keeps that part as it is (the formula's o l / l would round o): a decode
// step's row may have one part where the same row in a pass over more rows has that part and
// empty ones (key ranges and pages past its position), and both must give the same bits.
// One thread per (row, dim).

struct Params {
    rows: u32,
    dim: u32,
    parts: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> o_in: array<f32>;
@group(0) @binding(2) var<storage, read> m_in: array<f32>;
@group(0) @binding(3) var<storage, read> l_in: array<f32>;
@group(0) @binding(4) var<storage, read_write> o: array<f32>;
@group(0) @binding(5) var<storage, read_write> m: array<f32>;
@group(0) @binding(6) var<storage, read_write> l: array<f32>;

@compute @workgroup_size(WG)
fn attn_merge(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = gid.x + gid.y * nwg.x * WG;
    if id >= p.rows * p.dim {
        return;
    }
    let row = id / p.dim;
    var mx = 0.0;
    var seen = 0u;
    var last = 0u;
    for (var i = 0u; i < p.parts; i++) {
        let j = i * p.rows + row;
        if l_in[j] > 0.0 {
            if seen == 0u || m_in[j] > mx {
                mx = m_in[j];
            }
            seen++;
            last = j;
        }
    }
    if seen == 1u {
        o[id] = o_in[last * p.dim + id % p.dim];
        if id % p.dim == 0u {
            m[row] = mx;
            l[row] = l_in[last];
        }
        return;
    }
    var sum = 0.0;
    var acc = 0.0;
    for (var i = 0u; i < p.parts; i++) {
        let j = i * p.rows + row;
        if l_in[j] > 0.0 {
            let wgt = l_in[j] * exp(m_in[j] - mx);
            sum += wgt;
            acc += wgt * o_in[j * p.dim + id % p.dim];
        }
    }
    var neg_inf_bits = 0xff800000u;
    if seen > 0u {
        o[id] = acc / sum;
    } else {
        o[id] = 0.0;
        mx = bitcast<f32>(neg_inf_bits);
    }
    if id % p.dim == 0u {
        m[row] = mx;
        l[row] = sum;
    }
}
