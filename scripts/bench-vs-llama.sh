#!/usr/bin/env bash
# tether against llama.cpp, side by side: same machine, same weights, alternated runs, one sitting.
# Not run in CI (building llama.cpp takes ~11 min on 2 cores).
#
#   scripts/bench-vs-llama.sh [--types "f16 q8_0 q4_0 q4_k_m"] [--depths "0 4096"] [--runs 3]
#                             [--threads 2] [--prompt 512] [--gen 64] [--avx2]
#                             [--cache-types "f16 q8_0"]
#   scripts/bench-vs-llama.sh --spec [--types "f16 q4_k_m"] [--runs 5] [--threads 2] [--gen 64]
#                             [--text TEXT] [--draft-max 8] [--mtp] [--mtp-draft-max 2]
#                             [--quiet SECONDS]
#   scripts/bench-vs-llama.sh --serve [--types q4_k_m] [--runs 2] [--threads 2] [--gen 64]
#                             [--parallel 1,4,8,16]
#
# 1. Builds llama.cpp once into .llama/ (ignored): the llama-cpp-python 0.3.36 sdist from PyPI
#    vendors upstream 0c1e57098, which has the qwen35 architecture.
# 2. Writes the Qwen3.5-0.8B-shaped synthetic model (`tether synth --dtype bf16`), gives it the
#    fixtures' Qwen3.5 tokenizer and writes it as an f16 GGUF with `tether quantize`, which writes
#    the file llama.cpp's converter writes (tests/tests/cli.rs checks that byte for byte); the
#    other types come from that f16 file through llama.cpp's own `llama-quantize`. Both engines
#    read the same GGUF.
# 3. For each type, depth and KV cache type (--cache-types, keys and values alike; f16 unless
#    told), alternates `tether bench` and `llama-bench` (flash attention on, as llama.cpp needs
#    for a quantised V cache) --runs times and prints the medians and the ratios, with the
#    machine's CPU flags and measured read bandwidth.
#
# --avx2: both engines on AVX2 code paths only, so that an AVX-512 machine stands in for an
# AVX2-only one (the code paths, not its memory system): llama.cpp built for AVX/AVX2/FMA/F16C/
# BMI2 into .llama/llama.cpp/build-avx2; tether's HEAD built in a scratch worktree
# (.llama/avx2-tree) for x86-64-v3 with gemm's AVX-512 kernels left out, run with
# TETHER_ISA=avx2 (which caps tether's integer kernels at AVX2).
#
# --spec: speculative decoding side by side instead (issue 36), greedy, on a prompt whose
# continuation repeats (--text; the default, "abc" 18 times, is 18 tokens 13290: the ids of
# docs/PERFORMANCE.md's `--prompt abcabcabcabcabcabc --prompt-tokens 18`). llama.cpp is given the
# same text; the script stops unless llama-tokenize gives tether's ids. Per type, alternated
# --runs times: `tether bench` plain and with `--draft ngram --draft-max K`, and llama.cpp's
# examples/speculative-simple plain (ngram-simple with an n-gram longer than the context, so it
# never drafts: the same loop and timer) and with `--spec-type ngram-simple` (n 3, m K) and
# `ngram-map-k` (n 3, m K, one hit; the closer to tether's drafter, which takes an occurrence
# with K tokens after it where ngram-simple takes the latest). Prints decode tok/s, drafted and
# kept counts, the ratios and each run's greedy text. --mtp also writes the preset with a seeded
# MTP head (`tether synth --mtp`; an f16 GGUF with the blk.N.nextn.* block) and runs `tether
# bench --draft mtp` against llama.cpp's `--spec-type draft-mtp` (--mtp-draft-max a step),
# printing the drafts llama.cpp logs. On a shared machine llama.cpp's two OpenMP threads fall
# far behind when a third runnable process takes a core (tether's much less); --quiet S waits up
# to S seconds before each run for 3 s with no other runnable process, and every run records
# the load average.
#
# --serve: many users at once (issue 37): `tether serve --parallel N` against `llama-server -np
# N` (continuous batching) on the same GGUF, through scripts/serve_load.py: aggregate
# throughput of N concurrent requests at each N, alternated --runs times, and the time to first
# token (p50, p95) under a steady stream of new requests at N = 8.
set -euo pipefail
cd "$(dirname "$0")/.."

