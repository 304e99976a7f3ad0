"""In-process A/B of scoring the n-gram proposal a round did not verify (decode.py: in a plain round, or a
hybrid round the model drafted, the n-gram kind's estimate learns from what the target emitted): before
(commit 04f3ba2) and now, for the n-gram and hybrid drafters at auto; model auto and target-only alongside
(bench/ab.py; priced and wall ratios).
Usage: python bench/ab_shadow.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
import subprocess
import sys
import types
from pathlib import Path

from ab import main
from specrt.runtime import decode

src = subprocess.run(["git", "show", "04f3ba2:specrt/runtime/decode.py"], capture_output=True, text=True, check=True,
                     cwd=Path(__file__).parent).stdout
old = sys.modules["decode_04f3ba2"] = types.ModuleType("decode_04f3ba2")
exec(compile(src, "decode_04f3ba2.py", "exec"), old.__dict__)
now = decode.decode


def use(fn):
    def setup():
        decode.decode = fn
    return setup


main({"none": (0, "model", use(now)), "model": ("auto", "model", use(now)),
      "ngram_before": ("auto", "ngram", use(old.decode)), "ngram_now": ("auto", "ngram", use(now)),
      "hybrid_before": ("auto", "hybrid", use(old.decode)), "hybrid_now": ("auto", "hybrid", use(now))}, __doc__)
