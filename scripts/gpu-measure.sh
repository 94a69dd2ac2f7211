#!/usr/bin/env bash
# The GPU-machine measurements the open issues ask for, one PART per call (each fits the device's
# 10-minute limit; the models stay in MODEL_DIR between calls while the machine is held):
#
#   models   start the llama.cpp build in the background (benches/compare-llama-cpp.sh build, needs
#            .llama/src carried), write the 16-layer Qwen3-30B-A3B-shaped models (uniform, skewed,
#            domains:2) and run the GPU test binaries + golden check meanwhile (scripts/gpu-test.sh)
#   metrics  bench --metrics-ab: tg with the perf state / metrics on and off in the same runs (issue 11)
#   shift    bench --scenario shift on the domains:2 model at 50% (issue 10)
#   plan     plan --sweep from a 50%-budget perf file, then measured bench at 0/25/50/75/100% (issue 10)
#   compare  llama.cpp and moe-lanes alternately on the same files: CPU only, budget 0 / 50% / 100%
#            on the uniform model, 50% on the skewed one (issues 14, 16)
#   quant    a 2-layer model quantized by `moe-lanes quantize` (q4_k_m, q8_0) loads and runs in
#            llama.cpp with per-position argmax agreement (llama-argmax); the pipeline engine's
#            pp/tg on the same files (issue 12)
#   quantprep  in the background (returns at once): the llama.cpp build (from .llama/src or the
#            tarball LLAMA_TAR), the skewed model, then its QTYPES files written by moe-lanes
#            quantize and, once llama.cpp is built, by llama-quantize; quantcmp waits for it
#   quantcmp the skewed model quantized (QTYPES q4_k_m q8_0) by llama-quantize and by moe-lanes,
#            both systems at budget 0 / 50% / 100% on each file (issue 12)
#   prefillab  all experts on the GPU, pp512 on the skewed BF16 file and its Q4_K_M file (written
#            by quantprep): split vs one-rounding bf16 activations (MOE_LANES_PREFILL_ACTIVATIONS),
#            alternating in one call (issues 12, 14; the grouped GEMMs' synchronous vs pipelined
#            A/B of issue 12 is settled and its switch removed)
#   batching llama-batched-bench and llama-server against bench --parallel and serve --parallel on
#            the uniform model, BATCH_Q4=1 adds its Q4_K_M file at budget 0 (issue 43; below)
#   pingpong bench --parallel with the lane ping-pong off and on, alternately, on one file and
#            budget (issue 43; below)
#   hotlane  bench --parallel all hot on the Q4_K_M file: quantized hot experts grouped from 8 rows
#            against the decode GEMVs (issue 43; below)
#
# Usage on the GPU machine, from the repository root, after scripts/gpu-build.sh here:
#   bash scripts/gpu-measure.sh models      (then, chained: metrics shift plan, and compare)
# Settings: GPU_DIR (.gpu), MODEL_DIR (/dev/shm), OUT (logs; the device's $OUT), P (512), N (128),
# RUNS (3), LAYERS (16).
set -u
GPU_DIR="${GPU_DIR:-.gpu}"
BIN="$PWD/$GPU_DIR/moe-lanes"
MD="${MODEL_DIR:-/dev/shm}"
LOGS="${OUT:-$GPU_DIR/logs}"
P="${P:-512}"
N="${N:-128}"
RUNS="${RUNS:-3}"
LAYERS="${LAYERS:-16}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOE_LANES_NVRTC_CACHE="${MOE_LANES_NVRTC_CACHE:-$PWD/$GPU_DIR/nvrtc-cache}"
mkdir -p "$LOGS"
# A model's folder: MODEL_DIR, except that the shift scenario's model goes to /tmp when MODEL_DIR
# (a tmpfs) cannot hold all three (about 20 GiB each at 16 layers).
model_dir() {
    local need_kb=$(( 3 * LAYERS * 1300 * 1024 ))
    if [ "$1" = "domains:2" ] && [ ! -f "$MD/q$LAYERS-$1.gguf" ] &&
        [ "$(df --output=avail -k "$MD" | tail -1)" -lt "$need_kb" ]; then
        echo /tmp
    else
        echo "$MD"
    fi
}
model() { echo "$(model_dir "$1")/q$LAYERS-$1.gguf"; }
# MiB of all experts of the 16-layer model (128 experts x 9 MiB per layer) and a share of it.
all_mib() { echo $(( LAYERS * 128 * 9 )); }
share_mib() { echo $(( $(all_mib) * $1 / 100 )); }

