"""`specrt bench`: speculative vs target-only, side by side in one process and one run.

Draft lengths are interleaved inside each repeat (0, k1, k2, ... then again), so drift of the
machine's speed hits every setting alike; numbers are medians over repeats after a warm-up.
"""
from __future__ import annotations

import json
import resource
import statistics
from dataclasses import dataclass
from pathlib import Path

from specrt.config import GenerationConfig, SamplingConfig
from specrt.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: list[int]
    kind: str  # prompt class, e.g. "code", "edit", "chat"


def read_prompts(path: Path, pair, limit: int | None = None) -> list[Prompt]:
    """JSONL: {"id", "prompt" | "messages", "chat": bool (default true for "prompt"), "class"}."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read prompts file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"prompts file {path} is not UTF-8") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            if "messages" in rec:
                text = pair.codec.apply_chat_template(rec["messages"])
                ids = pair.encode(text)
            elif isinstance(rec.get("prompt"), str):
                ids = pair.encode(rec["prompt"], chat=rec.get("chat", True))
            else:
                raise ValueError('needs "prompt" (string) or "messages"')
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"{path}:{n}: bad prompt line: {e}") from None
        prompts.append(Prompt(str(rec.get("id", n)), ids, str(rec.get("class", "default"))))
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts[:limit]


def settings_grid(draft_lens: list, drafters: list[str], confidence_stops: list[float] = (0.0,)) -> list[tuple]:
    """(drafter, draft_len, confidence_stop) settings; target-only (k = 0) once, whatever the drafter."""
    grid = [("none", 0, 0.0)] * (0 in draft_lens)
    for d in drafters:
        for k in draft_lens:
            if k:
                grid += [(d, k, c) for c in (confidence_stops if d != "ngram" else (0.0,))]
    return grid


def run_bench(pair, prompts: list[Prompt], draft_lens: list, max_new_tokens: int = 128, repeats: int = 3,
              sampling: SamplingConfig = SamplingConfig(), seed: int = 0, drafters: list[str] = ("model",),
              progress=None, confidence_stops: list[float] = (0.0,)) -> dict:
    settings = settings_grid(draft_lens, drafters, confidence_stops)
    cfgs = {s: GenerationConfig(max_new_tokens=max_new_tokens, draft_len=s[1], sampling=sampling, seed=seed,
                                drafter=s[0] if s[1] else "model", confidence_stop=s[2]) for s in settings}
    for cfg in cfgs.values():  # warm-up (and up-front validation of every setting)
        pair.run(prompts[0].ids, cfg)
    runs = {s: [] for s in settings}  # setting -> list of (repeat, prompt, stats)
    for r in range(repeats):
        for s, cfg in cfgs.items():
            for p in prompts:
                runs[s].append((r, p, pair.run(p.ids, cfg).stats))
                if progress:
                    progress()
    rows = [{"drafter": s[0], "confidence_stop": s[2], **_summarize(s[1], runs[s], repeats)} for s in settings]
    base = next((row for row in rows if row["draft_len"] == 0), None)
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        if base:
            row["speedup_by_class"] = {c: v / base["tokens_per_s_by_class"][c]
                                       for c, v in row["tokens_per_s_by_class"].items()}
    best = max(rows, key=lambda row: row["tokens_per_s"])
    return {
        "draft_lens": draft_lens, "drafters": list(drafters), "best_drafter": best["drafter"],
        "best_draft_len": best["draft_len"], "best_confidence_stop": best["confidence_stop"],
        "max_new_tokens": max_new_tokens, "repeats": repeats, "temperature": sampling.temperature,
        "prompts": len(prompts), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": rows,
    }


def _summarize(k, runs: list, repeats: int) -> dict:
    def rate(items):  # aggregate tokens/s of one repeat over its prompts
        return sum(s["new_tokens"] for _, _, s in items) / sum(s["wall_s"] for _, _, s in items)

    per_repeat = [rate([x for x in runs if x[0] == r]) for r in range(repeats)]
    classes = sorted({p.kind for _, p, _ in runs})
    by_class = {c: statistics.median(rate([x for x in runs if x[0] == r and x[1].kind == c]) for r in range(repeats))
                for c in classes}
    stats = [s for _, _, s in runs]
    proposed = sum(s["proposed"] for s in stats)
    width = max((len(s["accepted_per_position"]) for s in stats), default=0)
    prop = [sum(s["proposed_per_position"][i] for s in stats if i < len(s["proposed_per_position"])) for i in range(width)]
    acc = [sum(s["accepted_per_position"][i] * s["proposed_per_position"][i] for s in stats
               if i < len(s["proposed_per_position"])) for i in range(width)]
    while prop and prop[-1] == 0:  # positions auto never drafted
        prop.pop()
    pos = [a / p if p else 0.0 for a, p in zip(acc, prop)]
    itl = [1 / s["decode_tokens_per_s"] for s in stats if s["decode_tokens_per_s"] > 0]
    return {
        "draft_len": k,
        "tokens_per_s": statistics.median(per_repeat),
        "tokens_per_s_by_class": by_class,
        "acceptance_rate": sum(s["accepted"] for s in stats) / proposed if proposed else 0.0,
        "accepted_per_position": pos,
        "tokens_per_target_pass": sum(s["new_tokens"] for s in stats) / sum(s["target_passes"] for s in stats),
        "ttft_ms": statistics.median(s["ttft_s"] for s in stats) * 1000,
        "itl_ms": statistics.median(itl) * 1000 if itl else 0.0,
    }


def format_table(res: dict) -> str:
    head = f"{'drafter':>7} {'draft_len':>9} {'conf':>5} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/pass':>8} {'ttft ms':>8} {'itl ms':>7}  per-position acceptance"
    lines = [head]
    for r in res["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
        lines.append(f"{r['drafter']:>7} {str(r['draft_len']):>9} {r['confidence_stop']:>5.2f} {r['tokens_per_s']:>8.2f} {sp:>8} {r['acceptance_rate']:>7.0%} "
                     f"{r['tokens_per_target_pass']:>8.2f} {r['ttft_ms']:>8.1f} {r['itl_ms']:>7.1f}  {pos}")
    classes = list(res["rows"][0]["tokens_per_s_by_class"])
    if len(classes) > 1 and res["rows"][0].get("speedup_by_class"):
        lines.append("speedup by prompt class: " + "; ".join(
            f"{c}: " + " ".join(f"{r['drafter']}{r['draft_len']}={r['speedup_by_class'][c]:.2f}x" for r in res["rows"])
            for c in classes))
    lines.append(f"best: drafter {res['best_drafter']}, draft_len {res['best_draft_len']}, "
                 f"confidence_stop {res['best_confidence_stop']}   peak RSS {res['peak_rss_mb']:.0f} MB   "
                 f"({res['prompts']} prompts x {res['repeats']} repeats, {res['max_new_tokens']} new tokens, "
                 f"temperature {res['temperature']})")
    return "\n".join(lines)
