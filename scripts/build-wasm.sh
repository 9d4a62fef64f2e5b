#!/usr/bin/env bash
# The browser helper: wasm-demo for wasm32 (release), wrapped by wasm-bindgen for the page in
# wasm-demo/www (helper.html imports pkg/wasm_demo.js). wasm-opt from npm's binaryen (wasm-demo's
# devDependencies, after `npm ci` in wasm-demo) shrinks it when installed; Debian's wasm-opt
# emits broken modules, so only that one is used. Prints the sizes, raw and gzipped.
set -euo pipefail
cd "$(dirname "$0")/.."

want=$(sed -n 's/^wasm-bindgen = "=\(.*\)"$/\1/p' wasm-demo/Cargo.toml)
have=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')
if [ "$have" != "$want" ]; then
  echo "wasm-bindgen $want is needed (found: ${have:-none}): cargo install wasm-bindgen-cli --version $want" >&2
  exit 1
fi

cargo build -p wasm-demo --target wasm32-unknown-unknown --release
target="${CARGO_TARGET_DIR:-target}"
out=wasm-demo/www/pkg
rm -rf "$out"
wasm-bindgen --target web --no-typescript --out-dir "$out" \
  "$target/wasm32-unknown-unknown/release/wasm_demo.wasm"

wasm="$out/wasm_demo_bg.wasm"
opt=wasm-demo/node_modules/.bin/wasm-opt
if [ -x "$opt" ]; then
  before=$(stat -c %s "$wasm")
  "$opt" -O2 --enable-bulk-memory --enable-nontrapping-float-to-int --enable-sign-ext \
    --enable-mutable-globals --enable-reference-types --enable-multivalue \
    "$wasm" -o "$wasm.opt"
  mv "$wasm.opt" "$wasm"
  echo "wasm-opt (npm binaryen): $before -> $(stat -c %s "$wasm") bytes"
else
  echo "no $opt (npm ci in wasm-demo installs it): the module is not optimised further"
fi
raw=$(stat -c %s "$wasm")
gz=$(gzip -9 -c "$wasm" | wc -c)
echo "wasm_demo_bg.wasm: $raw bytes raw, $gz bytes gzip -9"
