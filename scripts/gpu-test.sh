#!/usr/bin/env bash
# Run every GPU test and benchmark on the GPU machine and print summary tables: the test
# binaries, the cold-lane kernel bench, and the end-to-end bench (pp/tg at hot budgets 0, 50% and
# 100% of expert bytes, skewed and uniform routing) on a Qwen3-30B-A3B-shaped synthetic model.
# PARTS selects what runs (default "tests engine kernels overhead bench"); BENCH_SKEWS (default "skewed uniform"),
# BENCH_LAYERS (16), BENCH_P (512), BENCH_N (128), BENCH_RUNS (3) and MODEL_DIR (/dev/shm when it
# has room, else /tmp) tune the bench.
#
# Layout (built elsewhere by scripts/gpu-build.sh, which needs no GPU), GPU_DIR default .gpu:
#   $GPU_DIR/bin/<name>      test binaries (cargo test --release --no-run)
#   $GPU_DIR/fixtures/       copy of tests/fixtures (found through MOE_LANES_FIXTURES)
# Usage, from the repository root: [GPU_DIR=.gpu] bash scripts/gpu-test.sh [args for every binary]
# Logs go to $OUT (when set, e.g. on the device machine) or $GPU_DIR/logs.
set -u
GPU_DIR="${GPU_DIR:-.gpu}"
CUDA_LIB=${CUDA_LIB:-/usr/local/cuda/lib64}
export LD_LIBRARY_PATH="$CUDA_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# On the GPU machine a missing/broken CUDA must fail the tests, not skip them.
export MOE_LANES_REQUIRE_GPU="${MOE_LANES_REQUIRE_GPU:-1}"
export MOE_LANES_FIXTURES="${MOE_LANES_FIXTURES:-$PWD/$GPU_DIR/fixtures}"
export MOE_LANES_NVRTC_CACHE="${MOE_LANES_NVRTC_CACHE:-$PWD/$GPU_DIR/nvrtc-cache}"
LOGS="${OUT:-$GPU_DIR/logs}"
mkdir -p "$LOGS"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
fail=0
if [[ " ${PARTS:-tests engine kernels overhead bench} " == *" tests "* ]]; then
shopt -s nullglob
bins=("$GPU_DIR"/bin/*)
if [ ${#bins[@]} -eq 0 ]; then echo "no test binaries in $GPU_DIR/bin"; exit 2; fi
rows=()
for b in "${bins[@]}"; do
    name=$(basename "$b")
    start=$(date +%s%N)
    "$b" --test-threads=1 "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN{printf "%.2f", (b-a)/1e9}')
    if [ $rc -eq 0 ]; then status=passed; else status="FAILED($rc)"; fail=1; fi
    skips=$(grep -c '^SKIP' "$LOGS/$name.log")
    summary=$(grep -E '^test result' "$LOGS/$name.log" | tail -1 | sed 's/test result: //')
    rows+=("$(printf '%-28s %-10s %7.2f  skips=%-3s %s' "$name" "$status" "$secs" "$skips" "$summary")")
done
echo
printf '%-28s %-10s %7s  %s\n' "test binary" "result" "seconds" "details"
for r in "${rows[@]}"; do echo "$r"; done

fi

# ---- the CLI's GPU engine against the golden fixtures ----
if [[ " ${PARTS:-tests engine kernels overhead bench} " == *" engine "* ]]; then
    echo; echo "== generate --engine gpu vs golden greedy tokens (hot fraction 0 / 0.5 / 1) =="
    GPU_DIR="$GPU_DIR" bash "$GPU_DIR/gpu-engine-check.sh" > "$LOGS/engine-check.log" 2>&1 || fail=1
    echo "$(grep -c ' ok$' "$LOGS/engine-check.log") ok, $(grep -c MISMATCH "$LOGS/engine-check.log") mismatched"
fi

# ---- cold-lane kernels ----
if [[ " ${PARTS:-tests engine kernels overhead bench} " == *" kernels "* ]]; then
    echo; echo "== bench-kernels (all cores) =="
    "$GPU_DIR/moe-lanes" bench-kernels --json | tee "$LOGS/bench-kernels.json"
    "$GPU_DIR/moe-lanes" bench-kernels --simd avx512 --json | tee "$LOGS/bench-kernels-avx512.json"
fi

# ---- pipeline message overhead ----
if [[ " ${PARTS:-tests engine kernels overhead bench} " == *" overhead "* ]] && [ -x "$GPU_DIR/pipeline_overhead" ]; then
    echo; echo "== pipeline message overhead (per layer, expert math excluded) =="
    "$GPU_DIR/pipeline_overhead" --bench --warm-up-time 1 --measurement-time 2 > "$LOGS/pipeline_overhead.log" 2>&1
    grep MEDIAN "$LOGS/pipeline_overhead.log"
fi

# ---- end-to-end bench ----
if [[ " ${PARTS:-tests engine kernels overhead bench} " == *" bench "* ]]; then
    MODEL_DIR="${MODEL_DIR:-$( [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 30000000 ] 2>/dev/null && echo /dev/shm || echo /tmp)}"
    layers="${BENCH_LAYERS:-16}"
    table=()
    for skew in ${BENCH_SKEWS:-skewed uniform}; do
        model="$MODEL_DIR/qwen3-30b-a3b-${layers}l-$skew.gguf"
        if [ ! -f "$model" ]; then
            echo; echo "== synth $model =="
            "$GPU_DIR/moe-lanes" synth --preset qwen3-30b-a3b --layers "$layers" --skew "$skew" --format gguf --out "$model" || { fail=1; continue; }
        fi
        all_mib=$(( layers * 128 * 9 ))
        for budget in 0 $(( all_mib / 2 )) $all_mib; do
            echo; echo "== bench $skew budget ${budget} MiB =="
            json="$LOGS/bench-$skew-$budget.json"
            "$GPU_DIR/moe-lanes" bench --model "$model" --hot-budget-mib "$budget" -p "${BENCH_P:-512}" -n "${BENCH_N:-128}" --runs "${BENCH_RUNS:-3}" --json > "$json" || { fail=1; continue; }
            table+=("$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%-8s %9s %5.0f%% %9.1f %9.1f %7.1f%% %9.1f %9.1f %5d" % (sys.argv[2], sys.argv[3], 100*r["hot_bytes"]/r["all_experts_bytes"], r["pp_tokens_per_s"], r["tg_tokens_per_s"], 100*r["hit_rate"], r["overlap_us"], r["join_wait_us"], r["fallbacks"]))' "$json" "$skew" "$budget")")
        done
        [ -n "${KEEP_MODELS:-}" ] || rm -f "$model"
    done
    echo; echo "== end-to-end bench (pp${BENCH_P:-512}, tg${BENCH_N:-128}, median of ${BENCH_RUNS:-3}) =="
    printf '%-8s %9s %6s %9s %9s %8s %9s %9s %5s\n' skew budget_MiB hot pp_t/s tg_t/s hit_rate overlap_us wait_us fallb
    for r in "${table[@]}"; do echo "$r"; done
fi
exit $fail
