#!/usr/bin/env python3
"""Per-position argmax agreement of llama.cpp (llama-argmax's JSON) and moe-lanes (`logits` JSON)
on the same file and token ids. Prints one line; exits 1 when they agree on fewer than MIN_AGREE
of the positions whose moe-lanes top-2 lead is clear (> 1% of the logits' spread), where
quantised activations in llama.cpp cannot flip the order."""
import json
import sys

MIN_AGREE = 0.9


def moe_rows(path):
    doc = json.load(open(path))
    rows = doc["logits"] if isinstance(doc, dict) else doc
    return rows


def main(llama_path, moe_path, label):
    llama = json.load(open(llama_path))
    rows = moe_rows(moe_path)
    if len(rows) != len(llama["argmax"]):
        print(f"{label}: position count differs: llama.cpp {len(llama['argmax'])}, moe-lanes {len(rows)}")
        return 1
    agree = clear = clear_agree = 0
    for row, theirs in zip(rows, llama["argmax"]):
        order = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:2]
        spread = max(row) - min(row)
        ours = order[0]
        agree += ours == theirs
        if row[order[0]] - row[order[1]] > 0.01 * spread:
            clear += 1
            clear_agree += ours == theirs
    n = len(rows)
    share = clear_agree / clear if clear else 1.0
    print(f"{label}: argmax agreement {agree}/{n} positions; {clear_agree}/{clear} where the lead is clear"
          f" ({'ok' if share >= MIN_AGREE else 'FAIL'})")
    return 0 if share >= MIN_AGREE else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
