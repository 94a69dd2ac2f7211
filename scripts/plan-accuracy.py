#!/usr/bin/env python3
"""plan-accuracy.py LOGS PCT...: the what-if planner's predicted tg/pp (LOGS/plan-PCT.json) against
the measured bench (LOGS/plan-bench-PCT.json) at each budget percentage, and the error."""
import json
import sys

logs, pcts = sys.argv[1], sys.argv[2:]
print("| budget | planned hit | measured hit | predicted tg | measured tg | tg error | predicted pp | measured pp | pp error |")
print("|---|---|---|---|---|---|---|---|---|")
for pct in pcts:
    plan = json.load(open(f"{logs}/plan-{pct}.json"))["plan"]
    bench = json.load(open(f"{logs}/plan-bench-{pct}.json"))
    def err(pred, meas):
        return "-" if pred is None else f"{(pred - meas) / meas * 100:+.1f}%"
    ptg, ppp = plan.get("tg_tokens_per_s"), plan.get("pp_tokens_per_s")
    print(f"| {pct}% | {plan['hit_rate']:.3f} | {bench['hit_rate']:.3f} | {ptg or 0:.1f} | "
          f"{bench['tg_tokens_per_s']:.1f} | {err(ptg, bench['tg_tokens_per_s'])} | {ppp or 0:.1f} | "
          f"{bench['pp_tokens_per_s']:.1f} | {err(ppp, bench['pp_tokens_per_s'])} |")
# The cost model the predictions came from (the same calibration file for every budget).
cost = json.load(open(f"{logs}/plan-{pcts[0]}.json"))
for phase, c in cost["cost_model"]["phases"].items():
    lc = c.get("layer_call")
    if lc is None:
        print(f"\n{phase}: per-slot model (no lane_cost in the calibration file)")
    else:
        w0 = lc["no_cold_us"]
        print(f"\n{phase}: fit {lc['fit']}, {lc['tokens_per_call']:.0f} tokens/call, W0 "
              f"{'-' if w0 is None else f'{w0:.1f}'} us, F {lc['fixed_us']:.1f} us, "
              f"D {lc['per_cold_expert_us']:.2f} us/expert, S {lc['per_cold_slot_us']:.2f} us/slot, "
              f"other {c['other_us_per_token']:.1f} us/token")
for n in cost.get("notes", []):
    print(f"note: {n}")
