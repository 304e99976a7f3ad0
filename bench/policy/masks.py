"""What a constraint's token masks cost, against the target pass they sit beside.

    python bench/policy/masks.py PAIR_DIR [--prompts bench/prompts/structured.jsonl] [--max-new-tokens 128]

For each structured-output record (bench/ab.py --structured) it generates the constrained target-only
output, then replays that output through a fresh constraint (decoding/constraint.py), timing at every
position what a round computes there: the mask (`allowed`, the bits unpacked to a boolean per token) and
the forced continuation (`forced`). It prints the mean, median and 99th percentile per token, and the
median one-token target pass at the same context, measured in the same process.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for ab.py
from ab import structured_prompts  # noqa: E402

import specrt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair_dir")
    ap.add_argument("--prompts", default="bench/prompts/structured.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    pair = specrt.load(a.pair_dir)
    t0 = time.perf_counter()
    pair.grammars.tokenizer
    print(f"llguidance tokenizer view: {time.perf_counter() - t0:.2f} s (once per pair)")
    plist, grammars = structured_prompts([Path(a.prompts)], pair, True)
    masks, forced, passes, compile_s = [], [], [], []
    for p in plist:
        g = grammars[p.id]
        res = pair.run(p.ids, pair.config(max_new_tokens=a.max_new_tokens, draft_len=0, grammar=g))
        pair.grammars._compiled.clear()  # a grammar's first check, as a new request's
        t0 = time.perf_counter()
        c = pair.grammars.start(g)
        compile_s.append(time.perf_counter() - t0)
        for t in res.tokens:
            t0 = time.perf_counter()
            c.allowed(())
            t1 = time.perf_counter()
            c.forced(8)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            forced.append(t2 - t1)
            c.commit([t])
        # a one-token target pass at this request's context
        e = pair.target
        e.truncate(0)
        e.forward(np.array([p.ids + res.tokens]), np.array([len(p.ids) + len(res.tokens) - 1]))
        for _ in range(5):
            t0 = time.perf_counter()
            e.forward(np.array([[res.tokens[-1]]]), np.array([0]))
            passes.append(time.perf_counter() - t0)
            e.truncate(e.length - 1)
        pair.forget_caches()
        print(f"{p.id}: {len(res.tokens)} tokens, mask median {statistics.median(masks[-len(res.tokens):]) * 1e6:.0f} us",
              flush=True)

    def show(name, xs):
        xs = np.array(xs) * 1e6
        return f"{name}: mean {xs.mean():.0f} us, median {np.median(xs):.0f} us, p99 {np.percentile(xs, 99):.0f} us"

    tp = statistics.median(passes) * 1e6
    print(f"positions {len(masks)} over {len(plist)} requests")
    print(show("mask", masks), f"= {np.mean(masks) * 1e6 / tp:.2%} of a one-token target pass ({tp / 1e3:.1f} ms)")
    print(show("forced", forced))
    print(f"grammar check and matcher per request: median {statistics.median(compile_s) * 1e3:.1f} ms, "
          f"max {max(compile_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
