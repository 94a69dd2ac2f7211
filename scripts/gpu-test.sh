#!/usr/bin/env bash
# Run every GPU test binary in .gpu/ on the GPU machine and print a summary table.
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
shopt -s nullglob
bins=("$GPU_DIR"/bin/*)
if [ ${#bins[@]} -eq 0 ]; then echo "no test binaries in $GPU_DIR/bin"; exit 2; fi
rows=()
fail=0
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
exit $fail
