#!/usr/bin/env python3
"""`tether serve --parallel N` against `llama-server -np N`, side by side (issue 37): the same
GGUF, the same machine and thread count, the two servers alternated, in one sitting.

    python3 scripts/serve_load.py --tether target/release/tether \\
        --llama-server .llama/llama.cpp/build/bin/llama-server --model q4_k_m.gguf \\
        [--parallel 1,4,8,16] [--runs 2] [--gen 64] [--prompt-words 24] [--threads 2] \\
        [--ttft-parallel 8] [--ttft-requests 40] [--ttft-load 0.6]

`scripts/bench-vs-llama.sh --serve` builds llama-server and the GGUF and calls this. For each N
and run, each server in turn is started with N slots (`--parallel N` / `-np N`, a context of
`--ctx` positions shared by the slots in both) and sent N requests at once, each a different
prompt (never one a server has seen, so neither reuses a cached prompt) asking for --gen
tokens at temperature 0, whole (not streamed). Aggregate throughput is the completion tokens
of all N (from each answer's `usage`) over the wall time from the first request sent to the
last answer. Then, at N = --ttft-parallel, a steady stream of new streamed requests (Poisson
arrivals at --ttft-load times the slower server's measured request rate at that N, the same
arrival times for both) gives the time to first token (first text chunk) of each: p50, p95.
Prints a JSON object; not part of CI.
"""

import argparse
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

WORDS = ("page frame helper phone cable tablet browser memory token prefill decode layer "
         "state delta attention split host link socket cache engine kernel shader row").split()


def prompt_text(tag, words):
    """A prompt of `words` words, unlike any other tag's."""
    rng = random.Random(tag)
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))


class Server:
    """One server process on a free port, up until stopped."""

    def __init__(self, argv, port, log):
        self.port = port
        # Something else answering on the port would be measured instead.
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            raise SystemExit(f"port {port} is taken: stop what listens there")
        except OSError:
            pass
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{argv[0]} exited: see {log.name}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                r = c.getresponse()
                r.read()
                if r.status == 200 and self.proc.poll() is None:
                    c.request("GET", "/v1/models")
                    # The name each server answers to.
                    self.model = json.loads(c.getresponse().read())["data"][0]["id"]
                    return
            except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{argv[0]} did not come up")

    def post(self, body):
        body = {**body, "model": self.model}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data[:300]!r}")
        return json.loads(data)

    def first_token(self, body):
        """Seconds to the first text chunk of a streamed completion; reads the stream out."""
        t0 = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        body = {**body, "model": self.model, "stream": True}
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {r.read()[:300]!r}")
        first = None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            text = (chunk.get("choices") or [{}])[0].get("text") or ""
            if text and first is None:
                first = time.perf_counter() - t0
        return first

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()


def start(engine, a, n, port, log):
    ctx = str(a.ctx)
    if engine == "tether":
        argv = [a.tether, "serve", "--model", a.model, "--port", str(port), "--parallel",
                str(n), "--ctx-size", ctx, "--log", "warn"]
    else:
        argv = [a.llama_server, "-m", a.model, "--port", str(port), "-np", str(n), "-c", ctx,
                "-t", str(a.threads), "-tb", str(a.threads), "--cont-batching", "-fa", "on"]
    return Server(argv, port, log)


def aggregate(server, n, tag, a):
    """N different prompts at once, whole answers: (completion tokens per second, tokens)."""
    bodies = [{"prompt": prompt_text(f"{tag}-{i}", a.prompt_words),
               "max_tokens": a.gen, "temperature": 0} for i in range(n)]
    out = [None] * n

    def one(i):
        out[i] = server.post(bodies[i])["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if None in out:
        raise SystemExit(f"a request failed ({tag})")
    return sum(out) / wall, out


def ttft(server, arrivals, tag, a):
    """Streamed requests sent at `arrivals` (seconds from now): each one's time to first token."""
    got = [None] * len(arrivals)

    def one(i):
        body = {"prompt": prompt_text(f"{tag}-{i}", a.prompt_words),
                "max_tokens": a.gen, "temperature": 0}
        got[i] = server.first_token(body)

    t0 = time.perf_counter()
    threads = []
    for i, at in enumerate(arrivals):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if None in got:
        raise SystemExit(f"a streamed request gave no text ({tag})")
    got.sort()
    return {"p50_ms": 1e3 * statistics.median(got),
            "p95_ms": 1e3 * got[min(len(got) - 1, int(round(0.95 * (len(got) - 1))))],
            "requests": len(got)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tether", required=True)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--parallel", default="1,4,8,16")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--ttft-parallel", type=int, default=8)
    p.add_argument("--ttft-requests", type=int, default=40)
    p.add_argument("--ttft-load", type=float, default=0.6)
    p.add_argument("--port", type=int, default=18480)
    p.add_argument("--log", default="/tmp/serve_load.log")
    a = p.parse_args()
    engines = ("tether", "llama")
    result = {"model": a.model, "gen": a.gen, "prompt_words": a.prompt_words,
              "threads": a.threads, "ctx": a.ctx, "aggregate": {}, "ttft": {}}
    log = open(a.log, "w")
    rates = {}
    for n in [int(x) for x in a.parallel.split(",")]:
        runs = {e: [] for e in engines}
        for r in range(a.runs):
            # Alternate which engine goes first.
            for e in (engines if r % 2 == 0 else engines[::-1]):
                with start(e, a, n, a.port, log) as s:
                    aggregate(s, n, f"warm-{e}-{n}-{r}", a)
                    tps, tokens = aggregate(s, n, f"agg-{n}-{r}", a)
                runs[e].append(tps)
                print(f"N={n} run {r} {e}: {tps:.1f} tok/s ({tokens})", file=sys.stderr)
        med = {e: statistics.median(v) for e, v in runs.items()}
        result["aggregate"][n] = {"tether_tok_s": med["tether"], "llama_tok_s": med["llama"],
                                  "ratio": med["tether"] / med["llama"], "runs": runs}
        rates[n] = min(med.values()) / a.gen
    n = a.ttft_parallel
    rate = a.ttft_load * rates.get(n, min(rates.values()))
    rng = random.Random(37)
    arrivals, t = [], 0.0
    for _ in range(a.ttft_requests):
        arrivals.append(t)
        t += rng.expovariate(rate)
    result["ttft"] = {"parallel": n, "rate_per_s": rate}
    for e in engines:
        with start(e, a, n, a.port, log) as s:
            aggregate(s, n, f"warm-ttft-{e}", a)
            result["ttft"][e] = ttft(s, arrivals, "ttft", a)
        print(f"TTFT {e}: {result['ttft'][e]}", file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
