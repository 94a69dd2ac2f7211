#!/usr/bin/env python3
"""Concurrent streaming load on an OpenAI-compatible server (`moe-lanes serve`, `llama-server`):
aggregate generation throughput, time to first token and inter-token latency. Standard library
only, so it runs on the GPU machine as it is.

  scripts/serve-load.py --url http://127.0.0.1:8080 --clients 16 --requests 2 \\
      --prompt-tokens 128 --max-tokens 64 --vocab 151936 [--extra '{"ignore_eos": true}'] [--json F]

Each of --clients threads sends --requests streamed, greedy /v1/completions in turn. A request's
prompt is --prompt-tokens token ids drawn from a generator seeded by the request's number, so
every server gets the same prompts. One warm-up request runs first and is not counted.

Measured per request: the time to its first token event, the gaps between its token events
(inter-token latency) and its completion tokens (the final `usage`, else the token events).
Reported: tokens/s = every request's completion tokens / the wall time from the first request's
start to the last one's end; p50 / p99 of the first-token times and of all gaps; failures (an
HTTP error, a stream without `[DONE]`, fewer tokens than --max-tokens) by reason. Exit status 1
when any request failed.
"""
import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse


def percentile(values, q):
    """The q-th percentile (0-100) by the nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def prompt_ids(n, vocab, seed):
    """n token ids below vocab, past the first 100 (where special tokens usually live)."""
    rng = random.Random(seed)
    lo, hi = min(100, vocab - 1), min(vocab, 30000)
    return [rng.randrange(lo, hi) for _ in range(n)]


def one_request(url, body, timeout_s, expect_tokens):
    """Stream one completion; returns a dict of its measurements and `error` (None when whole:
    `[DONE]` came and at least `expect_tokens` tokens before it)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout_s)
    out = {"ttft_s": None, "gaps_s": [], "tokens": 0, "error": None}
    start = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = "http %d" % resp.status
            resp.read()
            return out
        last, events, usage, done = None, 0, None, False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out["error"] = "stream error"
                return out
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if choices and choices[0].get("finish_reason") is None:
                now = time.monotonic()
                if last is None:
                    out["ttft_s"] = now - start
                else:
                    out["gaps_s"].append(now - last)
                last, events = now, events + 1
        out["tokens"] = (usage or {}).get("completion_tokens", events)
        if not done:
            out["error"] = "no [DONE]"
        elif out["tokens"] < expect_tokens:
            out["error"] = "short answer"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = type(e).__name__
    finally:
        conn.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests each client sends in turn")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--extra", default="{}", help="JSON object merged into every request body")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    ap.add_argument("--json", help="write the summary here as JSON")
    ap.add_argument("--label", default="", help="a name for the summary line")
    a = ap.parse_args()
    extra = json.loads(a.extra)

    def body(seed):
        b = {"prompt": prompt_ids(a.prompt_tokens, a.vocab, seed), "max_tokens": a.max_tokens,
             "stream": True, "temperature": 0}
        b.update(extra)
        return b

    warm = one_request(a.url, dict(body(10**6), max_tokens=4), a.timeout, 1)
    if warm["error"]:
        sys.exit("warm-up request failed: %s" % warm["error"])
    results, lock = [], threading.Lock()

    def client(c):
        for r in range(a.requests):
            res = one_request(a.url, body(c * a.requests + r), a.timeout, a.max_tokens)
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    failed = {}
    for r in results:
        if r["error"]:
            failed[r["error"]] = failed.get(r["error"], 0) + 1
    tokens = sum(r["tokens"] for r in results)
    gaps = [g for r in results for g in r["gaps_s"]]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    ms = lambda v: None if v is None else round(1000 * v, 2)
    summary = {
        "label": a.label, "clients": a.clients, "requests": len(results), "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens, "wall_s": round(wall, 3), "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p99": ms(percentile(gaps, 99)),
        "failed": failed,
    }
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
