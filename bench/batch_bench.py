"""Batched decoding benchmark: aggregate tokens/s per batch size, speculative and target-only.

For every (draft length, batch size) the whole prompt list runs through one BatchDecoder (slots are
refilled as rows finish, so the batch stays full until the list runs dry); the rate is total generated
tokens / wall seconds of that run, prefills included. One warm-up request per setting first; one
timed run each (no repeats). Speedups are against batch 1, draft length 0 of the same invocation.

    python bench/batch_bench.py PAIR_DIR --prompts bench/prompts/prompts.jsonl --batch-sizes 1,2,4,8 \\
        --draft-lens 0,3 [--max-new-tokens 64] [--temperature 0] [--limit N] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path


def _ints(text: str, name: str, low: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < low:
        print(f"Error: --{name} must be comma-separated integers >= {low}, got {text!r}", file=sys.stderr)
        sys.exit(2)
    return vals


def run(pair, prompts, batch_sizes, draft_lens, max_new_tokens, temperature, seed=0, log=print) -> dict:
    from specrt.config import SamplingConfig
    from specrt.runtime.batch import BatchDecoder, Request

    sampling = SamplingConfig(temperature=temperature)
    rows = []
    for k in draft_lens:
        cfg = pair.config(max_new_tokens=max_new_tokens, draft_len=k, seed=seed, sampling=sampling)
        for b in batch_sizes:
            reqs = [Request(i, p.ids, cfg) for i, p in enumerate(prompts)]
            with BatchDecoder(pair, b) as dec:
                for r in reqs:
                    dec.check(r.prompt, r.cfg)
                list(dec.run(reqs[:1]))  # warm-up
                dec.totals = type(dec.totals)(batch_size=b)
                t0 = time.perf_counter()
                results = dict(dec.run(reqs))
                wall = time.perf_counter() - t0
                tot = dec.totals.as_dict()
            tokens = sum(len(r.tokens) for r in results.values())
            row = {"draft_len": k, "batch_size": b, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                   "acceptance_rate": tot["acceptance_rate"], "occupancy": tot["occupancy"],
                   "target_passes": tot["target_passes"], "draft_passes": tot["draft_passes"],
                   "tokens_per_target_pass": tokens / tot["target_passes"] if tot["target_passes"] else 0.0,
                   "compactions": tot["compactions"],
                   "mean_latency_s": sum(r.stats["wall_s"] for r in results.values()) / len(results)}
            rows.append(row)
            log(f"  draft_len {k}, batch {b}: {row['tokens_per_s']:.1f} tok/s")
    base = next((r for r in rows if r["draft_len"] == 0 and r["batch_size"] == 1), None)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperature": temperature,
            "batch_sizes": batch_sizes, "draft_lens": draft_lens, "rows": rows,
            "best": {"draft_len": best["draft_len"], "batch_size": best["batch_size"]},
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "machine": {"platform": platform.platform(), "processor": platform.processor()}}


def format_table(res: dict) -> str:
    lines = [f"{'draft_len':>9} {'batch':>5} {'tok/s':>9} {'speedup':>8} {'accept':>7} {'tok/pass':>8} "
             f"{'occupancy':>9} {'latency s':>9} {'compact':>7}"]
    for r in res["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(f"{r['draft_len']:>9} {r['batch_size']:>5} {r['tokens_per_s']:>9.1f} {sp:>8} "
                     f"{r['acceptance_rate']:>7.0%} {r['tokens_per_target_pass']:>8.2f} {r['occupancy']:>9.0%} "
                     f"{r['mean_latency_s']:>9.2f} {r['compactions']:>7}")
    b = res["best"]
    lines.append(f"best: draft_len {b['draft_len']}, batch size {b['batch_size']}   peak RSS {res['peak_rss_mb']:.0f} MB "
                 f"({res['prompts']} prompts, {res['max_new_tokens']} new tokens, temperature {res['temperature']}; "
                 "speedup vs batch 1 target-only)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair_dir", type=Path)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL: {id, prompt | messages, class, chat} per line")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--draft-lens", default="0,3")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--threads", type=int, default=None, help="onnxruntime threads (default: its own choice)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    a = p.parse_args(argv)
    sizes, ks = _ints(a.batch_sizes, "batch-sizes", 1), _ints(a.draft_lens, "draft-lens", 0)

    import specrt
    from specrt.runtime.bench import read_prompts

    try:
        with specrt.load(a.pair_dir, threads=a.threads) as pair:
            prompts = read_prompts(a.prompts, pair, a.limit)
            res = run(pair, prompts, sizes, ks, a.max_new_tokens, a.temperature,
                      log=lambda s: print(s, file=sys.stderr))
    except specrt.SpecrtError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    print(format_table(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
