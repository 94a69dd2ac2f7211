#!/usr/bin/env python3
"""Check the Grafana dashboard against a live server and a real Prometheus.

1. Validates grafana/dashboards/*.json (panels, grid positions, targets, refIds) and that every
   panel and target names the datasource uid that grafana/provisioning/datasources provisions.
2. Starts `moe-lanes serve` on a small synthetic model on loopback, drives requests (and a manual
   hot-cache apply, so exchanges move), and runs `promtool check metrics` on /metrics.
3. Starts a real `prometheus` scraping it (loopback, temp dir), waits for scrapes, then evaluates
   every target's PromQL (template variables substituted) through /api/v1/query: each must be
   valid, return at least one series, and every moe_lanes_* metric it names must exist. Metrics
   only a GPU engine exports (GPU_ONLY) must instead be named in the server's or library's source.

Stdlib only. Usage: scripts/grafana-check.py --bin target/debug/moe-lanes. Bounded (DEADLINE_S)
and stops everything it started.
"""

import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 110
# Exported only by the GPU engine (free device memory); CI has no GPU.
GPU_ONLY = {"moe_lanes_device_free_bytes"}
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "5m"}
PANEL_TYPES = {"timeseries", "heatmap", "gauge", "stat", "bargauge", "table", "text"}


def fail(msg):
    print(f"grafana-check: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def provisioned_uid():
    uids = []
    for path in glob.glob(os.path.join(ROOT, "grafana/provisioning/datasources/*.yaml")):
        text = open(path).read()
        if not re.search(r"^\s*type:\s*prometheus\s*$", text, re.M):
            fail(f"{path}: no prometheus datasource")
        uids += re.findall(r"^\s*uid:\s*(\S+)\s*$", text, re.M)
    if len(uids) != 1:
        fail(f"expected one provisioned datasource uid, found {uids}")
    providers = glob.glob(os.path.join(ROOT, "grafana/provisioning/dashboards/*.yaml"))
    if not providers or not all(re.search(r"type:\s*file", open(p).read()) for p in providers):
        fail("grafana/provisioning/dashboards needs a file provider")
    return uids[0]


def dashboard_targets(uid):
    """Validate every dashboard's structure; return [(where, expr)]."""
    out = []
    paths = sorted(glob.glob(os.path.join(ROOT, "grafana/dashboards/*.json")))
    if not paths:
        fail("no dashboard JSON under grafana/dashboards")
    for path in paths:
        name = os.path.relpath(path, ROOT)
        d = json.load(open(path))
        for key in ("uid", "title", "panels", "schemaVersion"):
            if key not in d:
                fail(f"{name}: missing '{key}'")
        if not d["panels"]:
            fail(f"{name}: no panels")
        ids = [p.get("id") for p in d["panels"]]
        if len(set(ids)) != len(ids):
            fail(f"{name}: panel ids repeat: {ids}")
        for p in d["panels"]:
            where = f"{name} panel '{p.get('title')}'"
            if p.get("type") not in PANEL_TYPES:
                fail(f"{where}: unknown type {p.get('type')}")
            g = p.get("gridPos", {})
            if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] + g["w"] > 24:
                fail(f"{where}: bad gridPos {g}")
            if p.get("datasource", {}).get("uid") != uid:
                fail(f"{where}: datasource uid {p.get('datasource')} is not the provisioned '{uid}'")
            targets = p.get("targets") or fail(f"{where}: no targets")
            refs = [t.get("refId") for t in targets]
            if len(set(refs)) != len(refs) or None in refs:
                fail(f"{where}: refIds missing or repeated: {refs}")
            for t in targets:
                if t.get("datasource", {}).get("uid", uid) != uid:
                    fail(f"{where} target {t['refId']}: datasource uid is not '{uid}'")
                if not t.get("expr", "").strip():
                    fail(f"{where} target {t['refId']}: empty expr")
                out.append((f"{where} target {t['refId']}", t["expr"]))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, data=None, timeout=30):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError) as e:  # not listening (yet)
        return 0, json.dumps({"status": "error", "error": str(e)})


def start_server(binary, tmp):
    model = os.path.join(tmp, "m.gguf")
    # Experts large enough that a 4 MiB budget holds only some of them (exchanges can happen).
    subprocess.run([binary, "synth", "--out", model, "--hidden", "256", "--expert-ff", "256", "--experts", "16"],
                   check=True, stdout=subprocess.DEVNULL)
    proc = subprocess.Popen([binary, "serve", "--model", model, "--listen", "127.0.0.1:0", "--engine", "pipeline",
                             "--perf-mode", "full", "--hot-budget-mib", "4"],
                            stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "serve.log"), "w"), text=True)
    line = proc.stdout.readline()
    m = re.match(r"listening on http://(\S+)", line)
    if not m:
        proc.kill()
        fail(f"the server did not start: {line!r}; see {tmp}/serve.log")
    return proc, m.group(1)


