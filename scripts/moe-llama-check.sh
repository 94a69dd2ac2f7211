#!/usr/bin/env bash
# llama.cpp as a second oracle for DeepSeek-V3 / Kimi K2 (GGUF deepseek2) and GLM-4.5 (glm4moe),
# issue 42, and GPT-OSS (gpt-oss, issue 41: sliding windows with sinks, YaRN, biases, the clamped
# SwiGLU; quantized to MXFP4_MOE instead of Q4_K_M) and Gemma 4 (gemma4, issue 41: sliding and
# global layers of their own head sizes, keys as values, proportional RoPE through rope_freqs, the
# scaled router, per-expert scales, sandwich and branch norms, soft-capped logits): synthetic GGUF files in llama.cpp's layout (split attn_k_b / attn_v_b, exp_probs_b,
# shared experts, leading dense layers, YaRN with yarn_log_multiplier; GLM's NextN/MTP layer,
# q/k/v biases or none), each checked against llama.cpp's layout by gguf-py
# (scripts/gguf-layout-check.py), then the logits of every position from llama.cpp (llama-argmax,
# CPU) and from moe-lanes (reference and pipeline at half the experts hot, and with GPU=1 the GPU
# engine, where it runs the file's kinds), compared by scripts/logits-agreement.py. Files: F32,
# BF16, BF16 quantized by llama.cpp's llama-quantize (Q4_K_M; GPT-OSS: MXFP4_MOE), and our own
# `synth --quant` of the same type.
#
#   BIN=path/to/moe-lanes OUT=dir bash scripts/moe-llama-check.sh
#
# Needs llama.cpp built into .llama/build (benches/compare-llama-cpp.sh build; LLAMA_TAR, a
# tarball of .llama/src, is unpacked and built CPU-only when there is no build). Settings:
# BIN (target/release/moe-lanes), OUT (a temp dir), MODELS (/dev/shm/moe-llama), LAYERS (6: the
# DeepSeek-V3 preset keeps 3 dense layers, so 3 MoE layers), SPECS (all of the list below), QUANT
# (the quantized type of every spec instead of its own, e.g. mxfp4_moe), LLAMA_DIR (.llama).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-target/release/moe-lanes}"
OUT="${OUT:-$(mktemp -d)}"
MODELS="${MODELS:-/dev/shm/moe-llama}"
LAYERS="${LAYERS:-6}"
mkdir -p "$OUT" "$MODELS"
LLAMA="${LLAMA_DIR:-.llama}/build/bin"

if [ ! -x "$LLAMA/llama-argmax" ]; then
    if [ ! -d .llama/src ] && [ -n "${LLAMA_TAR:-}" ]; then
        mkdir -p .llama && tar xJf "$LLAMA_TAR" -C .llama
    fi
    LLAMA_CUDA="${LLAMA_CUDA:-0}" bash benches/compare-llama-cpp.sh build > "$OUT/llama-build.log" 2>&1 \
        || { tail -20 "$OUT/llama-build.log"; exit 1; }
fi
HAVE_GGUF_PY=0
python3 -c 'import gguf' 2>/dev/null && HAVE_GGUF_PY=1

# 80 positions: past YaRN's original context of the tiny preset (64), several prefill tiles.
TOKENS=$(python3 -c 'print(",".join(str((i * 7919 + 13) % 4000 + 5) for i in range(80)))')

