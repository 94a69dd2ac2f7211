#!/usr/bin/env bash
# Coverage-guided fuzzing with AFL++ (cargo-afl, stable toolchain) of one target or all of them.
#   scripts/fuzz.sh [TARGET|all] [EXECS]     (default: all, 10000000 executions each)
# Targets: gguf safetensors_header safetensors_index perf_json hot_experts_json completion_request
# (fuzz/targets.rs).
# Limits: 1000 ms per input (a hang), 1024 MiB of memory (an over-limit allocation aborts: a crash).
# Each run starts from fuzz/seeds/<target> and writes fuzz/out/<target>; the summary line per
# target gives executions, time, corpus size, crashes and hangs. A crash found is copied to
# fuzz/regressions/<target>/ once fixed, where `server/tests/fuzz_regressions.rs` replays it forever.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
target="${1:-all}"
execs="${2:-10000000}"
all=(gguf safetensors_header safetensors_index perf_json hot_experts_json completion_request)
if [ "$target" = all ]; then targets=("${all[@]}"); else targets=("$target"); fi
command -v cargo-afl >/dev/null || cargo install cargo-afl --locked
cargo afl config --build >/dev/null 2>&1 || true
cargo afl build --release --quiet
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_QUIET=1
failed=0
for t in "${targets[@]}"; do
  bin="target/release/fuzz-${t//_/-}"
  rm -rf "out/$t"
  mkdir -p out
  cargo afl fuzz -i "seeds/$t" -o "out/$t" -E "$execs" -t 1000 -m 1024 "$bin" >"out/$t.log" 2>&1 || {
    echo "afl-fuzz failed on $t: see fuzz/out/$t.log"; failed=1; continue; }
  stats="out/$t/default/fuzzer_stats"
  get() { awk -F' *: *' -v k="$1" '$1==k {print $2}' "$stats"; }
  echo "$t: execs=$(get execs_done) time_s=$(get run_time) corpus=$(get corpus_count) crashes=$(get saved_crashes) hangs=$(get saved_hangs) execs_per_s=$(get execs_per_sec)"
  if [ "$(get saved_crashes)" != 0 ] || [ "$(get saved_hangs)" != 0 ]; then failed=1; fi
done
exit "$failed"
