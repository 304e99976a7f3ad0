"""What pass times does auto learn in a live `specrt bench`-style run, against the priced table?
Runs every other prompt of prompts.jsonl + edits.jsonl once under target-only, model k=2, k=3 and auto
(as `specrt bench` does: one loaded pair, settings back to back) and prints the distribution of every
target pass time by verify width and of the draft step, then the costs the EMA held at the end.
The priced table (bench/ab.py) measures each width with warm threads, one engine at a time.
Usage: python bench/live_costs.py PAIR_DIR"""
import collections
import sys
from pathlib import Path

import numpy as np

import specrt
from specrt.runtime.adaptive import CostModel
from specrt.runtime.bench import read_prompts, run_bench

seen = collections.defaultdict(list)
observe_target, observe_draft = CostModel.observe_target, CostModel.observe_draft


def target(self, width, seconds):
    seen[width].append(seconds)
    observe_target(self, width, seconds)


def draft(self, seconds, passes):
    if passes:
        seen["draft"].append(seconds / passes)
    observe_draft(self, seconds, passes)


if len(sys.argv) != 2:
    sys.exit(__doc__)
CostModel.observe_target, CostModel.observe_draft = target, draft
pair = specrt.load(sys.argv[1])
prompts = read_prompts([Path("bench/prompts/prompts.jsonl"), Path("bench/prompts/edits.jsonl")], pair, None)[::2]
run_bench(pair, prompts, [0, 2, 3, "auto"], repeats=1, drafters=["model"])
for key in sorted(seen, key=str):
    x = np.array(seen[key]) * 1e3
    if len(x) > 5:
        print(f"{key}: {len(x)} passes, ms: median {np.median(x):.1f} mean {x.mean():.1f} "
              "p10 %.1f p90 %.1f p99 %.1f" % tuple(np.percentile(x, [10, 90, 99])))
print("EMA at the end, ms:", {w: round(v * 1e3, 1) for w, v in sorted(pair.costs.target_s.items())},
      "draft", round(pair.costs.draft_s * 1e3, 2))
