#!/usr/bin/env bash
# Build everything the GPU machine runs (no GPU needed here) and stage it in DEST (default .gpu):
#   DEST/bin/<test>      test binaries: CUDA kernels (bf16 and quantized blocks), GPU parity, quantized engines, CPU kernel equivalence (AVX-512
#                        levels only run there), cold pool
#   DEST/moe-lanes       the CLI (bench-kernels, synth, bench)
#   DEST/pipeline_overhead  the message-overhead bench
#   DEST/fixtures/       copy of tests/fixtures
#   DEST/gpu-test.sh     the runner (scripts/gpu-test.sh)
# Usage: scripts/gpu-build.sh [DEST]; then on the GPU machine: GPU_DIR=DEST bash DEST/gpu-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-$PWD/.gpu}"
mkdir -p "$DEST/bin"
rm -f "$DEST/bin/"*
cargo build --release --bin moe-lanes
cp target/release/moe-lanes "$DEST/moe-lanes"
strip --strip-debug "$DEST/moe-lanes"
cargo test --release --no-run --message-format=json -p moe-lanes -p moe-lanes-kernels \
    --test gpu_parity --test quant_engine --test cuda_kernels --test cuda_quant --test equivalence --test pool --test cold_lane --test lane_faults 2>/dev/null |
    python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
    while read -r name exe; do cp "$exe" "$DEST/bin/$name"; strip --strip-debug "$DEST/bin/$name" 2>/dev/null || true; echo "staged $name"; done
# The pipeline message-overhead bench (criterion; prints MEDIAN lines at the end).
exe=$(cargo bench -p moe-lanes --bench pipeline_overhead --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "pipeline_overhead":
        print(m["executable"])' | tail -1)
cp "$exe" "$DEST/pipeline_overhead" && strip --strip-debug "$DEST/pipeline_overhead" && echo "staged pipeline_overhead"
rm -rf "$DEST/fixtures"
cp -r tests/fixtures "$DEST/fixtures"
rm -rf "$DEST/fixtures/__pycache__"
cp scripts/gpu-test.sh "$DEST/gpu-test.sh"
cp scripts/gpu-engine-check.sh "$DEST/gpu-engine-check.sh"
cp scripts/compare-binaries.sh "$DEST/compare-binaries.sh"
du -sh "$DEST"
