#!/usr/bin/env python3
"""Logits of llama.cpp (llama-argmax's LOGITS_OUT: little-endian f32, a row per position) against
moe-lanes (`moe-lanes logits` JSON, or another LOGITS_OUT file) on the same file and token ids.

  logits-agreement.py THEIRS OURS LABEL [--max-err E] [--vocab N] [--json]

(--vocab: the row length when both files are raw f32.)

Prints one line: the largest |ours - theirs| of a row divided by that row's largest |theirs|
(the `max_rel_err` of the Rust tests), the mean of that per-row ratio, argmax agreement, and
argmax agreement where llama.cpp's top-2 lead is clear (> 1% of the row's spread). Exits 1 when
--max-err is given and exceeded, or when the clear-lead argmax agreement is below 100%."""
import json
import struct
import sys


def read_rows(path, n_vocab=None):
    if path.endswith(".json"):
        doc = json.load(open(path))
        return doc["logits"] if isinstance(doc, dict) else doc
    data = open(path, "rb").read()
    n = len(data) // 4
    values = struct.unpack(f"<{n}f", data)
    return [list(values[i:i + n_vocab]) for i in range(0, n, n_vocab)]


def argmax(row):
    return max(range(len(row)), key=row.__getitem__)


def main(argv):
    theirs_path, ours_path, label = argv[:3]
    max_err = float(argv[argv.index("--max-err") + 1]) if "--max-err" in argv else None
    vocab = int(argv[argv.index("--vocab") + 1]) if "--vocab" in argv else None
    if ours_path.endswith(".json"):
        ours = read_rows(ours_path)
        theirs = read_rows(theirs_path, len(ours[0]))
    else:
        theirs = read_rows(theirs_path, vocab)
        ours = read_rows(ours_path, len(theirs[0]))
    if len(ours) != len(theirs):
        print(f"{label}: position count differs: theirs {len(theirs)}, ours {len(ours)}")
        return 1
    worst, total, agree, clear, clear_agree = 0.0, 0.0, 0, 0, 0
    for a, b in zip(ours, theirs):
        scale = max(max(abs(v) for v in b), 1e-12)
        err = max(abs(x - y) for x, y in zip(a, b)) / scale
        worst, total = max(worst, err), total + err
        top = sorted(range(len(b)), key=b.__getitem__, reverse=True)[:2]
        same = argmax(a) == top[0]
        agree += same
        if b[top[0]] - b[top[1]] > 0.01 * (max(b) - min(b)):
            clear += 1
            clear_agree += same
    n = len(ours)
    ok = clear_agree == clear and (max_err is None or worst <= max_err)
    result = {"label": label, "max_rel_err": worst, "mean_rel_err": total / n, "argmax_agree": agree,
              "clear": clear, "clear_agree": clear_agree, "positions": n, "ok": ok}
    if "--json" in argv:
        print(json.dumps(result))
    else:
        bound = f" (bound {max_err:.1e})" if max_err is not None else ""
        print(f"{label}: max rel err {worst:.2e}{bound}, mean {total / n:.2e}; argmax {agree}/{n}, "
              f"{clear_agree}/{clear} where llama.cpp's lead is clear ({'ok' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
