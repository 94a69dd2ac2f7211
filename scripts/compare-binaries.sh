#!/usr/bin/env bash
# Old binary against new binary, in one invocation on one machine and one model (the GPU machine;
# needs only the two prebuilt binaries, python3 and the model: no Rust, no network).
#
# Usage: scripts/compare-binaries.sh OLD_BIN NEW_BIN MODEL
#
# 1. Hot budgets (SHARES, default 0, 50% and 100%) of the model's expert bytes (`NEW_BIN inspect MODEL --json`,
#    all_experts_bytes, in MiB; 100% rounded up).
# 2. One learn file for both: `NEW_BIN learn --engine gpu`, else `OLD_BIN learn` (pipeline).
# 3. Per budget, REPEATS pairs in alternation (old, new, old, new, ...) so drift of clocks,
#    temperature or the host spreads over both: `OLD_BIN bench` (no --engine flag, its bench is the
#    GPU one) and `NEW_BIN bench --engine gpu`, each with --learn, -p P -n N --runs RUNS --json.
# 4. A markdown table of the medians over the repeats: budget, old/new pp and tg, new/old ratios.
#
# Env: SHARES ("0 50 100": the budgets as percentages of all experts), P (512), N (128), RUNS (3: timed runs inside one bench), REPEATS (2: old/new pairs per
# budget), LEARN_TOKENS (256), CUDA_LIB (/usr/local/cuda/lib64), OLD_ARGS / NEW_ARGS (extra bench
# flags; NEW_ARGS defaults to --greedy when only the new binary has that flag, so both feed the
# greedy token during tg as the old one does; set NEW_ARGS= to leave it out).
# Logs (learn file, every report and stderr, runs.tsv, compare.md) go to $OUT/compare-binaries
# when OUT is set, else to a new directory under ${TMPDIR:-/tmp}. Exit 0 when every bench ran.
set -uo pipefail

