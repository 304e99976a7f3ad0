"""In-process A/B: n-gram proposal kinds split by where the matched occurrence lies, in the prompt
("ngram3p") or in the output so far ("ngram3o"). In an edit the answer copies the prompt's code; on
code and chat a match in the prompt is mostly the instructions' words, and 1-2 token matches there
displaced model drafts in hybrid (gen-palindrome, bench/RESULTS.md eleventh sitting). Each kind keeps
its own auto controller and learned acceptance. Patches NgramDrafter in this process only.
Usage: python bench/ab_ngram_source.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N]
[--prompts=FILE,FILE] [--frozen] [--table=FILE]"""
import numpy as np

from ab import main
from specrt.runtime.drafters import NgramDrafter

plain_start, plain_pick = NgramDrafter.start, NgramDrafter.pick


def first_match_end(seq, max_ngram):
    """Where the occurrence NgramDrafter.match proposes from ends (its logic, returning the position)."""
    arr = np.asarray(seq, np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    n = 1
    while len(ends) and n < max_ngram:
        longer = ends[ends >= n]
        longer = longer[arr[longer - n] == arr[-1 - n]]
        if not len(longer):
            break
        ends, n = longer, n + 1
    return int(ends[0]) if len(ends) else -1


def start(self, prompt):
    self.prompt_len = len(prompt)
    plain_start(self, prompt)


def pick(self, seq, k, judged=False):
    plain_pick(self, seq, k, judged)
    if self.matched:
        self.kind += "p" if first_match_end(seq, self.max_ngram) < self.prompt_len else "o"
    return self


def by_source(on: bool):
    def setup():
        NgramDrafter.start, NgramDrafter.pick = (start, pick) if on else (plain_start, plain_pick)
    return setup


main({"none": (0, "model", by_source(False)),
      "ngram_auto": ("auto", "ngram", by_source(False)),
      "ngram_source": ("auto", "ngram", by_source(True)),
      "hybrid_auto": ("auto", "hybrid", by_source(False)),
      "hybrid_source": ("auto", "hybrid", by_source(True))}, __doc__)
