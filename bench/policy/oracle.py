"""The most any draft-length policy could make of the pair's drafters on this host: an oracle bound for
`specrt bench --drafters hybrid --draft-lens 0,auto` on the same prompts (greedy).

Per prompt, in the bench's order: the target's greedy output (target-only, through `pair.run`), then what
each drafter would propose at every position of that output:
- the draft model: its greedy token given the exact prefix (one teacher-forced draft pass a token; a model
  round drafts exactly these tokens for as long as its drafts are accepted);
- prompt lookup and the suffix drafter (decoding/proposers.py; the suffix drafter's history holds the
  earlier prompts' outputs, as the bench's hybrid setting has it).
Knowing the output, a round at position i drafting k tokens by drafter d emits min(agree, k) + 1 tokens
(agree: how many of d's tokens from i match the output), and costs k draft passes (the model only) plus one
target pass of k + 1 tokens, at this host's pass costs measured here (one process, interleaved, medians,
after a past of --past tokens), and the prompt's passes: the target's, and the draft model's when it drafts
at all. A dynamic program over the positions finds the cheapest sequence of rounds through each output. It
leaves out what real rounds also pay: the draft model's catch-up after lookup rounds, the second token a
draft pass reads after a round that accepted everything, the loop's own time, and learning which drafter
is right. So no policy over these drafters does better on these prompts at these
pass costs; the distance from it to the bench's hybrid auto is the policy's (docs/drafting.md). Beside it,
the same outputs with the draft model drafting a fixed k every round (what a policy that knows nothing of
the text gets; the same costs, and the two-token draft pass after a round that accepted all).

Prints, per prompt class and over all, tokens per second of target-only and of the oracle on those costs
(the prompts' passes, timed or priced, on both sides) and their ratio, and the fixed-k columns.

    python bench/policy/oracle.py PAIR_DIR --prompts bench/prompts/prompts.jsonl --prompts bench/prompts/more.jsonl \
        --prompts bench/prompts/edits.jsonl [--max-new-tokens 128] [--past 300] [--repeats 15] [--table FILE] [--json OUT]
        [--trees [--alternatives N] [--deep]]

`--table FILE` prices the rounds with a table `bench/ab.py --table FILE` measured (its target column times a
pass with the last position's logits only; a verify pass computes every position's, which the head's
arithmetic makes up to ~1 ms dearer at 9 tokens on the 1.5B), so that the bound and a frozen, priced A/B
share one set of prices.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def pass_costs(pair, past: int, repeats: int, widths: range) -> tuple[dict[int, float], float, float]:
    """(target seconds by width, draft seconds at one token, at two tokens): medians, widths and the draft
    interleaved. The two-token draft pass computes the last position's logits only (the draft engine makes no
    more): a tree's draft step needs both, so its price here is a little low, as a bound's may be."""
    rng = np.random.default_rng(0)
    V = pair.manifest.vocab_size
    ids = rng.integers(0, V, (1, past + max(widths)))
    t, d = pair.target, pair.draft
    t.truncate(0), d.truncate(0)
    t.forward(ids[:, :past], np.array([past - 1]))
    d.forward(ids[:, :past], np.array([past - 1]))
    times = defaultdict(list)
    for rep in range(repeats + 1):  # the first: a warm-up
        for w in ["draft", "draft2", *widths]:
            e, n = (d, {"draft": 1, "draft2": 2}[w]) if isinstance(w, str) else (t, w)
            e.truncate(past)
            s = time.perf_counter()
            e.forward(ids[:, past:past + n], np.array([n - 1]) if isinstance(w, str) else np.arange(n))
            if rep:
                times[w].append(time.perf_counter() - s)
    t.truncate(0), d.truncate(0)
    return {w: statistics.median(times[w]) for w in widths}, statistics.median(times["draft"]), \
        statistics.median(times["draft2"])


def model_tokens(pair, prompt: list[int], out: list[int], alternatives: int = 1) -> tuple[list[int], list[list[int]], float]:
    """(the draft model's greedy token at every output position given the exact prefix [len(out)], its next
    `alternatives` choices there (a tree's runner-ups), the seconds its prompt pass took)."""
    from specrt.decoding.proposers import greedy

    d, V, ids = pair.draft, pair.manifest.vocab_size, pair.draft_ids
    d.truncate(0)
    t0 = time.perf_counter()
    row = d.forward(np.array([prompt]), np.array([len(prompt) - 1]))[0, -1]
    prefill = time.perf_counter() - t0
    picks, seconds = [], []
    for tok in [None, *out[:-1]]:
        if tok is not None:
            row = d.forward(np.array([[tok]]), np.array([0]))[0, -1]
        pick, _, alts = greedy(row, ids, V, alternatives)
        picks.append(pick)
        seconds.append([t for t, _ in alts])
    d.truncate(0)
    return picks, seconds, prefill


def agree(proposal, out: list[int], i: int) -> int:
    n = 0
    while n < len(proposal) and i + n < len(out) and int(proposal[n]) == out[i + n]:
        n += 1
    return n


def cheapest(out: list[int], model: list[int] | None, lookups: list[list], target_s: dict[int, float], draft_s: float,
             kmax: int, second: list[int] | None = None, deep: float | None = None) -> float:
    """Seconds of the cheapest sequence of rounds that emits out[1:] (out[0] comes with the prefill).
    `model[i]`: the draft model's token at i (None: no model rounds); `lookups[i]`: the lookup proposals
    at i (token lists). A model round's draft passes are charged one token each (a pass after a round that
    accepted all reads two: left out, as a bound must). `second[i]`: the model's next choices at i: a model
    round may then verify a tree of at most kmax nodes (decoding/tree.py's shapes): its chain of k, the
    runner-up where the chain fails (whichever of them is right), and the first l tokens of one lookup proposal, which share with the chain
    the tokens both got right (a longer common prefix, where both are wrong alike, is not counted).
    `deep` (with `second`): a runner-up may also be continued by the draft model (a branch that is not a leaf):
    its L tokens come from L more draft steps, each a pass of two tokens (`deep` seconds) while the chain is
    still drafting, of one after it; knowing the output, the runner-up that is right is the output's token,
    so its continuation is the draft's teacher-forced tokens and agrees for run[i + a + 1] tokens."""
    n = len(out)
    run = [0] * (n + 1)  # the model's drafts from i that match, in a row
    for i in range(n - 1, -1, -1):
        run[i] = run[i + 1] + 1 if model is not None and model[i] == out[i] else 0
    best = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        options = [target_s[1] + best[i + 1]]
        for k in range(1, kmax + 1 if model is not None else 1):
            a = min(run[i], k)
            options.append(k * draft_s + target_s[k + 1] + best[min(i + a + 1, n)])
            if second is None:
                continue
            hit = a < k and i + a < n and out[i + a] in second[i + a]
            if hit and k + 1 <= kmax:  # the runner-up where the chain fails
                options.append(k * draft_s + target_s[k + 2] + best[min(i + a + 2, n)])
            if hit and deep is not None:  # ... continued by the draft model
                for ln in range(1, kmax - k):
                    both = max(0, min(k, a + 1 + ln) - (a + 1))  # draft steps the chain and the branch share
                    steps = max(k, a + 1 + ln)
                    s = (steps - both) * draft_s + both * deep + target_s[k + 2 + ln]
                    options.append(s + best[min(i + a + 2 + min(ln, run[i + a + 1]), n)])
            for prop in lookups[i]:
                b = agree(prop, out, i)
                for ln in range(1, len(prop) + 1):
                    extra = ln - min(b, a, ln)
                    for r in (0, 1) if hit else (0,):
                        if extra and k + extra + r <= kmax:
                            got = max(a + r, min(b, ln))
                            options.append(k * draft_s + target_s[k + extra + r + 1] + best[min(i + got + 1, n)])
        for prop in lookups[i]:
            a = agree(prop, out, i)
            for k in range(1, min(len(prop), kmax) + 1):
                options.append(target_s[k + 1] + best[min(i + min(a, k) + 1, n)])
        best[i] = min(options)
    return best[1]


def fixed(out: list[int], model: list[int], target_s: dict[int, float], draft_s: tuple[float, float], k: int) -> float:
    """Seconds to emit out[1:] drafting k tokens with the draft model every round (no oracle); `draft_s`:
    a draft pass of one token and of two (the first of a round after a round that accepted all)."""
    n, i, spent, two = len(out), 1, 0.0, False
    while i < n:
        a = 0
        while a < k and i + a < n and model[i + a] == out[i + a]:
            a += 1
        spent += draft_s[two] + (k - 1) * draft_s[0] + target_s[k + 1]
        i, two = i + a + 1, a == k
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--prompts", action="append", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--table", type=Path, help="the prices of bench/ab.py's table FILE instead of measuring them")
    ap.add_argument("--trees", action="store_true",
                    help="also the bound of model rounds verifying trees (`cheapest`'s `second`): the oracle's column "
                         "with trees")
    ap.add_argument("--alternatives", type=int, default=2,
                    help="with --trees: the draft's next choices a tree may hang where its chain fails "
                         "(PolicyConfig.tree_alternatives)")
    ap.add_argument("--deep", action="store_true",
                    help="with --trees: also the bound of trees whose runner-up the draft model continues (`cheapest`'s "
                         "`deep`: draft passes of two tokens), a column of its own")
    ap.add_argument("--json")
    args = ap.parse_args()
    import specrt
    from specrt.apps.bench import read_prompts
    from specrt.config import SamplingConfig
    from specrt.decoding.policy import PolicyConfig
    from specrt.decoding.proposers import History, LookupProposer, SuffixProposer

    pair = specrt.load(args.pair, threads=args.threads)
    kmax = pair.manifest.max_draft_len
    prompts = read_prompts(args.prompts, pair)
    cfg = pair.config(max_new_tokens=args.max_new_tokens, draft_len=0, sampling=SamplingConfig(temperature=0.0))
    if args.table:  # bench/ab.py's prices: by its widths, interpolated
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for ab.py
        from ab import Meter

        table = json.loads(args.table.read_text())

        def price(name: str, width: int) -> float:  # as bench/ab.py's Meter.price
            t, w = table[name], Meter.WIDTHS
            if width > w[-1]:
                return t[-1] + (t[-1] - t[-2]) / (w[-1] - w[-2]) * (width - w[-1])
            return float(np.interp(width, w, t))
        target_s = {w: price("target", w) for w in range(1, kmax + 2)}
        draft_s, draft2_s = price("draft", 1), price("draft", 2)
        tree2_s = draft2_s  # its two-token price (a pass with the last logits only: the head's rows left out)
    else:
        price = None
        target_s, draft_s, tree2_s = pass_costs(pair, args.past, args.repeats, range(1, kmax + 2))
        draft2_s = draft_s
    print(f"# {' '.join(sys.argv)}")
    print(f"# target pass ms by width: {' '.join(f'{w}:{s * 1e3:.1f}' for w, s in target_s.items())}; draft step "
          f"{draft_s * 1e3:.1f} ms (c = {draft_s / target_s[1]:.3f})")
    history = History()
    share = PolicyConfig().suffix_share
    # class -> tokens, target-only s, oracle s, tree oracle s, model k s
    totals = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0] + [0.0] * kmax)
    rows = []
    for p in prompts:
        res = pair.run(p.ids, cfg)
        out = list(res.tokens) + ([pair.manifest.eos_token_ids[0]] if res.finish_reason == "eos" else [])
        pair.draft_memory.forget()
        model, second, draft_prefill = model_tokens(pair, p.ids, out, args.alternatives)
        lookup, suffix = LookupProposer(), SuffixProposer(history, min_share=share)
        lookup.start(p.ids), suffix.start(p.ids)
        seq = list(p.ids) + out
        lookups = [[] for _ in out]
        for i in range(1, len(out)):
            found = {tuple(int(x) for x in f.tokens) for f in (lookup.find(seq[:len(p.ids) + i], kmax),
                                                                 suffix.find(seq[:len(p.ids) + i], kmax))}
            lookups[i] = [list(t) for t in found if t]
        history.add(res.tokens)
        # the prompt's passes: the target's on both sides, the draft model's where it drafts
        prefill = price("target", len(p.ids)) if price else res.stats["ttft_s"]
        draft_prefill = price("draft", len(p.ids)) if price else draft_prefill
        plain = prefill + (len(out) - 1) * target_s[1]
        best = prefill + min(cheapest(out, None, lookups, target_s, draft_s, kmax),
                             draft_prefill + cheapest(out, model, lookups, target_s, draft_s, kmax))
        tree = prefill + min(cheapest(out, None, lookups, target_s, draft_s, kmax),
                             draft_prefill + cheapest(out, model, lookups, target_s, draft_s, kmax, second)) \
            if args.trees else best
        deep = prefill + min(cheapest(out, None, lookups, target_s, draft_s, kmax),
                             draft_prefill + cheapest(out, model, lookups, target_s, draft_s, kmax, second, tree2_s)) \
            if args.trees and args.deep else tree
        n = len(res.tokens)
        ks = [prefill + draft_prefill + fixed(out, model, target_s, (draft_s, draft2_s), k) for k in range(1, kmax + 1)]
        for key in (p.kind, "all"):
            totals[key][0] += n
            totals[key][1] += plain
            totals[key][2] += best
            totals[key][3] += tree
            totals[key][4] += deep
            for k in range(kmax):
                totals[key][5 + k] += ks[k]
        right = float(np.mean([m == o for m, o in zip(model[1:], out[1:])])) if len(out) > 1 else 0.0
        rows.append({"prompt": p.id, "class": p.kind, "tokens": n, "target_only_s": plain, "oracle_s": best,
                     "tree_oracle_s": tree, "deep_tree_oracle_s": deep,
                     "model_agree": right})
        print(f"{p.id:<18} {p.kind:<5} {n:4d} tokens  oracle {plain / best:.2f}x  trees {plain / tree:.2f}x  deep {plain / deep:.2f}x  (draft model right on "
              f"{rows[-1]['model_agree']:.0%} of positions)", flush=True)
    print(f"class   tokens  target-only tok/s  oracle tok/s  oracle / target-only  with trees  deep trees  model drafts k = 1..{kmax} "
          "every round")
    summary = {}
    for key, (n, plain, best, tree, deep, *ks) in sorted(totals.items(), key=lambda kv: kv[0] == "all"):
        summary[key] = {"tokens": n, "target_only_tok_s": n / plain, "oracle_tok_s": n / best, "ratio": plain / best,
                        "tree_ratio": plain / tree, "deep_tree_ratio": plain / deep,
                        "model_fixed_k": {k + 1: plain / t for k, t in enumerate(ks)}}
        print(f"{key:<7} {n:6d} {n / plain:18.1f} {n / best:13.1f} {plain / best:21.2f} {plain / tree:11.2f} {plain / deep:11.2f}  "
              + " ".join(f"{plain / t:.2f}" for t in ks))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "prompts": rows,
                                               "target_ms": {w: t * 1e3 for w, t in target_s.items()},
                                               "draft_ms": draft_s * 1e3,
                                               "draft_two_ms": tree2_s * 1e3}, indent=1))


if __name__ == "__main__":
    main()
