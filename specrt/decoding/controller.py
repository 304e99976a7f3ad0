"""What `auto` learns and plans with (decoding/policy.py): the measured pass costs (`CostModel`), the draft
model's first-token acceptance by the target's confidence (`Calibration`), and one proposal kind's acceptance
estimate and probe schedule (`Controller`), under the policy's settings (`PolicyConfig`)."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's settings: numbers only. Each mechanism whose switched-off variant lost in bench/RESULTS.md
    ("The draft-length policy: what each mechanism gains") is simply the code; a variant to compare is
    `dataclasses.replace(PolicyConfig(), field=...)`, or an alternative part kept in bench/."""

    # acceptance per position a request starts from when nothing was learned yet
    prior: float = 0.7
    # EMA weight kept by the acceptance estimate at each observation (it counts as ~5.7 observations)
    decay: float = 0.85
    # plain rounds before the first probe; each probe that does not restart drafting doubles the wait
    probe_every: int = 16
    # the longest wait: a probe after that many plain rounds is due whatever it costs
    max_probe_every: int = 1024
    # a probe is due once the plain rounds since the last one are worth this fraction of its cost
    probe_budget: float = 0.015
    # every this many drafting rounds, draft one token more than the estimate says (0: never)
    widen_every: int = 8
    # the suffix proposer drafts a token from the history only where at least this share of the matched
    # earlier occurrences continue with it (where they disagree it stops; at the first token, the request's
    # own lookup proposes instead); 0: the most frequent continuation wherever it goes
    suffix_share: float = 0.5
    # fixed hybrid: a lookup proposal drafts when at least this long and continuing a match this long
    min_len: int = 2
    min_match: int = 2
    # hybrid with a windowed draft: after its first draft of a request a catch-up reads at most this
    # many of the tokens it missed (lookup rounds' copies; None: all, up to the window)
    skip: int | None = 8
    # a constrained request drafts what its grammar forces, free (decoding/constraint.py): in place of the
    # policy's proposer when it forces at least `forced_first` tokens, or when the proposer would draft none
    forced_first: int = 2
    # a tree round puts each branch family's best node in whatever it is expected to pay every this many
    # rounds, so a family judged useless is measured again (decoding/tree.py)
    tree_probe_every: int = 16
    # a tree's candidate runner-ups: the draft's next this many choices at each drafted position (2 lost to 1 on
    # the AVX-512 VNNI host, priced: its third choices cost a node for few tokens; a host with cheap wide passes
    # may differ)
    tree_alternatives: int = 1
    # a model round alone drafts while its tokens so far, by the draft's confidence in each, make one more worth
    # its cost (`DraftStop`), up to the pass's room, once auto chose to draft; False: the controller's k
    draft_stop: bool = True


