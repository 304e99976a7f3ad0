"""In-process A/B of the draft model's catch-up window (GenerationConfig.draft_window): a draft more
than W tokens behind (the prompt at the start of a request; what n-gram or plain rounds emitted) starts
over from the last W tokens instead of reading them all. Variants: the model and hybrid drafters at
auto with no window and with W = 16, 32 and 64; the n-gram drafter alongside (bench/ab.py; priced and wall
ratios, deterministic with --frozen).
Usage: python bench/ab_window.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--frozen] [--table=FILE]"""
from ab import main


def nothing():
    pass


main({"none": (0, "model", nothing), "ngram_auto": ("auto", "ngram", nothing),
      **{f"{d}_w{w}": ("auto", d, nothing, {"draft_window": w}) for d in ("model", "hybrid") for w in (0, 16, 32, 64)}},
     __doc__)
