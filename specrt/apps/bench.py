"""`specrt bench`: speculative vs target-only, side by side in one process and one run.

Every setting runs each prompt back to back (in an order rotated from prompt to prompt), so the
drift of the machine's speed (+-8% over tens of seconds on a shared 2-core VM) hits all settings of
one prompt alike. Speedups are medians over repeats of the ratio to target-only within the same
repeat (paired); tokens/s are medians over repeats; all after a warm-up.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specrt.config import MAX_NEW_TOKENS, SamplingConfig
from specrt.decoding.decode import Request
from specrt.decoding.proposers import History
from specrt.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: list[int]
    kind: str  # prompt class, e.g. "code", "edit", "chat"


def read_prompts(path, pair, limit: int | None = None) -> list[Prompt]:
    """JSONL: {"id", "prompt" | "messages", "chat": bool (default true for "prompt"), "class"}.
    `path`: one file, or several (their prompts in order)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if isinstance(path, (list, tuple)):
        return [p for one in path for p in read_prompts(one, pair)][:limit]
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


def settings_grid(draft_lens: list, drafters: list[str], confidence_stops: list[float] = (0.0,),
                  trees: list[str] = ("auto",)) -> list[tuple]:
    """(drafter, draft_len, confidence_stop, tree) settings; target-only (k = 0) once, whatever the drafter."""
    grid = [("none", 0, 0.0, "off")] * (0 in draft_lens)
    for d in drafters:
        for k in draft_lens:
            if k:
                grid += [(d, k, c, t) for c in (confidence_stops if d != "ngram" else (0.0,)) for t in trees]
    return grid


def run_bench(pair, prompts: list[Prompt], draft_lens: list, max_new_tokens: int = MAX_NEW_TOKENS, repeats: int = 3,
              sampling: SamplingConfig = SamplingConfig(), seed: int = 0, drafters: list[str] = ("model",),
              progress=None, confidence_stops: list[float] = (0.0,), trees: list[str] = ("auto",)) -> dict:
    settings = settings_grid(draft_lens, drafters, confidence_stops, trees)
    cfgs = {s: pair.config(max_new_tokens=max_new_tokens, draft_len=s[1], sampling=sampling, seed=seed,
                           drafter=s[0] if s[1] else "model", confidence_stop=s[2], tree=s[3]) for s in settings}
    for cfg in cfgs.values():  # warm-up (and up-front validation of every setting)
        pair.run(prompts[0].ids, cfg)
    runs = {s: [] for s in settings}  # setting -> list of (repeat, prompt, stats)
    order = list(cfgs.items())
    # Each setting drafts from the outputs of its own earlier requests of the repeat (the suffix
    # proposer's history), as a job running only that setting would: never from another setting's run of
    # the same prompt, nor from an earlier repeat's.
    own = pair.state.history
    histories = {s: History(own.cap) if own is not None else None for s in settings}
    try:
        for r in range(repeats):
            for h in histories.values():
                if h is not None:
                    h.clear()
            _repeat(pair, prompts, order, runs, histories, r, progress)
    finally:
        pair.state.history = own
    rows = [{"drafter": s[0], "confidence_stop": s[2], "tree": s[3], **_summarize(s[1], runs[s], repeats)}
            for s in settings]
    base = next((row for row in rows if row["draft_len"] == 0), None)
    for row in rows:
        row["speedup"] = statistics.median(a / b for a, b in zip(row["rates"], base["rates"])) if base else None
        if base:
            row["speedup_by_class"] = {c: statistics.median(a / b for a, b in zip(v, base["rates_by_class"][c]))
                                       for c, v in row["rates_by_class"].items()}
    best = max(rows, key=lambda row: row["tokens_per_s"])
    return {
        "draft_lens": draft_lens, "drafters": list(drafters), "best_drafter": best["drafter"],
        "best_draft_len": best["draft_len"], "best_confidence_stop": best["confidence_stop"], "best_tree": best["tree"],
        "max_new_tokens": max_new_tokens, "repeats": repeats, "temperature": sampling.temperature,
        "prompts": len(prompts), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": rows,
    }


def _repeat(pair, prompts, order, runs, histories, r, progress) -> None:
    """One repeat: every prompt under every setting, the settings' order rotated per prompt."""
    for i, p in enumerate(prompts):
        # What the caches would hold if this prompt followed the previous one: their shared prefix (a
        # chat template's system part, a job's instruction); the runs of this prompt itself must not help.
        shared = len(os.path.commonprefix([prompts[i - 1].ids, p.ids])) if len(prompts) > 1 else 0
        shift = (r * len(prompts) + i) % len(order)
        for s, cfg in order[shift:] + order[:shift]:
            pair.draft_memory.keep(shared)
            pair.prompt_cache.keep(shared)
            pair.state.history = histories[s]
            runs[s].append((r, p, pair.run(p.ids, cfg).stats))
            if progress:
                progress()


