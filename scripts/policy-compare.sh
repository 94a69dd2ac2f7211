#!/usr/bin/env bash
# tg of every hot-cache policy on a locality workload, in one invocation on one machine and one
# model (the GPU machine; needs only the prebuilt release binary and python3).
#
# Usage: scripts/policy-compare.sh BIN
#
# Writes (once; kept for later calls) a 16-layer Qwen3-30B-A3B-shaped synthetic file whose routing
# follows the workload: `BIN synth --preset qwen3-30b-a3b --layers 16 --skew $SPEC` into
# $MODEL_DIR (default ${TMPDIR:-/tmp}/policy-compare); or uses $MODEL when set (it must have been
# written with the same --skew $SPEC). Then per hot fraction F of FRACTIONS (default "0.25 0.5")
# and per policy: `BIN bench --model M --scenario $SPEC -p P -n N --runs RUNS --hot-fraction F
# --json` (`--scenario` for locality specs only; skewed, domains:D etc. run bench's random ids) with
#   static   --cache-policy planned                    (today's static cache)
#   online   --cache-policy planned --update auto --update-every-tokens 32   (today's updater)
#   lru | lfu | tinylfu | adaptive | reuse   --cache-policy NAME   (per-token online policies)
# each bounded by BENCH_TIMEOUT seconds; a run that would start after BUDGET_S seconds of the
# script (the model's synthesis included) is skipped (NA), so the whole call stays under
# BUDGET_S + BENCH_TIMEOUT seconds (defaults 390 + 60: 7.5 minutes; the first call spends one to
# two of them writing the 20 GiB model, so a later call, with the file kept, runs every bench).
# Every policy runs at the first fraction before any at the next; with ROUNDS > 1 the policies
# take turns ROUNDS times at each fraction (static, online, reuse, static, ...), so a drift of
# the host's memory bandwidth over the call reaches every policy alike. Prints a markdown table
# (tg: the median of the rounds' medians, and the slowest and fastest run; decode hit rate and
# copies: the rounds' mean) and logs everything under $OUT/policy-compare when OUT is set, else a new
# directory under ${TMPDIR:-/tmp}.
# A policy NAME-base runs NAME with BASE_BIN instead of BIN (another build of the same policy,
# taking turns with this one: POLICIES="static online reuse reuse-base" BASE_BIN=old/moe-lanes);
# NAME-inline runs NAME with `lag_steps` 0 (the default: its exchanges before the next call, the
# step waited for: --engine-config {"cache_policy": {"kind": NAME, "lag_steps": 0}}), NAME-lagged
# with `lag_steps` 1 (the step beside the next call, its exchanges before the one after).
# LABEL=FILE runs --engine-config FILE (any engine configuration, e.g. a policy's copy cost:
# POLICIES="reuse counted=counted.json" with {"cache_policy": {"copy_cost": {"pcie_overlapped": false}}}),
# named LABEL in the table.
# Env: SPEC (locality:p=0.8,drift=0.01), FRACTIONS, P (64), N (256), RUNS (3), ROUNDS (1), POLICIES
# ("static online lru lfu tinylfu adaptive reuse"), BASE_BIN, MODEL, MODEL_DIR, BENCH_TIMEOUT (60), BUDGET_S (390),
# EXTRA_ARGS (more bench flags, e.g. --engine pipeline off the GPU machine), SYNTH_ARGS (default
# "--preset qwen3-30b-a3b --layers 16"), CUDA_LIB (/usr/local/cuda/lib64).
set -uo pipefail
die() { echo "policy-compare: $*" >&2; exit 2; }
[ $# -eq 1 ] || die "usage: $0 BIN"
BIN=$1
[ -x "$BIN" ] || die "$BIN: not an executable file"
SPEC=${SPEC:-locality:p=0.8,drift=0.01} FRACTIONS=${FRACTIONS:-0.25 0.5}
P=${P:-64} N=${N:-256} RUNS=${RUNS:-3} ROUNDS=${ROUNDS:-1} BUDGET_S=${BUDGET_S:-390} BENCH_TIMEOUT=${BENCH_TIMEOUT:-60}
POLICIES=${POLICIES:-static online lru lfu tinylfu adaptive reuse}
SYNTH_ARGS=${SYNTH_ARGS:---preset qwen3-30b-a3b --layers 16}
export LD_LIBRARY_PATH="${CUDA_LIB:-/usr/local/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -n "${OUT:-}" ]; then LOGS=$OUT/policy-compare; mkdir -p "$LOGS" || die "cannot create $LOGS"
else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/policy-compare.XXXXXX") || die "cannot create a log directory"; fi
START=$SECONDS
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/setup.txt"
if [ -z "${MODEL:-}" ]; then
    MODEL_DIR=${MODEL_DIR:-${TMPDIR:-/tmp}/policy-compare}
    mkdir -p "$MODEL_DIR" || die "cannot create $MODEL_DIR"
    MODEL=$MODEL_DIR/m-$(echo "$SYNTH_ARGS $SPEC" | tr -c 'A-Za-z0-9.\n' '_').gguf
    if [ ! -f "$MODEL" ]; then
        read -r -a sa <<<"$SYNTH_ARGS"
        "$BIN" synth "${sa[@]}" --skew "$SPEC" --format gguf --out "$MODEL" >"$LOGS/synth.log" 2>&1 \
            || die "synth failed (see $LOGS/synth.log)"
        echo "synth $SPEC: $((SECONDS - START)) s ($MODEL)"
    fi
fi
[ -e "$MODEL" ] || die "$MODEL: no such model"
flags() {
    case "$1" in
        static) echo "--cache-policy planned" ;;
        online) echo "--cache-policy planned --update auto --update-every-tokens 32" ;;
        *-inline | *-lagged)
            # -inline: the step waited for, its exchanges applied before the next call; -lagged:
            # the step beside the next call, its exchanges before the one after
            local cfg="$LOGS/${1}.json" name=${1%-inline} lag=0
            [ "${1%-lagged}" != "$1" ] && name=${1%-lagged} lag=1
            printf '{"cache_policy": {"kind": "%s", "lag_steps": %s}}\n' "$name" "$lag" >"$cfg"
            echo "--engine-config $cfg" ;;
        *) echo "--cache-policy $1" ;;
    esac
}
# a locality workload's tokens come from its routing process; skewed, domains:D, ... take bench's random ids
scenario=()
case "$SPEC" in locality:*) scenario=(--scenario "$SPEC") ;; esac
: >"$LOGS/runs.tsv"
read -r -a extra <<<"${EXTRA_ARGS:-}"
for f in $FRACTIONS; do
  for round in $(seq 1 "$ROUNDS"); do
    for pol in $POLICIES; do
        label=${pol%%=*}
        out="$LOGS/$label-$f-r$round.json"
        if [ $((SECONDS - START)) -ge "$BUDGET_S" ]; then
            printf '%s\t%s\tNA\tNA\tNA\tNA\t# skipped: past BUDGET_S\n' "$label" "$f" >>"$LOGS/runs.tsv"
            continue
        fi
        bin=$BIN name=$pol
        if [ "${pol%-base}" != "$pol" ]; then
            bin=${BASE_BIN:?"$pol needs BASE_BIN"} name=${pol%-base}
        fi
        if [ "${pol#*=}" != "$pol" ]; then
            pf=(--engine-config "${pol#*=}")
        else
            read -r -a pf <<<"$(flags "$name")"
        fi
        timeout "$BENCH_TIMEOUT" "$bin" bench --model "$MODEL" "${scenario[@]}" -p "$P" -n "$N" --runs "$RUNS" \
            --hot-fraction "$f" --json "${pf[@]}" "${extra[@]}" >"$out" 2>"$out.err"
        rc=$?
        python3 - "$out" "$label" "$f" "$rc" >>"$LOGS/runs.tsv" <<'PY'
