# Longer recipes for moe-lanes. The two everyday commands are in README.md:
#   cargo run --release -- demo      and      cargo test --workspace

model := env_var_or_default("MODEL", "models/qwen3-30b-a3b-16l.gguf")

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

# Regenerate the golden fixtures with transformers (makes a venv from PyPI if torch is missing).
fixtures:
    tests/fixtures/make_golden.sh

# Cold-lane kernel bandwidth on this machine.
bench-kernels:
    cargo run --release -- bench-kernels

# Criterion micro-benchmarks (kernels, message overhead).
bench:
    cargo bench --workspace

# Build GPU test binaries into .gpu/ and print how to run them on the GPU machine.
gpu-build:
    scripts/gpu-build.sh

# Run every GPU test and benchmark (on the GPU machine, from the repo root, after gpu-build).
gpu-test:
    scripts/gpu-test.sh
