"""In-process A/B of two changes to how auto judges n-gram proposals (decode.py):
- "shadow" (commit ea1cf4c): the n-gram proposal is scored in full against what the target emitted, also in a
  plain round or a hybrid round the model drafted, and past the k it verified (free observations);
- "catch-up" (after it): in hybrid, the model's proposal is charged the catch-up pass it needs first when the
  draft model is behind (the whole prompt at the start of a request).
Variants: n-gram and hybrid auto before both (commit 04f3ba2), hybrid with the first only (ea1cf4c), both
now (in bench/results/ab_shadow.log: commit 776c93f); target-only alongside (bench/ab.py; priced and wall
ratios). bench/results/ab_shadow_v1.log is an
earlier run of a first version of "shadow" that scored only proposals a round did not verify at all.
Usage: python bench/ab_shadow.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
import subprocess
import sys
import types
from pathlib import Path

from ab import main
from specrt.runtime import decode


def at(commit):
    src = subprocess.run(["git", "show", f"{commit}:specrt/runtime/decode.py"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent).stdout
    mod = sys.modules[f"decode_{commit}"] = types.ModuleType(f"decode_{commit}")
    exec(compile(src, f"decode_{commit}.py", "exec"), mod.__dict__)
    return mod.decode


before, shadow, now = at("04f3ba2"), at("ea1cf4c"), decode.decode


def use(fn):
    def setup():
        decode.decode = fn
    return setup


main({"none": (0, "model", use(now)),
      "ngram_before": ("auto", "ngram", use(before)), "ngram_now": ("auto", "ngram", use(now)),
      "hybrid_before": ("auto", "hybrid", use(before)), "hybrid_shadow": ("auto", "hybrid", use(shadow)),
      "hybrid_now": ("auto", "hybrid", use(now))}, __doc__)
