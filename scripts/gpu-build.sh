#!/usr/bin/env bash
# Build the GPU test binaries here (no GPU needed) and stage them with the fixtures in DEST/.gpu
# (default: this repository root's .gpu) for scripts/gpu-test.sh on the GPU machine.
# Usage: bash scripts/gpu-build.sh [DEST_DIR]   (then GPU_DIR=<DEST_DIR relative to the root>)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-$PWD/.gpu}"
mkdir -p "$DEST/bin"
rm -f "$DEST/bin/"*
cargo test --release --no-run --message-format=json -p moe-lanes -p moe-lanes-kernels \
    --test gpu_parity --test cuda_kernels 2>/dev/null |
    python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
    while read -r name exe; do cp "$exe" "$DEST/bin/$name"; strip --strip-debug "$DEST/bin/$name" 2>/dev/null || true; echo "staged $name"; done
rm -rf "$DEST/fixtures"
cp -r tests/fixtures "$DEST/fixtures"
cp scripts/gpu-test.sh "$DEST/gpu-test.sh"
