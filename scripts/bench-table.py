#!/usr/bin/env python3
"""Print one comparison table from `moe-lanes bench --json` reports (standard library only).

Usage: bench-table.py [--skip-missing] REPORT [REPORT ...]
       bench-table.py --self-test
A REPORT is PATH or LABEL=PATH; without a label the run is named by the file's stem without a
`bench-` prefix (models/bench-hot.json -> hot). With runs named `hot` and `off` a last line gives
the hot/off ratios of pp and tg. --skip-missing leaves out files that do not exist (a run not
made yet); otherwise a missing file is an error. Exit status: 0 table printed, 1 bad or no
report, 2 usage.
"""
import json
import os
import sys
import tempfile

# (title, width, align); the cells of a row are cut to the width.
COLUMNS = [
    ("run", 6, "<"), ("engine/device", 34, "<"), ("budget", 8, ">"), ("hot MiB", 9, ">"),
    ("hit %", 6, ">"), ("pp t/s", 9, ">"), ("tg t/s", 8, ">"), ("overlap us", 10, ">"),
    ("join wait us", 12, ">"), ("fallbacks", 9, ">"),
]
# Keys the table reads (numbers unless listed in TEXT_KEYS); `engine` is optional (older
# binaries print only the device).
KEYS = ["device", "budget", "hot_bytes", "hit_rate", "pp_tokens_per_s", "tg_tokens_per_s",
        "overlap_us", "join_wait_us", "fallbacks", "n_prompt_tokens", "n_gen_tokens", "n_runs"]
TEXT_KEYS = {"device", "budget"}
MIB = 1 << 20


class ReportError(Exception):
    pass


