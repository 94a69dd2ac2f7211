#!/usr/bin/env bash
# Side-by-side comparison with llama.cpp on the same machine, the same file, in one call.
#
#   bash benches/compare-llama-cpp.sh fetch      # here (network): llama-cpp-python's sdist from PyPI,
#                                                #   pruned to the llama.cpp sources into $LLAMA_DIR/src
#   bash benches/compare-llama-cpp.sh build      # cmake build of llama-bench, llama-batched-bench,
#                                                #   llama-server, llama-quantize and our
#                                                #   llama-argmax (benches/llama-argmax) into $LLAMA_DIR/build
#                                                #   (CUDA when nvcc is present and LLAMA_CUDA is not 0, else CPU)
#   bash benches/compare-llama-cpp.sh run        # build (if missing, in the background while the model is
#                                                #   written), then llama.cpp and moe-lanes alternately
#   bash benches/compare-llama-cpp.sh batched    # the same, batched throughput: llama-batched-bench
#                                                #   against `moe-lanes bench --parallel` for B in PL
#   bash benches/compare-llama-cpp.sh server     # the servers: llama-server -np B against `moe-lanes
#                                                #   serve --parallel B` under scripts/serve-load.py (B
#                                                #   streaming clients): tokens/s, inter-token latency
#
# `run` prints one table: pp$P / tg$N of llama.cpp and moe-lanes and their ratios, for each case of
# CASES. A case is `cpu` (no GPU visible to either, CUDA_VISIBLE_DEVICES empty: llama.cpp -ngl 0
# with op offload off, moe-lanes --engine pipeline) or `SHARE` in percent of expert bytes in VRAM (moe-lanes --hot-budget-mib SHARE% of all
# experts; llama.cpp -ncmoe with the matching number of layers' experts kept on the CPU). No llama.cpp
# source is committed: only this script.
#
# Settings (environment): LLAMA_DIR (.llama), LLAMA_VERSION (0.3.36), BIN (target/release/moe-lanes),
# MODEL (written with SYNTH_ARGS when missing), SYNTH_ARGS (--preset qwen3-30b-a3b --layers 16 --skew
# uniform --format gguf), CASES ("0 50 100" with a GPU, "cpu" without), P (512), N (128), REPS (3),
# THREADS (all cores), D (context depth before the pp and tg tests, llama-bench -d; 0),
# OUT_JSON (a file for the table as JSON lines; optional), PL (batch sizes of `batched`, "1,4,16": B
# sequences of P prompt tokens each, then N decode steps of B tokens; of `server`: B clients),
# REQS (requests each client of `server` sends in turn; 2), PORT (the servers' port; 18481).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_DIR="${LLAMA_DIR:-.llama}"
LLAMA_VERSION="${LLAMA_VERSION:-0.3.36}"
BIN="${BIN:-target/release/moe-lanes}"
THREADS="${THREADS:-$(nproc)}"
P="${P:-512}"
N="${N:-128}"
REPS="${REPS:-3}"
D="${D:-0}"
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

fetch() {
    local tmp
    tmp=$(mktemp -d)
    # --no-binary for this package only: its build dependencies may come as wheels.
    pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -d "$tmp" >&2
    tar xzf "$tmp"/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$tmp"
    rm -rf "$LLAMA_DIR/src"
    mkdir -p "$LLAMA_DIR"
    mv "$tmp/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" "$LLAMA_DIR/src"
    rm -rf "$tmp"
    # Prune what the tools never build, so the tree travels to the GPU machine (64 MiB limit):
    # llama-server keeps its sources and the UI's CMake files and templates (built without the web UI).
    local s="$LLAMA_DIR/src"
    rm -rf "$s"/{docs,models,tests,examples,benches,pocs,gguf-py,media,.git*} "$s"/tools/server/{tests,bench}
    find "$s/tools/ui" -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name "*.in" -exec rm -rf {} +
    rm -rf "$s"/ggml/src/ggml-{vulkan,sycl,opencl,hexagon,metal,et,cann,musa,webgpu,zdnn,kompute}
    echo "llama.cpp $LLAMA_VERSION sources in $s ($(du -sh "$s" | cut -f1))"
}

