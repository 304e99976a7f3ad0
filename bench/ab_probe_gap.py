"""In-process A/B of auto's probe schedule: the old one (first probe after 16 plain rounds, doubling) vs the
cost-scaled one (runtime/adaptive.py min_probe_gap), target-only alongside, settings interleaved per prompt.
Usage: python bench/ab_probe_gap.py PAIR_DIR REPEATS"""
import statistics, sys, json
from pathlib import Path
import specrt
from specrt.runtime.adaptive import AutoDraftLen
from specrt.runtime.bench import read_prompts

pair_dir, repeats = sys.argv[1], int(sys.argv[2])
orig = AutoDraftLen.min_probe_gap
old = lambda self: self.probe_every
pair = specrt.load(pair_dir)
plist = read_prompts(Path('bench/prompts/prompts.jsonl'), pair)
variants = {"none": (0, orig), "auto_old": ("auto", old), "auto_new": ("auto", orig)}
state = {v: (dict(), dict()) for v in variants}  # per variant: its own learned acceptance and probe schedule
res = {v: {} for v in variants}
for v, (k, fn) in variants.items():  # warm-up: each variant learns on the first prompt
    AutoDraftLen.min_probe_gap = fn
    pair.acceptance, pair.probes = state[v]
    pair.draft_memory.forget()
    pair.run(plist[0].ids, pair.config(max_new_tokens=64, draft_len=k, drafter="model"))
for r in range(repeats):
    for p in plist:
        for v, (k, fn) in variants.items():
            AutoDraftLen.min_probe_gap = fn
            pair.acceptance, pair.probes = state[v]
            pair.draft_memory.forget()
            s = pair.run(p.ids, pair.config(max_new_tokens=128, draft_len=k, drafter="model")).stats
            res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_skipped"], s["draft_len_hist"]))
    print("repeat", r, flush=True)
cls = {p.id: p.kind for p in plist}
out = {}
for v in variants:
    by = {}
    for pid, runs in res[v].items():
        by.setdefault(cls[pid], []).append(statistics.median(n / w for n, w, _, _ in runs))
    out[v] = {c: sum(x) for c, x in by.items()}
for c in out["none"]:
    print(c, {v: round(out[v][c] / out["none"][c], 3) for v in variants})
tot = {v: sum(out[v].values()) for v in variants}
print("all", {v: round(tot[v] / tot["none"], 3) for v in variants})
print(json.dumps({v: {pid: runs for pid, runs in res[v].items()} for v in variants})[:3000])
