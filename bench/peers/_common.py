"""Shared harness for the peer benchmarks (transformers, onnxruntime-genai, llama.cpp).

Protocol (same as `specrt bench`): prompts are turned into token ids once, up front (tokenization is
not timed); each setting runs one warm-up generation on the first prompt; then, inside each repeat,
every setting runs every prompt (settings interleaved, so machine drift hits them alike). A repeat's
rate is aggregate generated tokens / aggregate wall seconds over its prompts; the reported rate is
the median over repeats. Wall time covers prefill + decode of one request (time.perf_counter), from
prompt ids to generated ids. Generated tokens exclude the prompt and the end-of-sequence token
(and anything after it), exactly as specrt's `new_tokens`.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "prompts" / "prompts.jsonl"
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"


def die(msg: str, code: int = 2):
    print(f"Error: {msg}", file=sys.stderr)
    sys.exit(code)


def require(module: str, install: str):
    """Import `module` or exit with one clear line naming what to install."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        die(f"{module} is not installed ({e}); install it with: {install}")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL lines {id, class, prompt}")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this file")
    return p


def read_prompts(path: Path, limit: int | None) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        die(f"cannot read prompts file {path}: {e.strerror}")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError('needs "prompt" (string)')
        except ValueError as e:
            die(f"{path}:{n}: bad prompt line: {e}")
        out.append({"id": str(rec.get("id", n)), "class": str(rec.get("class", "default")), "prompt": rec["prompt"]})
    if not out:
        die(f"{path} holds no prompts")
    return out[:limit] if limit else out


def cut_at_eos(ids, eos_ids) -> tuple[list[int], str]:
    """Generated ids -> (ids before the first EOS, finish reason)."""
    ids = [int(t) for t in ids]
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i], "eos"
    return ids, "length"


def run_protocol(settings: dict, prompts: list[dict], repeats: int, progress: bool = True,
                 before_measure=None) -> dict:
    """settings: name -> fn(prompt_index) -> dict(tokens=[ids], wall_s, [proposed, accepted, target_passes])."""
    runs = {name: [] for name in settings}  # name -> [(repeat, prompt_index, result)]
    t0 = time.perf_counter()
    for name, fn in settings.items():
        r = fn(0)
        if progress:
            print(f"  warm-up {name}: {len(r['tokens'])} tokens in {r['wall_s']:.2f} s", file=sys.stderr, flush=True)
    if before_measure is not None:
        before_measure()
    for rep in range(repeats):
        for name, fn in settings.items():
            for i in range(len(prompts)):
                res = fn(i)
                runs[name].append((rep, i, res))
                if progress:
                    print(f"  [{time.perf_counter() - t0:7.1f} s] repeat {rep} {name:>14} {prompts[i]['id']:>16}: "
                          f"{len(res['tokens']):4d} tok {res['wall_s']:6.2f} s "
                          f"({len(res['tokens']) / res['wall_s']:.2f} tok/s)", file=sys.stderr, flush=True)
    base = next(iter(settings))
    rows = [_summarize(name, runs[name], runs[base], prompts, repeats) for name in settings]
    return {"rows": rows, "bench_wall_s": time.perf_counter() - t0}


def _summarize(name, runs, base_runs, prompts, repeats) -> dict:
    def rate(items):
        return sum(len(r["tokens"]) for _, _, r in items) / sum(r["wall_s"] for _, _, r in items)

    per_repeat = [rate([x for x in runs if x[0] == rep]) for rep in range(repeats)]
    classes = sorted({p["class"] for p in prompts})
    by_class = {c: statistics.median(rate([x for x in runs if x[0] == rep and prompts[x[1]]["class"] == c])
                                     for rep in range(repeats)) for c in classes}
    res = [r for _, _, r in runs]
    row = {
        "setting": name,
        "tokens_per_s": statistics.median(per_repeat),
        "tokens_per_s_per_repeat": per_repeat,
        "tokens_per_s_by_class": by_class,
        "new_tokens_per_repeat": sum(len(r["tokens"]) for _, _, r in runs if _ == 0),
        "wall_s_per_repeat": [sum(r["wall_s"] for rep, _, r in runs if rep == k) for k in range(repeats)],
    }
    proposed = sum(r.get("proposed", 0) for r in res)
    if any("proposed" in r for r in res):
        row["proposed"] = proposed
        row["accepted"] = sum(r.get("accepted", 0) for r in res)
        row["acceptance_rate"] = row["accepted"] / proposed if proposed else 0.0
    if any("target_passes" in r for r in res):
        row["tokens_per_target_pass"] = sum(len(r["tokens"]) for r in res) / max(1, sum(r["target_passes"] for r in res))
    # Greedy sanity check: same generated ids as the first (baseline) setting, prompt by prompt (repeat 0).
    first = {i: r["tokens"] for rep, i, r in base_runs if rep == 0}
    mine = {i: r["tokens"] for rep, i, r in runs if rep == 0}
    row["same_tokens_as_baseline"] = sum(first[i] == mine[i] for i in mine)
    row["per_prompt"] = [{"id": prompts[i]["id"], "new_tokens": len(r["tokens"]), "finish": r.get("finish"),
                          "wall_s": [rr["wall_s"] for _, j, rr in runs if j == i],
                          **({"proposed": r["proposed"], "accepted": r["accepted"]} if "proposed" in r else {})}
                         for rep, i, r in runs if rep == 0]
    return row


def format_table(rows: list[dict], n_prompts: int) -> str:
    base = rows[0]["tokens_per_s"]
    lines = [f"{'setting':>16} {'tok/s':>8} {'vs first':>8} {'accept':>7} {'tok/pass':>8} {'same':>6}  per-repeat tok/s"]
    for r in rows:
        acc = f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r else "-"
        tpp = f"{r['tokens_per_target_pass']:.2f}" if "tokens_per_target_pass" in r else "-"
        reps = " ".join(f"{x:.2f}" for x in r["tokens_per_s_per_repeat"])
        lines.append(f"{r['setting']:>16} {r['tokens_per_s']:>8.2f} {r['tokens_per_s'] / base:>7.2f}x {acc:>7} "
                     f"{tpp:>8} {r['same_tokens_as_baseline']:>3}/{n_prompts:<2}  {reps}")
    return "\n".join(lines)


def finish(args, meta: dict, result: dict, prompts: list[dict]):
    import resource
    out = {
        **meta,
        "prompts_file": str(args.prompts), "prompts": len(prompts), "prompt_ids": [p["id"] for p in prompts],
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
        "greedy": True, "python": platform.python_version(), "machine": platform.machine(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **result,
    }
    print(format_table(result["rows"], len(prompts)))
    print(f"({len(prompts)} prompts x {args.repeats} repeats, max {args.max_new_tokens} new tokens, greedy, "
          f"{args.threads} threads; tok/s = median over repeats of aggregate tokens / aggregate wall; "
          f"'same' = prompts whose generated ids equal the first setting's; peak RSS {out['peak_rss_mb']:.0f} MB)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return out