import json, sys
f, pol, frac, rc = sys.argv[1:]
try:
    r = json.load(open(f))
    s = r["tg_tokens_per_s_spread"]
    print(f"{pol}\t{frac}\t{s['median']:.1f} {s['min']:.1f} {s['max']:.1f}\t{r['hit_rate']:.4f}\t{r['cache_exchanges']}")
except Exception as e:
    print(f"{pol}\t{frac}\tNA\tNA\tNA\t# rc {rc}: {e}")
PY
        tail -1 "$LOGS/runs.tsv"
    done
  done
done
echo "total: $((SECONDS - START)) s"
python3 - "$LOGS/runs.tsv" "$SPEC" <<'PY' | tee "$LOGS/compare.md"
import statistics, sys
cells = {}
for line in open(sys.argv[1]):
    r = line.rstrip("\n").split("\t")
    if len(r) < 5 or r[2] == "NA":
        cells.setdefault((r[1], r[0]), [])
        continue
    cells.setdefault((r[1], r[0]), []).append(([float(x) for x in r[2].split()], float(r[3]), int(r[4])))
print(f"workload {sys.argv[2]}; tg t/s: the median of the rounds' medians [slowest-fastest run]; decode hit rate and exchanges (a round's timed runs): the rounds' mean")
print("| hot fraction | policy | tg t/s | spread | hit rate | exchanges |")
print("|---|---|---|---|---|---|")
for (frac, pol), got in cells.items():
    if not got:
        print(f"| {frac} | {pol} | NA | NA | NA | NA |")
        continue
    tg = [g[0][0] for g in got]
    lo, hi = min(g[0][1] for g in got), max(g[0][2] for g in got)
    hit = statistics.mean(g[1] for g in got)
    ex = statistics.mean(g[2] for g in got)
    print(f"| {frac} | {pol} | {statistics.median(tg):.1f} | [{lo:.1f}-{hi:.1f}] | {100 * hit:.1f}% | {ex:.0f} |")
PY
