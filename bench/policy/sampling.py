"""What sampling costs per position at a real vocabulary, beside the target pass it follows.

    python bench/policy/sampling.py PAIR_DIR [--repeats 200]

For each setting: warping the target's logits (temperature, top-k, top-p) at every position of a real
text, then choosing the token by rejection (an inverse-CDF draw) or by coupling (sampling.Coupled.pick):
the median over positions and `--repeats` rounds of each, and the one-token target pass of the pair
(median of 30) for scale. With top-p, also top-p by a full sort of the vocabulary (what warp did before it
sorted only the likeliest tokens; the same bits, checked here).
"""
import argparse
import statistics
import time

import numpy as np

import specrt
from specrt.config import SamplingConfig
from specrt.decoding import sampling

TEXT = ("The old lighthouse keeper climbed the stairs each evening, counting the steps as his father had, "
        "and wondered what the ships saw when they looked back at the coast. Some nights the fog came in so "
        "thick that")
SETTINGS = [dict(temperature=0.7, top_p=0.95), dict(temperature=1.0, top_p=0.95), dict(temperature=0.7),
            dict(temperature=1.0)]


def full_sort_warp(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    p = sampling.warp(logits, SamplingConfig(cfg.temperature, cfg.top_k))
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
    keep = np.zeros_like(mass_before, bool)
    np.put_along_axis(keep, order, mass_before < cfg.top_p, axis=-1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair_dir")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    with specrt.load(a.pair_dir, draft_model=False) as pair:
        ids = pair.encode(TEXT)
        vocab = pair.manifest.vocab_size
        target = pair.target
        target.truncate(0)
        rows = []
        for at in range(0, len(ids), 8):  # a pass returns at most max_draft_len + 1 rows of logits
            chunk = ids[at:at + 8]
            rows.append(target.forward(np.array([chunk]), np.arange(len(chunk)))[0, :, :vocab].copy())
        logits = np.concatenate(rows)  # [n, V]
        n = len(ids)

        def one_pass():
            target.truncate(n)
            target.forward(np.array([[ids[-1]]]), np.array([0]))

        pass_ms = median_ms(one_pass, 30)
    print(f"vocabulary {vocab}; {n} positions; one-token target pass {pass_ms:.1f} ms (median of 30)")
    print("| setting | kept tokens (median) | warp ms (full sort) | + rejection draw ms | + coupled pick ms | "
          "coupled - rejection, % of a pass |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rng, noise = np.random.default_rng(0), sampling.Coupled(0)
    for s in SETTINGS:
        cfg = SamplingConfig(**s)
        rows = [logits[i:i + 1] for i in range(n)]
        ps = [sampling.warp(r, cfg)[0] for r in rows]
        warp = statistics.median(median_ms(lambda: sampling.warp(r, cfg), a.repeats) for r in rows)
        full = ""
        if cfg.top_p < 1.0:
            assert all(np.array_equal(full_sort_warp(r, cfg)[0], p) for r, p in zip(rows, ps))
            full = f" ({statistics.median(median_ms(lambda: full_sort_warp(r, cfg), a.repeats) for r in rows):.2f})"
        draw = statistics.median(median_ms(lambda: sampling.draw(p, rng.random()), a.repeats) for p in ps)
        pick = statistics.median(median_ms(lambda: noise.pick(p, i), a.repeats) for i, p in enumerate(ps))
        name = ", ".join(f"{k} {v}" for k, v in s.items())
        kept = statistics.median(int(np.count_nonzero(p)) for p in ps)
        print(f"| {name} | {kept:g} | {warp:.2f}{full} | {draw:.2f} | {pick:.2f} | {100 * (pick - draw) / pass_ms:.1f} |")


if __name__ == "__main__":
    main()