types="f16 q8_0 q4_0 q4_k_m"
depths="0 4096"
runs=3
threads=2
cache_types=f16
prompt=512
gen=64
avx2=
spec=
serve=
parallel=1,4,8,16
text=abcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabc
draft_max=8
mtp_max=2
mtp=
quiet=0
types_set=
runs_set=
while [ $# -gt 0 ]; do
    case "$1" in
    --types) types="$2"; types_set=1; shift 2 ;;
    --depths) depths="$2"; shift 2 ;;
    --cache-types) cache_types="$2"; shift 2 ;;
    --runs) runs="$2"; runs_set=1; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --gen) gen="$2"; shift 2 ;;
    --avx2) avx2=1; shift ;;
    --spec) spec=1; shift ;;
    --serve) serve=1; shift ;;
    --parallel) parallel="$2"; shift 2 ;;
    --text) text="$2"; shift 2 ;;
    --draft-max) draft_max="$2"; shift 2 ;;
    --mtp) mtp=1; shift ;;
    --mtp-draft-max) mtp_max="$2"; shift 2 ;;
    --quiet) quiet="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -n "$spec" ]; then
    [ -z "$avx2" ] || { echo "--spec and --avx2 do not go together" >&2; exit 2; }
    [ -n "$types_set" ] || types="f16 q4_k_m"
    [ -n "$runs_set" ] || runs=5
fi
if [ -n "$serve" ]; then
    [ -z "$avx2$spec" ] || { echo "--serve goes with neither --spec nor --avx2" >&2; exit 2; }
    [ -n "$types_set" ] || types="q4_k_m"
    [ -n "$runs_set" ] || runs=2
fi

dir=$PWD/.llama
# .gitignore has /.llama (a linked worktree has no .git/info/exclude of its own).
git check-ignore -q .llama || echo "/.llama/" >>"$(git rev-parse --git-path info/exclude)"
mkdir -p "$dir"
fixtures=${TETHER_FIXTURES:-}
for d in ../shared/fixtures /work/shared/fixtures; do
    if [ -z "$fixtures" ] && [ -d "$d" ]; then fixtures=$(cd "$d" && pwd); fi
done
test -f "$fixtures/tokenizer/tokenizer.json" || { echo "the fixtures' tokenizer is missing: set TETHER_FIXTURES" >&2; exit 1; }

# 1. llama.cpp
bin=$dir/llama.cpp/build/bin
targets="llama-bench llama-quantize"
# --spec: examples/speculative-simple (n-gram and MTP speculation, greedy, with timings and
# draft counts) and llama-tokenize (to check the prompt's ids).
[ -z "$spec" ] || targets="$targets llama-speculative-simple llama-tokenize"
[ -z "$serve" ] || targets="$targets llama-server"
missing=
for t in $targets; do [ -x "$bin/$t" ] || missing=1; done
if [ -n "$missing" ]; then
    if [ ! -x "$dir/venv/bin/cmake" ]; then
        python3 -m venv "$dir/venv"
        "$dir/venv/bin/pip" install -q scikit-build-core cmake ninja
    fi
    if [ ! -f "$dir/llama.cpp/CMakeLists.txt" ]; then
        (cd "$dir" && "$dir/venv/bin/pip" download -q --no-deps --no-binary :all: \
            --no-build-isolation llama-cpp-python==0.3.36)
        rm -rf "$dir/src" && mkdir -p "$dir/src"
        tar -xzf "$dir"/llama_cpp_python-0.3.36.tar.gz -C "$dir/src"
        rm -rf "$dir/llama.cpp"
        mv "$dir/src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$dir/llama.cpp"
    fi
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
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
    # shellcheck disable=SC2086 # $targets is a list
    PATH=$dir/venv/bin:$PATH cmake --build "$dir/llama.cpp/build" -j 2 --target $targets
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
if [ -n "$mtp" ] && [ ! -f "$model/mtp-f16.gguf" ]; then
    rm -rf "$model/hf-mtp"
    "$tether" synth --preset qwen35-0.8b --mtp --dtype bf16 --out "$model/hf-mtp"
    cp "$fixtures/tokenizer/tokenizer.json" "$model/hf-mtp/"
    "$tether" quantize "$model/hf-mtp" "$model/mtp-f16.gguf" --type f16
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

