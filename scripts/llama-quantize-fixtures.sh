#!/usr/bin/env bash
# Write tests/fixtures/gguf/*.{q4_0,q5_1,q4_k_m,...}.gguf with llama.cpp's own quantiser, so that
# tests/tests/gguf.rs loads files as llama.cpp writes them at every type tether reads:
#   - tiny_fp32.f32.gguf (the converter's, from the tiny fixture) at q4_0, q5_1 and q4_k_m: its
#     64-wide rows are not whole k-quant super-blocks, so llama-quantize falls back to Q5_0,
#     Q5_1 and Q8_0 there, as it does for such shapes of real models;
#   - the tiny256 preset (rows of 256, 2 key heads and 4 value heads), written as f32 GGUF by
#     `tether quantize`, at q2_k, q3_k_m (with Q4_K and Q5_K), q4_k_m (with Q6_K) and iq4_xs.
# Not run in CI: it needs llama.cpp's llama-quantize (scripts/bench-vs-llama.sh builds it into
# .llama/).
set -euo pipefail
cd "$(dirname "$0")/.."
quantize=${LLAMA_QUANTIZE:-.llama/llama.cpp/build/bin/llama-quantize}
out=tests/fixtures/gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for t in q4_0 q5_1 q4_k_m; do
    "$quantize" "$out/tiny_fp32.f32.gguf" "$out/tiny_fp32.$t.gguf" "$t" >"$tmp/$t.log" 2>&1
done
cargo run --release -q -p host-native -- quantize tiny256 "$tmp/tiny256.f32.gguf" --type f32 \
    --dtype f32 --weight-seed 3
for t in q2_k q3_k_m q4_k_m iq4_xs; do
    "$quantize" "$tmp/tiny256.f32.gguf" "$out/tiny256.$t.gguf" "$t" >"$tmp/$t.log" 2>&1
done
ls -l "$out"
