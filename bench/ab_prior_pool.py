"""In-process A/B of what a request hands the next one (Pair.prior_weight): the acceptance estimate it
ended with ("last", weight 1, before) against a running mean over requests that moves a quarter of the
way to it ("pool", weight 0.25, kept), for the model and hybrid drafters at auto; target-only alongside
(bench/ab.py). Run not frozen: the point is what auto does with the costs it learns live.
Usage: python bench/ab_prior_pool.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
from ab import main, setting
from specrt.runtime.pair import Pair

main({"none": (0, "model", setting(Pair, "prior_weight", 1.0)),
      "model_last": ("auto", "model", setting(Pair, "prior_weight", 1.0)),
      "model_pool": ("auto", "model", setting(Pair, "prior_weight", 0.25)),
      "hybrid_last": ("auto", "hybrid", setting(Pair, "prior_weight", 1.0)),
      "hybrid_pool": ("auto", "hybrid", setting(Pair, "prior_weight", 0.25))}, __doc__)