@dataclass
class CostModel:
    """Running (EMA) costs in seconds: one draft pass, a target pass per verify width, and what each
    further token of a draft catch-up pass costs (`draft_read_s`)."""

    draft_s: float | None = None
    target_s: dict[int, float] = field(default_factory=dict)
    draft_read_s: float | None = None
    decay: float = 0.8

    def observe_draft(self, seconds: float, passes: int) -> None:
        if passes:
            per = seconds / passes
            self.draft_s = per if self.draft_s is None else self.decay * self.draft_s + (1 - self.decay) * per

    def observe_catchup(self, seconds: float, tokens: int) -> None:
        """A draft pass that read `tokens` (> 2) tokens at once: each beyond the first costs this much."""
        if tokens > 2 and self.draft_s is not None:
            per = max(seconds - self.draft_s, 0.0) / (tokens - 1)
            old = self.draft_read_s
            self.draft_read_s = per if old is None else self.decay * old + (1 - self.decay) * per

    def observe_target(self, width: int, seconds: float) -> None:
        old = self.target_s.get(width)
        self.target_s[width] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def target(self, width: int) -> float | None:
        """Measured cost at `width`, else interpolated/extrapolated linearly from measured widths; never
        above what a wider pass measured (a slow spike left in the one-token cost would otherwise make
        drafting look cheaper than plain decoding whatever the acceptance, and keep it drafting)."""
        wider = [s for w, s in self.target_s.items() if w > width]
        raw = self._target(width)
        return min([raw, *wider]) if raw is not None else None

    def _target(self, width: int) -> float | None:
        if width in self.target_s:
            return self.target_s[width]
        known = sorted(self.target_s)
        if not known:
            return None
        lo = max((w for w in known if w < width), default=None)
        hi = min((w for w in known if w > width), default=None)
        if lo is not None and hi is not None:
            t = (width - lo) / (hi - lo)
            return self.target_s[lo] * (1 - t) + self.target_s[hi] * t
        if len(known) >= 2:  # extrapolate from the two nearest widths, never below the nearest
            a, b = (known[-2], known[-1]) if hi is None else (known[0], known[1])
            slope = max((self.target_s[b] - self.target_s[a]) / (b - a), 0.0)
            edge = b if hi is None else a
            return max(self.target_s[edge] + slope * (width - edge), 0.0)
        # prior: a wider pass costs a bit more (a batch's passes are much wider than a one-token one)
        return self.target_s[known[0]] * max(1 + 0.1 * (width - known[0]), 0.1)


@dataclass
class Calibration:
    """How often a draft token is accepted, by how sure someone was there (a top probability, in bins at
    `edges`), learned from the rounds the draft model drafts. Two are kept: by the target's confidence at the
    first position, which in a plain round predicts for free whether a draft would have been accepted (measured
    on the int4 pair at k = 2: 0.31 below 0.5, 0.91 above 0.99); and by the draft's own confidence at each
    drafted token (`DRAFT_EDGES`), which tells a round while it drafts how likely its tokens are (`DraftStop`).
    Older rounds fade (`keep`: an observation 140 back counts half); a bin predicts once it holds `min_seen`."""

    edges: tuple[float, ...] = (0.5, 0.8, 0.95, 0.99)
    hits: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    keep: float = 0.995
    min_seen: float = 4.0

    def __post_init__(self):
        self.hits = self.hits or [0.0] * (len(self.edges) + 1)
        self.seen = self.seen or [0.0] * (len(self.edges) + 1)

    def observe(self, top: float, accepted: bool) -> None:
        b = bisect.bisect_right(self.edges, top)
        self.hits = [h * self.keep for h in self.hits]
        self.seen = [n * self.keep for n in self.seen]
        self.hits[b] += float(accepted)
        self.seen[b] += 1.0

    @property
    def ready(self) -> bool:
        """Whether some bin predicts yet (until then a plain round need not compute the top probability)."""
        return max(self.seen) >= self.min_seen

    def predict(self, top: float) -> float | None:
        b = bisect.bisect_right(self.edges, top)
        return self.hits[b] / self.seen[b] if self.seen[b] >= self.min_seen else None


# bins of the draft's top probability for its acceptance (on the int4 pair, greedy, 27 prompts: 0.37 of its
# tokens accepted below 0.43, 0.56 at 0.43-0.61, 0.73 at 0.61-0.80, 0.91 at 0.80-0.92, 0.98 above)
DRAFT_EDGES = (0.3, 0.45, 0.6, 0.75, 0.85, 0.92, 0.97, 0.99)


