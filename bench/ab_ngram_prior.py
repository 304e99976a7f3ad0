"""In-process A/B: hybrid's n-gram kinds start every request from the default prior instead of what
earlier requests learned (the running mean over requests). On code, 1-2 token matches displaced a
caught-up model draft (gen-palindrome, bench/RESULTS.md eleventh sitting); their carried estimates
come mostly from the edits.
Usage: python bench/ab_ngram_prior.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
import specrt.runtime.decode as decode_mod
from ab import main

carried = decode_mod.decode  # Pair.run imports it from the module at each request


def fresh_ngram(*a, **kw):  # decode(target, drafter, prompt, cfg, vocab, eos, on_tokens, costs, max_k, prior, ...)
    a = list(a)
    a[9] = {k: v for k, v in a[9].items() if not k.startswith("ngram")}
    return carried(*a, **kw)


def using(decode):
    def setup():
        decode_mod.decode = decode
    return setup


main({"none": (0, "model", using(carried)),
      "model_auto": ("auto", "model", using(carried)),
      "hybrid_carried": ("auto", "hybrid", using(carried)),
      "hybrid_fresh": ("auto", "hybrid", using(fresh_ngram))}, __doc__)