# 4p. --serve: the two servers, alternated
if [ -n "$serve" ]; then
    for t in $types; do
        echo "== $t: aggregate decode of N concurrent requests, then TTFT under load"
        python3 scripts/serve_load.py --tether "$tether" --llama-server "$bin/llama-server" \
            --model "$model/$t.gguf" --parallel "$parallel" --runs "$runs" --gen "$gen" \
            --threads "$threads" --log "$dir/serve-$t.log"
    done
    exit 0
fi

# 4s. --spec: speculative decoding, alternated runs
if [ -n "$spec" ]; then
    so=$dir/spec
    rm -rf "$so" && mkdir -p "$so"
    ids=$("$tether" tokenize --tokenizer "$fixtures/tokenizer/tokenizer.json" --text "$text")
    n=$(python3 -c 'import json, sys; print(len(json.loads(sys.argv[1])))' "$ids")
    echo "prompt \"$text\": $n tokens $ids; greedy; $gen generated; $threads threads"
    cases=$types
    [ -z "$mtp" ] || cases="$cases mtp-f16"
    # tether: `bench` (decode tok/s of --gen tokens after the first, drafts counted) and `run`
    # (the greedy text). llama.cpp: examples/speculative-simple, whose timer covers the loop
    # from the prompt's last token on. Its plain run is the same loop with an n-gram longer
    # than the context (ngram-simple never drafts then).
    modes() { # case -> engine:mode:arguments..., alternated in this order each run
        if [ "$1" = mtp-f16 ]; then
            echo "tether:none"
            echo "llama:none:--spec-type ngram-simple --spec-ngram-simple-size-n 1024"
            echo "tether:mtp:--draft mtp --draft-max $mtp_max"
            echo "llama:draft-mtp:--spec-type draft-mtp --spec-draft-n-max $mtp_max"
        else
            echo "tether:none"
            echo "llama:none:--spec-type ngram-simple --spec-ngram-simple-size-n 1024"
            echo "tether:ngram:--draft ngram --draft-max $draft_max"
            echo "llama:ngram-simple:--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m $draft_max --spec-draft-n-max $draft_max"
            echo "llama:ngram-map-k:--spec-type ngram-map-k --spec-ngram-map-k-size-n 3 --spec-ngram-map-k-size-m $draft_max --spec-ngram-map-k-min-hits 1 --spec-draft-n-max $draft_max"
        fi
    }
    wait_quiet() { # up to $quiet seconds, for 3 s in a row with only this shell runnable
        local end=$((SECONDS + quiet)) calm=0 running _
        while [ "$SECONDS" -lt "$end" ] && [ "$calm" -lt 3 ]; do
            read -r _ _ _ running _ </proc/loadavg
            if [ "${running%/*}" -le 1 ]; then calm=$((calm + 1)); else calm=0; fi
            sleep 1
        done
    }
    lspec() { # llama.cpp's speculative loop on the current case's file $f
        "$bin/llama-speculative-simple" -m "$f" -t "$threads" -tb "$threads" \
            -c $((n + gen + 64)) -n "$gen" --temp 0 --top-k 1 -p "$text" "$@"
    }
    for c in $cases; do
        f=$model/$c.gguf
        lids=$("$bin/llama-tokenize" -m "$f" -p "$text" --ids --log-disable 2>/dev/null | tail -n 1)
        if ! python3 -c 'import json, sys; sys.exit(json.loads(sys.argv[1]) != json.loads(sys.argv[2]))' \
            "$ids" "$lids"; then
            echo "$c: llama.cpp tokenises the prompt as $lids, tether as $ids" >&2
            exit 1
        fi
        for r in $(seq "$runs"); do
            while IFS=: read -r engine mode args; do
                log=$c.$engine-$mode.$r
                wait_quiet
                # shellcheck disable=SC2086 # $args is a list
                if [ "$engine" = tether ]; then
                    if [ "$r" = 1 ]; then
                        "$tether" run --model "$f" --threads "$threads" --raw --temperature 0 \
                            --prompt "$text" --max-tokens $((gen + 1)) $args >"$so/$log.out" 2>/dev/null
                    fi
                    "$tether" bench --model "$f" --threads "$threads" --prompt "$text" \
                        --prompt-tokens "$n" --gen "$gen" --json $args >"$so/$log.json"
                else
                    if [ "$r" = 1 ] && [ "$mode" = draft-mtp ]; then
                        # Untimed, at debug verbosity: the drafter logs its candidates.
                        lspec $args -lv 5 >/dev/null 2>"$so/$log.drafts"
                    fi
                    lspec $args >"$so/$log.out" 2>"$so/$log.err"
                fi
                load=$(cut -d' ' -f1 /proc/loadavg)
                echo "{\"case\":\"$c\",\"engine\":\"$engine\",\"mode\":\"$mode\",\"run\":$r,\"log\":\"$log\",\"load\":$load}" >>"$so/runs.jsonl"
            done < <(modes "$c")
        done
    done
    python3 - "$so" "$text" <<'EOF'
