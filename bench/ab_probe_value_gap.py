"""In-process A/B of when a valued probe may come (adaptive.AutoDraftLen.probe_due): "gap" (the code of the
ninth sitting), where every probe waits out a gap that doubles after each probe that does not restart
drafting (up to 1024 plain rounds), against "value": the doubling gap holds back only the budget rule (a
probe paid for by 1.5% of the plain rounds since the last); a probe whose expected saving over the rest of
the request covers its cost may come after `probe_every` (16) plain rounds whatever the gap. With the draft
window a probe costs at most a catch-up of W tokens, so the gap no longer has to bound it; what the gap did
was keep a request plain to its end after a failed probe in the one before (bench/RESULTS.md, tenth sitting).
Model and hybrid auto, target-only alongside (bench/ab.py); not frozen by default.
Usage: python bench/ab_probe_value_gap.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
from ab import main, setting
from specrt.runtime.adaptive import AutoDraftLen

gap = AutoDraftLen.probe_due


def value(self, behind, limit=1, remaining=0):
    if self._since_probe < self.probe_every:
        return False
    if self._since_probe >= self._gap and gap(self, behind, limit, 0):  # the budget rule, behind the gap
        return True
    cost = self.probe_cost(behind)
    return cost is None or self.probe_value(limit, remaining) >= cost


main({"none": (0, "model", setting(AutoDraftLen, "probe_due", gap)),
      "model_gap": ("auto", "model", setting(AutoDraftLen, "probe_due", gap)),
      "model_value": ("auto", "model", setting(AutoDraftLen, "probe_due", value)),
      "hybrid_gap": ("auto", "hybrid", setting(AutoDraftLen, "probe_due", gap)),
      "hybrid_value": ("auto", "hybrid", setting(AutoDraftLen, "probe_due", value))}, __doc__)
