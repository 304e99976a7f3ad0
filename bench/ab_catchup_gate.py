"""In-process A/B of auto's catch-up gate (adaptive.AutoDraftLen.choose): a draft model that has to read what
it is behind by first (the prompt, at the start of a request) drafts only if drafting saves that much over
the tokens left (for hybrid's model: over the part of them n-gram proposals have not been serving). Before
(commit 776c93f: hybrid already charged the model draft its catch-up when comparing it with an n-gram
proposal) and now, for the model and hybrid drafters at auto; target-only alongside (bench/ab.py; priced
and wall ratios). AutoDraftLen comes from the same commit as decode.py. bench/results/ab_catchup_gate.log
ran the gate's first version (hybrid's share: rounds without a usable 2-token match, 86c14b6);
ab_hybrid_judged_stretch.log a version that also offered hybrid every n-gram proposal and amortized the
catch-up over the mean run of rounds without one (dropped); ab_hybrid_judged_served.log the code now.
Usage: python bench/ab_catchup_gate.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
from ab import at_commit, main, setting
from specrt.runtime import decode

before, now = at_commit("776c93f", "adaptive", "decode")["decode"].decode, decode.decode


def use(fn):
    return setting(decode, "decode", fn)


main({"none": (0, "model", use(now)),
      "model_before": ("auto", "model", use(before)), "model_now": ("auto", "model", use(now)),
      "hybrid_before": ("auto", "hybrid", use(before)), "hybrid_now": ("auto", "hybrid", use(now))}, __doc__)
