# Longer recipes for moe-lanes. The two everyday commands are in README.md:
#   cargo run --release -- demo      and      cargo test --workspace
#
# The seeds' benchmark passes: `just learn` (learn pass, cache off, into LEARN), `just hot` (timed
# pp/tg with the hot cache planned into BUDGET MiB from the learn file), `just off` (the same with
# budget 0); `hot` and `off` print one comparison table (pp, tg, hit rate, overlap, join wait) of
# whichever of the two runs exist, `just compare` prints it again. They work in a fresh clone: the
# model and the learn file are made when missing. The engine is the GPU when one is usable, else
# the CPU pipeline (ENGINE=gpu|pipeline forces one).
#
# Every variable below can be set in the environment or on the command line:
#   MODEL=models/qwen3-30b-a3b-16l.gguf just hot        just ENGINE=pipeline P=32 N=8 off
# On a machine without cargo, BIN runs a prebuilt binary:  BIN=.gpu/moe-lanes just hot

# The model the passes run on; written with SYNTH_ARGS when missing.
MODEL := env_var_or_default("MODEL", "models/bench.gguf")
# A fresh clone's model: Qwen3-30B-A3B shapes with 2 layers, BF16, skewed routing (3.5 GiB:
# 2.25 GiB of experts, 1.2 GiB embeddings/output). `just synth-bench-model` writes the 16-layer
# benchmark model of the design (19.7 GiB).
SYNTH_ARGS := env_var_or_default("SYNTH_ARGS", "--preset qwen3-30b-a3b --layers 2 --skew skewed --format gguf")
LEARN := env_var_or_default("LEARN", "models/learn.json")
LEARN_TOKENS := env_var_or_default("LEARN_TOKENS", "256")
# Hot-cache budget of `just hot` in MiB; -1 = free VRAM minus a reserve (0 MiB without a GPU).
BUDGET := env_var_or_default("BUDGET", "-1")
# gpu, pipeline or reference; empty lets the CLI choose (gpu when usable, else pipeline).
ENGINE := env_var_or_default("ENGINE", "")
BIN := env_var_or_default("BIN", "cargo run --release --")
# Run sizes: pp512/tg128 (as in benches/RESULTS.md) where the GPU engine runs, pp64/tg16 on the CPU
# pipeline (about 3 tokens/s for the default model on 2 cores).
gpu_seen := `nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes || echo no`
gpu_sizes := if ENGINE == "gpu" { "yes" } else if ENGINE == "" { gpu_seen } else { "no" }
P := env_var_or_default("P", if gpu_sizes == "yes" { "512" } else { "64" })
N := env_var_or_default("N", if gpu_sizes == "yes" { "128" } else { "16" })
RUNS := env_var_or_default("RUNS", "3")

engine_flag := if ENGINE == "" { "" } else { "--engine " + ENGINE }
hot_json := "models/bench-hot.json"
off_json := "models/bench-off.json"
learn_cmd := BIN + " learn --model " + quote(MODEL) + " " + engine_flag + " --n-tokens " + LEARN_TOKENS + " --out " + quote(LEARN) + " --force"
bench_cmd := BIN + " bench --model " + quote(MODEL) + " " + engine_flag + " --learn " + quote(LEARN) + " -p " + P + " -n " + N + " --runs " + RUNS + " --json"
table_cmd := "python3 scripts/bench-table.py --skip-missing " + hot_json + " " + off_json

# Run every test (the README's test command).
test:
    cargo test --workspace

# The default demo: generates the embedded synthetic model on first use.
demo:
    cargo run --release -- demo

# Write MODEL with SYNTH_ARGS if it is missing.
model:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ -e {{ quote(MODEL) }} ]; then echo "model {{ MODEL }} exists"; exit 0; fi
    mkdir -p "$(dirname {{ quote(MODEL) }})"
    {{ BIN }} synth {{ SYNTH_ARGS }} --out {{ quote(MODEL) }}

# Write the benchmark model: Qwen3-30B-A3B shapes, 16 layers, BF16, skewed routing (19.7 GiB).
synth-bench-model out="models/qwen3-30b-a3b-16l.gguf":
    mkdir -p "$(dirname {{ quote(out) }})"
    {{ BIN }} synth --preset qwen3-30b-a3b --layers 16 --format gguf --skew skewed --out {{ quote(out) }}
    @echo "bench it with: MODEL={{ out }} just hot off"

# Learn pass (cache off): per-layer, per-expert usage of LEARN_TOKENS tokens into LEARN.
learn: model
    mkdir -p "$(dirname {{ quote(LEARN) }})"
    {{ learn_cmd }}

# The learn pass when LEARN is missing (or, at the default path, older than MODEL).
[private]
learned: model
    #!/usr/bin/env bash
    set -euo pipefail
    learn={{ quote(LEARN) }} model={{ quote(MODEL) }}
    if [ -f "$learn" ] && [ "$learn" -nt "$model" ]; then exit 0; fi
    if [ -f "$learn" ] && [ "$learn" != models/learn.json ]; then
        echo "warning: $learn is older than $model (learned on another model?); \`just learn\` rewrites it" >&2
        exit 0
    fi
    [ -f "$learn" ] && echo "$learn is older than $model: learning again" >&2
    mkdir -p "$(dirname "$learn")"
    {{ learn_cmd }}

# Timed pp/tg with the hot cache planned into BUDGET MiB from LEARN -> models/bench-hot.json; table.
hot: learned
    mkdir -p models
    {{ bench_cmd }} --hot-budget-mib {{ BUDGET }} > {{ hot_json }}.tmp || { rm -f {{ hot_json }}.tmp; exit 1; }
    mv {{ hot_json }}.tmp {{ hot_json }}
    @{{ table_cmd }}

