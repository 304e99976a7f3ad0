"""In-process A/B: the draft model's catch-up after its first draft of a request reads only the last `skip`
tokens it missed (a gap in its context) instead of all of them, up to the window. hybrid's model falls
behind over every n-gram round; on the edits its catch-ups read up to 32 tokens (~62 ms, two target
steps) for a stretch of a few model rounds (bench/hybrid_trace.py). hybrid_skipN: HybridDrafter.skip = N
(0: none; 8 is the default since the eleventh sitting); model_skipN: the model drafter alone skipping.
Usage: python bench/ab_skip.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
from ab import main
from specrt.runtime.drafters import HybridDrafter, ModelDrafter


def skipping(hybrid: int | None, model: int | None):
    def setup():
        HybridDrafter.skip, ModelDrafter.skip = hybrid, model
    return setup


main({"none": (0, "model", skipping(8, None)),
      **{f"hybrid_skip{s}": ("auto", "hybrid", skipping(s or None, None)) for s in (0, 4, 8, 16)},
      **{f"model_skip{s}": ("auto", "model", skipping(8, s or None)) for s in (0, 8)},
      "ngram_auto": ("auto", "ngram", skipping(8, None))}, __doc__)
