#!/usr/bin/env bash
# Replayed hit rates of every hot-cache policy against Belady's optimum, on small synthetic models
# (CPU only: the pipeline engine writes the expert traces, `plan --trace --policies` replays them).
#
# Usage: scripts/policy-replay-table.sh BIN
#
# Per workload W of WORKLOADS (default: four locality settings, skewed and domains:2): `synth
# --skew W` (qwen3_moe, LAYERS layers, EXPERTS experts, top-k TOPK, tiny otherwise), then `bench
# --engine pipeline -p 32 -n N --runs 1 --trace` (locality workloads with `--scenario W`: the
# routing process's tokens; the others random ids), then `plan --trace --policies
# --policy-fractions 0.25,0.5 --json`. Prints a markdown table (hit rate, adaptive's and reuse's
# shares of Belady's, copies per layer and call; `hindsight`: the best fixed set of the scored calls). Logs under $OUT/policy-replay when OUT is set, else a new directory in /tmp.
# Env: WORKLOADS, LAYERS (4), EXPERTS (32), TOPK (4), N (1500), SEED (7: the synth seed), LAG
# (`plan --policy-lag`: 0, the engines' default, a step policy's exchanges serve from the next
# call; 1, from the one after, as with "lag_steps": 1).
set -uo pipefail
die() { echo "policy-replay-table: $*" >&2; exit 2; }
[ $# -eq 1 ] || die "usage: $0 BIN"
BIN=$1
[ -x "$BIN" ] || die "$BIN: not an executable file"
WORKLOADS=${WORKLOADS:-locality:p=0.5,drift=0.01 locality:p=0.8,drift=0.01 locality:p=0.8,drift=0.1 locality:p=0.95,drift=0.05 skewed domains:2}
LAYERS=${LAYERS:-4} EXPERTS=${EXPERTS:-32} TOPK=${TOPK:-4} N=${N:-1500}
if [ -n "${OUT:-}" ]; then LOGS=$OUT/policy-replay; mkdir -p "$LOGS" || die "cannot create $LOGS"
else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/policy-replay.XXXXXX") || die "cannot create a log directory"; fi
i=0
for w in $WORKLOADS; do
    m="$LOGS/m$i.gguf" t="$LOGS/t$i.jsonl" j="$LOGS/r$i.json"
    "$BIN" synth --force --out "$m" --layers "$LAYERS" --experts "$EXPERTS" --top-k "$TOPK" --skew "$w" --seed "${SEED:-7}" \
        >"$LOGS/synth$i.log" 2>&1 || die "synth $w failed (see $LOGS/synth$i.log)"
    scen=()
    case "$w" in locality:*) scen=(--scenario "$w") ;; esac
    "$BIN" bench --model "$m" --engine pipeline -p 32 -n "$N" --runs 1 --hot-fraction 0.25 \
        --cache-policy planned --trace "$t" --force "${scen[@]}" >"$LOGS/bench$i.log" 2>&1 \
        || die "bench $w failed (see $LOGS/bench$i.log)"
    "$BIN" plan --model "$m" --trace "$t" --policies --policy-fractions 0.25,0.5 --policy-lag "${LAG:-0}" --json >"$j" \
        || die "plan $w failed"
    echo "$w" >"$j.name"
    i=$((i + 1))
done
python3 - "$LOGS" "$i" <<'PY'
import json, sys
logs, n = sys.argv[1], int(sys.argv[2])
policies = ["static", "hindsight", "online", "lru", "lfu", "tinylfu", "adaptive", "reuse", "belady"]
copied = ["lru", "lfu", "tinylfu", "adaptive", "reuse"]
print("| workload | budget | " + " | ".join(policies) + " | adaptive / Belady | reuse / Belady | copies per layer and call ("
      + " / ".join(copied) + ") |")
print("|---" * (5 + len(policies)) + "|")
for i in range(n):
    name = open(f"{logs}/r{i}.json.name").read().strip()
    for r in json.load(open(f"{logs}/r{i}.json")):
        rows = {x["policy"]: x for x in r["rows"]}
        cells = [f"{100 * rows[p]['hit_rate']:.1f}%" for p in policies]
        steps = max(1, r["scored_steps"] * len(rows["static"]["hit_rate_per_layer"]))
        copies = " / ".join(f"{rows[p]['admissions'] / steps:.2f}" for p in copied)
        shares = " | ".join(f"{100 * rows[p]['of_belady']:.1f}%" for p in ["adaptive", "reuse"])
        print(f"| {name} | {100 * r['fraction']:.0f}% | " + " | ".join(cells) + f" | {shares} | {copies} |")
PY
