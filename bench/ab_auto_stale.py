"""In-process A/B of auto's acceptance estimate and probes (adaptive.AutoDraftLen): before (commit 5290011),
an EMA at weight 0.15 and probes due when 1.5% of the plain rounds since the last one cover their cost; now,
the estimate ages in plain rounds (a probe after a long pause counts up to half) and a probe is also due when
what it may save over the rest of the request covers its cost. Each variant keeps its own costs, acceptance
and probe schedule (bench/ab.py). In bench/results/ab_auto_stale.log, "model_now" and "hybrid_now" also ran
the cost update of bench/ab_cost_speed.py (since reverted); "model_now_oldcost" is the code as committed.
Usage: python bench/ab_auto_stale.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]"""
from ab import at_commit, main, setting
from specrt.runtime import decode
from specrt.runtime.adaptive import AutoDraftLen

old = at_commit("5290011", "adaptive")["adaptive"]


class OldAuto(old.AutoDraftLen):
    def choose(self, limit, behind=0, remaining=0, share=1.0):
        return super().choose(limit, behind)


def use(auto):
    return setting(decode, "AutoDraftLen", auto)


main({"none": (0, "model", use(AutoDraftLen)),
      "model_before": ("auto", "model", use(OldAuto)), "model_now": ("auto", "model", use(AutoDraftLen)),
      "hybrid_before": ("auto", "hybrid", use(OldAuto)), "hybrid_now": ("auto", "hybrid", use(AutoDraftLen))},
     __doc__)
