"""The graph's folds (engines/int4.py: a constant bias Add into the matmul before it, a gated MLP's activation
into the gate/up matmul, a norm into the matmul after it) against the same graph without them (`--unfold`:
which; default all), in one process: the pair loaded twice, passes of each width run back to back on both
(which goes first alternates), the median of the per-repeat time ratios (unfolded / folded: above 1,
folding is faster) and each side's median.

    python bench/kernels/fusion.py PAIR_DIR [--unfold bias,glu,norm] [--past 300] [--widths 1,3,5,9] [--repeats 20] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--widths", default="1,3,5,9")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--unfold", default="bias,glu,norm", help="the folds the unfolded side goes without")
    args = ap.parse_args()
    import specrt
    from specrt.engines import int4

    if int4.unavailable():
        sys.exit(int4.unavailable())
    widths = [int(w) for w in args.widths.split(",")]
    folded = specrt.load(args.pair, threads=args.threads)
    folds = {"bias": "_fold_bias", "glu": "_fuse_glu", "norm": "_fold_norm"}
    unfold = [folds[f] for f in args.unfold.split(",")]
    kept = {f: getattr(int4, f) for f in unfold}
    for f in unfold:
        setattr(int4, f, lambda *a: 0)
    try:
        plain = specrt.load(args.pair, threads=args.threads)
    finally:
        for f, fn in kept.items():
            setattr(int4, f, fn)
    print(f"# {' '.join(sys.argv)}")
    rng = np.random.default_rng(0)
    V = folded.manifest.vocab_size
    past = rng.integers(0, V, (1, args.past))
    new = rng.integers(0, V, (1, max(widths)))
    for role in ("target", "draft"):
        engines = {"folded": getattr(folded, role), "plain": getattr(plain, role)}
        if engines["folded"] is None:
            continue
        for e in engines.values():
            e.forward(past, np.array([args.past - 1]))
        times = {(k, w): [] for k in engines for w in widths}
        for rep in range(args.repeats + 1):  # the first: a warm-up
            for w in widths:
                for k in (("folded", "plain") if rep % 2 else ("plain", "folded")):
                    e = engines[k]
                    e.truncate(args.past)
                    t = time.perf_counter()
                    e.forward(new[:, :w], np.arange(w) if role == "target" else np.array([w - 1]))
                    if rep:
                        times[k, w].append(time.perf_counter() - t)
        for w in widths:
            ratio = statistics.median(p / f for p, f in zip(times["plain", w], times["folded", w]))
            print(f"{role} width {w}: folded {statistics.median(times['folded', w]) * 1e3:.1f} ms, unfolded "
                  f"{statistics.median(times['plain', w]) * 1e3:.1f} ms, unfolded / folded {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