import json, os, re, statistics, sys
so, text = sys.argv[1], sys.argv[2]
def read(name, ext):
    return open(os.path.join(so, name + ext), "rb").read().decode("utf-8", "replace")
def tether(name, first):
    j = json.loads(read(name, ".json"))
    v = {"tok_s": j["decode_tok_s"], "drafted": j["drafted"], "kept": j["drafts_kept"]}
    if first:
        v["text"] = read(name, ".out").strip("\n")
    return v
def llama(name, first):
    err = read(name, ".err")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", err)
    num = lambda key: int(re.search(key + r"\s*=\s*(\d+)", err).group(1))
    v = {"tok_s": float(m.group(3)), "drafted": num("n_drafted"), "kept": num("n_accept")}
    if first:
        # llama-speculative-simple prints the prompt, then the generated text.
        out = read(name, ".out").strip("\n")
        v["text"] = out[len(text):] if out.startswith(text) else out
        # With -lv 5 the draft-mtp drafter logs its candidates: the most likely is the draft.
        if os.path.exists(os.path.join(so, name + ".drafts")):
            d = re.findall(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+)", read(name, ".drafts"))
            v["drafts"] = [int(t) for p, t in d]
    return v
runs, loads = {}, []
for line in open(os.path.join(so, "runs.jsonl")):
    r = json.loads(line)
    f = tether if r["engine"] == "tether" else llama
    runs.setdefault((r["case"], r["engine"], r["mode"]), []).append(f(r["log"], r["run"] == 1))
    loads.append(r["load"])