def load(path):
    """The report at `path`, checked for every key the table reads; errors name the file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ReportError(f"{path}: cannot read: {e.strerror}")
    if not text.strip():
        raise ReportError(f"{path}: empty file, not a bench report (did the bench fail?)")
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})")
    if not isinstance(report, dict):
        raise ReportError(f"{path}: not a bench report (JSON {type(report).__name__}, expected an object)")
    missing = [k for k in KEYS if k not in report]
    if missing:
        raise ReportError(f"{path}: not a bench report, missing {', '.join(missing)}")
    for k in KEYS:
        v = report[k]
        if k not in TEXT_KEYS and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ReportError(f"{path}: key {k} is {v!r}, expected a number")
    return report


def budget_cell(budget):
    """`{"bytes": N}` -> MiB, `"auto"`, `{"fraction": F}` -> f=F; anything else as printed."""
    if isinstance(budget, dict) and len(budget) == 1:
        (kind, value), = budget.items()
        if kind == "bytes" and isinstance(value, (int, float)):
            return f"{value / MIB:.0f}"
        if kind == "fraction" and isinstance(value, (int, float)):
            return f"f={value:.2f}"
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return f"{budget / MIB:.0f}"
    return str(budget)


def fmt_row(cells):
    return " ".join(f"{str(c)[:w]:{a}{w}}" for (_, w, a), c in zip(COLUMNS, cells)).rstrip()


def row(name, r):
    engine = r.get("engine")
    where = f"{engine}/{r['device']}" if engine else str(r["device"])
    return fmt_row([
        name, where, budget_cell(r["budget"]), f"{r['hot_bytes'] / MIB:.1f}",
        f"{100 * r['hit_rate']:.1f}", f"{r['pp_tokens_per_s']:.1f}", f"{r['tg_tokens_per_s']:.1f}",
        f"{r['overlap_us']:.1f}", f"{r['join_wait_us']:.1f}", str(r["fallbacks"]),
    ])


def ratio(a, b):
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def table(named):
    """The table of (label, report) pairs, in order."""
    sizes = sorted({(r["n_prompt_tokens"], r["n_gen_tokens"], r["n_runs"]) for _, r in named})
    title = "; ".join(f"pp{p} tg{n}, median of {k} run{'s' if k != 1 else ''}" for p, n, k in sizes)
    head = fmt_row([t for t, _, _ in COLUMNS])
    lines = [f"bench: {title}", head, "-" * len(head)] + [row(n, r) for n, r in named]
    by = dict(named)
    if "hot" in by and "off" in by:
        hot, off = by["hot"], by["off"]
        lines.append(f"hot/off: pp {ratio(hot['pp_tokens_per_s'], off['pp_tokens_per_s'])}, "
                     f"tg {ratio(hot['tg_tokens_per_s'], off['tg_tokens_per_s'])}")
    for n, r in named:
        if r["budget"] == "auto" and r["hot_bytes"] == 0:
            lines.append(f"note: {n}: the auto budget planned no hot experts (no GPU memory on "
                         f"{r['device']}?); give a size, e.g. BUDGET=1024")
    return "\n".join(lines)


def label_and_path(arg):
    if "=" in arg and not os.path.exists(arg):
        label, path = arg.split("=", 1)
        if label and "/" not in label:
            return label, path
    stem = os.path.splitext(os.path.basename(arg))[0]
    return stem.removeprefix("bench-") or stem, arg


SAMPLE_HOT = {
    "device": "NVIDIA H100 80GB HBM3 (sm_90)", "engine": "gpu", "model": "models/bench.gguf",
    "n_prompt_tokens": 512, "n_gen_tokens": 128, "n_runs": 3,
    "pp_tokens_per_s": 4000.0, "tg_tokens_per_s": 370.25, "hit_rate": 0.9634, "pp_hit_rate": 0.95,
    "overlap_us": 5.04, "join_wait_us": 25.0, "hot_lane_us": 30.0, "cold_lane_us": 20.0,
    "fallbacks": 0, "hot_bytes": 9 << 30, "hot_experts": 1024, "all_experts_bytes": 18 << 30,
    "budget": "auto", "planned_hit_rate": 0.96, "learn_source": "learn file",
    "cold_threads": 16, "simd": "avx512",
}
SAMPLE_OFF = dict(SAMPLE_HOT, engine=None, hot_bytes=0, hot_experts=0, hit_rate=0.0,
                  pp_tokens_per_s=400.0, tg_tokens_per_s=74.05, overlap_us=0.0,
                  join_wait_us=812.5, budget={"bytes": 0})
del SAMPLE_OFF["engine"]  # an older binary's report: device only
EXPECTED = """\
bench: pp512 tg128, median of 3 runs
run    engine/device                        budget   hot MiB  hit %    pp t/s   tg t/s overlap us join wait us fallbacks
------------------------------------------------------------------------------------------------------------------------
hot    gpu/NVIDIA H100 80GB HBM3 (sm_90)      auto    9216.0   96.3    4000.0    370.2        5.0         25.0         0
off    NVIDIA H100 80GB HBM3 (sm_90)             0       0.0    0.0     400.0     74.0        0.0        812.5         0
hot/off: pp 10.00x, tg 5.00x"""


def self_test():
    failures = []
    out = table([("hot", SAMPLE_HOT), ("off", SAMPLE_OFF)])
    if out != EXPECTED:
        failures.append("table differs from the expected formatting:\n" + out)
    if budget_cell({"fraction": 0.5}) != "f=0.50" or budget_cell({"bytes": 512 << 20}) != "512":
        failures.append("budget cells")
    if label_and_path("x/bench-off.json") != ("off", "x/bench-off.json") or \
            label_and_path("new=/tmp/a.json") != ("new", "/tmp/a.json"):
        failures.append("labels")
    with tempfile.TemporaryDirectory() as d:
        cases = {"bench-nokey.json": (json.dumps({"device": "cpu"}), "missing budget"),
                 "bench-text.json": ("bench failed: no GPU\n", "not JSON"),
                 "bench-empty.json": ("", "empty file"),
                 "bench-list.json": ("[1, 2]", "expected an object"),
                 "bench-type.json": (json.dumps(dict(SAMPLE_HOT, fallbacks="0")), "key fallbacks")}
        for name, (content, want) in cases.items():
            path = os.path.join(d, name)
            with open(path, "w") as f:
                f.write(content)
            try:
                load(path)
                failures.append(f"{name}: accepted")
            except ReportError as e:
                if path not in str(e) or want not in str(e):
                    failures.append(f"{name}: message {e!s} lacks the file or '{want}'")
        try:
            load(os.path.join(d, "absent.json"))
            failures.append("absent file accepted")
        except ReportError as e:
            if "absent.json" not in str(e):
                failures.append(f"absent file: {e}")
    cpu = dict(SAMPLE_OFF, device="cpu", engine="pipeline", budget="auto")
    if "note: hot: the auto budget planned no hot experts (no GPU memory on cpu?)" not in table([("hot", cpu)]):
        failures.append("no note for an auto budget that planned nothing")
    print(out)
    for f in failures:
        print("FAILED:", f)
    print("self-test", "FAILED" if failures else "passed")
    return 1 if failures else 0


def main(argv):
    args = argv[1:]
    if args == ["--self-test"]:
        return self_test()
    skip_missing = "--skip-missing" in args
    args = [a for a in args if a != "--skip-missing"]
    if not args or any(a.startswith("-") for a in args):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    named = []
    for arg in args:
        label, path = label_and_path(arg)
        if skip_missing and not os.path.exists(path):
            continue
        try:
            named.append((label, load(path)))
        except ReportError as e:
            print(f"bench-table: {e}", file=sys.stderr)
            return 1
    if not named:
        print("bench-table: no bench reports yet (" + ", ".join(args) + "): run `just hot` and/or `just off`",
              file=sys.stderr)
        return 1
    print(table(named))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
