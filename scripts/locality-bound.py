#!/usr/bin/env python3
"""The best hit rate any causal hot-cache policy can reach on the locality workload, against
Belady's (issue 47's target: 90% of Belady's at budgets 25% and 50%).

The bound: before each step, a policy that knew the process's own law (src/locality.rs: re-pick a
recent token's topic with probability p, else a Zipf draw over the current, drifting ranking) and
could swap any experts in for free would hold the `cap` experts of highest probability of use in
that step; its expected hits are the sum of those probabilities. No causal policy beats it in
expectation. Belady: MIN with bypass on the same sequence (keep the `cap` experts used soonest).
Each topic's experts per layer are k distinct experts drawn at random (what synth's sharp
per-topic router biases give: a topic's top-k of random biases); 32 experts, top-4, 4 layers, 16
topics, window 8, as scripts/policy-replay-table.sh's models.

Usage: scripts/locality-bound.py P,DRIFT [P,DRIFT ...]   e.g. 0.5,0.01 0.8,0.1
"""
import math
import random
import sys
from collections import deque
def run(p, drift, topics=16, window=8, experts=32, k=4, cap=8, steps=20000, seed=7, layers=4):
    rnd = random.Random(seed)
    ranking = list(range(topics)); rnd.shuffle(ranking)
    H = [1.0/(1+r) for r in range(topics)]; tot = sum(H)
    sets = [[rnd.sample(range(experts), k) for _ in range(topics)] for _ in range(layers)]
    recent = deque(); seq = []; bound = [0.0]*layers
    for s in range(steps):
        # the law of this step's topic given everything before (the process's own state)
        probs = [0.0]*topics
        for r, t in enumerate(ranking):
            probs[t] += (1 - (p if recent else 0)) * H[r] / tot
        if recent:
            for t in recent: probs[t] += p / len(recent)
        for l in range(layers):
            pe = [0.0]*experts
            for t in range(topics):
                for e in sets[l][t]: pe[e] += probs[t]
            bound[l] += sum(sorted(pe, reverse=True)[:cap])
        if recent and rnd.random() < p:
            topic = recent[rnd.randrange(len(recent))]
        else:
            x = rnd.random()*tot; acc = 0
            for r in range(topics):
                acc += H[r]
                if x < acc: break
            topic = ranking[r]
        recent.append(topic)
        if len(recent) > window: recent.popleft()
        if rnd.random() < drift:
            half = topics//2; a = rnd.randrange(half); b = half + rnd.randrange(topics-half)
            ranking[a], ranking[b] = ranking[b], ranking[a]
        seq.append(topic)
    bel = 0
    for l in range(layers):
        req = [sets[l][t] for t in seq]
        # next use of each expert after step s
        nxt = [None]*len(req); last = {}
        for s in range(len(req)-1, -1, -1):
            nxt[s] = {e: last.get(e, math.inf) for e in req[s]}
            for e in req[s]: last[e] = s
        cache = set(); nu = {}
        for s, r in enumerate(req):
            bel += sum(1 for e in r if e in cache)
            for e in r: nu[e] = nxt[s][e]
            cand = cache | set(r)
            cache = set(sorted(cand, key=lambda e: nu[e])[:cap])
            cache = {e for e in cache if nu[e] != math.inf}
    total = steps*k*layers
    return sum(bound)/total, bel/total
for spec in sys.argv[1:]:
    p, drift = map(float, spec.split(','))
    for cap in (8, 16):
        b, bel = run(p, drift, cap=cap)
        print(f"p={p} drift={drift} budget {cap/32:.0%}: causal bound {b:.3f}, Belady {bel:.3f}, bound/Belady {b/bel:.3f}")