# The same with the hot cache off (budget 0: every expert cold) -> models/bench-off.json; table.
off: learned
    mkdir -p models
    {{ bench_cmd }} --hot-budget-mib 0 > {{ off_json }}.tmp || { rm -f {{ off_json }}.tmp; exit 1; }
    mv {{ off_json }}.tmp {{ off_json }}
    @{{ table_cmd }}

# The comparison table of the last `hot` and `off` runs.
compare:
    @{{ table_cmd }}

# The workload that moves: a domains:2 model (SHIFT_MODEL, written first from SHIFT_SYNTH), then
# bench --scenario shift at half the experts hot (static_first, online, static_second per request).
SHIFT_MODEL := env_var_or_default("SHIFT_MODEL", "models/shift.gguf")
SHIFT_SYNTH := env_var_or_default("SHIFT_SYNTH", "--preset qwen3-30b-a3b --layers 2 --skew domains:2 --format gguf")
UPDATE_RATE := env_var_or_default("UPDATE_RATE", "0.25")

# A moving workload: bench --scenario shift on a domains:2 model (static vs online cache updates).
shift:
    mkdir -p models
    test -e {{ quote(SHIFT_MODEL) }} || {{ BIN }} synth {{ SHIFT_SYNTH }} --out {{ quote(SHIFT_MODEL) }}
    {{ BIN }} bench --model {{ quote(SHIFT_MODEL) }} {{ engine_flag }} --scenario shift --domains 2 --requests 8 -p 32 -n {{ N }} --hot-fraction 0.5 --update-rate {{ UPDATE_RATE }}

# Criterion micro-benchmarks (kernels, message overhead) and the cold-lane kernel bench.
bench:
    cargo bench -p moe-lanes
    {{ BIN }} bench-kernels

# Regenerate the golden fixtures with transformers (makes a venv from PyPI if torch is missing).
fixtures:
    tests/fixtures/make_golden.sh

# Stage the CLI, the GPU/kernel test binaries and the fixtures in .gpu/ (no GPU needed).
gpu-build:
    scripts/gpu-build.sh

# The CLI and the named test binaries xz-packed in .gpu-pack/ (device carry limit); there: source .gpu-pack/unpack.sh.
gpu-pack *tests:
    scripts/gpu-pack.sh {{ tests }}

# On the GPU machine after gpu-build: every GPU test, bench-kernels, the end-to-end bench table.
gpu-test:
    GPU_DIR=.gpu bash .gpu/gpu-test.sh

# On the GPU machine: old binary vs new, alternating, one learn file, budgets 0/50/100% (env P N RUNS).
compare-binaries old new model:
    bash scripts/compare-binaries.sh {{ quote(old) }} {{ quote(new) }} {{ quote(model) }}

alias gpu-compare := compare-binaries

# Side by side with llama.cpp on the same file in one run (benches/compare-llama-cpp.sh): `just
# llama-fetch` here (downloads llama-cpp-python's source distribution from PyPI into .llama/, git-ignored),
# then `just compare-llama` builds llama-bench (CUDA when nvcc is present) and prints pp/tg and ratios
# for budget 0 / 50 / 100% vs -ncmoe (with a GPU) or CPU-only (without). MODEL, CASES, P, N, REPS, THREADS.

# Download llama.cpp's source (llama-cpp-python's sdist from PyPI) into .llama/ for compare-llama.
llama-fetch:
    bash benches/compare-llama-cpp.sh fetch

# Build llama-bench and print pp/tg side by side with moe-lanes at budgets 0 / 50 / 100%.
compare-llama:
    cargo build --release --bin moe-lanes
    bash benches/compare-llama-cpp.sh run

# Batched throughput beside llama-batched-bench (PL: batch sizes, "1,4,16"; P, N per sequence).
compare-llama-batched:
    cargo build --release --bin moe-lanes
    bash benches/compare-llama-cpp.sh batched

# `serve --parallel B` beside `llama-server -np B`, B streaming clients each (PL, REQS, P, N).
compare-llama-server:
    cargo build --release --bin moe-lanes
    bash benches/compare-llama-cpp.sh server

# A GGUF file (e.g. from `moe-lanes quantize`) in llama.cpp: per-position argmax of llama.cpp's
# `llama-argmax` (benches/llama-argmax, built with llama-bench by `compare-llama`) against
# `moe-lanes logits` on the same file and token ids (scripts/argmax-agreement.py).

# Per-position argmax agreement of llama.cpp and `moe-lanes logits` on one GGUF file.
llama-argmax file tokens="1,17,256,4096,77,9000,31,5,1234,600,42,7,8191,300,12,99":
    .llama/build/bin/llama-argmax {{ quote(file) }} 0 {{ tokens }} > target/llama-argmax.json
    cargo run --release --bin moe-lanes -- logits --model {{ quote(file) }} --tokens {{ tokens }} > target/moe-logits.json
    python3 scripts/argmax-agreement.py target/llama-argmax.json target/moe-logits.json {{ quote(file) }}

# Coverage-guided fuzzing (AFL++ through cargo-afl, stable toolchain) of the GGUF reader, the
# safetensors header and index, the perf/learn JSON and the hot-experts JSON: 10M executions each
# by default; crashes and hangs fail it. `just fuzz gguf 1000000` runs one target.

# Fuzz the file and JSON readers with AFL++ (TARGET all or one; EXECS executions each).
fuzz target="all" execs="10000000":
    scripts/fuzz.sh {{ target }} {{ execs }}
