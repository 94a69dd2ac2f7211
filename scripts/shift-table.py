#!/usr/bin/env python3
"""Summarise `bench --scenario shift --json`: per request and policy the hit rate and tg, then the
issue-10 figures: requests after the shift until the online updater reaches 90% of the best static
(static_second) hit rate, its tg over the second domain against the stale cache (static_first), and
tg of the requests whose updates exchanged experts against the same requests of static_second."""
import json
import statistics
import sys

r = json.load(open(sys.argv[1]))
rows = r["requests"]
after = r["domains"][1]
policies = ["static_first", "online", "static_second"]
by = {p: [x for x in rows if x["policy"] == p] for p in policies}
print(f"device {r['device']}, engine {r['engine']}, {r['n_hot_experts']} hot experts, update {r['update']}")
print("| request | domain | " + " | ".join(f"{p} hit / tg / exch" for p in policies) + " |")
print("|---|---|" + "---|" * len(policies))
for i in range(len(by["online"])):
    cells = []
    for p in policies:
        x = by[p][i]
        cells.append(f"{x['hit_rate']:.3f} / {x['tg_tokens_per_s']:.1f} / {x['exchanges']}")
    x = by["online"][i]
    print(f"| {x['index']} | {x['domain']} | " + " | ".join(cells) + " |")
second = {p: [x for x in by[p] if x["domain"] == after] for p in policies}
best = statistics.mean(x["hit_rate"] for x in second["static_second"])
reach = next((k + 1 for k, x in enumerate(second["online"]) if x["hit_rate"] >= 0.9 * best), None)
tg = {p: statistics.mean(x["tg_tokens_per_s"] for x in second[p]) for p in policies}
print(f"best static hit rate after the shift {best:.3f}; online reaches 90% of it at request "
      f"{reach} after the shift (target <= 8)")
print(f"tg over the second domain: online {tg['online']:.1f}, static_first {tg['static_first']:.1f} "
      f"({tg['online'] / tg['static_first']:.2f}x, target >= 1.5x), static_second {tg['static_second']:.1f}")
upd = [(x, y) for x, y in zip(by["online"], by["static_second"]) if x["exchanges"] > 0 and x["domain"] == after]
if upd:
    ratio = statistics.mean(x["tg_tokens_per_s"] / y["tg_tokens_per_s"] for x, y in upd)
    print(f"requests with exchanges: online tg / static_second tg = {ratio:.3f} over {len(upd)} requests")