class DraftStop:
    """Whether a model round drafts one more token, asked after each (proposers.Stop): the tokens so far are
    accepted together with chance R (the product of each one's acceptance by the draft's confidence in it,
    `calibration`; its top probability itself until a bin has seen enough), so the round as it stands is
    expected to emit E = 1 + the sum of those chances, for a draft step per token and a pass one wider. It goes
    on while some number m of further tokens (each accepted with the controller's chance at its position)
    is expected to add more tokens per second than the round has without them: the marginal rule a draft
    length is chosen by (`Controller.best`), with what the draft said of this round's tokens in place of the
    average. `widen`: a round the controller widened drafts one token past where the rule stops, so the
    estimate past it is measured again; `also`: the request's own `confidence_stop`."""

    def __init__(self, controller: "Controller", calibration: Calibration, cap: int, widen: bool = False,
                 also: float = 0.0):
        self.ctl, self.cal, self.cap, self.widen, self.also = controller, calibration, cap, widen, also
        self.k, self.reach, self.expected = 0, 1.0, 1.0

    def __call__(self, top: float) -> bool:
        self.k += 1
        c = self.cal.predict(top)
        self.reach *= top if c is None else c
        self.expected += self.reach
        if top < self.also or self.k >= self.cap:
            return True
        if not self._goes_on():
            if not self.widen:
                return True
            self.widen = False
        return False

    def _goes_on(self) -> bool:
        ctl, k = self.ctl, self.k
        cost = ctl.cost(k)
        if cost <= 0:
            return True
        gain, run = 0.0, self.reach
        for m in range(1, self.cap - k + 1):
            run *= ctl.accept[k + m - 1] if k + m - 1 < len(ctl.accept) else 0.0
            gain += run
            if (self.expected + gain) * cost > self.expected * ctl.cost(k + m):
                return True
        return False


@dataclass(frozen=True)
class Batch:
    """A round of a batch, as one row plans it. A batched pass computes `rows` x its widest row's tokens (rows
    are right-padded; `rows`: from the first active row to the last, idle ones between them included), so a
    row's draft costs the pass only where it makes the pass wider than `widest`, the rows already planned this
    round; `rate`: the batch's tokens per second lately."""

    rows: int
    widest: int
    rate: float


