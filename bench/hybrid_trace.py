"""Where hybrid auto loses to (or beats) its parts, token by token. Greedy decoding emits the same tokens
whatever drafts, so each output position can be charged, per variant, its share of the priced cost of the
round that emitted it (bench/ab.py's table, frozen planning: deterministic). Summed by what hybrid did
in the round that emitted the token (model draft, an n-gram kind, plain), the differences say which of
hybrid's choices cost it against n-gram auto and model auto.
Usage: python bench/hybrid_trace.py PAIR_DIR --table=FILE [--prompts=FILE,FILE] [--only=ID,ID]
Variants run the prompts in order, each with its own carried state, as bench/ab.py's do, but without
ab.py's warm-up request, so a variant's numbers can differ from its ab.py run by the path its state takes."""
import collections
import sys
from pathlib import Path

import numpy as np

import specrt
from ab import Meter, priced_run
from specrt.runtime import decode as decode_mod, drafters
from specrt.runtime.adaptive import Calibration
from specrt.runtime.bench import read_prompts

opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
VARIANTS = {"ngram": ("auto", "ngram"), "model": ("auto", "model"), "hybrid": ("auto", "hybrid"),
            **({"hybrid3": (3, "hybrid")} if "--with-fixed" in sys.argv else {})}
pair = specrt.load(args[0])
plist = read_prompts([Path(f) for f in opts.get("prompts", "bench/prompts/prompts.jsonl").split(",")], pair)
meter = Meter(pair, Path(opts["table"]))
rounds = []  # of the request running: (kind, k, accepted, priced seconds)
last = {"kind": "plain"}

real_accept = decode_mod.sampling.accept_greedy


def accept_greedy(d, logits):
    n, t = real_accept(d, logits)
    rounds.append((last["kind"] if len(d) else "plain", len(d), n, meter.take()))
    last["kind"] = "plain"
    return n, t


class Sampling:  # decode's view of the sampling module, with accept_greedy logged
    def __getattr__(self, name):
        return accept_greedy if name == "accept_greedy" else getattr(decode_mod.sampling_real, name)


decode_mod.sampling_real = decode_mod.sampling
decode_mod.sampling = Sampling()
for cls in (drafters.ModelDrafter, drafters.NgramDrafter):
    def wrapped(self, *a, _real=cls.propose, **kw):
        out = _real(self, *a, **kw)
        last["kind"] = self.kind + (f"+{self.catchup_tokens}" if getattr(self, "catchup_tokens", 0) else "")
        return out
    cls.propose = wrapped

state = {v: ({}, {}, meter.costs(), Calibration()) for v in VARIANTS}
only = set(opts["only"].split(",")) if "only" in opts else None
cost = collections.defaultdict(lambda: collections.defaultdict(float))  # [hybrid's kind][variant] seconds
count = collections.Counter()
for p in plist:
    per = {}
    for v, (k, drafter) in VARIANTS.items():
        rounds.clear()
        priced_run(pair, meter, state[v], p.ids, pair.config(max_new_tokens=128, draft_len=k, drafter=drafter))
        per[v] = list(rounds)
    if only and p.id not in only:
        continue
    # per output position: (variant's cost share, hybrid's round kind)
    share = {}
    for v, rs in per.items():
        share[v] = np.concatenate([np.full(n + 1, s / (n + 1)) for _, _, n, s in rs])
    if "--rounds" in sys.argv and only:
        print(p.id, "hybrid rounds (kind+catch-up tokens, k, accepted, ms):",
              " ".join(f"{kd}/{k}/{n}/{s * 1e3:.0f}" for kd, k, n, s in per["hybrid"]))
    for v in per:  # a catch-up is a cost of the model kind's round, not a kind of its own
        per[v] = [(kd.split("+")[0], k, n, s) for kd, k, n, s in per[v]]
    kinds = [kind for kind, _, n, _ in per["hybrid"] for _ in range(n + 1)]
    m = min(len(x) for x in share.values())
    tot = {v: share[v][:m].sum() for v in share}
    print(f"{p.id} ({p.kind}): priced s", {v: round(t, 3) for v, t in tot.items()},
          "rounds", {v: len(rs) for v, rs in per.items()})
    by = collections.defaultdict(lambda: collections.defaultdict(float))
    for i in range(m):
        for v in share:
            by[kinds[i]][v] += share[v][i]
        count[(p.kind, kinds[i])] += 1
    for kind in sorted(by):
        n_tok = sum(1 for x in kinds[:m] if x == kind)
        print(f"   hybrid {kind:>13} {n_tok:4d} tokens:", {v: round(s * 1e3) for v, s in by[kind].items()}, "ms")
        for v in by[kind]:
            cost[(p.kind, kind)][v] += by[kind][v]
    hk = collections.Counter((kind, k, n) for kind, k, n, _ in per["hybrid"])
    print("   hybrid rounds (kind, k, accepted): ", dict(sorted(hk.items())))
    sys.stdout.flush()
print("== by class and hybrid's round kind: tokens, ms per variant")
for key in sorted(cost):
    print(key, count[key], {v: round(s * 1e3) for v, s in cost[key].items()})
