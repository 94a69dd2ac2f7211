#!/usr/bin/env bash
# llama.cpp as a second oracle for the Qwen hybrids (issue 40): synthetic qwen35moe and qwen3next
# GGUF files (F32, BF16, and BF16 quantized to Q4_K_M by llama.cpp's own llama-quantize), the
# logits of every position from llama.cpp (llama-argmax, CPU) and from moe-lanes (reference,
# pipeline and, with a GPU, the GPU engine at half the experts hot), compared by
# scripts/logits-agreement.py.
#
#   BIN=path/to/moe-lanes OUT=dir bash scripts/hybrid-llama-check.sh
#
# Needs llama.cpp built into .llama/build (benches/compare-llama-cpp.sh build; LLAMA_TAR, a
# tarball of .llama/src, is unpacked and built CPU-only when there is no build). Settings:
# BIN (target/release/moe-lanes), OUT (a temp dir), MODELS (/dev/shm/hybrid-llama), LAYERS (8).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-target/release/moe-lanes}"
OUT="${OUT:-$(mktemp -d)}"
MODELS="${MODELS:-/dev/shm/hybrid-llama}"
LAYERS="${LAYERS:-8}"
mkdir -p "$OUT" "$MODELS"
LLAMA=.llama/build/bin

if [ ! -x "$LLAMA/llama-argmax" ]; then
    if [ ! -d .llama/src ] && [ -n "${LLAMA_TAR:-}" ]; then
        mkdir -p .llama && tar xJf "$LLAMA_TAR" -C .llama
    fi
    LLAMA_CUDA="${LLAMA_CUDA:-0}" bash benches/compare-llama-cpp.sh build > "$OUT/llama-build.log" 2>&1 \
        || { tail -20 "$OUT/llama-build.log"; exit 1; }
fi

# A prompt longer than one prefill chunk of the DeltaNet kernels.
TOKENS=$(python3 -c 'print(",".join(str((i * 7919 + 13) % 4000 + 5) for i in range(80)))')
ENGINES="reference pipeline"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    ENGINES="$ENGINES gpu"
fi

check() {  # FILE LABEL
    local file=$1 label=$2
    "$LLAMA/llama-argmax" "$file" 0 "$TOKENS" "$OUT/$label.llama.f32" > "$OUT/$label.llama.json" \
        2> "$OUT/$label.llama.log" || { echo "$label: llama.cpp FAILED"; tail -5 "$OUT/$label.llama.log"; return; }
    for engine in $ENGINES; do
        local hot=()
        [ "$engine" = reference ] || hot=(--hot-fraction 0.5)
        "$BIN" logits --model "$file" --tokens "$TOKENS" --engine "$engine" "${hot[@]}" \
            > "$OUT/$label.$engine.json" 2> "$OUT/$label.$engine.log" \
            || { echo "$label $engine: moe-lanes FAILED"; tail -3 "$OUT/$label.$engine.log"; continue; }
        local args=("$OUT/$label.llama.f32" "$OUT/$label.$engine.json" "$label $engine vs llama.cpp")
        python3 scripts/logits-agreement.py "${args[@]}" || true
        python3 scripts/logits-agreement.py "${args[@]}" --json >> "$OUT/agreement.jsonl" || true
    done
}

for spec in "qwen3_5_moe qwen3.6-35b-a3b" "qwen3_next qwen3-next-80b-a3b"; do
    set -- $spec
    arch=$1 preset=$2
    mtp=(); [ "$arch" = qwen3_5_moe ] && mtp=(--mtp-layers 1)  # as llama.cpp's converter writes Qwen3.5
    dims=("${mtp[@]}" --preset "$preset" --layers "$LAYERS" --hidden 512 --experts 16 --top-k 4 --expert-ff 256
          --shared-expert-ff 256 --vocab 4096 --skew uniform --seed 5)
    for dtype in f32 bf16; do
        f="$MODELS/$arch-$dtype.gguf"
        [ -f "$f" ] || "$BIN" synth --arch "$arch" "${dims[@]}" --dtype "$dtype" --out "$f" > /dev/null
        check "$f" "$arch-$dtype"
    done
    q="$MODELS/$arch-q4_k_m.gguf"
    [ -f "$q" ] || "$LLAMA/llama-quantize" "$MODELS/$arch-bf16.gguf" "$q" Q4_K_M > "$OUT/$arch-quantize.log" 2>&1 \
        || { echo "$arch: llama-quantize FAILED"; tail -5 "$OUT/$arch-quantize.log"; continue; }
    check "$q" "$arch-q4_k_m"
    # llama.cpp's own activation rounding: the same weights upcast to F32 (llama-quantize), where
    # llama.cpp keeps f32 activations in the matmuls; its BF16 / Q4_K_M runs against that run
    # measure what its bf16 / q8_K activations change, the bound for our agreement above.
    for t in bf16 q4_k_m; do
        src="$MODELS/$arch-$t.gguf" up="$MODELS/$arch-$t-as-f32.gguf"
        [ -f "$up" ] || "$LLAMA/llama-quantize" --allow-requantize "$src" "$up" F32 > "$OUT/$arch-$t-up.log" 2>&1 \
            || { echo "$arch $t: upcast FAILED"; tail -3 "$OUT/$arch-$t-up.log"; continue; }
        "$LLAMA/llama-argmax" "$up" 0 "$TOKENS" "$OUT/$arch-$t-up.llama.f32" > /dev/null 2>&1
        python3 scripts/logits-agreement.py "$OUT/$arch-$t-up.llama.f32" "$OUT/$arch-$t.llama.f32" \
            "$arch-$t llama.cpp vs llama.cpp on its F32 upcast" --vocab 4096 || true
        python3 scripts/logits-agreement.py "$OUT/$arch-$t-up.llama.f32" "$OUT/$arch-$t.reference.json" \
            "$arch-$t reference vs llama.cpp on its F32 upcast" || true
    done
done
"$BIN" inspect "$MODELS/qwen3_5_moe-q4_k_m.gguf" > "$OUT/inspect-q4.txt" 2>&1 || true
echo "results in $OUT/agreement.jsonl"
