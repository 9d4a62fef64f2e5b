#!/usr/bin/env bash
# The browser helper's WebAssembly module: wasm-demo for wasm32 (release), wrapped by
# wasm-bindgen for the pages in wasm-demo/www (helper.html and the split page's simulator import
# pkg/wasm_demo.js) and shrunk by wasm-opt from npm's binaryen (Debian's wasm-opt emits broken
# modules). The module is checked in (wasm-demo/www/pkg), so `cargo build` puts the pages in
# tether (host-native/build.rs) with nothing else installed; whoever changes what it compiles
# (wasm-demo, engine-core, shaders, Cargo.lock) rebuilds it with this script and commits it.
#
#   scripts/build-wasm.sh          rebuild wasm-demo/www/pkg; prints the sizes, raw and gzipped
#   scripts/build-wasm.sh --check  (CI) rebuild into a temporary folder and fail unless that is
#                                  byte for byte the checked-in wasm-demo/www/pkg
#
# Needs: rustup target add wasm32-unknown-unknown; cargo install wasm-bindgen-cli at the
# version wasm-demo/Cargo.toml pins; (cd wasm-demo && npm ci) for binaryen's wasm-opt.
#
# The build is reproducible byte for byte from the same sources with the same rustc,
# wasm-bindgen and binaryen, in any folder and under any home: the workspace's crates are
# compiled by relative paths, the registry's crates (their panic locations are in the module)
# are remapped from $CARGO_HOME to /cargo, and wasm-bindgen and wasm-opt drop the debug info.
# pkg/BUILT_WITH names the three tools; --check builds with the rustc named there (rustup
# installs it when the default one differs), so a new stable release alone does not fail CI.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd -P)
pkg=wasm-demo/www/pkg

check=false
case "${1:-}" in
  "") ;;
  --check) check=true ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

want=$(sed -n 's/^wasm-bindgen = "=\(.*\)"$/\1/p' wasm-demo/Cargo.toml)
have=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')
if [ "$have" != "$want" ]; then
  echo "wasm-bindgen $want is needed (found: ${have:-none}): cargo install wasm-bindgen-cli --version $want" >&2
  exit 1
fi
opt=wasm-demo/node_modules/.bin/wasm-opt
if [ ! -x "$opt" ]; then
  echo "no $opt: (cd wasm-demo && npm ci) installs binaryen's wasm-opt" >&2
  exit 1
fi

# --check: the rustc that built the checked-in module.
if $check && [ -f "$pkg/BUILT_WITH" ]; then
  built=$(sed -n 's/^\(rustc .*\)$/\1/p' "$pkg/BUILT_WITH")
  if [ -n "$built" ] && [ "$built" != "$(rustc -V)" ]; then
    version=$(sed -n 's/^rustc \([0-9]*\.[0-9]*\.[0-9]*\) .*$/\1/p' <<<"$built")
    if [ -z "$version" ] || ! command -v rustup >/dev/null; then
      echo "$pkg was built with $built, which cannot be installed here: rebuild it with a" \
        "stable rustc (scripts/build-wasm.sh) and commit wasm-demo/www/pkg" >&2
      exit 1
    fi
    echo "$pkg was built with $built (the default here: $(rustc -V)): checking with that"
    if [ "$(rustup run "$version" rustc -V 2>/dev/null)" != "$built" ]; then
      rustup toolchain install "$version" --profile minimal
    fi
    rustup target add --toolchain "$version" wasm32-unknown-unknown
    export RUSTUP_TOOLCHAIN=$version
  fi
fi

# Every flag for wasm32 comes from here (CARGO_ENCODED_RUSTFLAGS outranks RUSTFLAGS and the
# config files; with --target it leaves build scripts and proc macros alone). The last remap
# that matches wins: the registry's unpacked sources become /cargo/registry/src/crates.io
# whatever the index's folder is called (a mirror's differs); `cargo fetch` unpacks them first.
cargo_home=${CARGO_HOME:-$HOME/.cargo}
target=${CARGO_TARGET_DIR:-target}
cargo fetch --target wasm32-unknown-unknown --quiet
remaps=("$root=/tether" "$cargo_home=/cargo")
if [ -d "$cargo_home" ] && [ "$(cd "$cargo_home" && pwd -P)" != "$cargo_home" ]; then
  remaps+=("$(cd "$cargo_home" && pwd -P)=/cargo")
fi
for index in "$cargo_home"/registry/src/*/; do
  if [ -d "$index" ]; then remaps+=("${index%/}=/cargo/registry/src/crates.io"); fi
done
flags=""
for remap in "${remaps[@]}"; do
  flags+="${flags:+$'\x1f'}--remap-path-prefix=$remap"
done
CARGO_ENCODED_RUSTFLAGS=$flags cargo build -p wasm-demo --target wasm32-unknown-unknown --release

# Built beside, then compared (--check) or put in place: a failed build leaves pkg as it was.
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
wasm-bindgen --target web --no-typescript --out-dir "$out" \
  "$target/wasm32-unknown-unknown/release/wasm_demo.wasm"
wasm="$out/wasm_demo_bg.wasm"
before=$(stat -c %s "$wasm")
"$opt" -O2 --enable-bulk-memory --enable-nontrapping-float-to-int --enable-sign-ext \
  --enable-mutable-globals --enable-reference-types --enable-multivalue \
  "$wasm" -o "$wasm.opt"
mv "$wasm.opt" "$wasm"
{
  rustc -V
  wasm-bindgen --version
  "$opt" --version
} >"$out/BUILT_WITH"

raw=$(stat -c %s "$wasm")
gz=$(gzip -9 -c "$wasm" | wc -c)
echo "wasm-opt: $before -> $raw bytes; wasm_demo_bg.wasm: $raw bytes raw, $gz bytes gzip -9"

if ! $check; then
  rm -rf "$pkg"
  mkdir "$pkg"
  cp -r "$out"/. "$pkg"/
  exit 0
fi
if diff -r "$pkg" "$out" >/dev/null 2>&1; then
  echo "$pkg is what these sources build"
  exit 0
fi
echo "$pkg is not what these sources build:" >&2
for f in $( (ls "$pkg" 2>/dev/null; ls "$out") | sort -u); do
  if [ ! -f "$pkg/$f" ]; then
    echo "  $pkg/$f: missing" >&2
  elif [ ! -f "$out/$f" ]; then
    echo "  $pkg/$f: not built any more" >&2
  elif ! cmp -s "$pkg/$f" "$out/$f"; then
    echo "  $pkg/$f: differs ($(stat -c %s "$pkg/$f") bytes checked in, $(stat -c %s "$out/$f") built)" >&2
  fi
done
diff "$pkg/BUILT_WITH" "$out/BUILT_WITH" >&2 2>/dev/null || true
echo "run scripts/build-wasm.sh and commit wasm-demo/www/pkg" >&2
exit 1