_RUN_KEYS = ("new_tokens", "wall_s", "ttft_s", "draft_len_hist", "rounds_skipped", "rounds_by_drafter", "tree_nodes",
             "tree_rounds", "accepted_by_branch",
             "acceptance_estimate", "predicted_speedup", "measured_speedup")


def _summarize(k, runs: list, repeats: int) -> dict:
    def rate(items):  # aggregate tokens/s of one repeat over its prompts
        return sum(s["new_tokens"] for _, _, s in items) / sum(s["wall_s"] for _, _, s in items)

    per_repeat = [rate([x for x in runs if x[0] == r]) for r in range(repeats)]
    classes = sorted({p.kind for _, p, _ in runs})
    rates_by_class = {c: [rate([x for x in runs if x[0] == r and x[1].kind == c]) for r in range(repeats)]
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
    rounds = sum(s["rounds"] for s in stats)
    return {
        "draft_len": k,
        "tokens_per_s": statistics.median(per_repeat),
        "tokens_per_s_by_class": {c: statistics.median(v) for c, v in rates_by_class.items()},
        "rates": per_repeat,  # tokens/s per repeat (speedups pair them with target-only's)
        "rates_by_class": rates_by_class,
        "runs": [{"repeat": r, "prompt": p.id, "class": p.kind, **{k: s[k] for k in _RUN_KEYS if k in s}}
                 for r, p, s in runs],  # each request, for a closer look (bench --json)
        "acceptance_rate": sum(s["accepted"] for s in stats) / proposed if proposed else 0.0,
        "accepted_per_position": pos,
        "tokens_per_target_pass": sum(s["new_tokens"] for s in stats) / sum(s["target_passes"] for s in stats),
        # per verify pass after the prompt's (what a round emits, as the cost model's break-even counts it)
        "tokens_per_round": sum(s["new_tokens"] - 1 for s in stats) / rounds if rounds else 0.0,
        "tree_nodes": sum(s["proposed"] for s in stats) / rounds if rounds else 0.0,  # draft tokens verified per round
        "ttft_ms": statistics.median(s["ttft_s"] for s in stats) * 1000,
        "itl_ms": statistics.median(itl) * 1000 if itl else 0.0,
    }


def format_table(res: dict) -> str:
    head = f"{'drafter':>7} {'draft_len':>9} {'conf':>5} {'tree':>4} {'nodes':>5} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/pass':>8} {'ttft ms':>8} {'itl ms':>7}  per-position acceptance"
    lines = [head]
    for r in res["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        pos = " ".join(f"{a:.2f}" for a in r["accepted_per_position"])
        lines.append(f"{r['drafter']:>7} {str(r['draft_len']):>9} {r['confidence_stop']:>5.2f} {r['tree']:>4} "
                     f"{r['tree_nodes']:>5.2f} {r['tokens_per_s']:>8.2f} {sp:>8} {r['acceptance_rate']:>7.0%} "
                     f"{r['tokens_per_target_pass']:>8.2f} {r['ttft_ms']:>8.1f} {r['itl_ms']:>7.1f}  {pos}")
    classes = list(res["rows"][0]["tokens_per_s_by_class"])
    if len(classes) > 1 and res["rows"][0].get("speedup_by_class"):
        lines.append("speedup by prompt class: " + "; ".join(
            f"{c}: " + " ".join(f"{r['drafter']}{r['draft_len']}{'' if r['tree'] == 'off' else '+tree'}="
                                f"{r['speedup_by_class'][c]:.2f}x" for r in res["rows"])
            for c in classes))
    lines.append(f"best: drafter {res['best_drafter']}, draft_len {res['best_draft_len']}, "
                 f"confidence_stop {res['best_confidence_stop']}, tree {res['best_tree']}   peak RSS {res['peak_rss_mb']:.0f} MB   "
                 f"({res['prompts']} prompts x {res['repeats']} repeats, {res['max_new_tokens']} new tokens, "
                 f"temperature {res['temperature']})")
    return "\n".join(lines)


def run_batch_bench(pair, prompts: list[Prompt], batch_sizes: list[int], draft_lens: list[int],
                    max_new_tokens: int = MAX_NEW_TOKENS, repeats: int = 1, sampling: SamplingConfig = SamplingConfig(),
                    seed: int = 0, drafter: str = "model", progress=None, trees: list[str] = ("auto",)) -> dict:
    """Aggregate tokens/s per (draft length, tree, batch size): the whole prompt list runs through one
    batch runner (slots are refilled as rows finish), rate = generated tokens / wall seconds of that
    run, prefills included. Settings are interleaved inside each repeat; medians over repeats;
    speedups against batch 1, draft length 0 of the same run. A draft length "auto" plans each round
    (and grows each row's tree) against the batch's pass (decoding/policy.py)."""
    settings = [(k, t, b) for k in draft_lens for t in (trees if k else ("off",)) for b in batch_sizes]
    cfgs = {(k, t): pair.config(batched=True, max_new_tokens=max_new_tokens, draft_len=k, sampling=sampling, seed=seed,
                                drafter=drafter if k else "model", confidence_stop=0.0, tree=t)
            for k, t, _ in settings}
    decoders = {}
    try:
        for k, t, b in settings:  # one decoder (KV caches) per batch size; warm-up and validation up front
            if b not in decoders:
                decoders[b] = pair.runner(b)
            list(decoders[b].run([Request(0, prompts[0].ids, cfgs[(k, t)])]))
        runs = {s: [] for s in settings}
        for _ in range(repeats):
            for k, t, b in settings:
                dec = decoders[b]
                dec.reset_totals()
                if pair.state.history is not None:  # each run drafts only from its own earlier outputs
                    pair.state.history.clear()
                t0 = time.perf_counter()
                results = dict(dec.run([Request(i, p.ids, cfgs[(k, t)]) for i, p in enumerate(prompts)]))
                wall = time.perf_counter() - t0
                runs[(k, t, b)].append((sum(len(r.tokens) for r in results.values()), wall, dec.totals.as_dict(),
                                     [r.stats["wall_s"] for r in results.values()]))
                if progress:
                    progress()
    finally:
        for dec in decoders.values():
            dec.close()
    rows = []
    for (k, tree, b), items in runs.items():
        tokens = sum(t for t, _, _, _ in items)
        tot = [x for _, _, x, _ in items]
        passes = sum(x["target_passes"] for x in tot)
        row_rounds = sum(x["row_rounds"] for x in tot)
        rows.append({
            "draft_len": k, "tree": tree, "batch_size": b,
            "tree_nodes": sum(x["proposed"] for x in tot) / row_rounds if row_rounds else 0.0,  # drafts a row verified a round
            "tokens_per_s": statistics.median(t / w for t, w, _, _ in items),
            "acceptance_rate": statistics.mean(x["acceptance_rate"] for x in tot),
            "tokens_per_target_pass": tokens / passes if passes else 0.0,
            "occupancy": statistics.mean(x["occupancy"] for x in tot),
            "mean_latency_s": statistics.median(statistics.mean(lat) for _, _, _, lat in items),
        })
    base = next((r for r in rows if r["draft_len"] == 0 and r["batch_size"] == 1), None)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        same_b = next((x for x in rows if x["draft_len"] == 0 and x["batch_size"] == r["batch_size"]), None)
        r["speculation_gain"] = r["tokens_per_s"] / same_b["tokens_per_s"] if same_b and r["draft_len"] else None
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {"mode": "batch", "drafter": drafter, "batch_sizes": batch_sizes, "draft_lens": draft_lens, "rows": rows,
            "best_batch_size": best["batch_size"], "best_draft_len": best["draft_len"], "best_tree": best["tree"],
            "max_new_tokens": max_new_tokens, "repeats": repeats, "temperature": sampling.temperature,
            "prompts": len(prompts), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def format_batch_table(res: dict) -> str:
    lines = [f"{'draft_len':>9} {'tree':>4} {'batch':>5} {'tok/s':>9} {'speedup':>8} {'spec gain':>9} {'accept':>7} "
             f"{'nodes':>5} {'tok/pass':>8} {'occupancy':>9} {'latency s':>9}"]
    for r in res["rows"]:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        gain = f"{r['speculation_gain']:.2f}x" if r["speculation_gain"] is not None else "-"
        lines.append(f"{r['draft_len']:>9} {r['tree']:>4} {r['batch_size']:>5} {r['tokens_per_s']:>9.1f} {sp:>8} {gain:>9} "
                     f"{r['acceptance_rate']:>7.0%} {r['tree_nodes']:>5.2f} {r['tokens_per_target_pass']:>8.2f} "
                     f"{r['occupancy']:>9.0%} {r['mean_latency_s']:>9.2f}")
    lines.append(f"best: drafter {res['drafter']}, draft_len {res['best_draft_len']}, tree {res['best_tree']}, "
                 f"batch size {res['best_batch_size']}   "
                 f"peak RSS {res['peak_rss_mb']:.0f} MB   ({res['prompts']} prompts x {res['repeats']} repeats, "
                 f"{res['max_new_tokens']} new tokens, temperature {res['temperature']}; speedup vs batch 1 "
                 "target-only, spec gain vs target-only at the same batch size)")
    return "\n".join(lines)
