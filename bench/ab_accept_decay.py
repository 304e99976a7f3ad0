"""In-process A/B of auto's acceptance memory (AutoDraftLen.decay, the EMA weight of the estimate per
position): with 0.85 two rejections take a carried 0.99 to 0.71 and can leave a code request plainly
decoded to its end (bench/results/auto_state_diag.log). Model drafter, target-only alongside,
interleaved and rotated per prompt, each variant with its own learned state, paired ratios.
Usage: python bench/ab_accept_decay.py PAIR_DIR REPEATS [--json=OUT]"""
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
post = AutoDraftLen.__post_init__
variants = {"none": (0, None), "decay_0.85": ("auto", 0.85), "decay_0.93": ("auto", 0.93)}
pair = specrt.load(pair_dir)
plist = read_prompts(Path('bench/prompts/prompts.jsonl'), pair)
state = {v: (dict(), dict()) for v in variants}
res = {v: {} for v in variants}


def run(v, p, n):
    k, decay = variants[v]

    def init(self):
        post(self)
        if decay is not None:
            self.decay = decay

    AutoDraftLen.__post_init__ = init
    pair.acceptance, pair.probes = state[v]
    pair.draft_memory.forget()
    return pair.run(p.ids, pair.config(max_new_tokens=n, draft_len=k, drafter="model")).stats


for v in variants:
    run(v, plist[0], 64)
names = list(variants)
for r in range(repeats):
    for i, p in enumerate(plist):
        shift = (r * len(plist) + i) % len(names)
        for v in names[shift:] + names[:shift]:
            s = run(v, p, 128)
            res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_skipped"], s["draft_len_hist"]))
    print("repeat", r, flush=True)
cls = {p.id: p.kind for p in plist}


def ratios(v, ids):
    return [(n / w) / (res["none"][pid][r][0] / res["none"][pid][r][1]) for pid in ids for r, (n, w, _, _) in enumerate(res[v][pid])]


for c in sorted(set(cls.values())):
    ids = [pid for pid in cls if cls[pid] == c]
    print(c, {v: round(statistics.median(ratios(v, ids)), 3) for v in variants})
print("all (median / mean)", {v: (round(statistics.median(ratios(v, cls)), 3), round(statistics.mean(ratios(v, cls)), 3)) for v in variants})
print("requests with >= 100 plain rounds", {v: sum(x[2] >= 100 for runs in res[v].values() for x in runs) for v in variants})
if out_json:
    Path(out_json).write_text(json.dumps(res))
