"""In-process A/B of hybrid's switching cost (decode.py: leaving a caught-up draft model costs it a catch-up
pass later): hybrid auto with and without it, model auto, target-only alongside (bench/ab.py).
Usage: python bench/ab_hybrid_switch.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]"""
from ab import main
from specrt.runtime.adaptive import AutoDraftLen

best = AutoDraftLen.best


def no_extra(self, limit, extra_s=0.0):
    return best(self, limit, 0.0)


def use(fn):
    def setup():
        AutoDraftLen.best = fn
    return setup


main({"none": (0, "model", use(best)), "model_auto": ("auto", "model", use(best)),
      "hybrid_old": ("auto", "hybrid", use(no_extra)), "hybrid_new": ("auto", "hybrid", use(best))}, __doc__)
