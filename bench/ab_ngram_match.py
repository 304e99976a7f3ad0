"""In-process A/B of the prompt-lookup match rule (drafters.NgramDrafter.match): before, the most recent
occurrence of the longest suffix of at most 3 tokens; now, the longest suffix up to 16 tokens and its
first occurrence (kinds up to "ngram8"). n-gram and hybrid auto under both, target-only alongside (bench/ab.py).
Usage: python bench/ab_ngram_match.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]"""
from ab import main
from ngram_match import recent3
from specrt.runtime.drafters import NgramDrafter

now = NgramDrafter.match


def use(fn):
    def setup():
        NgramDrafter.match = fn
    return setup


def before(self, seq, k):
    d, n = recent3(seq, k)
    return d.astype("int64").copy(), n


main({"none": (0, "model", use(now)), "ngram_before": ("auto", "ngram", use(before)), "ngram_now": ("auto", "ngram", use(now)),
      "hybrid_before": ("auto", "hybrid", use(before)), "hybrid_now": ("auto", "hybrid", use(now))}, __doc__)
