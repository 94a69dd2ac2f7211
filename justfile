# Longer recipes for moe-lanes. The two everyday commands are in README.md:
#   cargo run --release -- demo      and      cargo test --workspace
#
# The seeds' benchmark passes: `just learn` (learn pass, cache off), `just hot` (timed run with the
# hot cache planned into BUDGET MiB from the learn file), `just off` (the same with budget 0);
# `hot` and `off` print one comparison table (pp, tg, hit rate, overlap, join wait). They work in
# a fresh clone: the model and the learn file are made when missing. The engine is the GPU when
# one is usable, else the CPU pipeline (ENGINE=gpu|pipeline forces one).

model := env_var_or_default("MODEL", "models/bench.gguf")
# A fresh clone's model: Qwen3-30B-A3B shapes with 2 layers (~2.5 GB, BF16, skewed routing).
# `just synth-bench-model` writes the 16-layer benchmark model (~20 GB).
synth_args := env_var_or_default("SYNTH_ARGS", "--preset qwen3-30b-a3b --layers 2 --skew skewed")
learn_file := env_var_or_default("LEARN", "models/learn.json")
budget := env_var_or_default("BUDGET", "-1")
engine := env_var_or_default("ENGINE", "")
p := env_var_or_default("P", "512")
n := env_var_or_default("N", "128")
runs := env_var_or_default("RUNS", "3")
learn_tokens := env_var_or_default("LEARN_TOKENS", "256")
engine_flag := if engine == "" { "" } else { "--engine " + engine }
bin := "cargo run --release --quiet --"

# Run every test (the README's test command).
test:
    cargo test --workspace

# The default demo: generates the embedded synthetic model on first use.
demo:
    cargo run --release -- demo

# Write MODEL if it is missing (SYNTH_ARGS choose its shape).
model:
    @mkdir -p "$(dirname {{model}})"
    @test -f {{model}} || {{bin}} synth {{synth_args}} --format gguf --out {{model}}

# Write the benchmark model: Qwen3-30B-A3B shapes, 16 layers, BF16, skewed routing (~20 GB).
synth-bench-model:
    mkdir -p models
    {{bin}} synth --preset qwen3-30b-a3b --layers 16 --format gguf --skew skewed --out models/qwen3-30b-a3b-16l.gguf

# Learn pass (cache off): per-layer, per-expert usage into the learn file.
learn: model
    {{bin}} learn --model {{model}} {{engine_flag}} --n-tokens {{learn_tokens}} --out {{learn_file}}

# Timed pp/tg with the hot cache planned into BUDGET MiB (-1: free VRAM minus the reserve).
hot: model
    @test -f {{learn_file}} || just learn
    {{bin}} bench --model {{model}} {{engine_flag}} --learn {{learn_file}} --hot-budget-mib {{budget}} -p {{p}} -n {{n}} --runs {{runs}} --json > models/bench-hot.json
    @python3 scripts/bench-table.py models/bench-hot.json models/bench-off.json

# The same run with the hot cache off (budget 0: every expert cold).
off: model
    @test -f {{learn_file}} || just learn
    {{bin}} bench --model {{model}} {{engine_flag}} --learn {{learn_file}} --hot-budget-mib 0 -p {{p}} -n {{n}} --runs {{runs}} --json > models/bench-off.json
    @python3 scripts/bench-table.py models/bench-hot.json models/bench-off.json

# The comparison table of the last `hot` and `off` runs.
compare:
    python3 scripts/bench-table.py models/bench-hot.json models/bench-off.json

# Criterion micro-benchmarks (kernels, message overhead) and the cold-lane kernel bench.
bench:
    cargo bench -p moe-lanes
    {{bin}} bench-kernels

# Regenerate the golden fixtures with transformers (makes a venv from PyPI if torch is missing).
fixtures:
    tests/fixtures/make_golden.sh

# Stage the CLI, the GPU/kernel test binaries and the fixtures in .gpu/ (no GPU needed).
gpu-build:
    scripts/gpu-build.sh

# On the GPU machine, from the repo root after gpu-build: every GPU test, bench-kernels and the
# end-to-end bench table (budgets 0/50/100%, skewed and uniform routing).
gpu-test:
    GPU_DIR=.gpu bash .gpu/gpu-test.sh

# On the GPU machine: an old binary against the new one, same call, same model (budgets 0/50/100%).
gpu-compare old new model:
    bash .gpu/gpu-compare.sh {{old}} {{new}} {{model}}
