"""In-process A/B of two changes to how auto judges n-gram proposals (decode.py):
- "shadow" (commit ea1cf4c): the n-gram proposal is scored in full against what the target emitted, also in a
  plain round or a hybrid round the model drafted, and past the k it verified (free observations);
- "catch-up" (after it): in hybrid, the model's proposal is charged the catch-up pass it needs first when the
  draft model is behind (the whole prompt at the start of a request).
Variants: n-gram and hybrid auto before both (commit 04f3ba2), hybrid with the first only (ea1cf4c), both
now (in bench/results/ab_shadow.log: commit 776c93f); target-only alongside (bench/ab.py; priced and wall
ratios). bench/results/ab_shadow_v1.log is an
earlier run of a first version of "shadow" that scored only proposals a round did not verify at all.
Usage: python bench/ab_shadow.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
from ab import at_commit, main, setting
from specrt.runtime import decode

before, shadow, now = at_commit("04f3ba2", "decode")["decode"].decode, at_commit("ea1cf4c", "decode")["decode"].decode, decode.decode


def use(fn):
    return setting(decode, "decode", fn)


main({"none": (0, "model", use(now)),
      "ngram_before": ("auto", "ngram", use(before)), "ngram_now": ("auto", "ngram", use(now)),
      "hybrid_before": ("auto", "hybrid", use(before)), "hybrid_shadow": ("auto", "hybrid", use(shadow)),
      "hybrid_now": ("auto", "hybrid", use(now))}, __doc__)
