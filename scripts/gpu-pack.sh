#!/usr/bin/env bash
# Stage the CLI and the named test binaries for the GPU machine in one compressed pack under the
# device tool's carry limit (64 MiB: the unpacked binaries, fixtures and llama.cpp's sources pass
# it; xz brings them to about 15-20 MB). Needs no GPU.
#
#   scripts/gpu-pack.sh [TEST...]     e.g. scripts/gpu-pack.sh cuda_mla gpu_parity equivalence
#
# Writes .gpu-pack/ (git-ignored): g.tar.xz (the CLI as moe-lanes, bin/<test>, fixtures/, the GPU
# scripts, with PREBUILD_NVRTC the kernels' cubin: below), llama-src.tar.xz (llama.cpp's pruned
# sources, when `benches/compare-llama-cpp.sh fetch` has put them in .llama/src) and unpack.sh. On the device machine, carry .gpu-pack and
# run `source .gpu-pack/unpack.sh` first: it unpacks into .gpu and .llama/src, sets the test
# environment (MOE_LANES_FIXTURES, MOE_LANES_REQUIRE_GPU, the CUDA library path) and names the card.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.gpu-pack
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$PACK"
cargo build --release --bin moe-lanes
cp target/release/moe-lanes "$stage/moe-lanes"
if [ "$#" -gt 0 ]; then
    args=()
    for t in "$@"; do args+=(--test "$t"); done
    cargo test --release --no-run --message-format=json -p moe-lanes -p moe-lanes-kernels "${args[@]}" 2>/dev/null |
        python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
        while read -r name exe; do cp "$exe" "$stage/bin/$name"; echo "staged $name"; done
fi
for f in "$stage/moe-lanes" "$stage"/bin/*; do [ -f "$f" ] && strip --strip-debug "$f"; done
# With PREBUILD_NVRTC (a directory with the GPU machine's NVRTC release: lib/libnvrtc.so.* and
# include/, e.g. the nvidia-cuda-nvrtc and nvidia-cuda-runtime wheels of CUDA 13.0 unpacked), the
# kernels' cubin for sm_90 is compiled here (kept in .gpu-pack/nvrtc-cache between packs) and
# travels as .gpu/nvrtc-cache, so a fresh GPU machine loads it instead of compiling (minutes).
if [ -n "${PREBUILD_NVRTC:-}" ]; then
    cargo build --release -p moe-lanes-kernels --example nvrtc_prebuild
    made=$(LD_LIBRARY_PATH="$PREBUILD_NVRTC/lib" target/release/examples/nvrtc_prebuild "$PACK/nvrtc-cache" sm_90 \
        "$PREBUILD_NVRTC/include")
    echo "$made"
    mkdir -p "$stage/nvrtc-cache"
    cp "${made##*-> }" "$stage/nvrtc-cache/"
fi
cp -r tests/fixtures "$stage/fixtures"
rm -rf "$stage/fixtures/__pycache__"
cp scripts/gpu-test.sh scripts/gpu-engine-check.sh scripts/compare-binaries.sh "$stage/"
tar -cJf "$PACK/g.tar.xz" -C "$stage" .
if [ -d .llama/src ]; then
    tar -cJf "$PACK/llama-src.tar.xz" -C .llama src
fi
cat > "$PACK/unpack.sh" <<'UNPACK'
# Sourced on the device machine from the repository root (scripts/gpu-pack.sh wrote it).
mkdir -p .gpu .llama
tar xJf .gpu-pack/g.tar.xz -C .gpu
if [ ! -d .llama/src ] && [ -f .gpu-pack/llama-src.tar.xz ]; then tar xJf .gpu-pack/llama-src.tar.xz -C .llama; fi
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MOE_LANES_FIXTURES=$PWD/.gpu/fixtures MOE_LANES_REQUIRE_GPU=1 MOE_LANES_NVRTC_CACHE=$PWD/.gpu/nvrtc-cache
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; fi
UNPACK
du -ch "$PACK"/* | tail -1
