#!/usr/bin/env bash
# Greedy tokens of `generate --engine gpu` against every golden fixture (run on the GPU machine),
# at hot fractions 0 / 0.5 / 1, each with Post-Fetch of cold experts in prefill as it defaults
# (auto), forced on, forced on without blocking on a late copy, on with a one-expert scratchpad
# (fallbacks to the CPU), on with every copy of layer 0 late and not waited for (the CPU
# computes those experts), forced to the CPU, and off.
GPU_DIR="${GPU_DIR:-.gpu}"
export LD_LIBRARY_PATH="${CUDA_LIB:-/usr/local/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fail=0
for d in $GPU_DIR/fixtures/*/; do
  # only model fixtures have golden tokens (chat_templates/, quant/, tokenizer/ do not)
  [ -f "$d/golden.json" ] || continue
  prompt=$(python3 -c "import json;g=json.load(open('$d/golden.json'));print(','.join(map(str,g['prompt'])))")
  want=$(python3 -c "import json;g=json.load(open('$d/golden.json'));print(json.dumps(g['greedy_new_tokens'],separators=(',',':')))")
  n=$(python3 -c "import json;g=json.load(open('$d/golden.json'));print(len(g['greedy_new_tokens']))")
  for pf in auto on noblock tiny late cpu off; do
    mode=$pf scratch="" block="" fault=""
    case $pf in
      noblock) mode=on block=0 ;;
      tiny) mode=on scratch=0.01 ;;
      late) mode=on block=0 fault=postfetch_late:0 ;;
    esac
    for f in 0 0.5 1; do
      got=$(MOE_LANES_POSTFETCH=$mode MOE_LANES_POSTFETCH_SCRATCH_MIB=$scratch MOE_LANES_POSTFETCH_BLOCK_ON_MISS=$block MOE_LANES_FAULT=$fault $GPU_DIR/moe-lanes generate --model "$d" --tokens "$prompt" --max-new-tokens "$n" --engine gpu --hot-fraction $f 2>/tmp/err | python3 -c "import json,sys;print(json.dumps(json.load(sys.stdin)['tokens'],separators=(',',':')))")
      if [ "$got" == "$want" ] && ! grep -q "unavailable" /tmp/err; then r=ok; else r="MISMATCH got=$got want=$want $(cat /tmp/err)"; fail=1; fi
      echo "$(basename $d) F=$f postfetch=$pf $r"
    done
  done
done
exit $fail