die() { echo "compare-binaries: $*" >&2; exit 2; }
[ $# -eq 3 ] || die "usage: $0 OLD_BIN NEW_BIN MODEL"
OLD=$1 NEW=$2 MODEL=$3
for b in "$OLD" "$NEW"; do [ -x "$b" ] || die "$b: not an executable file"; done
[ -e "$MODEL" ] || die "$MODEL: no such model"
command -v python3 >/dev/null || die "python3 not found"
P=${P:-512} N=${N:-128} RUNS=${RUNS:-3} REPEATS=${REPEATS:-2} LEARN_TOKENS=${LEARN_TOKENS:-256}
for v in P N RUNS REPEATS LEARN_TOKENS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
export LD_LIBRARY_PATH="${CUDA_LIB:-/usr/local/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -n "${OUT:-}" ]; then LOGS=$OUT/compare-binaries; mkdir -p "$LOGS" || die "cannot create $LOGS"
else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/compare-binaries.XXXXXX") || die "cannot create a log directory"; fi

if [ -z "${NEW_ARGS+set}" ]; then
    NEW_ARGS=
    if "$NEW" bench --help 2>/dev/null | grep -q -- '--greedy' && ! "$OLD" bench --help 2>/dev/null | grep -q -- '--greedy'; then
        NEW_ARGS=--greedy
    fi
fi
read -r -a old_args <<<"${OLD_ARGS:-}"
read -r -a new_args <<<"$NEW_ARGS"

{
    echo "old:   $OLD ($(sha256sum "$OLD" | cut -c1-12)) ${OLD_ARGS:-}"
    echo "new:   $NEW ($(sha256sum "$NEW" | cut -c1-12)) --engine gpu $NEW_ARGS"
    echo "model: $MODEL"
    echo "pp$P tg$N, $RUNS timed runs per bench, $REPEATS old/new pairs per budget; logs in $LOGS"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "host:  $(nproc) CPUs"
} | tee "$LOGS/setup.txt"

all_mib=$("$NEW" inspect "$MODEL" --json 2>"$LOGS/inspect.err" |
    python3 -c 'import json, sys; print(-(-json.load(sys.stdin)["all_experts_bytes"] // (1 << 20)))') ||
    die "NEW_BIN inspect $MODEL --json gave no all_experts_bytes (see $LOGS/inspect.err)"
read -r -a shares <<<"${SHARES:-0 50 100}"
budgets=()
for s in "${shares[@]}"; do
    [[ $s =~ ^[0-9]+$ && $s -le 100 ]] || die "SHARES: '$s' is not a percentage 0..100"
    budgets+=($((all_mib * s / 100)))
done
echo "budgets: ${budgets[*]} MiB (${shares[*]}% of all experts, $all_mib MiB)"

learn=$LOGS/learn.json
if "$NEW" learn --engine gpu --model "$MODEL" --n-tokens "$LEARN_TOKENS" --out "$learn" --force 2>"$LOGS/learn-new.err"; then
    echo "learn file: new binary (learn --engine gpu, $LEARN_TOKENS tokens)"
elif "$OLD" learn --model "$MODEL" --n-tokens "$LEARN_TOKENS" --out "$learn" 2>"$LOGS/learn-old.err"; then
    echo "learn file: old binary (learn on the pipeline, $LEARN_TOKENS tokens); new failed: $(tail -1 "$LOGS/learn-new.err")"
else
    die "no learn file: both learn passes failed ($LOGS/learn-new.err, $LOGS/learn-old.err)"
fi

fail=0
printf 'seq\tshare\tbudget_mib\trep\tbinary\trc\tpp\ttg\n' >"$LOGS/runs.tsv"
seq_no=0
run_bench() { # which share budget rep
    local which=$1 share=$2 budget=$3 rep=$4 base rc
    base=$LOGS/s$share-r$rep-$which
    seq_no=$((seq_no + 1))
    if [ "$which" = old ]; then
        "$OLD" bench --model "$MODEL" --learn "$learn" --hot-budget-mib "$budget" -p "$P" -n "$N" \
            --runs "$RUNS" --json "${old_args[@]}" >"$base.json" 2>"$base.err"
    else
        "$NEW" bench --engine gpu --model "$MODEL" --learn "$learn" --hot-budget-mib "$budget" -p "$P" -n "$N" \
            --runs "$RUNS" --json "${new_args[@]}" >"$base.json" 2>"$base.err"
    fi
    rc=$?
    [ $rc -eq 0 ] || { fail=1; echo "FAILED ($rc): $which budget $budget MiB rep $rep: $(tail -1 "$base.err")" >&2; }
    python3 - "$base.json" "$seq_no" "$share%" "$budget" "$rep" "$which" "$rc" >>"$LOGS/runs.tsv" <<'PY'
import json, sys
path, *cols = sys.argv[1:]
try:
    r = json.load(open(path))
    cols += [f"{r['pp_tokens_per_s']:.2f}", f"{r['tg_tokens_per_s']:.2f}"]
except Exception:
    cols += ["-", "-"]
print("\t".join(cols))
PY
    tail -1 "$LOGS/runs.tsv" | awk -F'\t' '{printf "  #%-3s %4s budget %6s MiB  rep %s  %-3s  pp %9s  tg %8s\n", $1, $2, $3, $4, $5, $7, $8}'
}
for i in "${!shares[@]}"; do
    for rep in $(seq "$REPEATS"); do
        run_bench old "${shares[$i]}" "${budgets[$i]}" "$rep"
        run_bench new "${shares[$i]}" "${budgets[$i]}" "$rep"
    done
done

python3 - "$LOGS" "${shares[*]}" "${budgets[@]}" <<'PY' | tee "$LOGS/compare.md"
import glob, json, os, statistics, sys
logs, shares = sys.argv[1], [int(s) for s in sys.argv[2].split()]
budgets = list(zip(shares, (int(b) for b in sys.argv[3:])))
notes = []

def reports(share, which):
    out = []
    for path in sorted(glob.glob(os.path.join(logs, f"s{share}-r*-{which}.json"))):
        try:
            r = json.load(open(path))
            float(r["pp_tokens_per_s"]), float(r["tg_tokens_per_s"])
            out.append(r)
        except (OSError, ValueError, KeyError, TypeError) as e:
            notes.append(f"{os.path.basename(path)}: no report ({type(e).__name__}: {e}); see {os.path.basename(path)[:-5]}.err")
    return out

def med(rs, key):
    return statistics.median(r[key] for r in rs) if rs else None

def num(v):
    return "-" if v is None else f"{v:.1f}"

def ratio(new, old):
    return "-" if new is None or old is None or old <= 0 else f"{new / old:.3f}"

print()
print("| budget MiB | old pp | new pp | pp ratio | old tg | new tg | tg ratio |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for share, b in budgets:
    old, new = reports(share, "old"), reports(share, "new")
    op, np_, ot, nt = med(old, "pp_tokens_per_s"), med(new, "pp_tokens_per_s"), med(old, "tg_tokens_per_s"), med(new, "tg_tokens_per_s")
    print(f"| {b} ({share}%) | {num(op)} | {num(np_)} | {ratio(np_, op)} | {num(ot)} | {num(nt)} | {ratio(nt, ot)} |")
    oh, nh = med(old, "hit_rate"), med(new, "hit_rate")
    if oh is not None and nh is not None and abs(oh - nh) > 0.01:
        notes.append(f"budget {b} MiB ({share}%): tg hit rates differ (old {oh:.3f}, new {nh:.3f}): not the same hot set or token feed")
    fb = sum(r.get("fallbacks", 0) for r in new)
    if fb:
        notes.append(f"budget {b} MiB ({share}%): new binary reported {fb} fallbacks")
    n_old, n_new = len(old), len(new)
    if n_old != n_new:
        notes.append(f"budget {b} MiB ({share}%): {n_old} old and {n_new} new reports")
print()
print("Medians over the repeats of each bench's median; ratios are new / old.")
for n in notes:
    print(f"- {n}")
PY
echo "logs: $LOGS"
exit $fail
