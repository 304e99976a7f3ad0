"""In-process A/B of draft_len "auto" against fixed draft lengths, for each drafter: the
issue-4 target "auto within 5% of the best fixed length on every prompt class" (and hybrid
at least as fast as the better of its two parts), priced and deterministic with --frozen
(bench/ab.py). Fixed lengths do not plan, so the table only prices them.
Usage: python bench/ab_fixed.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
from ab import main


def nothing():
    pass


main({"none": (0, "model", nothing),
      **{f"model{k}": (k, "model", nothing) for k in (2, 3, 4)}, "model_auto": ("auto", "model", nothing),
      **{f"ngram{k}": (k, "ngram", nothing) for k in (3, 6)}, "ngram_auto": ("auto", "ngram", nothing),
      "hybrid3": (3, "hybrid", nothing), "hybrid_auto": ("auto", "hybrid", nothing)}, __doc__)
