"""Does the target's own confidence predict whether the draft model's first token is accepted?
Runs the 15 bench prompts (prompts.jsonl + edits.jsonl) with the model drafter at k = 2, greedy, and
for every drafting round records the target's top probability at the first draft position and whether
that token was accepted; prints the acceptance per bin of that probability, per prompt class. This is
what adaptive.Calibration learns live (bench/RESULTS.md, tenth sitting).
Usage: python bench/confidence_accept.py PAIR_DIR"""
import sys
from pathlib import Path

import numpy as np

import specrt
from specrt.runtime import sampling
from specrt.runtime.bench import read_prompts

if len(sys.argv) != 2:
    sys.exit(__doc__)
pair = specrt.load(sys.argv[1])
rows, current = [], {}
accept_greedy = sampling.accept_greedy


def spy(d, logits):
    n, t = accept_greedy(d, logits)
    if len(d):
        rows.append((current["kind"], sampling.top_prob(logits[0]), n >= 1))
    return n, t


sampling.accept_greedy = spy
for p in read_prompts([Path("bench/prompts/prompts.jsonl"), Path("bench/prompts/edits.jsonl")], pair, None):
    current["kind"] = p.kind
    pair.draft_memory.forget()
    pair.generate(p.ids, max_new_tokens=128, draft_len=2, drafter="model")
edges = [0, 0.5, 0.8, 0.95, 0.99, 1.01]
for kind in ("chat", "code", "edit", None):
    sel = [r for r in rows if kind is None or r[0] == kind]
    top, hit = np.array([r[1] for r in sel]), np.array([r[2] for r in sel], float)
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        m = (top >= lo) & (top < hi)
        bins.append(f"[{lo},{min(hi, 1)}{']' if hi > 1 else ')'} n={m.sum()} accepted {hit[m].mean() if m.any() else float('nan'):.2f}")
    print(kind or "all", f"rounds {len(sel)} accepted {hit.mean():.2f} mean top {top.mean():.2f} |", " ".join(bins))
