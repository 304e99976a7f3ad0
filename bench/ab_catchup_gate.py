"""In-process A/B of auto's catch-up gate (adaptive.AutoDraftLen.choose): a draft model that has to read what
it is behind by first (the prompt, at the start of a request) drafts only if drafting saves that much over
the tokens left (for hybrid's model: over the part of them n-gram proposals have not been serving). Before
(commit 776c93f: hybrid already charged the model draft its catch-up when comparing it with an n-gram
proposal) and now, for the model and hybrid drafters at auto; target-only alongside (bench/ab.py; priced
and wall ratios). AutoDraftLen comes from the same commit as decode.py. bench/results/ab_catchup_gate.log
ran the gate's first version (hybrid's share: rounds without a usable 2-token match, 86c14b6);
ab_hybrid_judged_stretch.log a version that also offered hybrid every n-gram proposal and amortized the
catch-up over the mean run of rounds without one (dropped); ab_hybrid_judged_served.log the code now.
Usage: python bench/ab_catchup_gate.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
import subprocess
import sys
import types
from pathlib import Path

from ab import main
from specrt.runtime import decode


def at(commit):
    mods = {}
    for name in ("adaptive", "decode"):
        src = subprocess.run(["git", "show", f"{commit}:specrt/runtime/{name}.py"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parent).stdout
        mod = sys.modules[f"{name}_{commit}"] = types.ModuleType(f"{name}_{commit}")
        if name == "decode":  # the old loop with the old controller
            src = src.replace("from specrt.runtime.adaptive import", f"from {name.replace('decode', 'adaptive')}_{commit} import")
        exec(compile(src, f"{name}_{commit}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["decode"].decode


before, now = at("776c93f"), decode.decode


def use(fn):
    def setup():
        decode.decode = fn
    return setup


main({"none": (0, "model", use(now)),
      "model_before": ("auto", "model", use(before)), "model_now": ("auto", "model", use(now)),
      "hybrid_before": ("auto", "hybrid", use(before)), "hybrid_now": ("auto", "hybrid", use(now))}, __doc__)
