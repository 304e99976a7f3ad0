"""`draft_len="auto"`: choose each round's draft length from measured acceptance and pass costs.

With per-position acceptance a_i (the chance draft token i is accepted given 1..i-1 were), a
round with k drafts emits E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens and costs
k * c_draft + c_target(k+1) (Leviathan et al. 2023, with measured rather than modelled costs).
The controller picks the k that maximises E(k) / cost(k); k = 0 is plain decoding. When k = 0
wins, it still probes with one draft token now and then, so it can resume drafting once the numbers
say it pays. A probe's cost is mostly the draft model's catch-up: it reads every token it skipped in
one pass, up to its window (measured here: ~2.3 ms a token for the int4 0.5B draft, ~7% of a target
step, so a probe after 60 plain rounds costs ~4% of them without a window). So a probe waits until the plain rounds since the last one
are worth `probe_budget` of the probe's cost *now* (draft step + catch-up over the tokens the draft is
behind + a wider verify): within a long request that seldom happens, at the start of the next
request (behind = its prompt) it does, which is where probes then land; a probe is also due when what it
is expected to save over the rest of the request covers its cost (`probe_value`). The estimate ages in
plain rounds (`weight`), so the first observation after a long pause counts up to half. Every probe that does not
restart drafting also doubles the wait before the next (`probe_every` rounds up to
`max_probe_every`, after which a probe is due whatever it costs), so a draft that never pays costs
less and less. Likewise, positions past the chosen k are never observed, so a pessimistic estimate
there would stick: every `widen_every` rounds the controller drafts one token more than it would,
to measure it again. A plain round also tells something without a probe: the target's confidence
there predicts whether a model draft would have been accepted (`Calibration`, learned from the
rounds that drafted), and the first position's estimate follows that prediction (`follow`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


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
        above what a wider pass measured. A narrower pass is not dearer, and a width auto stops using
        is not measured again: a slow spike left in the one-token cost would make drafting look
        cheaper than plain decoding whatever the acceptance, and so keep it drafting."""
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
        return self.target_s[known[0]] * (1 + 0.1 * (width - known[0]))  # prior: a wider pass costs a bit more


@dataclass
class Calibration:
    """How often the draft model's first token is accepted, by how sure the target is of its own token
    there (its top probability, in bins at `EDGES`), learned from the rounds the draft model drafts.
    In a plain round the target's logits are at hand, so this predicts for free what a draft would
    have been accepted there, and the estimate keeps following the text instead of sitting on what
    the last probe saw (measured on the int4 pair at k = 2: accepted 0.31 below 0.5, 0.91 above 0.99;
    mean top probability 0.66 on chat, 0.91 on code, 0.94 on edits). Older rounds fade (`keep`)."""

    EDGES = (0.5, 0.8, 0.95, 0.99)
    hits: list[float] = field(default_factory=lambda: [0.0] * 5)
    seen: list[float] = field(default_factory=lambda: [0.0] * 5)
    keep: float = 0.995  # per drafting round: a round 140 rounds back counts half
    min_seen: float = 4.0  # a bin predicts once it holds this many rounds' worth

    def observe(self, top: float, accepted: bool) -> None:
        b = bisect.bisect_right(self.EDGES, top)
        self.hits = [h * self.keep for h in self.hits]
        self.seen = [n * self.keep for n in self.seen]
        self.hits[b] += float(accepted)
        self.seen[b] += 1.0

    @property
    def ready(self) -> bool:
        """Whether some bin predicts yet (until then a plain round need not compute the top probability)."""
        return max(self.seen) >= self.min_seen

    def predict(self, top: float) -> float | None:
        """P(first draft token accepted) where the target's top probability is `top`; None while its bin
        has seen too little."""
        b = bisect.bisect_right(self.EDGES, top)
        return self.hits[b] / self.seen[b] if self.seen[b] >= self.min_seen else None


