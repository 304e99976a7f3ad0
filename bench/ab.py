"""The in-process A/B harness of the bench/ab_*.py scripts.

Every prompt of bench/prompts/prompts.jsonl runs under every variant back to back (order rotated
per prompt), each variant with its own learned acceptance, probe schedule and cost model (as a
deployment running only that setting would have) and a cleared draft cache; a warm-up request per
variant first. Prints per class the median over (prompt, repeat) of
each variant's tokens/s ratio to the "none" variant of the same prompt and repeat, and the median
and mean over all requests.

A variant is (draft_len, drafter, setup): `setup()` puts that variant's code in place (the scripts
monkeypatch one piece of specrt) right before each of its requests.
"""
import copy
import json
import statistics
import sys
from pathlib import Path

import specrt
from specrt.runtime.bench import read_prompts


def main(variants: dict, usage: str, max_new_tokens: int = 128) -> dict:
    """Run the A/B from the command line: PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
    [--prompts=FILE,FILE] (default bench/prompts/prompts.jsonl)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if len(args) < 2:
        sys.exit(usage)
    if len(args) > 2:
        variants = {v: variants[v] for v in ["none"] + args[2].split(",")}
    pair = specrt.load(args[0])
    files = opts.get("prompts", "bench/prompts/prompts.jsonl").split(",")
    plist = read_prompts([Path(f) for f in files], pair, int(opts["limit"]) if "limit" in opts else None)
    state = {v: ({}, {}, copy.deepcopy(pair.costs)) for v in variants}
    res = {v: {} for v in variants}

    def run(v, p, n):
        k, drafter, setup = variants[v]
        setup()
        pair.acceptance, pair.probes, pair.costs = state[v]
        pair.draft_memory.forget()
        return pair.run(p.ids, pair.config(max_new_tokens=n, draft_len=k, drafter=drafter)).stats

    for v in variants:
        run(v, plist[0], max_new_tokens // 2)
    names = list(variants)
    for r in range(int(args[1])):
        for i, p in enumerate(plist):
            shift = (r * len(plist) + i) % len(names)
            for v in names[shift:] + names[:shift]:
                s = run(v, p, max_new_tokens)
                res[v].setdefault(p.id, []).append((s["new_tokens"], s["wall_s"], s["rounds_skipped"], s["draft_len_hist"]))
        print("repeat", r, flush=True)
    cls = {p.id: p.kind for p in plist}

    def ratios(v, ids):
        return [(n / w) / (res["none"][pid][r][0] / res["none"][pid][r][1])
                for pid in ids for r, (n, w, _, _) in enumerate(res[v][pid])]

    for c in sorted(set(cls.values())):
        ids = [pid for pid in cls if cls[pid] == c]
        print(c, {v: round(statistics.median(ratios(v, ids)), 3) for v in variants})
    print("all (median / mean)", {v: (round(statistics.median(ratios(v, cls)), 3), round(statistics.mean(ratios(v, cls)), 3))
                                  for v in variants})
    print("requests with >= 100 plain rounds", {v: sum(x[2] >= 100 for runs in res[v].values() for x in runs) for v in variants})
    if "json" in opts:
        Path(opts["json"]).write_text(json.dumps(res))
    return res
