#!/usr/bin/env bash
# A browser tab's attention throughput against the native helper's, on this machine: `tether
# bench` on a preset with most of its KV pages on one helper that joins it (--accept-helpers):
# `tether-helper --join`, or headless Chromium opening the page the host serves (WebGPU on
# SwiftShader, or the tab's CPU backend), alternated RUNS times. Prints one line per run: the
# helper, its backend, pages attended per second (query to reply, link included: what the
# host waits for) and decode tok/s. A ratio between helpers on one machine, not a GPU claim.
# Not in CI. Needs: cargo build --release -p host-native (tether carries the page, checked
# in at wasm-demo/www/pkg), `npm ci` in wasm-demo, Chromium.
# Usage: [DEPTH=1024] scripts/tab_attention.sh [RUNS] (default 3). A run on SwiftShader takes
# minutes (its prefill attends every held page for 256 query rows per ubatch).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
BIN=target/release
MODEL=${MODEL:-qwen35-0.8b}
DEPTH=${DEPTH:-1024}
# All but one page (128 positions each) of a DEPTH-token context on the helper; no split
# prefill (the tab then needs no weights).
ARGS=(--model "$MODEL" --threads 1 --depth "$DEPTH" --prompt-tokens 16 --gen 32 --ubatch 256
      --page-size 128 --host-kv-tokens 128 --split-layer 24 --helper-wait 120 --json)
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores;" \
     "flags: $(grep -o -w -E 'avx2|avx512f|avx512bw|avx512_bf16|fma' /proc/cpuinfo | sort -u | xargs)"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run_one() {
  local kind=$1 dir port code bench helper
  dir=$(mktemp -d)
  port=$(free_port)
  TETHER_CONFIG_DIR=$dir/host TETHER_CACHE_DIR=$dir/cache \
    "$BIN/tether" bench "${ARGS[@]}" --accept-helpers "127.0.0.1:$port" >"$dir/out" 2>"$dir/err" &
  bench=$!
  code=""
  until [ -n "$code" ]; do
    sleep 0.2
    code=$(sed -n 's/^pairing code for new helpers: //p' "$dir/err" | head -1)
    kill -0 "$bench" 2>/dev/null || { cat "$dir/err" >&2; exit 1; }
  done
  case $kind in
    native)
      TETHER_CONFIG_DIR=$dir/helper "$BIN/tether-helper" --join "ws://127.0.0.1:$port" \
        --pair "$code" --model "$MODEL" --threads 1 >/dev/null 2>&1 &
      ;;
    tab-*)
      TAB_TIMEOUT_MS=3600000 node wasm-demo/tests/tab.mjs \
        "http://127.0.0.1:$port/helper/?host=ws://127.0.0.1:$port&code=$code&backend=${kind#tab-}&join=1" \
        >"$dir/tab" 2>/dev/null &
      ;;
  esac
  helper=$!
  wait "$bench" || { cat "$dir/err" >&2; exit 1; }
  kill "$helper" 2>/dev/null || true
  wait "$helper" 2>/dev/null || true
  python3 - "$kind" "$dir/out" "$dir/tab" <<'PY'
import json, os, sys
kind, out, tab = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
h = out["helpers"][0]
if h["attend_pages_per_s"] is None:
    sys.exit(f"{kind}: the helper was lost before the end of the run: {out}")
backend = "cpu (native, 1 thread)"
if os.path.exists(tab) and os.path.getsize(tab):
    backend = json.loads(open(tab).readline())["backend"]
print(f"{kind:10} {backend:40} pages {h['pages']:4}  attend {h['attend_pages_per_s']:8.1f} pages/s"
      f"  decode {out['decode_tok_s']:.2f} tok/s")
PY
  rm -rf "$dir"
}

for run in $(seq "$RUNS"); do
  for kind in native tab-gpu tab-cpu; do
    run_one "$kind"
  done
done