build() {
    local s="$LLAMA_DIR/src" b="$LLAMA_DIR/build" cuda=OFF
    [ -d "$s" ] || { echo "no llama.cpp sources in $s: run '$0 fetch' on a machine with network" >&2; exit 2; }
    if [ "${LLAMA_CUDA:-auto}" != 0 ] && { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
        cuda=ON
        export PATH="/usr/local/cuda/bin:$PATH"
    fi
    # Our wrapper project (benches/llama-argmax) adds llama.cpp as a subproject and its own
    # llama-argmax tool; the binaries land in $b/bin.
    cmake -S benches/llama-argmax -B "$b" -DLLAMA_SRC="$(realpath "$s")" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DGGML_CUDA="$cuda" -DCMAKE_CUDA_ARCHITECTURES=native -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON >&2
    cmake --build "$b" --target llama-bench llama-batched-bench llama-quantize llama-argmax llama-server \
        -j "${BUILD_JOBS:-$(nproc)}" >&2
    echo "built $b/bin/llama-bench (CUDA $cuda)"
}

# llama-bench's JSON: average tokens/s of the pp and tg tests.
llama_rates() {
    python3 -c 'import json,sys
rows = json.load(open(sys.argv[1]))
pp = [r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0]
tg = [r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0]
print(pp[0] if pp else 0, tg[0] if tg else 0)' "$1"
}

moe_rates() {
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["pp_tokens_per_s"], r["tg_tokens_per_s"], r.get("hit_rate", 0), r.get("cold_threads", ""))' "$1"
}

# One case: llama.cpp then moe-lanes on MODEL; prints one table row.
run_case() {
    local case="$1" layers="$2" all_mib="$3" logs="$4" lflags mflags env_l=()
    case_flags "$case" "$layers" "$all_mib"
    # CPU only means no GPU visible to either: the CUDA build at -ngl 0 -nopo 1 gave 615.7 pp512
    # on the Q4_K_M file that the CPU build ran at 263-336 (sessions 36 and 46, benches/RESULTS.md)
    [ "$case" = cpu ] && env_l=(CUDA_VISIBLE_DEVICES=)
    env "${env_l[@]}" "$LLAMA_DIR/build/bin/llama-bench" -m "$MODEL" -p "$P" -n "$N" -d "$D" -r "$REPS" -t "$THREADS" \
        "${lflags[@]}" -o json > "$logs/llama-$case-d$D.json" 2> "$logs/llama-$case-d$D.log"
    env "${env_l[@]}" "$BIN" bench --model "$MODEL" -p "$P" -n "$N" -d "$D" --runs "$REPS" --json "${mflags[@]}" \
        > "$logs/moe-$case-d$D.json" 2> "$logs/moe-$case-d$D.log"
    read -r lpp ltg < <(llama_rates "$logs/llama-$case-d$D.json")
    read -r mpp mtg hit threads < <(moe_rates "$logs/moe-$case-d$D.json")
    python3 -c 'import sys
c, lf, lpp, ltg, mpp, mtg, hit, th = sys.argv[1:9]
lpp, ltg, mpp, mtg, hit = map(float, (lpp, ltg, mpp, mtg, hit))
r = lambda a, b: "%.2fx" % (a / b) if b else "-"
print("| %s | %s | %.1f / %.1f | %.1f / %.1f | %s / %s | %.0f%% | %s |" % (c, lf, lpp, ltg, mpp, mtg, r(mpp, lpp), r(mtg, ltg), 100 * hit, th))' \
        "$case" "${lflags[*]}" "$lpp" "$ltg" "$mpp" "$mtg" "$hit" "$threads"
}

