# Longer recipes for moe-lanes. The two everyday commands are in README.md:
#   cargo run --release -- demo      and      cargo test --workspace

model := env_var_or_default("MODEL", "models/qwen3-30b-a3b-16l.gguf")
learn_file := env_var_or_default("LEARN", "models/learn.json")
hot_fraction := env_var_or_default("HOT_FRACTION", "0.5")
tokens := env_var_or_default("TOKENS", "5,17,200,3,99,1024,7,42")

# Run every test (the README's test command).
test:
    cargo test --workspace

# The default demo: generates the embedded synthetic model on first use.
demo:
    cargo run --release -- demo

# Write the benchmark model: Qwen3-30B-A3B shapes, 16 layers, BF16, skewed routing (~20 GB).
synth-bench-model:
    mkdir -p models
    cargo run --release -- synth --preset qwen3-30b-a3b --layers 16 --format gguf --skew skewed --out {{model}}

# Learn pass (cache off): per-layer, per-expert usage into the learn file.
learn:
    cargo run --release -- learn --model {{model}} --n-tokens 256 --out {{learn_file}}

# Generate with the hot cache on (the most-used experts of the learn file), perf JSON to models/perf-hot.json.
hot:
    cargo run --release -- generate --model {{model}} --tokens {{tokens}} --max-new-tokens 32 --learn {{learn_file}} --hot-fraction {{hot_fraction}} --perf-json models/perf-hot.json

# The same run with the hot cache off (every expert cold), perf JSON to models/perf-off.json.
off:
    cargo run --release -- generate --model {{model}} --tokens {{tokens}} --max-new-tokens 32 --hot-fraction 0 --perf-json models/perf-off.json

# Criterion micro-benchmarks (kernels, message overhead) and the cold-lane kernel bench.
bench:
    cargo bench --workspace
    cargo run --release -- bench-kernels

# End-to-end GPU bench on the model (needs a CUDA GPU).
bench-gpu budget="-1":
    cargo run --release -- bench --model {{model}} --hot-budget-mib {{budget}}

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
