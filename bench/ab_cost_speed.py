"""In-process A/B of the cost model's update (adaptive.CostModel.observe_target): an EMA per verify width
(kept), against a variant tried and reverted in the seventh sitting: every cost follows the machine's speed
(a pass that took q times its prediction moves all costs by q^0.2) and each width's ratio to the others is
learned slowly (q^0.05 more for the observed width). Model and hybrid auto under both, target-only alongside;
each variant keeps its own cost model (bench/ab.py). bench/results/ab_cost_speed.log: "before" = the EMA,
"now" = the speed variant, run with commit 5290011's controller.
Usage: python bench/ab_cost_speed.py PAIR_DIR REPEATS [VARIANT,...] [--json=OUT] [--limit=N] [--prompts=FILE,FILE]"""
from ab import main
from specrt.runtime.adaptive import CostModel

ema = CostModel.observe_target


def speed(self, width, seconds):
    old = self.target_s.get(width)
    if old is None or old <= 0 or seconds <= 0:
        self.target_s[width] = seconds
        return
    q = seconds / old
    f = q ** (1 - self.decay)
    self.target_s = {w: s * f for w, s in self.target_s.items()}
    self.target_s[width] *= q ** 0.05
    if self.draft_s is not None:
        self.draft_s *= f
    if self.draft_read_s is not None:
        self.draft_read_s *= f


def use(fn):
    def setup():
        CostModel.observe_target = fn
    return setup


main({"none": (0, "model", use(ema)), "model_before": ("auto", "model", use(ema)), "model_now": ("auto", "model", use(speed)),
      "hybrid_before": ("auto", "hybrid", use(ema)), "hybrid_now": ("auto", "hybrid", use(speed))}, __doc__)
