"""`specrt tune`: measure this device, sweep the drafting settings, write the winner into the manifest.

It measures the draft pass and the target pass at every verify width (the cost model of
`draft_len="auto"`), then benchmarks draft lengths, early-stop thresholds and drafters side by side
on the given prompts, and records the fastest setting with the numbers that chose it.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from specrt.apps.bench import run_bench
from specrt.engines.select import batch_engine
from specrt.manifest import read_manifest, write_manifest


def measure_costs(pair, past: int = 128, repeats: int = 5, batch_sizes: tuple[int, ...] = ()) -> dict:
    """Median seconds of one draft pass and of a target pass per width 1..max_draft_len+1, over `past`
    slots, and what each token of a draft catch-up (one pass over `past` tokens) costs beyond the first.
    `batch_sizes`: also a target pass of one token in each of B rows over `past` slots (`batch_s`)."""
    m = pair.manifest
    past = min(past, m.max_len - m.max_draft_len - 2)
    ctx = np.arange(past)[None] % m.vocab_size

    def timed(engine, width, logits, at=past):
        engine.truncate(0)
        engine.forward(ctx, np.array([past - 1]))
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            engine.truncate(at)
            t = time.perf_counter()
            engine.forward(ctx[:, :width], logits)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    pair.forget_caches()  # the timing passes overwrite the caches
    target_s = {w: timed(pair.target, w, np.arange(w)) for w in range(1, m.max_draft_len + 2)}
    out = {"draft_s": None, "target_s": target_s, "draft_read_s": None, "past": past}
    if batch_sizes:
        out["batch_s"] = {b: _batch_pass(pair, b, ctx, repeats) for b in batch_sizes}
    if pair.draft is not None:
        draft_s = timed(pair.draft, 1, np.array([0]))
        read = timed(pair.draft, past, np.array([past - 1]), at=0)
        out.update(draft_s=draft_s, draft_read_s=max(read - draft_s, 0.0) / (past - 1))
    return out


def _batch_pass(pair, b: int, ctx: np.ndarray, repeats: int) -> float:
    """Median seconds of a target pass of one token in each of `b` rows over `ctx` (the engine batching uses)."""
    past = ctx.shape[1]
    engine = batch_engine(pair.dir, pair.target, past + 8, b, b)
    try:
        engine.forward(np.repeat(ctx, b, axis=0), np.array([past - 1]))
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            for r in range(b):
                engine.set_length(r, past)
            t = time.perf_counter()
            engine.forward(ctx[:, :1].repeat(b, axis=0), np.array([0]))
            times.append(time.perf_counter() - t)
    finally:
        engine.close()
    return statistics.median(times[1:])


def conditional(accepted_per_position: list[float]) -> list[float]:
    """P(draft i accepted | drafts before it accepted), from fixed-length rounds' P(i accepted)."""
    out, before = [], 1.0
    for p in accepted_per_position:
        out.append(min(1.0, p / before) if before > 0 else 0.0)
        before = p
    return out


def tune(pair, prompts, max_new_tokens: int, repeats: int, draft_lens: list, drafters: list[str],
         confidence_stops: list[float], progress=None) -> dict:
    costs = measure_costs(pair)
    res = run_bench(pair, prompts, draft_lens, max_new_tokens, repeats, drafters=drafters,
                    confidence_stops=confidence_stops, progress=progress)
    best = max(res["rows"], key=lambda r: r["tokens_per_s"])
    model_rows = [r for r in res["rows"] if r["drafter"] == "model" and r["draft_len"] != 0]
    widest = max(model_rows, key=lambda r: len(r["accepted_per_position"]), default=None)
    return {
        "drafter": best["drafter"] if best["draft_len"] else pair.default_drafter,
        "draft_len": best["draft_len"],
        "confidence_stop": best["confidence_stop"],
        "acceptance": conditional(widest["accepted_per_position"]) if widest else [],
        "costs": costs,
        "graphs": pair.manifest.graph_hashes(),
        "measured": {
            "tokens_per_s": best["tokens_per_s"], "speedup": best["speedup"], "prompts": res["prompts"],
            "repeats": repeats, "max_new_tokens": max_new_tokens, "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "date": time.strftime("%Y-%m-%d"),
        },
        "bench": res,
    }


def write_tuned(pair_dir: Path, tuned: dict) -> None:
    """Store the tuned settings (without the full bench table) in the manifest, atomically."""
    m = read_manifest(pair_dir)
    write_manifest(pair_dir, dataclasses.replace(m, tuned={k: v for k, v in tuned.items() if k != "bench"}))
