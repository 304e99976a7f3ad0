"""How each drafter's carried acceptance estimate (the prior the next request starts from) moves from
request to request, frozen and priced as in bench/ab.py (no warm-up request).
Usage: python bench/prior_trace.py PAIR_DIR --table=FILE [--prompts=FILE,FILE] [--variants=model,hybrid]
Prints per request and variant: priced seconds, draft lengths used, and the model kind's prior
(positions 1-4) after the request."""
import sys
from pathlib import Path

import specrt
from ab import Meter, priced_run
from specrt.runtime.adaptive import Calibration
from specrt.runtime.bench import read_prompts

opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
pair = specrt.load(args[0])
plist = read_prompts([Path(f) for f in opts.get("prompts", "bench/prompts/prompts.jsonl").split(",")], pair)
meter = Meter(pair, Path(opts["table"]))
variants = opts.get("variants", "model,hybrid").split(",")
state = {v: ({}, {}, meter.costs(), Calibration()) for v in variants}
for p in plist:
    line = []
    for v in variants:
        st = priced_run(pair, meter, state[v], p.ids, pair.config(max_new_tokens=128, draft_len="auto", drafter=v))
        kind = "hybrid-model" if v == "hybrid" else "model"
        est = [round(x, 2) for x in pair.acceptance.get(kind, [])[:4]]
        hist = dict(sorted((int(k), n) for k, n in st["draft_len_hist"].items()))
        line.append(f"{v} {st['priced_s']:.3f}s k{hist} prior {est}")
    print(f"{p.id:16s}", " | ".join(line), flush=True)