def drive(addr, stop, errors):
    """Completions until `stop` is set (two at a time, so requests also wait)."""
    def one():
        while not stop.is_set():
            body = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 24}).encode()
            status, text = http(f"http://{addr}/v1/completions", body)
            if status not in (200, 429):
                errors.append(f"/v1/completions answered {status}: {text}")
                return
    threads = [threading.Thread(target=one, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    return threads


def exchange(addr):
    """Swap one hot expert of layer 0 for a cold one (a manual apply: exchanges move)."""
    status, text = http(f"http://{addr}/moe-hot-cache")
    hot = json.loads(text)["layers"]["0"]
    cold = [e for e in range(16) if e not in hot]
    if not hot or not cold:
        fail(f"the 4 MiB budget should leave layer 0 partly hot: {hot}")
    body = json.dumps({"layers": {"0": hot[1:] + cold[:1]}}).encode()
    status, text = http(f"http://{addr}/moe-hot-cache", body)
    if status != 200:
        fail(f"POST /moe-hot-cache answered {status}: {text}")


def promtool(addr, tmp):
    _, text = http(f"http://{addr}/metrics")
    path = os.path.join(tmp, "metrics.txt")
    open(path, "w").write(text)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"promtool check metrics: {r.stdout}{r.stderr}")
    print(f"grafana-check: promtool check metrics passed ({len(text.splitlines())} lines)")


def start_prometheus(addr, tmp):
    port = free_port()
    cfg = os.path.join(tmp, "prometheus.yml")
    open(cfg, "w").write(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: moe-lanes\n    static_configs:\n      - targets: ['{addr}']\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/tsdb",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "prometheus.log"), "w"))
    return proc, f"http://127.0.0.1:{port}"


def query(prom, expr):
    status, text = http(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {"status": "error", "error": text}


def wait_for_scrapes(prom, n, deadline):
    while time.time() < deadline:
        _, v = query(prom, 'count_over_time(up{job="moe-lanes"}[1m])')
        res = v.get("data", {}).get("result", []) if v.get("status") == "success" else []
        if res and float(res[0]["value"][1]) >= n:
            _, up = query(prom, 'up{job="moe-lanes"}')
            if up["data"]["result"][0]["value"][1] != "1":
                fail("Prometheus cannot scrape the server (up == 0)")
            return
        time.sleep(0.5)
    fail(f"Prometheus did not scrape {n} times in time")


def check_targets(prom, targets, source_text):
    names = set()
    for where, expr in targets:
        for key, value in SUBSTITUTIONS.items():
            expr = expr.replace(key, value)
        if "$" in expr:
            fail(f"{where}: unsubstituted template variable in {expr}")
        used = set(re.findall(r"\bmoe_lanes_[a-z_]+", expr))
        names |= used
        status, v = query(prom, expr)
        if v.get("status") != "success":
            fail(f"{where}: invalid PromQL ({status}): {v.get('error')}\n  {expr}")
        if not v["data"]["result"] and not used & GPU_ONLY:
            fail(f"{where}: no series\n  {expr}")
    for name in sorted(names):
        if name in GPU_ONLY:
            if name not in source_text:
                fail(f"{name}: GPU-only metric not named in the server or library source")
            continue
        _, v = query(prom, f'count({{__name__="{name}"}})')
        if not v["data"]["result"]:
            fail(f"the dashboard names {name}, which the server does not export")
    print(f"grafana-check: {len(targets)} dashboard queries returned series; {len(names)} metric names exist")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/debug/moe-lanes"))
    args = ap.parse_args()
    deadline = time.time() + DEADLINE_S
    for tool in ("prometheus", "promtool"):
        if not shutil.which(tool):
            fail(f"{tool} not found (scripts/grafana-check.sh installs Debian's prometheus)")
    uid = provisioned_uid()
    targets = dashboard_targets(uid)
    print(f"grafana-check: dashboard structure ok ({len(targets)} targets, datasource uid {uid})")
    source_text = "".join(open(p).read() for p in glob.glob(os.path.join(ROOT, "server/src/*.rs")) +
                          glob.glob(os.path.join(ROOT, "src/cache/perf.rs")))
    tmp = tempfile.mkdtemp(prefix="grafana-check-")
    procs, stop, errors = [], threading.Event(), []
    try:
        server, addr = start_server(args.bin, tmp)
        procs.append(server)
        drive(addr, stop, errors)
        exchange(addr)
        promtool(addr, tmp)
        prom_proc, prom = start_prometheus(addr, tmp)
        procs.append(prom_proc)
        wait_for_scrapes(prom, 5, deadline)
        stop.set()
        if errors:
            fail(errors[0])
        check_targets(prom, targets, source_text)
    finally:
        stop.set()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print("grafana-check: passed")


if __name__ == "__main__":
    main()
