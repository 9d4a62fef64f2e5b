// Causal depthwise conv1d then SiLU over u [t, channels], kernel taps weight [channels, kernel]
// with tap kernel - 1 on the current token. history [kernel - 1, channels] holds the inputs
// before u (zeros at the start of a sequence). The same two dispatches serve prefill (t rows)
// and a decode step (t = 1).
// conv_silu:    out[i, c] = silu(sum_j weight[c, j] * window[i + j, c]), window = history ++ u
// conv_history: history = the last kernel - 1 rows of the window (run after conv_silu)

struct Params {
    t: u32,
    channels: u32,
    kernel: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read> u: array<f32>;
@group(0) @binding(3) var<storage, read_write> history: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

fn window(r: u32, c: u32) -> f32 {
    let h = p.kernel - 1u;
    if r < h {
        return history[r * p.channels + c];
    }
    return u[(r - h) * p.channels + c];
}

@compute @workgroup_size(WG)
fn conv_silu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = gid.x + gid.y * nwg.x * WG;
    if id >= p.t * p.channels {
        return;
    }
    let i = id / p.channels;
    let c = id % p.channels;
    var acc = 0.0;
    for (var j = 0u; j < p.kernel; j++) {
        acc += weight[c * p.kernel + j] * window(i + j, c);
    }
    out[id] = acc / (1.0 + exp(-acc));
}

// One thread per channel, rows in ascending order: row j takes window row t + j > j, which
// no earlier step of this thread has overwritten.
@compute @workgroup_size(WG)
fn conv_history(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = gid.x + gid.y * nwg.x * WG;
    if c >= p.channels {
        return;
    }
    for (var j = 0u; j + 1u < p.kernel; j++) {
        history[j * p.channels + c] = window(p.t + j, c);
    }
}
