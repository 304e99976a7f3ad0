"""In-process A/B of hybrid's switching cost (decode.py: leaving a caught-up draft model costs it a catch-up
pass later): hybrid auto with and without it, model auto, target-only, settings interleaved per prompt.
Usage: python bench/ab_hybrid_switch.py PAIR_DIR REPEATS"""
import statistics, sys
from pathlib import Path
import specrt
from specrt.runtime import adaptive
from specrt.runtime.bench import read_prompts

pair_dir, repeats = sys.argv[1], int(sys.argv[2])
orig_best = adaptive.AutoDraftLen.best
def no_extra(self, limit, extra_s=0.0):
    return orig_best(self, limit, 0.0)
pair = specrt.load(pair_dir)
plist = read_prompts(Path('bench/prompts/prompts.jsonl'), pair)
variants = {"none": (0, "model", orig_best), "model_auto": ("auto", "model", orig_best),
            "hybrid_old": ("auto", "hybrid", no_extra), "hybrid_new": ("auto", "hybrid", orig_best)}
state = {v: ({}, {}) for v in variants}
res = {v: {} for v in variants}
def run(v, p, n):
    k, dr, fn = variants[v]
    adaptive.AutoDraftLen.best = fn
    pair.acceptance, pair.probes = state[v]
    pair.draft_memory.forget()
    return pair.run(p.ids, pair.config(max_new_tokens=n, draft_len=k, drafter=dr)).stats
for v in variants:
    run(v, plist[0], 64)
for r in range(repeats):
    for p in plist:
        for v in variants:
            s = run(v, p, 128)
            res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_by_drafter"]))
    print("repeat", r, flush=True)
adaptive.AutoDraftLen.best = orig_best
cls = {p.id: p.kind for p in plist}
out = {}
for v in variants:
    by = {}
    for pid, runs in res[v].items():
        by.setdefault(cls[pid], []).append(statistics.median(n / w for n, w, _ in runs))
    out[v] = {c: sum(x) for c, x in by.items()}
for c in out["none"]:
    print(c, {v: round(out[v][c] / out["none"][c], 3) for v in variants})
tot = {v: sum(out[v].values()) for v in variants}
print("all", {v: round(tot[v] / tot["none"], 3) for v in variants})
for v in ("hybrid_old", "hybrid_new"):
    agg = {}
    for pid, runs in res[v].items():
        for _, _, rb in runs:
            for d, n in rb.items():
                agg.setdefault(cls[pid], {}).setdefault(d, 0)
                agg[cls[pid]][d] += n
    print(v, "rounds by drafter", agg)
