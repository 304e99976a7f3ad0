import sys, time, statistics, json
import numpy as np
import specrt
from specrt.apps.bench import read_prompts
pair = specrt.load("/work/main/pairs/qwen2.5-coder-0.5b-1.5b-int4")
files = ["bench/prompts/prompts.jsonl", "bench/prompts/long.jsonl"]
prompts = read_prompts(files, pair)
t = pair.target
def read(ids, C):
    t.prefill_chunk = C
    t.truncate(0)
    t0 = time.perf_counter()
    t.forward(np.array([ids]), np.array([len(ids) - 1]))
    return time.perf_counter() - t0
read(prompts[0].ids, 64); read(prompts[0].ids, 128)
rows = []
for rep in range(3):
    for i, p in enumerate(prompts):
        order = (64, 128) if (i + rep) % 2 == 0 else (128, 64)
        got = {C: read(p.ids, C) for C in order}
        rows.append((p.id, len(p.ids), got[64], got[128]))
by = {}
for pid, n, a, b in rows:
    by.setdefault((pid, n), []).append(a / b)
ratios = [(n, statistics.median(v)) for (pid, n), v in by.items()]
tot64 = sum(r[2] for r in rows); tot128 = sum(r[3] for r in rows)
print("prompts", len(by), "lengths", min(n for n, _ in ratios), int(statistics.median(n for n, _ in ratios)), max(n for n, _ in ratios))
print("median per-prompt ratio 64/128:", round(statistics.median(r for _, r in ratios), 4))
print("total prefill time ratio 64/128:", round(tot64 / tot128, 4), "s per repeat", round(tot64/3, 2), round(tot128/3, 2))
for lo, hi in ((0, 64), (64, 128), (128, 256), (256, 4096)):
    sel = [r for n, r in ratios if lo < n <= hi]
    if sel: print(f"  {lo}-{hi} tokens: {len(sel)} prompts, median {statistics.median(sel):.4f}")