@dataclass
class AutoDraftLen:
    """Per-request controller. `prior` acceptance per position seeds it (from tune or 0.7)."""

    max_k: int
    costs: CostModel
    prior: float = 0.7
    free_draft: bool = False  # a prompt-lookup drafter costs (next to) nothing
    # EMA weight of the acceptance estimate. 0.93 left fewer requests stuck in plain decoding after
    # two early rejections in an A/B, but in two `specrt bench` runs auto then hardly drafted at all
    # (bench/RESULTS.md, sixth sitting): kept at 0.85.
    decay: float = 0.85
    probe_every: int = 16
    max_probe_every: int = 1024  # a probe after skipped rounds re-reads them all in the draft: about a prefill
    widen_every: int = 8
    probe_budget: float = 0.015  # a probe may cost at most this fraction of the plain rounds it waits for
    stale_half_life: int = 64  # plain rounds after which the estimate counts half as many observations
    accept: list[float] = field(default_factory=list)  # conditional acceptance per position
    _stale: int = 0  # plain rounds before the round being observed (a probe's), 0 when drafting
    _since_probe: int = 0
    _gap: int = 0
    _since_widen: int = 0
    rounds_skipped: int = 0

    def __post_init__(self):
        self._gap = self.probe_every
        self.accept = list(self.accept) + [self.prior] * (self.max_k - len(self.accept))

    @property
    def probe_state(self) -> tuple[int, int]:
        """(rounds between probes now, rounds since the last one): carried from request to request."""
        return self._gap, self._since_probe

    @probe_state.setter
    def probe_state(self, state: tuple[int, int]) -> None:
        self._gap, self._since_probe = int(state[0]), int(state[1])

    def expected_tokens(self, k: int) -> float:
        e, run = 1.0, 1.0
        for a in self.accept[:k]:
            run *= a
            e += run
        return e

    def cost(self, k: int) -> float:
        """Predicted seconds of a round with k drafts (0 when nothing is measured yet)."""
        target = self.costs.target(k + 1)
        draft_s = 0.0 if self.free_draft else (self.costs.draft_s or 0.0)
        return (target or 0.0) + k * draft_s

    def best(self, limit: int, extra_s: float = 0.0) -> tuple[int, float | None]:
        """(the k <= limit with the highest expected tokens per second, that rate); rate None while
        nothing is measured yet. No side effects (choose adds the probing and widening). `extra_s`: a
        cost a drafting round carries besides its passes (hybrid: the draft model's later catch-up)."""
        limit = min(limit, self.max_k)
        c1 = self.costs.target(1)
        draft_s = 0.0 if self.free_draft else self.costs.draft_s
        if c1 is None or draft_s is None:
            return min(max(limit, 0), 2), None  # nothing measured yet: a short draft measures both costs
        best_k, best_rate = 0, 1.0 / c1
        for k in range(1, limit + 1):
            rate = self.expected_tokens(k) / (self.cost(k) + extra_s)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def catchup_cost(self, behind: int) -> float:
        """Predicted seconds the draft model's next pass spends reading the `behind` tokens it has not
        seen, beyond the one a draft step reads anyway (before `draft_read_s` is measured: about one
        more pass); 0 for a free draft."""
        if self.free_draft:
            return 0.0
        if self.costs.draft_read_s is None:
            return self.costs.draft_s or 0.0
        return max(behind - 1, 0) * self.costs.draft_read_s

    def probe_cost(self, behind: int) -> float | None:
        """Predicted extra seconds of a one-token probe now: a draft step, the draft's catch-up over the
        `behind` tokens it has not read, and a verify one token wider than a plain step. None while
        nothing is measured."""
        c1 = self.costs.target(1)
        draft_s = 0.0 if self.free_draft else self.costs.draft_s
        if not c1 or draft_s is None:
            return None
        return draft_s + self.catchup_cost(behind) + max((self.costs.target(2) or c1) - c1, 0.0)

    def weight(self, stale: int) -> float:
        """EMA weight of an observation after `stale` plain rounds. The estimate counts as
        decay / (1 - decay) observations (5.7 at 0.85) while drafting; in plain rounds nothing is
        observed and what it knew ages, down to one observation's worth, so a probe after a long pause
        counts up to half: one accepted probe lifts an estimate of 0.37 to 0.69, where before it moved
        it to 0.46 and a draft that paid again (chat, then code) stayed off for many requests."""
        n = self.decay / (1 - self.decay) * 0.5 ** (stale / self.stale_half_life)
        return 1.0 / (1.0 + max(n, 1.0))

    def probe_value(self, limit: int, remaining: int) -> float:
        """Expected seconds a probe saves over the `remaining` tokens of the request: the chance it is
        accepted times what drafting at the estimate it would then leave saves a token, if anything."""
        c1 = self.costs.target(1)
        if not c1 or remaining <= 0:
            return 0.0
        hit = list(self.accept)
        hit[0] += (1.0 - hit[0]) * self.weight(self._since_probe)
        k, rate = AutoDraftLen(self.max_k, self.costs, free_draft=self.free_draft, accept=hit).best(limit)
        if not k or rate is None:
            return 0.0
        return self.accept[0] * max(c1 - 1.0 / rate, 0.0) * remaining

    def probe_due(self, behind: int, limit: int = 1, remaining: int = 0) -> bool:
        """After a plain round: is a probe due? Not before `_gap` plain rounds; then once those rounds'
        `probe_budget` covers the probe's cost now, or what it is expected to save over the `remaining`
        tokens does (a dipped estimate near break-even), or at the latest after `max_probe_every` rounds."""
        if self._since_probe < self._gap:
            return False
        if self._since_probe >= self.max_probe_every:
            return True
        cost, c1 = self.probe_cost(behind), self.costs.target(1)
        return (cost is None or self._since_probe * self.probe_budget * c1 >= cost
                or self.probe_value(limit, remaining) >= cost)

    def wait(self) -> None:
        """A round in which this proposal kind was not asked (hybrid: an n-gram round): one more round
        since its last probe (a kind that is drafting resets that count when next asked)."""
        self._since_probe += 1

    def choose(self, limit: int, behind: int = 0, remaining: int = 0, share: float = 1.0) -> int:
        """Draft length for the next round, at most `limit`; `behind`: tokens the draft model would have
        to read before it can draft (what a probe's catch-up costs); `remaining`: tokens the request may
        still generate (what a probe that restarts drafting could save on); `share`: the part of them
        this drafter may expect to draft for (hybrid's model: the rounds no n-gram proposal serves)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        best_k, rate = self.best(limit)
        if rate is None:
            return best_k
        if best_k and behind > 2 and remaining > 0 and not self.free_draft:
            # Drafting first needs a catch-up pass over what the draft has not read (at the start of a
            # request, the prompt; in hybrid, what n-gram rounds emitted): worth it only if drafting
            # saves that much over the tokens it may then draft for.
            if remaining * share * (self.costs.target(1) - 1.0 / rate) < self.catchup_cost(behind):
                best_k = 0
        if best_k == 0:
            self._since_probe += 1
            if self.probe_due(behind, limit, int(remaining * share)):  # a probe too saves only over that share
                self._gap = min(2 * self._since_probe, self.max_probe_every)  # twice the wait it just had
                self._stale, self._since_probe = self._since_probe, 0
                return 1
            self.rounds_skipped += 1
        else:
            self._stale, self._gap, self._since_probe = self._since_probe, self.probe_every, 0
            self._since_widen += 1
            if best_k < limit and self._since_widen >= self.widen_every:
                self._since_widen = 0
                return best_k + 1
        return best_k

    def follow(self, predicted: float) -> None:
        """A plain round's prediction of the first position's acceptance (`Calibration.predict`): it moves
        that estimate as an observation would, so a text that turns predictable restarts drafting
        without waiting for a probe, and one that does not keeps it off."""
        self.accept[0] += (predicted - self.accept[0]) * (1.0 - self.decay)

    def observe(self, proposed: int, accepted: int) -> None:
        """Update conditional acceptance: positions 1..accepted were accepted, accepted+1 (if proposed) was
        not; weighted `1 - decay`, more after plain rounds (`weight`)."""
        w = self.weight(self._stale)
        for i in range(min(proposed, self.max_k)):
            if i > accepted:
                break
            hit = 1.0 if i < accepted else 0.0
            self.accept[i] += (hit - self.accept[i]) * w
        self._stale = 0
