"""Wall A/B in one process of a sampled request's draft step and top-p: the functions at git revision BEFORE
(`ModelProposer.steps` and `sampling._nucleus`, loaded from `git show`) against the working tree's, requests
alternating (order flipped each prompt), each with the same seed, an empty history and cold caches (nothing from
the other run: the suffix drafter would copy it). Prints the median and mean over requests of tok/s new / old,
and how many texts are the same (coupled: all of them must be).

    python bench/results/sampling_warp/ab.py PAIR BEFORE TEMPERATURE TOP_P METHOD REPEATS
"""
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import specrt
import specrt.decoding.proposers as newmod
import specrt.decoding.sampling as newsamp
from specrt.apps.bench import read_prompts
from specrt.config import SamplingConfig

ROOT = Path(__file__).resolve().parents[3]
pair_dir, before, temp, top_p, method, reps = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), \
    sys.argv[5], int(sys.argv[6])


def old(name: str):
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{before}:specrt/decoding/{name}.py"], check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"old_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"old_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"old_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod


STEPS = {"new": newmod.ModelProposer.steps, "old": old("proposers").ModelProposer.steps}
NUCLEUS = {"new": newsamp._nucleus, "old": old("sampling")._nucleus}
pair = specrt.load(pair_dir)
plist = read_prompts([ROOT / "bench/prompts" / f for f in ("prompts.jsonl", "more.jsonl", "edits.jsonl")], pair)
samp = SamplingConfig(temperature=temp, top_p=top_p, method=method)


def run(which, p, seed):
    newmod.ModelProposer.steps, newsamp._nucleus = STEPS[which], NUCLEUS[which]
    cfg = pair.config(max_new_tokens=128, draft_len="auto", drafter="hybrid", sampling=samp, seed=seed)
    pair.state.history.clear(), pair.draft_memory.keep(0), pair.prompt_cache.keep(0)
    t = time.perf_counter()
    r = pair.run(p.ids, cfg)
    return time.perf_counter() - t, r.stats["new_tokens"], list(r.tokens)


run("new", plist[0], 0), run("old", plist[0], 0)
ratios, same = [], 0
for rep in range(reps):
    for i, p in enumerate(plist):
        order = ("old", "new") if (i + rep) % 2 == 0 else ("new", "old")
        res = {w: run(w, p, 1000 * rep + i) for w in order}
        (wo, no, to), (wn, nn, tn) = res["old"], res["new"]
        ratios.append((nn / wn) / (no / wo))
        same += to == tn
print(f"T={temp} top_p={top_p} {method}: tok/s new / old, median {statistics.median(ratios):.3f} mean "
      f"{statistics.mean(ratios):.3f} over {len(ratios)} requests; same text {same} of {len(ratios)}")
