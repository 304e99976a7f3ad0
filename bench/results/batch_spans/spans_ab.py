"""Batch passes over the rows they span against every row computed as padding (the behaviour before
LeanEngine.rows), in one process, on a batch-4 runner: two requests at once (a server's partial batch), one
request alone in the batch decoder, and a job of 12 prompts (its tail). Each scenario runs with draft_len auto
(hybrid) and 0, the two modes alternating in order by repeat; prints the median tokens/s of each and the
per-repeat ratios, and whether both modes gave the same tokens.

    python bench/results/batch_spans/spans_ab.py PAIR_DIR [REPEATS]
"""
import statistics
import sys
import time
from pathlib import Path

import specrt
from specrt.apps.bench import read_prompts
from specrt.decoding.decode import Request

pair = specrt.load(sys.argv[1], threads=2)
pair.share_prefix = False  # every run reads its prompts whole: the modes must not inherit each other's caches
prompts = read_prompts([Path("bench/prompts/batch.jsonl")], pair, 12)
run = pair.runner(4)
run.decoder.draft  # made now, so that both modes set it too


def mode(padded: bool) -> None:
    for rows in run.decoder.made:
        if padded:
            rows.span = lambda _rows, b=rows.batch: (0, b)
        else:
            rows.__dict__.pop("span", None)


scenarios = {"2 at once": (prompts[:2], 96), "1 alone": (prompts[2:3], 96), "job of 12": (prompts, 48)}
res = {}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
    for name, (ps, n) in scenarios.items():
        for k in ("auto", 0):
            cfg = pair.config(batched=True, max_new_tokens=n, draft_len=k, drafter="hybrid" if k else "model")
            for m in (("spanned", "padded") if rep % 2 == 0 else ("padded", "spanned")):
                mode(m == "padded")
                if pair.state.history is not None:
                    pair.state.history.clear()
                t = time.perf_counter()
                out = dict(run.run([Request(i, p.ids, cfg) for i, p in enumerate(ps)]))
                dt = time.perf_counter() - t
                res.setdefault((name, k, m), []).append((sum(len(r.tokens) for r in out.values()) / dt,
                                                         {i: r.tokens for i, r in out.items()}))
    print("repeat", rep, flush=True)
print("#", " ".join(sys.argv))
for name in scenarios:
    for k in ("auto", 0):
        a, b = res[name, k, "spanned"], res[name, k, "padded"]
        ma, mb = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
        same = all(x[1] == y[1] for x, y in zip(a, b))
        print(f"{name:10s} draft_len {k!s:4s}: spanned {ma:6.1f} tok/s, padded {mb:6.1f}; {ma / mb:.2f}x; "
              f"by repeat {[round(x[0] / y[0], 2) for x, y in zip(a, b)]}; same tokens: {same}")
