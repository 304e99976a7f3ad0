"""Per-pass cost of two exports of the same model side by side: one-token steps and verify passes of
2/3/5/9 tokens after a prompt, interleaved, medians. Made to compare the lean graph with the delta graph
an older specrt exported (any two pair folders with the same model work).

    python bench/lean_vs_delta.py OLD_PAIR NEW_PAIR [--role target|draft] [--past 300] [--repeats 15]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from specrt.config import read_manifest
    from specrt.engines.ort import ort_engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--role", default="target", choices=["target", "draft"])
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    widths = (1, 2, 3, 5, 9)
    engines = {}
    for name, d in (("a", args.a), ("b", args.b)):
        m = read_manifest(d)
        e = getattr(m, args.role)
        engines[name] = (ort_engine(d, e, m.max_len, max(widths)), e.graph)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20000, size=args.past)[None]
    for eng, _ in engines.values():
        eng.forward(prompt, np.array([args.past - 1]))
    times = {(n, w): [] for n in engines for w in widths}
    for _ in range(args.repeats):
        for w in widths:
            toks = rng.integers(100, 20000, size=w)[None]
            pos = np.arange(w) if args.role == "target" else np.array([w - 1])
            for name, (eng, _) in engines.items():
                eng.truncate(args.past)
                t = time.perf_counter()
                eng.forward(toks, pos)
                times[name, w].append(time.perf_counter() - t)
    ga, gb = engines["a"][1], engines["b"][1]
    print(f"{args.role}, past {args.past}, {args.repeats} repeats: a = {args.a} ({ga}), b = {args.b} ({gb})")
    for w in widths:
        a, b = (1e3 * np.median(times[n, w]) for n in ("a", "b"))
        print(f"width {w}: a {a:6.2f} ms   b {b:6.2f} ms   b/a {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
