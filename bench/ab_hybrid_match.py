"""In-process A/B of hybrid's n-gram threshold (drafters.HybridDrafter.min_match: the shortest matched suffix
whose proposal hybrid may take over the model's): model and n-gram auto, hybrid auto at min_match 2 (the
default) and 8, target-only alongside (bench/ab.py; priced and wall ratios).
Usage: python bench/ab_hybrid_match.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen]"""
from ab import main
from specrt.runtime.drafters import HybridDrafter


def use(n):
    def setup():
        HybridDrafter.min_match = n
    return setup


main({"none": (0, "model", use(2)), "model": ("auto", "model", use(2)), "ngram": ("auto", "ngram", use(2)),
      "hybrid2": ("auto", "hybrid", use(2)), "hybrid8": ("auto", "hybrid", use(8))}, __doc__)
