#!/usr/bin/env bash
# Frozen pages' Core ML packages, checked without Core ML: writes packages for a few page
# shapes (engine-core's coreml_pages example), then loads, type-checks and runs each with
# scripts/check_coreml.py (coremltools in a venv under .venv-coreml, ignored by git), which
# also makes sure broken copies are rejected. Core ML itself runs only on Apple devices.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-coreml
if ! "$venv/bin/python" -c "import coremltools, numpy" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "coremltools==9.0" "numpy<3"
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cargo run --quiet -p engine-core --features coreml --example coreml_pages -- "$out"
# coremltools says on import that the Core ML runtime (libcoremlpython) is absent: expected.
"$venv/bin/python" scripts/check_coreml.py "$out" 2> >(grep -v "Failed to load" >&2)
