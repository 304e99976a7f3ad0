"""In-process A/B: the draft model's catch-up in the middle of a request reads only the last `skip`
tokens it missed (ModelDrafter.skip; a gap in its context) instead of all of them, up to the window.
hybrid's model falls behind over every n-gram round; on the edits its catch-ups read up to 32 tokens
(~62 ms, two target steps) for a stretch of a few model rounds (bench/hybrid_trace.py).
Usage: python bench/ab_skip.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
from ab import main, setting
from specrt.runtime.drafters import ModelDrafter

main({"none": (0, "model", setting(ModelDrafter, "skip", None)),
      **{f"hybrid_skip{s}": ("auto", "hybrid", setting(ModelDrafter, "skip", s or None)) for s in (0, 4, 8, 16)},
      **{f"model_skip{s}": ("auto", "model", setting(ModelDrafter, "skip", s or None)) for s in (0, 8)},
      "ngram_auto": ("auto", "ngram", setting(ModelDrafter, "skip", None))}, __doc__)
