"""How good can prompt lookup get on these prompts? Offline, from the target's own greedy outputs.

1. Runs every prompt target-only (greedy, --max-new-tokens) and measures the target pass per verify
   width (tune.measure_costs).
2. Replays each output with a lookup rule: every round proposes k tokens from the sequence so far, the
   longest prefix equal to the greedy output is accepted, plus the target's own token. Prints tokens
   per target pass for the rule specrt used before (the most recent occurrence of the longest suffix up
   to 3 tokens) and for NgramDrafter now (longest suffix up to 16 tokens, first occurrence), and the
   first-token acceptance by matched length.
3. A bound no lookup drafter can beat: a copy oracle that, each round, drafts exactly the longest
   continuation found anywhere in the context (up to 8 tokens), and only when that pays at the measured
   costs; end to end it also pays the measured prefill.

Usage: python bench/ngram_match.py PAIR_DIR [PROMPTS.jsonl ...] [--max-new-tokens=128]
(default prompts: bench/prompts/prompts.jsonl and bench/prompts/edits.jsonl)
"""
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import specrt
from specrt.runtime.bench import read_prompts
from specrt.runtime.drafters import NgramDrafter
from specrt.runtime.tune import measure_costs


def recent3(seq, k):
    """The rule before: the most recent occurrence of the longest suffix of at most 3 tokens."""
    arr = np.asarray(seq)
    for n in range(min(3, len(arr) - 1), 0, -1):
        w = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((w == arr[-n:]).all(axis=1))
        if len(hits):
            return arr[hits[-1] + n: hits[-1] + n + k], n
    return arr[:0], 0


def replay(rule, k, prompt, out, lengths=None):
    """Tokens per target pass when `rule` drafts k tokens a round and the output is `out`."""
    i = passes = 0
    while i < len(out):
        prop, n = rule(prompt + out[:i], k)
        a = 0
        while a < len(prop) and i + a < len(out) and prop[a] == out[i + a]:
            a += 1
        if lengths is not None and len(prop):
            lengths[n].append(a)
        i, passes = i + a + 1, passes + 1
    return len(out) / passes


def copy_oracle(prompt, out, cost, k=8):
    """Decode seconds when each round drafts exactly the longest span of the context that continues
    the output (at most k tokens), if that beats plain steps at the measured costs."""
    i, seconds = 0, 0.0
    while i < len(out):
        ctx, a = prompt + out[:i], 0
        for span in range(min(k, len(out) - i - 1), 0, -1):
            want = out[i: i + span]
            if any(ctx[j: j + span] == want for j in range(len(ctx) - span + 1)):
                a = span
                break
        if a and cost[a + 1] >= (a + 1) * cost[1]:
            a = 0  # a round that does not pay: plain steps
        seconds += cost[a + 1] if a else cost[1]
        i += a + 1
    return seconds


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if not args:
        sys.exit(__doc__)
    n_new = int(opts.get("max-new-tokens", 128))
    pair = specrt.load(args[0])
    files = args[1:] or ["bench/prompts/prompts.jsonl", "bench/prompts/edits.jsonl"]
    prompts = read_prompts([Path(f) for f in files], pair)
    runs = {}
    for p in prompts:
        r = pair.run(p.ids, pair.config(max_new_tokens=n_new, draft_len=0, drafter="model"))
        runs[p.id] = (p, r.tokens, r.stats["ttft_s"])
    cost = measure_costs(pair)["target_s"]
    print("target pass ms by width:", {w: round(s * 1e3, 1) for w, s in cost.items()})
    ngram = NgramDrafter()
    rules = {"recent 3-gram (before)": recent3, "longest, first (now)": ngram.match}
    lengths = defaultdict(list)
    for k in (3, 8):
        print(f"\ntokens per target pass, k={k}")
        for name, rule in rules.items():
            tpp = {pid: replay(rule, k, p.ids, out, lengths if (k == 8 and rule == ngram.match) else None)
                   for pid, (p, out, _) in runs.items()}
            by = defaultdict(list)
            for pid, (p, _, _) in runs.items():
                by[p.kind].append(tpp[pid])
            print(f"  {name:24s}", "  ".join(f"{c} {statistics.mean(v):.2f}" for c, v in sorted(by.items())),
                  "| edits:", " ".join(f"{pid}={tpp[pid]:.2f}" for pid, (p, _, _) in runs.items() if p.kind == "edit"))
    print("\nnow, k=8: matched length -> rounds, first token accepted, mean accepted")
    for lo, hi in ((1, 1), (2, 2), (3, 7), (8, 15), (16, 16)):
        acc = [a for n in range(lo, hi + 1) for a in lengths[n]]
        if acc:
            print(f"  {lo}-{hi}: {len(acc)} rounds, {np.mean([a > 0 for a in acc]):.2f}, {np.mean(acc):.2f}")
    print("\ncopy oracle (k <= 8, drafts only when it pays) at the measured costs, edit prompts:")
    for pid, (p, out, ttft) in runs.items():
        if p.kind != "edit":
            continue
        plain = len(out) * cost[1]
        best = copy_oracle(p.ids, out, cost)
        print(f"  {pid:16s} {len(out):3d} tokens, prefill {ttft:.2f} s: decode x{plain / best:.2f},"
              f" end to end x{(ttft + plain) / (ttft + best):.2f}")


if __name__ == "__main__":
    main()
