#!/usr/bin/env bash
# Old binary against new binary, in one call on one machine and one model: `bench` at hot
# budgets 0, 50% and 100% of the expert bytes, alternating old and new, with one learn file.
# Usage (GPU machine): scripts/gpu-compare.sh OLD_BIN NEW_BIN MODEL   (env P, N, RUNS, REPEATS)
# Prints a markdown table of pp and tg medians and new/old ratios; logs to $OUT or /tmp.
set -u
OLD=$1 NEW=$2 MODEL=$3
P=${P:-512} N=${N:-128} RUNS=${RUNS:-3} REPEATS=${REPEATS:-1}
LOGS=${OUT:-/tmp}/compare
mkdir -p "$LOGS"
all_mib=$("$NEW" inspect "$MODEL" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["all_experts_bytes"] >> 20)')
"$NEW" learn --engine gpu --model "$MODEL" --n-tokens 256 --out "$LOGS/learn.json" 2>"$LOGS/learn.err" ||
    "$OLD" learn --model "$MODEL" --n-tokens 256 --out "$LOGS/learn.json"
for budget in 0 $((all_mib / 2)) "$all_mib"; do
    for rep in $(seq "$REPEATS"); do
        "$OLD" bench --model "$MODEL" --learn "$LOGS/learn.json" --hot-budget-mib "$budget" -p "$P" -n "$N" --runs "$RUNS" --json \
            >"$LOGS/old-$budget-$rep.json" 2>"$LOGS/old-$budget-$rep.err"
        "$NEW" bench --engine gpu --model "$MODEL" --learn "$LOGS/learn.json" --hot-budget-mib "$budget" -p "$P" -n "$N" --runs "$RUNS" --json \
            >"$LOGS/new-$budget-$rep.json" 2>"$LOGS/new-$budget-$rep.err"
    done
done
python3 - "$LOGS" "$all_mib" <<'PY'
import json, sys, glob, statistics
logs, all_mib = sys.argv[1], int(sys.argv[2])
print("| budget MiB | hit rate | old pp | new pp | pp new/old | old tg | new tg | tg new/old | new fallbacks |")
print("|---|---|---|---|---|---|---|---|---|")
for b in [0, all_mib // 2, all_mib]:
    def load(kind):
        out = []
        for f in sorted(glob.glob(f"{logs}/{kind}-{b}-*.json")):
            try:
                out.append(json.load(open(f)))
            except Exception as e:
                print(f"{f}: {e}", file=sys.stderr)
        return out
    old, new = load("old"), load("new")
    if not old or not new:
        print(f"| {b} | missing runs |"); continue
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    op, np_, ot, nt = med(old, "pp_tokens_per_s"), med(new, "pp_tokens_per_s"), med(old, "tg_tokens_per_s"), med(new, "tg_tokens_per_s")
    print(f"| {b} | {med(new, 'hit_rate'):.3f} | {op:.1f} | {np_:.1f} | {np_/op:.3f} | {ot:.1f} | {nt:.1f} | {nt/ot:.3f} | {sum(r['fallbacks'] for r in new)} |")
PY
