#!/usr/bin/env bash
# Which GPU stage moves GPT-OSS's fixture logits: the prompt's logits on the GPU engine at hot
# fractions 0 and 1 with each prefill attention kernel, activation split and KV cache type, against
# transformers' (tests/fixtures/gpt_oss_a/golden.json), the tests' max relative error per row.
#   BIN=path/to/moe-lanes [ATTENTION="mma tiled rows"] [ACTIVATIONS="split bf16"] [KV="f16 f32"] \
#       bash scripts/gpu-diag-gptoss.sh
set -euo pipefail
BIN=${BIN:-target/release/moe-lanes}
FIX=tests/fixtures/gpt_oss_a
TOKENS=$(python3 -c "import json; print(','.join(map(str, json.load(open('$FIX/golden.json'))['prompt'])))")
tmp=$(mktemp -d)
for kv in ${KV:-f16 f32}; do
for att in ${ATTENTION:-mma tiled rows}; do
    for act in ${ACTIVATIONS:-split bf16}; do
        echo "{\"gpu\": {\"prefill_attention\": \"$att\", \"prefill_activations\": \"$act\"}}" > "$tmp/cfg.json"
        for hot in 0 1; do
            "$BIN" logits --model "$FIX" --tokens "$TOKENS" --engine gpu --hot-fraction $hot \
                --cache-type-k "$kv" --cache-type-v "$kv" --engine-config "$tmp/cfg.json" > "$tmp/out.json" 2>/dev/null
            python3 - "$tmp/out.json" "$FIX/golden.json" "kv $kv $att $act hot $hot" <<'PY'
import json, sys
ours = json.load(open(sys.argv[1]))["logits"]; want = json.load(open(sys.argv[2]))["logits"]
errs = [max(abs(a - b) for a, b in zip(o, w)) / max(abs(b) for b in w) for o, w in zip(ours, want)]
worst = max(range(len(errs)), key=errs.__getitem__)
print(f"{sys.argv[3]}: worst row {worst} {errs[worst]:.2e}; rows over 1e-3: {sum(e > 1e-3 for e in errs)}/{len(errs)}")
PY
        done
    done
done
done
