"""In-process A/B of how auto prices a probe: the old way (a draft step for the catch-up, whatever the
draft skipped) vs the new one (runtime/adaptive.py probe_cost: the measured read cost of every token
the draft is behind), for the model and the hybrid drafter, target-only alongside (bench/ab.py).
"nowait": hybrid's n-gram rounds not counted toward the model's next probe (AutoDraftLen.wait).
Usage: python bench/ab_probe_catchup.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]"""
from ab import main
from specrt.runtime.adaptive import AutoDraftLen

new, wait = AutoDraftLen.probe_cost, AutoDraftLen.wait


def old(self, behind):  # the catch-up priced as one draft step, however far behind the draft is
    c1, draft_s = self.costs.target(1), 0.0 if self.free_draft else self.costs.draft_s
    if not c1 or draft_s is None:
        return None
    return draft_s + (0.0 if self.free_draft else draft_s) + max((self.costs.target(2) or c1) - c1, 0.0)


def use(cost, waits):
    def setup():
        AutoDraftLen.probe_cost = cost
        AutoDraftLen.wait = wait if waits else (lambda self: None)
    return setup


main({"none": (0, "model", use(new, True)), "model_old": ("auto", "model", use(old, False)),
      "model_new": ("auto", "model", use(new, True)), "hybrid_old": ("auto", "hybrid", use(old, False)),
      "hybrid_new_nowait": ("auto", "hybrid", use(new, False)), "hybrid_new": ("auto", "hybrid", use(new, True))},
     __doc__)