synth() {
    local skew="$1" out
    out=$(model "$skew")
    [ -f "$out" ] && return 0
    /usr/bin/time -f "synth $skew: %e s" "$BIN" synth --preset qwen3-30b-a3b --layers "$LAYERS" \
        --skew "$skew" --format gguf --out "$out" >/dev/null
}

part_models() {
    if [ -d .llama/src ] && [ ! -x .llama/build/bin/llama-bench ]; then
        setsid nohup bash benches/compare-llama-cpp.sh build > "$MD/llama-build.log" 2>&1 < /dev/null &
        echo "llama.cpp build started in the background (log $MD/llama-build.log)"
    fi
    # The three models at once (synth is single-threaded; the llama.cpp build takes the rest).
    synth uniform & synth domains:2 & synth skewed & wait
    ls -la "$MD"/*.gguf
    PARTS="tests engine" GPU_DIR="$GPU_DIR" bash scripts/gpu-test.sh
}

# Timed parts must not share the host with the llama.cpp build that `models` started. The pattern
# is anchored at the build's own command line: a shell whose command text names the build (a
# device call's `bash -c`) would match itself and wait for ever.
wait_llama_build() {
    if pgrep -f "^bash benches/compare-llama-cpp.sh build" >/dev/null; then
        echo "waiting for the llama.cpp build to finish before timing anything"
        while pgrep -f "^bash benches/compare-llama-cpp.sh build" >/dev/null; do sleep 5; done
        tail -1 "$MD/llama-build.log"
    fi
}

bench_json() { # OUTFILE MODEL [bench flags...]
    local out="$1" m="$2"
    shift 2
    "$BIN" bench --model "$m" -p "$P" -n "$N" --runs "$RUNS" --json "$@" > "$out" 2> "$out.log" ||
        { echo "bench failed: $*"; tail -5 "$out.log"; return 1; }
}

part_metrics() {
    # Six runs (bench_json reads RUNS): on/off alternate per run, three each way round.
    local f="$LOGS/metrics-ab.json" RUNS="${METRICS_RUNS:-6}"
    bench_json "$f" "$(model skewed)" --engine gpu --hot-budget-mib -1 --metrics-ab
    python3 - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
on, off = r["tg_tokens_per_s_spread"], r["tg_metrics_off_tokens_per_s_spread"]
print("metrics on  tg %.1f t/s (min %.1f max %.1f)" % (on["median"], on["min"], on["max"]))
print("metrics off tg %.1f t/s (min %.1f max %.1f)" % (off["median"], off["min"], off["max"]))
print("recording costs %.2f%% of tg (hit rate %.3f)" % ((off["median"] - on["median"]) / off["median"] * 100, r["hit_rate"]))
EOF
}

part_shift() {
    local f="$LOGS/shift.json"
    "$BIN" bench --model "$(model domains:2)" --engine gpu --scenario shift --domains 2 --shift 0,1 \
        --requests 8 -p 128 -n 128 --hot-budget-mib "$(share_mib 50)" --json > "$f" 2> "$f.log" ||
        { tail -5 "$f.log"; return 1; }
    python3 scripts/shift-table.py "$f"
}

part_plan() {
    local m learn="$LOGS/plan-calib.json"
    m=$(model skewed)
    bench_json "$LOGS/plan-calib-bench.json" "$m" --engine gpu --hot-budget-mib "$(share_mib 50)" \
        --perf-json "$learn" --force || return 1
    "$BIN" plan --model "$m" --learn "$learn" --hot-budget-mib "$(share_mib 50)" --sweep --json \
        > "$LOGS/plan-sweep.json" || return 1
    for pct in 0 25 50 75 100; do
        bench_json "$LOGS/plan-bench-$pct.json" "$m" --engine gpu --learn "$learn" \
            --hot-budget-mib "$(share_mib "$pct")" || return 1
        "$BIN" plan --model "$m" --learn "$learn" --hot-budget-mib "$(share_mib "$pct")" --json \
            > "$LOGS/plan-$pct.json" || return 1
    done
    python3 scripts/plan-accuracy.py "$LOGS" 0 25 50 75 100
}

part_compare() {
    if [ ! -x .llama/build/bin/llama-bench ]; then
        echo "waiting for the llama.cpp build"
        while pgrep -f "^bash benches/compare-llama-cpp.sh build" >/dev/null; do sleep 5; done
        tail -3 "$MD/llama-build.log"
    fi
    BIN="$BIN" MODEL="$(model uniform)" CASES="${CASES:-cpu 0 50 100}" OUT="$LOGS/compare-uniform" \
        REPS="${REPS:-3}" bash benches/compare-llama-cpp.sh run
    BIN="$BIN" MODEL="$(model skewed)" CASES="50" OUT="$LOGS/compare-skewed" REPS="${REPS:-3}" \
        bash benches/compare-llama-cpp.sh run | tail -1
}

rates() { # JSON [label]: one line of a bench JSON
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))
print("%-28s pp %8.1f  tg %7.1f  hit %.3f  cold_lane_us %6.0f  threads %s" % (sys.argv[2], r["pp_tokens_per_s"],
      r["tg_tokens_per_s"], r["hit_rate"], r["cold_lane_us"], r["threads"]))' "$1" "${2:-$1}"
}

# Token ids of the argmax check (any ids below the synthetic vocabulary's size).
ARGMAX_TOKENS="${ARGMAX_TOKENS:-1,17,256,4096,77,9000,31,5,1234,600,42,7,8191,300,12,99,2048,3,65,1000,5000,11,250,16000,8,640,72,13,4444,2,150,909}"

part_quant() {
    local f="$MD/q2-bf16.gguf" t q P=64 N=16 RUNS=1
    [ -f "$f" ] || "$BIN" synth --preset qwen3-30b-a3b --layers 2 --format gguf --out "$f" >/dev/null
    for t in q4_k_m q8_0; do
        q="$MD/q2-$t.gguf"
        /usr/bin/time -f "quantize $t: %e s" "$BIN" quantize "$f" "$q" --type "$t" --force --json \
            > "$LOGS/quantize-$t.json" || continue
        argmax_check "$q" "$t"
        bench_json "$LOGS/moe-q2-$t.json" "$q" --engine pipeline --hot-budget-mib 0 &&
            rates "$LOGS/moe-q2-$t.json" "moe-lanes pipeline $t"
    done
}

# A file written by `moe-lanes quantize` in llama.cpp (llama-argmax, CPU) against moe-lanes'
# reference forward on the same file: per-position argmax agreement over ARGMAX_TOKENS.
argmax_check() { # FILE LABEL
    local q="$1" t="$2"
    .llama/build/bin/llama-argmax "$q" 0 "$ARGMAX_TOKENS" > "$LOGS/llama-argmax-$t.json" \
        2> "$LOGS/llama-argmax-$t.log" || { echo "llama.cpp FAILED on $q:"; tail -5 "$LOGS/llama-argmax-$t.log"; return 1; }
    "$BIN" logits --model "$q" --tokens "$ARGMAX_TOKENS" > "$MD/moe-logits-$t.json" 2> "$LOGS/moe-logits-$t.log" ||
        { echo "moe-lanes logits failed on $q"; tail -3 "$LOGS/moe-logits-$t.log"; return 1; }
    python3 scripts/argmax-agreement.py "$LOGS/llama-argmax-$t.json" "$MD/moe-logits-$t.json" "$t"
    rm -f "$MD/moe-logits-$t.json"
}

# Issue 12's table: the skewed 16-layer model quantized by llama.cpp's llama-quantize and by
# `moe-lanes quantize` (QTYPES: q4_k_m q8_0), each run by both at budget 0 / 50% / 100%
# (llama.cpp -ncmoe 16 / 8 / 0); QWHO picks the quantizers (default: llama moe). Quantized files go to
# QDIR (/tmp: the tmpfs holds the BF16 ones).
# The quantized files of part_quantcmp, written in the background so that a call can return
# while they are made (moe-lanes quantize takes minutes for 16 layers of K-quants).
quant_file() { echo "${QDIR:-/tmp}/q$LAYERS-$1-$2.gguf"; }
part_quantprep() {
    if [ ! -d .llama/src ] && [ -f "${LLAMA_TAR:-$GPU_DIR/llama-src.tar.xz}" ]; then
        mkdir -p .llama && tar -C .llama -xJf "${LLAMA_TAR:-$GPU_DIR/llama-src.tar.xz}"
    fi
    rm -f "$MD/quantprep.done"
    BIN="$BIN" QTYPES="${QTYPES:-q4_k_m q8_0}" LAYERS="$LAYERS" MD="$MD" QDIR="${QDIR:-/tmp}" setsid nohup bash -c '
        [ -x .llama/build/bin/llama-bench ] || bash benches/compare-llama-cpp.sh build > "$1/llama-build.log" 2>&1 &
        build=$!
        '"$(declare -f model_dir model synth quant_file)"'
        synth skewed
        for t in $QTYPES; do
            q=$(quant_file moe "$t"); [ -f "$q" ] || "$BIN" quantize "$(model skewed)" "$q" --type "$t" --json > /dev/null
        done
        wait $build
        for t in $QTYPES; do
            q=$(quant_file llama "$t"); [ -f "$q" ] || .llama/build/bin/llama-quantize "$(model skewed)" "$q" "${t^^}" "$(nproc)" > /dev/null 2>&1
        done
        touch "$1/quantprep.done"' _ "$MD" > "$MD/quantprep.log" 2>&1 < /dev/null &
    echo "quantprep started in the background (log $MD/quantprep.log, marker $MD/quantprep.done)"
}

wait_quantprep() {
    if [ -f "$MD/quantprep.log" ] && [ ! -f "$MD/quantprep.done" ]; then
        echo "waiting for quantprep"
        while [ ! -f "$MD/quantprep.done" ]; do sleep 5; done
    fi
}

part_quantcmp() {
    local src t who q qd="${QDIR:-/tmp}"
    wait_quantprep
    src=$(model skewed)
    for t in ${QTYPES:-q4_k_m q8_0}; do
        for who in ${QWHO:-llama moe}; do
            q="$qd/q$LAYERS-$who-$t.gguf"
            if [ ! -f "$q" ]; then
                if [ "$who" = llama ]; then
                    /usr/bin/time -f "llama-quantize $t: %e s" .llama/build/bin/llama-quantize "$src" "$q" \
                        "${t^^}" "$(nproc)" > "$LOGS/llama-quantize-$t.log" 2>&1 || { tail -3 "$LOGS/llama-quantize-$t.log"; continue; }
                else
                    /usr/bin/time -f "moe-lanes quantize $t: %e s" "$BIN" quantize "$src" "$q" --type "$t" \
                        --json > "$LOGS/moe-quantize-$t.json" || continue
                fi
            fi
            echo "== $t written by $who: $(du -h "$q" | cut -f1)"
            BIN="$BIN" MODEL="$q" CASES="${QCASES:-0 50 100}" OUT="$LOGS/quantcmp-$who-$t" \
                REPS="${REPS:-1}" bash benches/compare-llama-cpp.sh run | tail -n +2
        done
    done
}

part_prefillab() {
    local m act r N=32 RUNS=2
    wait_quantprep
    for m in "$(model skewed)" "$(quant_file moe q4_k_m)"; do
        [ -f "$m" ] || { echo "no $m"; continue; }
        for r in 1 2; do
            for act in split auto; do
                # BF16 weights take split activations either way
                case "$m" in *q4_k_m*) ;; *) [ "$act" = auto ] && continue ;; esac
                MOE_LANES_PREFILL_ACTIVATIONS=$act bench_json \
                    "$LOGS/pab-$(basename "$m" .gguf)-$r-$act.json" "$m" --engine gpu --hot-budget-mib -1 &&
                    rates "$LOGS/pab-$(basename "$m" .gguf)-$r-$act.json" "$(basename "$m") $act"
            done
        done
    done
}

# Issue 43 on the uniform model (written by `models`): llama-batched-bench against bench --parallel
# at budgets 100 / 50 / 0 (B in 1,4,16), then llama-server -np 16 against serve --parallel 16 all
# on the GPU (scripts/serve-load.py: tokens/s, TTFT and inter-token latency p50/p99); with
# BATCH_Q4=1 also the uniform model's Q4_K_M file (llama-quantize; written here when missing) at
# budget 0, B in 1,2,4 (the lane ping-pong's question).
part_batching() {
    local m q
    m=$(model uniform)
    BIN="$BIN" MODEL="$m" CASES="${BATCH_CASES:-100 50 0}" PL=1,4,16 P=128 N=64 REPS=1 OUT="$LOGS" \
        bash benches/compare-llama-cpp.sh batched
    BIN="$BIN" MODEL="$m" CASES=100 PL=16 P=128 N=64 REPS=1 REQS=2 OUT="$LOGS" \
        bash benches/compare-llama-cpp.sh server
    [ "${BATCH_Q4:-0}" = 1 ] || return 0
    q="$MD/q$LAYERS-uniform-q4_k_m.gguf"
    [ -f "$q" ] || .llama/build/bin/llama-quantize "$m" "$q" Q4_K_M > "$LOGS/quantize-q4.log" 2>&1 ||
        { tail -5 "$LOGS/quantize-q4.log"; return 1; }
    BIN="$BIN" MODEL="$q" CASES=0 PL=1,2,4 P=128 N=64 REPS=1 OUT="$LOGS" bash benches/compare-llama-cpp.sh batched
}

# `bench --parallel PL` on the uniform model's Q4_K_M file (written by `moe-lanes synth --quant
# q4_k_m` when missing; AB_MODEL for another) with BUDGET MiB of experts in VRAM, with the
# environment variable VAR at OFF and at ON in turns, AB_ROUNDS (2) rounds; a table of each B's
# S_TG (median of the rounds and each round), decode step p50 and lanes per step.
# Usage: parallel_ab NAME VAR OFF ON BUDGET PL
parallel_ab() {
    local name="$1" var="$2" off="$3" on="$4" budget="$5" pl="$6" r v
    local m="${AB_MODEL:-$MD/q$LAYERS-uniform-q4_k_m.gguf}"
    [ -f "$m" ] || "$BIN" synth --preset qwen3-30b-a3b --layers "$LAYERS" --skew uniform --quant q4_k_m \
        --expert-row-pool 4096 --format gguf --out "$m" >/dev/null || return 1
    for r in $(seq 1 "${AB_ROUNDS:-2}"); do
        for v in "$off" "$on"; do
            env "$var=$v" "$BIN" bench --model "$m" -p "$P" -n "$N" --parallel "$pl" --runs 1 --json \
                --hot-budget-mib "$budget" > "$LOGS/$name-$v-$r.json" 2> "$LOGS/$name-$v-$r.log" ||
                { tail -5 "$LOGS/$name-$v-$r.log"; return 1; }
        done
    done
    python3 - "$LOGS" "$name" "$off" "$on" "$var" <<'PY'
import glob, json, statistics, sys
logs, name, off_v, on_v, var = sys.argv[1:6]
runs = {}
for path in glob.glob(f"{logs}/{name}-*-*.json"):
    value = path.rsplit("/", 1)[1][len(name) + 1:].rsplit("-", 1)[0]
    for r in json.load(open(path))["rows"]:
        runs.setdefault((r["parallel"], value), []).append(r)
print(f"{var}: off = {off_v}, on = {on_v}")
print("| B | S_TG off / on t/s | on / off | step p50 off / on ms | cold / overlapped / join wait ms a step, off | on | ping-pong steps on |")
print("|---|---|---|---|---|---|---|")
med = lambda rs, k: statistics.median(r[k] for r in rs)
for b in sorted({b for b, _ in runs}):
    off, on = runs.get((b, off_v), []), runs.get((b, on_v), [])
    if not off or not on:
        continue
    lanes = lambda rs: "%.2f / %.2f / %.2f" % tuple(med(rs, k) for k in ("cold_ms_per_step", "overlap_ms_per_step", "join_wait_ms_per_step"))
    print("| %d | %.1f / %.1f (%s / %s) | %.3f | %.2f / %.2f | %s | %s | %d |" % (
        b, med(off, "tg_tokens_per_s"), med(on, "tg_tokens_per_s"),
        ",".join("%.1f" % r["tg_tokens_per_s"] for r in off), ",".join("%.1f" % r["tg_tokens_per_s"] for r in on),
        med(on, "tg_tokens_per_s") / med(off, "tg_tokens_per_s"), med(off, "step_ms_p50"), med(on, "step_ms_p50"),
        lanes(off), lanes(on), sum(r["ping_pong_steps"] for r in on)))
PY
}

# Issue 43's lane ping-pong off (MOE_LANES_PING_PONG_MAX_ROWS=0, the default) and on for every B
# (=16), at PP_BUDGET_MIB (0) of experts in VRAM, B in PL (1,2,4,8).
part_pingpong() {
    parallel_ab pingpong MOE_LANES_PING_PONG_MAX_ROWS 0 16 "${PP_BUDGET_MIB:-0}" "${PL:-1,2,4,8}"
}

# The hot lane of a batched decode step over quantized experts, every expert hot: grouped from 8
# rows (off: the rule before session 44) against the decode GEMVs up to 64 rows (on: the default),
# B in PL (4,8,16,32).
part_hotlane() {
    parallel_ab hotlane MOE_LANES_HOT_GROUPED_MIN_ROWS_QUANTIZED 8 64 100000 "${PL:-4,8,16,32}"
}

status=0
for part in "$@"; do
    echo "== $part ($(date -u +%H:%M:%S)) =="
    [ "$part" = models ] || [ "$part" = quantprep ] || wait_llama_build
    case "$part" in
        models | metrics | shift | plan | compare | quant | quantprep | quantcmp | prefillab | batching | pingpong | hotlane)
            "part_$part" || status=1 ;;
        *) echo "unknown part $part (models metrics shift plan compare quant quantprep quantcmp prefillab batching pingpong hotlane)"
           exit 2 ;;
    esac
done
exit $status