med = statistics.median
n = max(len(v) for v in runs.values())
print(f"\nthe machine's 1-minute load average after each run: {min(loads):.2f} to {max(loads):.2f}")
print(f"decode tok/s: min / median of {n} alternated runs; drafted / kept: the median run's")
print("| weights | engine | drafts | decode tok/s | drafted / kept | x its plain decode |")
print("|---|---|---|---|---|---|")
plain = {}
for (c, e, m), v in runs.items():
    ts = [x["tok_s"] for x in v]
    if m == "none":
        plain[(c, e)] = med(ts)
    mid = sorted(v, key=lambda x: x["tok_s"])[len(v) // 2]
    print(f"| {c} | {'tether' if e == 'tether' else 'llama.cpp'} | {m} | {min(ts):.2f} / {med(ts):.2f} | "
          f"{mid['drafted']} / {mid['kept']} | {med(ts) / plain[(c, e)]:.2f}x |")
for c in dict.fromkeys(c for c, _, _ in runs):
    t, l = plain[(c, "tether")], plain[(c, "llama")]
    best = lambda e: max((med([x["tok_s"] for x in v]), m) for (cc, ee, m), v in runs.items() if cc == c and ee == e)
    (bt, mt), (bl, ml) = best("tether"), best("llama")
    print(f"{c}: tether / llama.cpp, plain {t / l:.2f}x; fastest of each ({mt}, {ml}) {bt / bl:.2f}x")
print("\ngreedy text after the prompt (tether run; llama.cpp's first run of each mode):")
for c in dict.fromkeys(c for c, _, _ in runs):
    texts = {f"{e}-{m}": v[0]["text"] for (cc, e, m), v in runs.items() if cc == c}
    # llama.cpp may keep a draft past -n: compare the text all of them have.
    k = min(len(x) for x in texts.values())
    first = texts["tether-none"]
    same = all(x[:k] == first[:k] for x in texts.values())
    print(f"{c}: {'the same' if same else 'DIFFERENT'} over the first {k} characters in "
          f"{', '.join(texts)}: {first!r}")
    for who, x in texts.items():
        if x[:k] != first[:k]:
            print(f"  {who}: {x!r}")
    for (cc, e, m), v in runs.items():
        if cc == c and v[0].get("drafts"):
            print(f"  {e}-{m} drafts (first run, in order): {v[0]['drafts']}")
EOF
    exit 0
fi

# 4. Alternated runs
out=$dir/results.jsonl
: >"$out"
for t in $types; do
    f=$model/$t.gguf
    for depth in $depths; do
        for ct in $cache_types; do
            for r in $(seq "$runs"); do
                j=$("$tether" bench --model "$f" --threads "$threads" --prompt-tokens "$prompt" \
                    --gen "$gen" --depth "$depth" --cache-type-k "$ct" --cache-type-v "$ct" --json)
                echo "{\"engine\":\"tether\",\"type\":\"$t\",\"kv\":\"$ct\",\"depth\":$depth,\"run\":$j}" >>"$out"
                # Flash attention on: llama.cpp needs it for a quantised V cache, and it is
                # the faster of its CPU attentions at depth; the same for every KV type.
                j=$("$bin/llama-bench" -m "$f" -t "$threads" -p "$prompt" -n "$gen" -d "$depth" \
                    -ctk "$ct" -ctv "$ct" -fa 1 -r 1 -o json 2>/dev/null | tr -d '\n')
                echo "{\"engine\":\"llama\",\"type\":\"$t\",\"kv\":\"$ct\",\"depth\":$depth,\"run\":$j}" >>"$out"
            done
        done
    done
done

python3 - "$out" "$bw" "$threads" "$prompt" "$gen" <<'EOF'
import json, statistics, sys
path, bw, threads, prompt, gen = sys.argv[1], float(sys.argv[2]), *sys.argv[3:]
rows = {}
for line in open(path):
    r = json.loads(line)
    key = (r["type"], r["kv"], r["depth"])
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
print("| type | KV | context | tether prefill | llama.cpp prefill | ratio | tether decode | llama.cpp decode | ratio | tether decode GB/s of weights (of %.1f) | of weights and KV |" % bw)
print("|---|---|---|---|---|---|---|---|---|---|---|")
for (t, kv_type, depth), d in rows.items():
    tp, lp, td, ld = med(d["tp"]), med(d["lp"]), med(d["td"]), med(d["ld"])
    gb, kv = med(d["gb"]), med(d["kv"])
    print(f"| {t} | {kv_type} | {depth} | {tp:.1f} | {lp:.1f} | {tp/lp:.2f}x | {td:.2f} | {ld:.2f} | {td/ld:.2f}x | {gb:.1f} ({100*gb/bw:.0f}%) | {kv:.1f} ({100*kv/bw:.0f}%) |")
EOF
