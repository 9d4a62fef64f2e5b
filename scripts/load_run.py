#!/usr/bin/env python3
"""The load run of docs/RELIABILITY.md: many concurrent streaming clients (the official `openai`
client) against `tether serve` with a paired helper on a shaped link.

    pip install openai
    cargo build --release -p host-native
    python3 scripts/load_run.py [--clients 64] [--link wifi] [--queue-memory 200K]

It starts `tether-helper --link LINK` (pairing as a user does: the code it prints), then
`tether serve --helper ... --pair CODE --link LINK` with a small --host-kv-tokens so KV pages
move to the helper, and a host-alone server with the same page and ubatch sizes. Every client
streams one chat completion at temperature 0, with no client-side retries, so each answer is
what the server said: 200 with a whole stream, or 503 with Retry-After. While they run, the
server's resident memory is sampled. Afterwards the helper must still hold pages and the
server's answer to one more request must equal the host-alone server's, token for token.
Prints one JSON object of figures; exits 1 if any check fails. Not part of CI (a few minutes,
needs the `openai` package).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai


def start(cmd, env, lines):
    """Start `cmd`, return (process, its first `lines` stdout lines)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    got = [p.stdout.readline().strip() for _ in range(lines)]
    return p, got


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def metric(base, name):
    body = urllib.request.urlopen(base + "/metrics").read().decode()
    m = re.search(re.escape(name) + r" ([0-9.e+]+)", body)
    return float(m.group(1)) if m else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="target/release")
    p.add_argument("--model", default="tiny")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--link", default="wifi")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--queue-memory", default=None, help="the server's --queue-memory (default: its own)")
    a = p.parse_args()

    keys = tempfile.mkdtemp(prefix="tether-load-keys-")
    env = dict(os.environ, TETHER_CONFIG_DIR=keys)
    helper, lines = start(
        [f"{a.bin}/tether-helper", "--model", a.model, "--listen", "127.0.0.1:0", "--link", a.link], env, 2
    )
    url = lines[0].split()[-1]
    code = lines[1].removeprefix("pairing code: ")
    common = ["--model", a.model, "--port", "0", "--page-size", "16", "--ubatch", "16"]
    serve = [f"{a.bin}/tether", "serve", *common, "--helper", url, "--pair", code, "--link", a.link,
             "--host-kv-tokens", "32", "--split-min", "64", "--split-ubatch", "16"]
    if a.queue_memory:
        serve += ["--queue-memory", a.queue_memory]
    server, lines = start(serve, env, 1)
    base = lines[0].split()[-1]
    alone, lines = start([f"{a.bin}/tether", "serve", *common], env, 1)
    base_alone = lines[0].split()[-1]

    prompt = "Tell me about the tides, the moon and the sea, at some length please. " * 3
    results = []
    lock = threading.Lock()

    def client(i):
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        t0 = time.time()
        try:
            stream = c.chat.completions.create(
                model="tiny", stream=True, temperature=0, max_tokens=a.max_tokens,
                messages=[{"role": "user", "content": f"{i}: {prompt}"}],
            )
            text, finish = "", None
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            r = {"status": 200, "complete": finish is not None, "s": time.time() - t0}
        except openai.APIStatusError as e:
            r = {"status": e.status_code, "retry_after": e.response.headers.get("retry-after"),
                 "s": time.time() - t0}
        except Exception as e:  # a dropped connection, a timeout: a failure of the run
            r = {"status": None, "error": repr(e), "s": time.time() - t0}
        with lock:
            results.append(r)

    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(server.pid))
            time.sleep(0.05)

    idle = rss_kib(server.pid)
    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    stop.set()
    sampler.join()

    # The helper still holds pages, and the next answer is the host alone's.
    helper_positions = metric(base, 'tether_kv_positions{device="helper"}')
    ask = [{"role": "user", "content": "After the load: " + prompt}]
    answers = []
    for b in (base, base_alone):
        c = openai.OpenAI(base_url=b + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=ask, temperature=0, max_tokens=a.max_tokens)
        answers.append(r.choices[0].message.content)
    for proc in (server, alone, helper):
        proc.terminate()
        proc.wait()

    statuses = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    report = {
        "clients": a.clients,
        "link": a.link,
        "queue_memory": a.queue_memory or "default",
        "statuses": statuses,
        "streams_complete": sum(r["complete"] for r in ok),
        "503_with_retry_after": sum(r.get("retry_after") is not None for r in refused),
        "wall_s": round(wall, 1),
        "slowest_200_s": round(max((r["s"] for r in ok), default=0), 1),
        "server_rss_idle_mib": round(idle / 1024, 1),
        "server_rss_peak_mib": round(peak[0] / 1024, 1),
        "helper_positions_after": helper_positions,
        "answer_after_equals_host_alone": answers[0] == answers[1],
    }
    print(json.dumps(report, indent=1))
    good = (
        len(ok) + len(refused) == a.clients
        and report["streams_complete"] == len(ok)
        and report["503_with_retry_after"] == len(refused)
        and (helper_positions or 0) > 0
        and report["answer_after_equals_host_alone"]
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
