"""In-process A/B: hybrid's model rounds learned under their own kind ("hybrid-model", since the third
sitting: then the model drafted only where no n-gram proposal was taken, the hard places) or under the
model drafter's ("model"): with every proposal judged, hybrid's model now drafts most rounds of chat
and code, where it trails the model drafter alone (bench/RESULTS.md, tenth and eleventh sittings).
Usage: python bench/ab_hybrid_kind.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
from ab import main, setting
from specrt.runtime.drafters import HybridDrafter

main({"none": (0, "model", setting(HybridDrafter, "model_kind", "hybrid-model")),
      "model_auto": ("auto", "model", setting(HybridDrafter, "model_kind", "hybrid-model")),
      "ngram_auto": ("auto", "ngram", setting(HybridDrafter, "model_kind", "hybrid-model")),
      "hybrid_own": ("auto", "hybrid", setting(HybridDrafter, "model_kind", "hybrid-model")),
      "hybrid_shared": ("auto", "hybrid", setting(HybridDrafter, "model_kind", "model"))}, __doc__)
