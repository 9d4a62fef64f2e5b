#!/usr/bin/env bash
# The GPU op benches (engine-core/benches/gpu_ops.rs) on a lent device machine (an H200 through
# Vulkan), in two steps, so the device time is spent running, not building:
#
#   scripts/device-gpu-bench.sh prepare   # here: build the bench binary into .bench/, fetch
#                                         # the Vulkan loader packages into .gl/ (both ignored)
#   then, through the device tool, with carry [".bench", ".gl"] and a timeout of ~400 s:
#   bash scripts/device-gpu-bench.sh run  # there: unpack the loader, run, log to $OUT/bench.log
#
# Criterion prints each op's throughput in GiB/s of bytes the op must read; docs/PERFORMANCE.md
# compares them with the card's copy bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    for d in /.bench/ /.gl/; do
        grep -qxF "$d" .git/info/exclude || echo "$d" >>.git/info/exclude
    done
    exe=$(cargo bench -p engine-core --features gpu --bench gpu_ops --no-run \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_ops" and m.get("executable"):
        print(m["executable"])')
    rm -rf .bench && mkdir -p .bench && cp "$exe" .bench/gpu_ops
    # Debug info would take it past the 64 MiB a device call carries.
    strip .bench/gpu_ops
    rm -rf .gl && mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update >/dev/null
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download libvulkan1)
    du -sh .bench .gl
    ;;
run)
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
    out=${OUT:-/tmp}
    WGPU_BACKEND=vulkan .bench/gpu_ops --bench --noplot 2>&1 | tee "$out/bench.log"
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
