"""What a target pass costs by its width, with onnxruntime's int4 kernel and with specrt's, in one process.

The target is loaded twice (SPECRT_INT4_KERNEL=off, then auto); each repeat runs every width on both,
interleaved, over a past of --past tokens (truncated back after each pass), after a warm-up. Prints the
median milliseconds per width and the ratio to the same kernel's one-token pass.

    python bench/passes.py PAIR_DIR [--past 300] [--widths 1,2,3,4,5,7,9] [--repeats 12] [--prefill N] [--json OUT]
        [--kernels off,auto]   (auto@/path/to/_int4.so: another build of the library, to compare builds)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair")
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--widths", default="1,2,3,4,5,7,9")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--kernels", default="off,auto",
                    help="SPECRT_INT4_KERNEL values to compare; VALUE@LIBRARY: with that build of the kernel library")
    ap.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: its own choice)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time reading a prompt of this many tokens into an empty cache (in the engine's chunks)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import specrt

    widths = [int(w) for w in args.widths.split(",")]
    engines = {}
    for k in args.kernels.split(","):
        os.environ["SPECRT_INT4_KERNEL"], _, lib = k.partition("@")
        os.environ.pop("SPECRT_INT4_LIBRARY", None)
        if lib:
            os.environ["SPECRT_INT4_LIBRARY"] = lib
        pair = specrt.load(args.pair, draft_model=False, threads=args.threads)
        engines[k] = (pair, pair.target)
        print(f"# {k}: {pair.target.kernel.describe() if pair.target.kernel else 'no int4 kernel'}", flush=True)
    rng = np.random.default_rng(0)
    V = next(iter(engines.values()))[0].manifest.vocab_size
    past = rng.integers(0, V, (1, args.past))
    toks = rng.integers(0, V, (1, max(widths)))
    for _, e in engines.values():
        e.truncate(0)
        e.forward(past, np.array([args.past - 1]))
    times = {(k, w): [] for k in engines for w in widths}
    for rep in range(args.repeats + 1):
        for w in widths:
            for k, (_, e) in engines.items():
                e.truncate(args.past)
                t = time.perf_counter()
                e.forward(toks[:, :w], np.arange(w))
                if rep:  # the first round is a warm-up
                    times[k, w].append(time.perf_counter() - t)
    if args.prefill:
        prompt = rng.integers(0, V, (1, args.prefill))
        for rep in range(args.repeats // 2 + 1):
            for k, (_, e) in engines.items():
                e.truncate(0)
                t = time.perf_counter()
                e.forward(prompt, np.array([args.prefill - 1]))
                if rep:
                    times[k, "prefill"] = times.get((k, "prefill"), []) + [time.perf_counter() - t]
    print(f"# {' '.join(sys.argv)}")
    name = max(len(k) for k in engines)
    print(f"{'kernel':<{name}} " + " ".join(f"{w:>7}" for w in widths) + "   (ms; then x of one token)")
    out = {}
    for k in engines:
        med = [statistics.median(times[k, w]) * 1e3 for w in widths]
        out[k] = dict(zip(map(str, widths), med))
        print(f"{k:<{name}} " + " ".join(f"{m:7.2f}" for m in med) + "   " + " ".join(f"{m / med[0]:.2f}" for m in med))
    if args.prefill:
        pre = {k: statistics.median(times[k, "prefill"]) for k in engines}
        first = next(iter(pre.values()))
        for k, v in pre.items():
            out[k]["prefill"] = v * 1e3
            print(f"prefill of {args.prefill} tokens, {k}: {v:.2f} s ({args.prefill / v:.0f} tok/s; {first / v:.2f}x the first)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "ms": out}, f, indent=1)


if __name__ == "__main__":
    main()
