#!/usr/bin/env python3
"""Print the learn / hot / off comparison table from `moe-lanes bench --json` reports.

Usage: bench-table.py REPORT.json [REPORT.json ...]   (the run's name is the file's stem,
e.g. models/bench-hot.json -> hot), or --self-test. Standard library only.
"""
import json
import os
import sys

COLUMNS = [
    ("run", "{:<6}"), ("engine", "{:<8}"), ("device", "{:<28}"), ("hot MiB", "{:>9}"),
    ("hit %", "{:>6}"), ("pp t/s", "{:>9}"), ("tg t/s", "{:>8}"), ("overlap us", "{:>10}"),
    ("join wait us", "{:>12}"), ("fallbacks", "{:>9}"),
]
KEYS = ["engine", "device", "hot_bytes", "hit_rate", "pp_tokens_per_s", "tg_tokens_per_s",
        "overlap_us", "join_wait_us", "fallbacks"]


class ReportError(Exception):
    pass


def load(path):
    try:
        with open(path) as f:
            report = json.load(f)
    except OSError as e:
        raise ReportError(f"{path}: cannot read: {e.strerror}")
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON: {e}")
    missing = [k for k in KEYS if k not in report]
    if missing:
        raise ReportError(f"{path}: not a bench report, missing {', '.join(missing)}")
    return report


def row(name, r):
    cells = [name[:6], r["engine"], r["device"][:28], f"{r['hot_bytes'] / 2**20:.1f}",
             f"{100 * r['hit_rate']:.1f}", f"{r['pp_tokens_per_s']:.1f}", f"{r['tg_tokens_per_s']:.1f}",
             f"{r['overlap_us']:.1f}", f"{r['join_wait_us']:.1f}", str(r["fallbacks"])]
    return " ".join(fmt.format(c) for (_, fmt), c in zip(COLUMNS, cells))


def table(named):
    head = " ".join(fmt.format(title) for title, fmt in COLUMNS)
    lines = [head, "-" * len(head)] + [row(n, r) for n, r in named]
    by = dict(named)
    if "hot" in by and "off" in by:
        pp = by["hot"]["pp_tokens_per_s"] / max(by["off"]["pp_tokens_per_s"], 1e-9)
        tg = by["hot"]["tg_tokens_per_s"] / max(by["off"]["tg_tokens_per_s"], 1e-9)
        lines.append(f"hot / off: pp {pp:.2f}x, tg {tg:.2f}x")
    return "\n".join(lines)


def self_test():
    base = {"engine": "gpu", "device": "NVIDIA H100 (sm_90)", "hot_bytes": 9 << 30, "hit_rate": 0.963,
            "pp_tokens_per_s": 4000.0, "tg_tokens_per_s": 370.0, "overlap_us": 5.0,
            "join_wait_us": 25.0, "fallbacks": 0}
    off = dict(base, hot_bytes=0, hit_rate=0.0, pp_tokens_per_s=400.0, tg_tokens_per_s=74.0)
    out = table([("hot", base), ("off", off)])
    ok = "hot / off: pp 10.00x, tg 5.00x" in out and "9216.0" in out and "96.3" in out
    try:
        table([("x", {"engine": "gpu"})])
        ok = False
    except KeyError:
        pass
    print(out)
    print("self-test", "passed" if ok else "FAILED")
    return 0 if ok else 1


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    named = []
    for path in argv[1:]:
        if not os.path.exists(path):
            continue  # a run not made yet (e.g. `just hot` before `just off`)
        try:
            named.append((os.path.splitext(os.path.basename(path))[0].removeprefix("bench-"), load(path)))
        except ReportError as e:
            print(e, file=sys.stderr)
            return 1
    if not named:
        print("no bench reports yet: run `just hot` and/or `just off`", file=sys.stderr)
        return 1
    print(table(named))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
