"""In-process A/B of how the cost model learns pass times (adaptive.CostModel): the EMA at 0.8 of the code
("ema", kept) against the median of the last 32 observations of each cost, seeded with its value so far
("med", tried and dropped in the ninth sitting), for the model and hybrid drafters at auto; target-only
alongside (bench/ab.py). Not frozen: what differs is how the variants learn the costs they plan with.
Usage: python bench/ab_cost_median.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]
[--table=FILE]"""
import statistics
from collections import deque

from ab import main
from specrt.runtime.adaptive import CostModel

EMA = {n: getattr(CostModel, n) for n in ("observe_draft", "observe_catchup", "observe_target")}


def _median(self, key, start, value):
    seen = self.__dict__.setdefault("_seen", {})
    xs = seen.setdefault(key, deque([] if start is None else [start], maxlen=32))
    xs.append(value)
    return statistics.median(xs)


def med_draft(self, seconds, passes):
    if passes:
        self.draft_s = _median(self, "draft", self.draft_s, seconds / passes)


def med_catchup(self, seconds, tokens):
    if tokens > 2 and self.draft_s is not None:
        self.draft_read_s = _median(self, "read", self.draft_read_s, max(seconds - self.draft_s, 0.0) / (tokens - 1))


def med_target(self, width, seconds):
    self.target_s[width] = _median(self, width, self.target_s.get(width), seconds)


MEDIAN = {"observe_draft": med_draft, "observe_catchup": med_catchup, "observe_target": med_target}


def use(methods):
    def setup():
        for name, fn in methods.items():
            setattr(CostModel, name, fn)
    return setup


main({"none": (0, "model", use(EMA)),
      "model_ema": ("auto", "model", use(EMA)), "model_med": ("auto", "model", use(MEDIAN)),
      "hybrid_ema": ("auto", "hybrid", use(EMA)), "hybrid_med": ("auto", "hybrid", use(MEDIAN))}, __doc__)
