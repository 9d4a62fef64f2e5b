#!/usr/bin/env bash
# The GPU backend on a lent device machine (an H200 through Vulkan), in two steps, so the
# device time is spent running, not building:
#
#   scripts/device-gpu-bench.sh prepare   # here: build what runs there into .dev/ (ignored):
#                                         # the GPU test binaries, the op benches
#                                         # (engine-core/benches/gpu_ops.rs), `tether` and the
#                                         # small fixtures, packed; the Vulkan loader into .gl/
#   then, through the device tool, with carry [".dev", ".gl"] and a timeout of ~560 s:
#   bash scripts/device-gpu-bench.sh run  # there: unpack the loader, then
#     1. the op benches (criterion: GiB/s of bytes each op must read);
#     2. the GPU tests (gpu_ops, gpu_model and the GGUF tests that run on the GPU) on the card;
#     3. `tether bench --backend gpu` on the 0.8B-shaped model as f16, Q8_0, Q4_0 and Q4_K_M
#        GGUFs written there by `tether quantize` from the preset;
#   each logged under $OUT.
#
# docs/PERFORMANCE.md compares the op figures with the card's copy bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."

# The test and bench executables cargo builds for `args`, one path per line.
executables() {
    cargo "$@" --message-format=json 2>/dev/null | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}

case "${1:-}" in
prepare)
    for d in /.dev/ /.gl/; do
        grep -qxF "$d" .git/info/exclude || echo "$d" >>.git/info/exclude
    done
    rm -rf .dev /tmp/tether-dev && mkdir -p .dev /tmp/tether-dev/bin /tmp/tether-dev/fixtures
    # For x86-64-v3, not this CPU (.cargo/config.toml's target-cpu=native): the device's CPU
    # may lack instructions this one has (a test binary built here for an AVX-512 EPYC died
    # there of SIGILL). Its own target directory keeps the native builds.
    export RUSTFLAGS="-C target-cpu=x86-64-v3" CARGO_TARGET_DIR=$PWD/target/portable
    cargo build --release -q -p host-native
    cp target/portable/release/tether /tmp/tether-dev/bin/
    executables bench -p engine-core --features gpu --bench gpu_ops --no-run |
        while read -r name exe; do [ "$name" = gpu_ops ] && cp "$exe" /tmp/tether-dev/bin/gpu_ops_bench; done
    executables test --release -p tests --test gpu_ops --test gpu_model --test gguf --no-run |
        while read -r name exe; do cp "$exe" "/tmp/tether-dev/bin/test_$name"; done
    strip /tmp/tether-dev/bin/*
    fixtures=${TETHER_FIXTURES:-/work/shared/fixtures}
    cp -r "$fixtures"/tiny_* /tmp/tether-dev/fixtures/
    # Debug info and the tokenizer would take it past the 64 MiB a device call carries.
    tar -C /tmp/tether-dev -cJf .dev/dev.tar.xz bin fixtures
    rm -rf .gl && mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update >/dev/null
    # shellcheck disable=SC2086
    # The loader, and the GL dispatch libraries NVIDIA's Vulkan driver links to.
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    du -sh .dev .gl
    ;;
run)
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    export WGPU_BACKEND=vulkan
    out=${OUT:-/tmp}
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>&1 | tee "$out/gpu.txt" || true
    (nproc && grep -m1 "model name" /proc/cpuinfo) >>"$out/gpu.txt"
    d=/tmp/tether-dev && rm -rf $d && mkdir -p $d && tar -C $d -xJf .dev/dev.tar.xz
    export TETHER_FIXTURES=$d/fixtures
    # 1. The op benches.
    timeout 150 "$d/bin/gpu_ops_bench" --bench --noplot --warm-up-time 1 --measurement-time 3 2>&1 |
        tee "$out/bench.log" || true
    # 2. The GPU tests, on the card (each binary run in the tests crate's directory, as cargo
    # runs it, for the committed GGUF fixtures).
    (cd tests && for t in gpu_ops gpu_model; do
        timeout 60 "$d/bin/test_$t" --test-threads 4 2>&1 || echo "FAILED: $t"
    done && timeout 60 "$d/bin/test_gguf" gpu 2>&1 || echo "FAILED: gguf gpu") | tee "$out/tests.log"
    # 3. The whole model, 512 prompt tokens and 64 generated, on the GPU backend.
    m=$d/model && t=$d/bin/tether && mkdir -p $m
    for q in f16 q8_0 q4_0 q4_k_m; do
        timeout 40 $t quantize qwen35-0.8b $m/$q.gguf --type $q >/dev/null 2>&1
        echo "== $q"
        timeout 40 $t bench --model $m/$q.gguf --backend gpu --prompt-tokens 512 --gen 64 2>&1 || echo "FAILED: $q"
    done | tee "$out/model.log"
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
