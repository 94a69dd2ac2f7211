#!/usr/bin/env bash
# Old binary against new binary at KV-cache depths, in one invocation on one machine and one model
# (the GPU machine; needs only the prebuilt binaries, python3 and the model).
#
# Usage: scripts/depth-compare.sh OLD_BIN NEW_BIN MODEL
#
# Per depth D of DEPTHS (default "0 8192 32768"): `bench -p P -n N -d D --runs RUNS --json
# --hot-fraction HOT` of OLD_BIN (OLD_ARGS), then of NEW_BIN once per NEW_CONFIGS entry
# (";"-separated extra flags; default "--cache-type-k f16 --cache-type-v f16;--cache-type-k f32
# --cache-type-v f32"), each bench bounded by BENCH_TIMEOUT seconds. Prints a markdown table of
# pp and tg (medians of the runs) and new/old ratios; logs go to $OUT/depth-compare when OUT is
# set, else to a new directory under ${TMPDIR:-/tmp}.
# Env: DEPTHS, P (512), N (64), RUNS (2), HOT (1: all experts hot), OLD_ARGS, NEW_CONFIGS,
# BENCH_TIMEOUT (300), CUDA_LIB (/usr/local/cuda/lib64).
set -uo pipefail
die() { echo "depth-compare: $*" >&2; exit 2; }
[ $# -eq 3 ] || die "usage: $0 OLD_BIN NEW_BIN MODEL"
OLD=$1 NEW=$2 MODEL=$3
for b in "$OLD" "$NEW"; do [ -x "$b" ] || die "$b: not an executable file"; done
[ -e "$MODEL" ] || die "$MODEL: no such model"
DEPTHS=${DEPTHS:-0 8192 32768} P=${P:-512} N=${N:-64} RUNS=${RUNS:-2} HOT=${HOT:-1}
NEW_CONFIGS=${NEW_CONFIGS:---cache-type-k f16 --cache-type-v f16;--cache-type-k f32 --cache-type-v f32}
export LD_LIBRARY_PATH="${CUDA_LIB:-/usr/local/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -n "${OUT:-}" ]; then LOGS=$OUT/depth-compare; mkdir -p "$LOGS" || die "cannot create $LOGS"
else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/depth-compare.XXXXXX") || die "cannot create a log directory"; fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/setup.txt"
IFS=';' read -r -a configs <<<"$NEW_CONFIGS"
: >"$LOGS/runs.tsv"
run() { # label bin depth args...
    local label=$1 bin=$2 d=$3; shift 3
    local f="$LOGS/$label-d$d.json"
    timeout "${BENCH_TIMEOUT:-300}" "$bin" bench --model "$MODEL" -p "$P" -n "$N" -d "$d" --runs "$RUNS" --json \
        --hot-fraction "$HOT" "$@" >"$f" 2>"$f.err"
    local rc=$?
    python3 - "$f" "$label" "$d" "$rc" >>"$LOGS/runs.tsv" <<'PY'
import json, sys
f, label, d, rc = sys.argv[1:]
try:
    r = json.load(open(f))
    print(f"{label}\t{d}\t{r['pp_tokens_per_s']:.1f}\t{r['tg_tokens_per_s']:.1f}")
except Exception as e:
    print(f"{label}\t{d}\tNA\tNA\t# rc {rc}: {e}")
PY
    tail -1 "$LOGS/runs.tsv"
}
for d in $DEPTHS; do
    read -r -a oa <<<"${OLD_ARGS:-}"
    run old "$OLD" "$d" "${oa[@]}"
    i=0
    for c in "${configs[@]}"; do
        read -r -a na <<<"$c"
        run "new$i" "$NEW" "$d" "${na[@]}"
        i=$((i + 1))
    done
done
python3 - "$LOGS/runs.tsv" "$NEW_CONFIGS" <<'PY' | tee "$LOGS/compare.md"
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
configs = sys.argv[2].split(";")
val = {(r[0], r[1]): (r[2], r[3]) for r in rows}
depths = sorted({int(r[1]) for r in rows})
labels = ["old"] + [f"new{i}" for i in range(len(configs))]
print("| depth | " + " | ".join(f"{l} pp / tg" for l in labels) + " | " + " | ".join(f"{l}/old pp / tg" for l in labels[1:]) + " |")
print("|---" * (1 + 2 * len(labels) - 1) + "|")
def ratio(a, b):
    try: return f"{float(a) / float(b):.2f}x"
    except Exception: return "NA"
for d in depths:
    o = val.get(("old", str(d)), ("NA", "NA"))
    cells = [f"{val.get((l, str(d)), ('NA', 'NA'))[0]} / {val.get((l, str(d)), ('NA', 'NA'))[1]}" for l in labels]
    rat = [f"{ratio(val.get((l, str(d)), ('NA','NA'))[0], o[0])} / {ratio(val.get((l, str(d)), ('NA','NA'))[1], o[1])}" for l in labels[1:]]
    print(f"| {d} | " + " | ".join(cells) + " | " + " | ".join(rat) + " |")
for i, c in enumerate(configs):
    print(f"\nnew{i}: {c}")
PY
