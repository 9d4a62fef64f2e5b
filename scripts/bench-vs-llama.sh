#!/usr/bin/env bash
# tether against llama.cpp, side by side: same machine, same weights, alternated runs, one sitting.
# Not run in CI (building llama.cpp takes ~11 min on 2 cores).
#
#   scripts/bench-vs-llama.sh [--types "f16 q8_0 q4_0 q4_k_m"] [--depths "0 4096"] [--runs 3]
#                             [--threads 2] [--prompt 512] [--gen 64] [--avx2]
#
# 1. Builds llama.cpp once into .llama/ (ignored): the llama-cpp-python 0.3.36 sdist from PyPI
#    vendors upstream 0c1e57098, which has the qwen35 architecture.
# 2. Writes the Qwen3.5-0.8B-shaped synthetic model (`tether synth --dtype bf16`), gives it the
#    fixtures' Qwen3.5 tokenizer and writes it as an f16 GGUF with `tether quantize`, which writes
#    the file llama.cpp's converter writes (tests/tests/cli.rs checks that byte for byte); the
#    other types come from that f16 file through llama.cpp's own `llama-quantize`. Both engines
#    read the same GGUF.
# 3. For each type and depth, alternates `tether bench` and `llama-bench` --runs times and prints
#    the medians and the ratios, with the machine's CPU flags and measured read bandwidth.
#
# --avx2: both engines on AVX2 code paths only, so that an AVX-512 machine stands in for an
# AVX2-only one (the code paths, not its memory system): llama.cpp built for AVX/AVX2/FMA/F16C/
# BMI2 into .llama/llama.cpp/build-avx2; tether's HEAD built in a scratch worktree
# (.llama/avx2-tree) for x86-64-v3 with gemm's AVX-512 kernels left out, run with
# TETHER_ISA=avx2 (which caps tether's integer kernels at AVX2).
set -euo pipefail
cd "$(dirname "$0")/.."

types="f16 q8_0 q4_0 q4_k_m"
depths="0 4096"
runs=3
threads=2
prompt=512
gen=64
avx2=
while [ $# -gt 0 ]; do
    case "$1" in
    --types) types="$2"; shift 2 ;;
    --depths) depths="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --gen) gen="$2"; shift 2 ;;
    --avx2) avx2=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

dir=$PWD/.llama
grep -qxF "/.llama/" .git/info/exclude 2>/dev/null || echo "/.llama/" >>.git/info/exclude
mkdir -p "$dir"
fixtures=${TETHER_FIXTURES:-}
for d in ../shared/fixtures /work/shared/fixtures; do
    if [ -z "$fixtures" ] && [ -d "$d" ]; then fixtures=$(cd "$d" && pwd); fi
done
test -f "$fixtures/tokenizer/tokenizer.json" || { echo "the fixtures' tokenizer is missing: set TETHER_FIXTURES" >&2; exit 1; }

# 1. llama.cpp
bin=$dir/llama.cpp/build/bin
if [ ! -x "$bin/llama-bench" ] || [ ! -x "$bin/llama-quantize" ]; then
    python3 -m venv "$dir/venv"
    "$dir/venv/bin/pip" install -q scikit-build-core cmake ninja
    (cd "$dir" && "$dir/venv/bin/pip" download -q --no-deps --no-binary :all: \
        --no-build-isolation llama-cpp-python==0.3.36)
    rm -rf "$dir/src" && mkdir -p "$dir/src"
    tar -xzf "$dir"/llama_cpp_python-0.3.36.tar.gz -C "$dir/src"
    rm -rf "$dir/llama.cpp"
    mv "$dir/src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$dir/llama.cpp"
    # On CPUs with AMX, ggml 0c1e57098's AMX matrix product crashes (SIGSEGV in
    # ggml_backend_amx_mul_mat on this model, seen on a Xeon with amx_int8 whose kernel grants
    # the tile state): build for the CPU's vector extensions by name, without AMX, instead of
    # -march=native.
    isa="-DGGML_NATIVE=ON"
    if grep -qw amx_int8 /proc/cpuinfo; then
        isa="-DGGML_NATIVE=OFF"
        for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
            avx_vnni:AVX_VNNI; do
            if grep -qw "${f%%:*}" /proc/cpuinfo; then isa="$isa -DGGML_${f##*:}=ON"; fi
        done
    fi
    PATH=$dir/venv/bin:$PATH cmake -S "$dir/llama.cpp" -B "$dir/llama.cpp/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release $isa -DGGML_OPENMP=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    PATH=$dir/venv/bin:$PATH cmake --build "$dir/llama.cpp/build" -j 2 \
        --target llama-bench llama-quantize
fi
quantize=$bin/llama-quantize
if [ -n "$avx2" ]; then
    bin=$dir/llama.cpp/build-avx2/bin
    if [ ! -x "$bin/llama-bench" ]; then
        PATH=$dir/venv/bin:$PATH cmake -S "$dir/llama.cpp" -B "$dir/llama.cpp/build-avx2" -G Ninja \
            -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
            -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
        PATH=$dir/venv/bin:$PATH cmake --build "$dir/llama.cpp/build-avx2" -j 2 --target llama-bench
    fi
fi

# 2. The weights
cargo build --release -q -p host-native
tether=$PWD/target/release/tether
model=$dir/qwen35-0.8b
if [ ! -f "$model/f16.gguf" ]; then
    rm -rf "$model/hf"
    "$tether" synth --preset qwen35-0.8b --dtype bf16 --out "$model/hf"
    cp "$fixtures/tokenizer/tokenizer.json" "$model/hf/"
    "$tether" quantize "$model/hf" "$model/f16.gguf" --type f16