class Controller:
    """The acceptance estimate and probe schedule of one proposal kind within a request."""

    def __init__(self, max_k: int, costs: CostModel, config: PolicyConfig = PolicyConfig(), free_draft: bool = False,
                 accept: Sequence[float] = ()):
        self.max_k, self.costs, self.c, self.free_draft = max_k, costs, config, free_draft
        self.accept = list(accept)[:max_k] + [config.prior] * (max_k - len(accept[:max_k]))
        self._gap, self._since_probe = config.probe_every, 0  # plain rounds before the next probe; since the last
        self._since_widen = 0
        self.rounds_skipped = 0
        self.probing = self.widened = False  # whether the last `choose` was a probe; drafted one more to measure it

    def expected_tokens(self, k: int) -> float:
        e, run = 1.0, 1.0
        for a in self.accept[:k]:
            run *= a
            e += run
        return e

    def cost(self, k: int) -> float:
        """Predicted seconds of a round with k drafts (0 when nothing is measured yet)."""
        draft_s = 0.0 if self.free_draft else (self.costs.draft_s or 0.0)
        return (self.costs.target(k + 1) or 0.0) + k * draft_s

    def best(self, limit: int, extra_s: float = 0.0, batch: Batch | None = None) -> tuple[int, float | None]:
        """(the k <= limit with the most expected tokens per second, its value; None while nothing is
        measured). The value: alone, that rate; in a `batch`, E(k) - rate * (what the row's k + 1 tokens add
        to the pass + its draft steps). `extra_s`: what a drafting round costs besides its passes (a later
        catch-up)."""
        limit = min(limit, self.max_k)
        c1 = self.costs.target(1 if batch is None else batch.rows * batch.widest)
        draft_s = 0.0 if self.free_draft else self.costs.draft_s
        if not c1 or draft_s is None:  # nothing measured yet (or a pass below the timer's resolution)
            return min(max(limit, 0), 2), None  # a short draft measures both costs
        if batch is not None:
            def value(k: int) -> float:
                wider = self.costs.target(batch.rows * max(k + 1, batch.widest)) - c1
                return self.expected_tokens(k) - batch.rate * (wider + k * draft_s + (extra_s if k else 0.0))
        else:
            def value(k: int) -> float:
                return self.expected_tokens(k) / (self.cost(k) + extra_s) if k else 1.0 / c1
        best_k, best_value = 0, value(0)
        for k in range(1, limit + 1):
            v = value(k)
            if v > best_value:
                best_k, best_value = k, v
        return best_k, best_value

    def catchup_cost(self, behind: int) -> float:
        """Seconds the draft model's next pass spends reading the `behind` tokens it has not seen, beyond
        the one a draft step reads anyway (before `draft_read_s` is measured: about one more pass)."""
        if self.free_draft:
            return 0.0
        if self.costs.draft_read_s is None:
            return self.costs.draft_s or 0.0
        return max(behind - 1, 0) * self.costs.draft_read_s

    def probe_cost(self, behind: int) -> float | None:
        """Extra seconds of a one-token probe now: a draft step, the catch-up, a verify one token wider."""
        c1 = self.costs.target(1)
        draft_s = 0.0 if self.free_draft else self.costs.draft_s
        if not c1 or draft_s is None:
            return None
        return draft_s + self.catchup_cost(behind) + max((self.costs.target(2) or c1) - c1, 0.0)

    def probe_due(self, behind: int) -> bool:
        """After a plain round: not before the wait; then once the plain rounds' `probe_budget` covers the
        probe's cost now, or after `max_probe_every` rounds whatever it costs."""
        if self._since_probe < self._gap:
            return False
        if self._since_probe >= self.c.max_probe_every:
            return True
        cost, c1 = self.probe_cost(behind), self.costs.target(1)
        return cost is None or self._since_probe * self.c.probe_budget * c1 >= cost

    def wait(self) -> None:
        """A round this kind was not asked (hybrid: a lookup round): one more round since its last probe."""
        self._since_probe += 1

    def choose(self, limit: int, behind: int = 0, remaining: int = 0, batch: Batch | None = None) -> int:
        """Draft length for the next round, at most `limit`; `behind`: tokens the draft would read first;
        `remaining`: tokens the request may still generate; `batch`: the round is a batch's (`best`)."""
        limit = min(limit, self.max_k)
        self.probing = self.widened = False
        if limit <= 0:
            return 0
        # in a batch a draft after rounds without one pays its catch-up pass (alone: the gate below)
        catchup = self.catchup_cost(behind) if batch is not None and behind > 2 else 0.0
        best_k, rate = self.best(limit, catchup, batch)
        if rate is None:
            return best_k
        if (batch is None and best_k and behind > 2 and remaining > 0
                and not self.free_draft):
            # drafting first needs a catch-up pass: worth it only if drafting saves that much
            if remaining * (self.costs.target(1) - 1.0 / rate) < self.catchup_cost(behind):
                best_k = 0
        if best_k == 0:
            self._since_probe += 1
            if self.probe_due(behind):
                self._gap = min(2 * self._since_probe, self.c.max_probe_every)  # twice the wait it just had
                self._since_probe = 0
                self.probing = True
                return 1
            self.rounds_skipped += 1
        else:
            self._gap, self._since_probe = self.c.probe_every, 0
            self._since_widen += 1
            if self.c.widen_every and best_k < limit and self._since_widen >= self.c.widen_every:
                self._since_widen = 0
                self.widened = True
                return best_k + 1
        return best_k

    def follow(self, predicted: float) -> None:
        """A plain round's prediction of the first position's acceptance moves it as an observation would."""
        self.accept[0] += (predicted - self.accept[0]) * (1.0 - self.c.decay)

    def observe(self, proposed: int, accepted: int) -> None:
        """Positions 1..accepted were accepted, accepted+1 (if proposed) was not."""
        for i in range(min(proposed, self.max_k, accepted + 1)):
            self.accept[i] += ((1.0 if i < accepted else 0.0) - self.accept[i]) * (1.0 - self.c.decay)
