#!/usr/bin/env bash
# Shaped tables of docs/PERFORMANCE.md, both directions shaped (helper --link too), plain link.
# Prints one JSON line per run after its command line ("== ..."). Needs `cargo build --release -p host-native`; about 25 minutes on 2 cores.
set -u
cd "$(dirname "$0")/.."
B=./target/release
helper() { # $1 link, rest: extra args
  local link=$1; shift
  $B/tether-helper --listen 127.0.0.1:0 --model qwen35-0.8b --threads 1 --insecure --link "$link" "$@" > /tmp/helper.out 2>/tmp/helper.err &
  HPID=$!
  for i in $(seq 1 600); do grep -q listening /tmp/helper.out 2>/dev/null && break; sleep 0.1; done
  URL=$(head -1 /tmp/helper.out | awk '{print $NF}')
}
stop() { kill $HPID 2>/dev/null; wait $HPID 2>/dev/null; }
run() { echo "== $*" ; "$@" 2>/dev/null | tr -d '\n' | head -c 3000; echo; }
P1="--model qwen35-0.8b --prompt-tokens 2048 --gen 16 --threads 1 --json"
for round in 1 2; do
  for link in unlimited usb2 wifi; do
    helper $link
    run $B/tether bench $P1 --insecure --helper $URL --link $link --split-layer 12 --split-ubatch 256 --split-min 512
    stop
  done
done
P2="--model qwen35-0.8b --threads 1 --prompt-tokens 512 --gen 32 --depth 4096 --json"
run $B/tether bench $P2 --ubatch 256
for link in usb-c-10g wifi; do
  helper $link
  run $B/tether bench $P2 --insecure --helper $URL --split-layer 12 --host-kv-tokens 1024 --page-size 1024 --link $link
  stop
done
P3="--model qwen35-0.8b --threads 1 --prompt-tokens 1024 --gen 8 --depth 4096 --page-size 512 --ubatch 256 --json"
for link in unlimited wifi; do
  for il in 100000000 0; do
    helper $link --mem-budget 8G
    run $B/tether bench $P3 --insecure --helper $URL --split-layer 24 --host-kv-tokens 512 --interleave-from $il --link $link
    stop
  done
done