# Build llama.cpp (when missing, in the background while the model is written), write the model
# when missing; prints "LAYERS ALL_EXPERT_MIB".
prepare() {
    local logs="$1" build_pid=""
    if [ ! -x "$LLAMA_DIR/build/bin/llama-bench" ] || [ ! -x "$LLAMA_DIR/build/bin/llama-server" ]; then
        build > "$logs/build.log" 2>&1 &
        build_pid=$!
    fi
    if [ ! -f "$MODEL" ]; then
        # shellcheck disable=SC2086
        "$BIN" synth ${SYNTH_ARGS:---preset qwen3-30b-a3b --layers 16 --skew uniform --format gguf} --out "$MODEL" >&2
    fi
    if [ -n "$build_pid" ]; then
        wait "$build_pid" || { tail -20 "$logs/build.log" >&2; exit 1; }
    fi
    "$BIN" inspect "$MODEL" --json | python3 -c 'import json,sys
r = json.load(sys.stdin); print(r["n_layers"], r["all_experts_bytes"] // (1 << 20))'
}

# The CPU case of llama.cpp's batched bench and server (they take no -nopo): no GPU visible
# (env_l, for `env`) and no layers offloaded; sets lflags and env_l.
serving_flags() {
    if [ "$1" = cpu ]; then
        lflags=(-ngl 0)
        env_l=(CUDA_VISIBLE_DEVICES=)
    fi
}

# The llama.cpp and moe-lanes flags of a case (see the header): sets lflags and mflags.
case_flags() {
    local case="$1" layers="$2" all_mib="$3"
    if [ "$case" = cpu ]; then
        lflags=(-ngl 0 -nopo 1)
        mflags=(--engine pipeline --hot-budget-mib 0)
    else
        lflags=(-ngl 99 -ncmoe $(( layers - layers * case / 100 )))
        mflags=(--hot-budget-mib $(( all_mib * case / 100 )))
    fi
}

# Prepare (build, model), print the header lines ($1: what is measured, $2: the table head), then
# run case function $3 for every case of CASES.
each_case() {
    local what="$1" head="$2" fn="$3" logs="${OUT:-$LLAMA_DIR/logs}" layers all_mib cases
    mkdir -p "$logs"
    MODEL="${MODEL:-$LLAMA_DIR/model.gguf}"
    read -r layers all_mib < <(prepare "$logs")
    echo "model $MODEL: $layers layers, $all_mib MiB of experts; $what, $REPS reps, $THREADS threads"
    echo "$head"
    echo "$head" | sed 's/[^|]\+/---/g'
    if have_gpu; then cases="${CASES:-0 50 100}"; else cases="${CASES:-cpu}"; fi
    for c in $cases; do
        "$fn" "$c" "$layers" "$all_mib" "$logs"
    done
}

run() {
    each_case "pp$P / tg$N at depth $D" \
        "| case | llama.cpp flags | llama.cpp pp / tg | moe-lanes pp / tg | ratio pp / tg | hit | cold threads |" run_case
}

# One batched case: llama-batched-bench then `moe-lanes bench --parallel`; one table row per B.
batched_case() {
    local case="$1" layers="$2" all_mib="$3" logs="$4" lflags mflags max_b ctx env_l=()
    case_flags "$case" "$layers" "$all_mib"
    serving_flags "$case"
    max_b=$(echo "$PL" | tr ',' '\n' | sort -n | tail -1)
    ctx=$(( max_b * (P + N) ))
    env "${env_l[@]}" "$LLAMA_DIR/build/bin/llama-batched-bench" -m "$MODEL" -c "$ctx" -b 2048 -ub 512 -npp "$P" -ntg "$N" \
        -npl "$PL" -t "$THREADS" -fa on "${lflags[@]}" --output-format jsonl \
        > "$logs/llama-batched-$case.jsonl" 2> "$logs/llama-batched-$case.log"
    "$BIN" bench --model "$MODEL" -p "$P" -n "$N" --parallel "$PL" --runs "$REPS" --json "${mflags[@]}" \
        > "$logs/moe-batched-$case.json" 2> "$logs/moe-batched-$case.log"
    python3 - "$case" "$logs/llama-batched-$case.jsonl" "$logs/moe-batched-$case.json" <<'PY'
import json, sys
case, lpath, mpath = sys.argv[1:4]
llama = {}
for line in open(lpath):
    line = line.strip()
    if line.startswith("{") and '"speed_tg"' in line:
        r = json.loads(line)
        llama[r["pl"]] = r
ours = {r["parallel"]: r for r in json.load(open(mpath))["rows"]}
ratio = lambda a, b: "%.2fx" % (a / b) if b else "-"
for b in sorted(ours):
    o, l = ours[b], llama.get(b, {})
    lpp, ltg = l.get("speed_pp", 0.0), l.get("speed_tg", 0.0)
    print("| %s | %d | %.1f / %.1f | %.1f / %.1f | %s / %s | %.1f / %.1f | %.2f / %.2f / %.2f | %d |" % (
        case, b, lpp, ltg, o["pp_tokens_per_s"], o["tg_tokens_per_s"],
        ratio(o["pp_tokens_per_s"], lpp), ratio(o["tg_tokens_per_s"], ltg), o["step_ms_p50"], o["step_ms_p99"],
        o.get("cold_ms_per_step", 0), o.get("overlap_ms_per_step", 0), o.get("join_wait_ms_per_step", 0),
        o.get("ping_pong_steps", 0)))
PY
}

batched() {
    PL="${PL:-1,4,16}"
    each_case "B in $PL, pp$P / tg$N per sequence" \
        "| case | B | llama.cpp S_PP / S_TG | moe-lanes S_PP / S_TG | ratio pp / tg | moe-lanes step p50 / p99 ms | cold / overlapped / join wait ms a step | ping-pong steps |" \
        batched_case
}

# Wait until the server at port $1 answers /health (both servers answer 200 once loaded), at most
# 600 s; $2: its process id (a server that exits fails the case).
wait_ready() {
    local i
    for i in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}

# Stop the server $1 and wait for it to exit (its memory is free for the next one).
stop_server() {
    kill "$1" 2>/dev/null
    wait "$1" 2>/dev/null || true
}

# One server case: for each B of PL, `moe-lanes serve --parallel B` and then `llama-server -np B`
# on the same file and placement (CPU-only: no GPU visible to llama-server), each under
# scripts/serve-load.py (B streaming clients, REQS requests each, P-token prompts, N tokens each);
# one table row per B.
server_case() {
    local case="$1" layers="$2" all_mib="$3" logs="$4" lflags mflags b vocab pid env_l=() port="${PORT:-18481}"
    case_flags "$case" "$layers" "$all_mib"
    serving_flags "$case"
    vocab=$("$BIN" inspect "$MODEL" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["vocab"])')
    for b in $(echo "$PL" | tr ',' ' '); do
        local load=(python3 scripts/serve-load.py --url "http://127.0.0.1:$port" --clients "$b" --requests "$REQS"
            --prompt-tokens "$P" --max-tokens "$N" --vocab "$vocab")
        "$BIN" serve --model "$MODEL" --listen "127.0.0.1:$port" --parallel "$b" --ctx-size $(( P + N + 16 )) \
            "${mflags[@]}" > "$logs/moe-server-$case-$b.log" 2>&1 &
        pid=$!
        if wait_ready "$port" "$pid"; then
            "${load[@]}" --label moe-lanes --json "$logs/moe-load-$case-$b.json" >> "$logs/moe-server-$case-$b.log" 2>&1
        fi
        stop_server "$pid"
        env "${env_l[@]}" "$LLAMA_DIR/build/bin/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$port" -np "$b" \
            -c $(( b * (P + N + 16) )) -t "$THREADS" -fa on "${lflags[@]}" > "$logs/llama-server-$case-$b.log" 2>&1 &
        pid=$!
        if wait_ready "$port" "$pid"; then
            "${load[@]}" --label llama.cpp --extra '{"ignore_eos": true}' --json "$logs/llama-load-$case-$b.json" \
                >> "$logs/llama-server-$case-$b.log" 2>&1
        fi
        stop_server "$pid"
        python3 - "$case" "$b" "$logs/llama-load-$case-$b.json" "$logs/moe-load-$case-$b.json" <<'PY'
import json, sys
case, b, lpath, mpath = sys.argv[1:5]
def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return {}
l, m = load(lpath), load(mpath)
f = lambda r, k: "-" if r.get(k) is None else "%.1f" % r[k]
ratio = "%.2fx" % (m["tokens_per_s"] / l["tokens_per_s"]) if l.get("tokens_per_s") and m.get("tokens_per_s") else "-"
bad = "; ".join("%s %s" % (n, r["failed"]) for n, r in (("llama.cpp", l), ("moe-lanes", m)) if r.get("failed"))
print("| %s | %s | %s | %s | %s | %s / %s | %s / %s | %s |" % (case, b, f(l, "tokens_per_s"), f(m, "tokens_per_s"), ratio,
      f(l, "itl_ms_p50"), f(l, "itl_ms_p99"), f(m, "itl_ms_p50"), f(m, "itl_ms_p99"), bad or "none"))
PY
    done
}

server() {
    PL="${PL:-1,4,16}"
    REQS="${REQS:-2}"
    each_case "B streaming clients in $PL, $REQS requests each, pp$P / tg$N per request" \
        "| case | B | llama-server t/s | moe-lanes serve t/s | ratio | llama.cpp ITL p50 / p99 ms | moe-lanes ITL p50 / p99 ms | failed |" \
        server_case
}

case "${1:-run}" in
    fetch) fetch ;;
    build) build ;;
    run) run ;;
    batched) batched ;;
    server) server ;;
    *) echo "usage: $0 fetch|build|run|batched|server" >&2; exit 2 ;;
esac