fi
for t in $types; do
    if [ "$t" != f16 ] && [ ! -f "$model/$t.gguf" ]; then
        "$quantize" "$model/f16.gguf" "$model/$t.gguf" "$t" >"$model/$t.log" 2>&1
    fi
done

if [ -n "$avx2" ]; then
    tree=$dir/avx2-tree
    rm -rf "$tree" && git worktree prune && git worktree add -q --detach "$tree" HEAD
    sed -i 's/"std", "x86-v4"/"std"/' "$tree/engine-core/Cargo.toml"
    (cd "$tree" && RUSTFLAGS="-C target-cpu=x86-64-v3" CARGO_TARGET_DIR=$dir/avx2-target \
        cargo build --release -q -p host-native)
    tether=$dir/avx2-target/release/tether
    export TETHER_ISA=avx2
fi

# 3. The machine: CPU flags and read bandwidth (a vectorised OpenMP sum over 1 GiB, best of 5)
cat >"$dir/bw.c" <<'EOF'
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
int main(void) {
    size_t n = (size_t)1 << 28; /* 1 GiB of floats */
    float *a = malloc(n * sizeof *a);
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 7);
    double best = 0;
    for (int r = 0; r < 5; r++) {
        double t = omp_get_wtime();
        float s = 0;
#pragma omp parallel for reduction(+ : s)
        for (size_t i = 0; i < n; i++) s += a[i];
        t = omp_get_wtime() - t;
        if (n * sizeof *a / t > best) best = n * sizeof *a / t;
        if (s == 1) puts("");
    }
    printf("%.1f\n", best / 1e9);
    return 0;
}
EOF
gcc -O3 -march=native -ffast-math -fopenmp "$dir/bw.c" -o "$dir/bw"
bw=$(OMP_NUM_THREADS=$threads "$dir/bw")
cpu=$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)
flags=$(grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512bw\|avx512vl\|avx512_vnni\|avx512_bf16\|avx_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')
echo "machine: $cpu; $(nproc) cores; flags: $flags; read bandwidth $bw GB/s with $threads threads"
[ -z "$avx2" ] || echo "both engines on AVX2 code paths (--avx2)"
echo "llama.cpp: $(cd "$dir/llama.cpp" && git describe --always 2>/dev/null || echo 0c1e57098 from llama-cpp-python 0.3.36); tether: $(git rev-parse --short HEAD)"

# 4. Alternated runs
out=$dir/results.jsonl
: >"$out"
for t in $types; do
    f=$model/$t.gguf
    for depth in $depths; do
        for r in $(seq "$runs"); do
            j=$("$tether" bench --model "$f" --threads "$threads" --prompt-tokens "$prompt" \
                --gen "$gen" --depth "$depth" --json)
            echo "{\"engine\":\"tether\",\"type\":\"$t\",\"depth\":$depth,\"run\":$j}" >>"$out"
            j=$("$bin/llama-bench" -m "$f" -t "$threads" -p "$prompt" -n "$gen" -d "$depth" \
                -r 1 -o json 2>/dev/null | tr -d '\n')
            echo "{\"engine\":\"llama\",\"type\":\"$t\",\"depth\":$depth,\"run\":$j}" >>"$out"
        done
    done
done

python3 - "$out" "$bw" "$threads" "$prompt" "$gen" <<'EOF'
import json, statistics, sys
path, bw, threads, prompt, gen = sys.argv[1], float(sys.argv[2]), *sys.argv[3:]
rows = {}
for line in open(path):
    r = json.loads(line)
    key = (r["type"], r["depth"])
    d = rows.setdefault(key, {"tp": [], "td": [], "lp": [], "ld": [], "gb": [], "kv": []})
    if r["engine"] == "tether":
        run = r["run"]
        d["tp"].append(run["prefill_tok_s"])
        d["td"].append(run["decode_tok_s"])
        d["gb"].append(run["decode_weight_gb_s"])
        # A decode step also reads the keys and values cached so far: on average those of
        # depth + prompt + gen / 2 positions (kv_cache_bytes holds all of them at the end).
        held = r["depth"] + run["prompt_tokens"] + run["gen_tokens"]
        kv = run["kv_cache_bytes"] * (held - run["gen_tokens"] / 2) / held
        d["kv"].append(run["decode_weight_gb_s"] + kv * run["decode_tok_s"] / 1e9)
    else:
        for t in r["run"]:
            (d["lp"] if t["n_gen"] == 0 else d["ld"]).append(t["avg_ts"])
med = statistics.median
print(f"\n{threads} threads, pp{prompt} and tg{gen}, medians of {len(d['tp'])} alternated runs")
print("| type | context | tether prefill | llama.cpp prefill | ratio | tether decode | llama.cpp decode | ratio | tether decode GB/s of weights (of %.1f) | of weights and KV |" % bw)
print("|---|---|---|---|---|---|---|---|---|---|")
for (t, depth), d in rows.items():
    tp, lp, td, ld = med(d["tp"]), med(d["lp"]), med(d["td"]), med(d["ld"])
    gb, kv = med(d["gb"]), med(d["kv"])
    print(f"| {t} | {depth} | {tp:.1f} | {lp:.1f} | {tp/lp:.2f}x | {td:.2f} | {ld:.2f} | {td/ld:.2f}x | {gb:.1f} ({100*gb/bw:.0f}%) | {kv:.1f} ({100*kv/bw:.0f}%) |")
EOF
