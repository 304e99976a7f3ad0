"""In-process A/B of auto following the target's confidence through plain rounds (adaptive.Calibration,
AutoDraftLen.follow): "before", where a plain round leaves the draft model's acceptance estimate where the
last drafting round or probe put it, against "follow" (kept), where each plain round moves the first
position's estimate to what the draft's acceptance at the target's top probability there has been.
Model and hybrid auto, target-only alongside; each variant has its own costs, acceptance, probes and
calibration (bench/ab.py). Not frozen by default: stuck-plain requests show up with live costs.
Usage: python bench/ab_calibration.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
from ab import main, setting
from specrt.runtime.adaptive import AutoDraftLen

follow = AutoDraftLen.follow


def still(self, predicted):
    pass


main({"none": (0, "model", setting(AutoDraftLen, "follow", follow)),
      "model_before": ("auto", "model", setting(AutoDraftLen, "follow", still)),
      "model_follow": ("auto", "model", setting(AutoDraftLen, "follow", follow)),
      "hybrid_before": ("auto", "hybrid", setting(AutoDraftLen, "follow", still)),
      "hybrid_follow": ("auto", "hybrid", setting(AutoDraftLen, "follow", follow))}, __doc__)