check() {  # FILE LABEL
    local file=$1 label=$2
    # gguf-layout-check.py knows deepseek2, glm4moe and gemma4; llama.cpp loading the file checks the rest
    if [ "$HAVE_GGUF_PY" = 1 ] && [[ $label != gpt-oss* ]]; then
        python3 scripts/gguf-layout-check.py "$file" > "$OUT/$label.layout.txt" 2>&1 \
            || { echo "$label: NOT llama.cpp's layout"; cat "$OUT/$label.layout.txt"; }
    fi
    "$LLAMA/llama-argmax" "$file" 0 "$TOKENS" "$OUT/$label.llama.f32" > "$OUT/$label.llama.json" \
        2> "$OUT/$label.llama.log" || { echo "$label: llama.cpp FAILED"; tail -5 "$OUT/$label.llama.log"; return; }
    local engines=(reference pipeline)
    # the GPU engine where there is one (GLM, GPT-OSS, DeepSeek's / Kimi's latent attention; a
    # kind it does not run is refused by name, and said). It holds an F32 file's matrices (and a
    # latent layer's k_b / v_b of any type) in bf16: on these random-weight files that alone moves
    # the reference by ~5e-3, and by 1e-1 or more at a routing near tie (DeepSeek's groups among
    # them; tests/deepseek.rs), so its F32 rows are not held to the reference's agreement.
    if [ "${GPU:-0}" = 1 ]; then engines+=(gpu); fi
    for engine in "${engines[@]}"; do
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

# label arch preset extra-flags...: the presets' routing and attention (DeepSeek-V3: 8 groups keep
# 4, scale 2.5, q_lora 1536, latent 512 + 64, YaRN x40; Kimi K2: one group, 64 heads, scale
# 2.827, YaRN x32; GLM-4.5-Air: GQA with biases, no q/k norm, one group; GLM tiny: q/k norm, 2
# groups keep 1, scale 2.5, with and without q/k/v biases), shrunk to a CPU-sized model.
DEFAULT_SPECS="deepseek-v3:deepseek_v3:deepseek-v3 kimi-k2:deepseek_v3:kimi-k2 glm-4.5-air:glm4_moe:glm-4.5-air
glm-tiny:glm4_moe:tiny glm-tiny-nobias:glm4_moe:tiny:--no-attention-bias gpt-oss-20b:gpt_oss:gpt-oss-20b
gpt-oss-tiny:gpt_oss:tiny gemma4-tiny:gemma4:tiny"
for spec in ${SPECS:-$DEFAULT_SPECS}; do
    IFS=: read -r name arch preset extra <<< "$spec"
    dims=(--preset "$preset" --layers "$LAYERS" --hidden 512 --experts 16 --top-k 4 --expert-ff 256
          --vocab 4096 --skew uniform --seed 5)
    quant=q4_k_m
    case $arch in
        deepseek_v3) dims+=(--heads 8 --shared-expert-ff 256) ;;
        # GPT-OSS: no shared expert; the preset's window 128 is past these 80 tokens, the tiny
        # one's 16 is not; experts MXFP4 as its published files
        gpt_oss) dims+=(--heads 8 --kv-heads 2 --head-dim 64) quant=mxfp4_moe ;;
        # GLM: head 64 (RoPE on 32 of it), 2 KV heads; one NextN/MTP layer, as llama.cpp's
        # converter writes GLM-4.5 (llama.cpp loads it and does not run it either).
        glm4_moe) dims+=(--heads 8 --kv-heads 2 --head-dim 64 --mtp-layers 1 --shared-expert-ff 256) ;;
        # Gemma 4: sliding layers (even; window 16, past within these 80 tokens) of heads of 64
        # with 2 KV heads, global ones of 128 with one KV head (keys as values, RoPE on a quarter)
        gemma4) dims+=(--heads 8 --kv-heads 2 --head-dim 64 --shared-expert-ff 256) ;;
    esac
    quant=${QUANT:-$quant}
    [ -n "$extra" ] && dims+=("$extra")
    for dtype in f32 bf16; do
        f="$MODELS/$name-$dtype.gguf"
        [ -f "$f" ] || "$BIN" synth --arch "$arch" "${dims[@]}" --dtype "$dtype" --out "$f" > /dev/null
        check "$f" "$name-$dtype"
    done
    ours="$MODELS/$name-ours-$quant.gguf"
    [ -f "$ours" ] || "$BIN" synth --arch "$arch" "${dims[@]}" --quant "$quant" --out "$ours" > /dev/null
    check "$ours" "$name-ours-$quant"
    q="$MODELS/$name-$quant.gguf"
    [ -f "$q" ] || "$LLAMA/llama-quantize" "$MODELS/$name-bf16.gguf" "$q" "${quant^^}" > "$OUT/$name-quantize.log" 2>&1 \
        || { echo "$name: llama-quantize FAILED"; tail -5 "$OUT/$name-quantize.log"; continue; }
    check "$q" "$name-$quant"
    # llama.cpp's own activation rounding: its BF16 / quantized runs against the same weights
    # upcast to F32 (llama-quantize) bound what our agreement above can be.
    for t in bf16 "$quant"; do
        src="$MODELS/$name-$t.gguf" up="$MODELS/$name-$t-as-f32.gguf"
        [ -f "$up" ] || "$LLAMA/llama-quantize" --allow-requantize "$src" "$up" F32 > "$OUT/$name-$t-up.log" 2>&1 \
            || { echo "$name $t: upcast FAILED"; tail -3 "$OUT/$name-$t-up.log"; continue; }
        "$LLAMA/llama-argmax" "$up" 0 "$TOKENS" "$OUT/$name-$t-up.llama.f32" > /dev/null 2>&1
        python3 scripts/logits-agreement.py "$OUT/$name-$t-up.llama.f32" "$OUT/$name-$t.llama.f32" \
            "$name-$t llama.cpp vs llama.cpp on its F32 upcast" --vocab 4096 || true
        python3 scripts/logits-agreement.py "$OUT/$name-$t-up.llama.f32" "$OUT/$name-$t.reference.json" \
            "$name-$t reference vs llama.cpp on its F32 upcast" || true
    done
done
"$BIN" inspect "$MODELS/glm-4.5-air-q4_k_m.gguf" > "$OUT/inspect-glm-q4.txt" 2>&1 || true
echo "results in $OUT/agreement.jsonl"
