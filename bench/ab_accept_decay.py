"""In-process A/B of auto's acceptance memory (AutoDraftLen.decay, the EMA weight of the estimate per
position): with 0.85 two rejections take a carried 0.99 to 0.71 and can leave a code request plainly
decoded to its end (bench/results/auto_state_diag.log). Model drafter, target-only alongside (bench/ab.py).
Usage: python bench/ab_accept_decay.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]"""
from ab import main
from specrt.runtime.adaptive import AutoDraftLen

post = AutoDraftLen.__post_init__


def decay(value):
    def init(self):
        post(self)
        self.decay = value

    def setup():
        AutoDraftLen.__post_init__ = init
    return setup


main({"none": (0, "model", decay(0.85)), "decay_0.85": ("auto", "model", decay(0.85)),
      "decay_0.93": ("auto", "model", decay(0.93))}, __doc__)
