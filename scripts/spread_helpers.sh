#!/usr/bin/env bash
# The cost of spreading a sequence's KV pages over 1, 2 and 3 helpers: `tether bench` with the
# same host budget and the pages going to N `tether-helper` processes on loopback (plain links,
# one thread each), alternated RUNS times. Prints one line per run: helpers, decode tok/s,
# link bytes and messages per decode token over all helpers, and each helper's pages. Not in CI (minutes of release-build runs).
# Usage: scripts/spread_helpers.sh [RUNS] (default 2); builds nothing: cargo build --release first.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-2}
BIN=target/release
MODEL=${MODEL:-qwen35-0.8b}
ARGS=(--model "$MODEL" --threads 1 --depth 2048 --prompt-tokens 128 --gen 32 --ubatch 256
      --page-size 128 --host-kv-tokens 512 --split-layer 24 --insecure --json)
helpers=()
start_helpers() {
  for _ in $(seq "$1"); do
    exec {fd}< <("$BIN/tether-helper" --model "$MODEL" --listen 127.0.0.1:0 --threads 1 --insecure 2>/dev/null)
    read -r line <&"$fd"
    helpers+=(--helper "${line##* }")
  done
}
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores;" \
     "flags: $(grep -o -w -E 'avx2|avx512f|avx512bw|avx512_bf16|fma' /proc/cpuinfo | sort -u | xargs)"
for run in $(seq "$RUNS"); do
  for n in 1 2 3; do
    helpers=()
    start_helpers "$n"
    out=$("$BIN/tether" bench "${ARGS[@]}" "${helpers[@]}")
    pkill -f "$BIN/tether-helper --model $MODEL --listen 127.0.0.1:0" || true
    python3 - "$run" "$n" "$out" <<'PY'
import json, sys
run, n, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tok = out["gen_tokens"]
hs = out["helpers"]
b = sum(h["decode_bytes"] for h in hs) / tok
m = sum(h["decode_messages"] for h in hs) / tok
pages = "/".join(str(h["pages"]) for h in hs)
print(f"run {run} helpers {n}: decode {out['decode_tok_s']:.2f} tok/s; link per decode token "
      f"{b:.0f} bytes in {m:.1f} messages (all helpers); pages per helper {pages}")
PY
  done
done
