"""In-process A/B of how auto prices a probe: the old way (a draft step for the catch-up, whatever the
draft skipped) vs the new one (runtime/adaptive.py probe_cost: the measured read cost of every token
the draft is behind), for the model and the hybrid drafter, target-only alongside, settings
interleaved per prompt, each variant with its own learned acceptance and probe schedule. "nowait":
hybrid's n-gram rounds not counted toward the model's next probe (AutoDraftLen.wait).
Usage: python bench/ab_probe_catchup.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT]"""
import json
import statistics
import sys
from pathlib import Path

import specrt
from specrt.runtime.adaptive import AutoDraftLen
from specrt.runtime.bench import read_prompts

args = [a for a in sys.argv[1:] if not a.startswith("--json")]
out_json = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")), None)
pair_dir, repeats = args[0], int(args[1])
new, wait = AutoDraftLen.probe_cost, AutoDraftLen.wait


def nowait(self):
    pass


def old(self, behind):  # the catch-up priced as one draft step, however far behind the draft is
    c1, draft_s = self.costs.target(1), 0.0 if self.free_draft else self.costs.draft_s
    if not c1 or draft_s is None:
        return None
    return draft_s + (0.0 if self.free_draft else draft_s) + max((self.costs.target(2) or c1) - c1, 0.0)


pair = specrt.load(pair_dir)
plist = read_prompts(Path('bench/prompts/prompts.jsonl'), pair)
variants = {"none": (0, "model", new, wait), "model_old": ("auto", "model", old, nowait),
            "model_new": ("auto", "model", new, wait), "hybrid_old": ("auto", "hybrid", old, nowait),
            "hybrid_new_nowait": ("auto", "hybrid", new, nowait), "hybrid_new": ("auto", "hybrid", new, wait)}
if len(args) > 2:
    variants = {v: variants[v] for v in ["none"] + args[2].split(",")}
state = {v: (dict(), dict()) for v in variants}  # per variant: its own learned acceptance and probe schedule
res = {v: {} for v in variants}


def run(v, p, n):
    k, drafter, fn, wt = variants[v]
    AutoDraftLen.probe_cost, AutoDraftLen.wait = fn, wt
    pair.acceptance, pair.probes = state[v]
    pair.draft_memory.forget()
    return pair.run(p.ids, pair.config(max_new_tokens=n, draft_len=k, drafter=drafter)).stats


for v in variants:  # warm-up: each variant learns on the first prompt
    run(v, plist[0], 64)
names = list(variants)
for r in range(repeats):
    for i, p in enumerate(plist):
        shift = (r * len(plist) + i) % len(names)
        for v in names[shift:] + names[:shift]:  # rotated, so no variant always runs first
            s = run(v, p, 128)
            res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_skipped"], s["draft_len_hist"]))
    print("repeat", r, flush=True)
cls = {p.id: p.kind for p in plist}
# paired: per (prompt, repeat) the ratio to target-only, then the median per class
for c in sorted(set(cls.values())):
    ids = [pid for pid in cls if cls[pid] == c]
    print(c, {v: round(statistics.median((n / w) / (res["none"][pid][r][0] / res["none"][pid][r][1])
                                          for pid in ids for r, (n, w, _, _) in enumerate(res[v][pid])), 3)
              for v in variants})
print("all", {v: round(statistics.median((n / w) / (res["none"][pid][r][0] / res["none"][pid][r][1])
                                         for pid in cls for r, (n, w, _, _) in enumerate(res[v][pid])), 3) for v in variants})
print("draft read cost per token (ms):", round((pair.costs.draft_read_s or 0) * 1e3, 2))
if out_json:
    Path(out_json).write_text(json.dumps(res))
