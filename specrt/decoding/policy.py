"""The draft-length policy: which proposer drafts each round, and how many tokens.

`Fixed(k)` drafts k tokens a round. With two proposers (hybrid) it takes the lookup proposal when it
is long enough and continues a long enough match, else the model's.

`Auto` ("auto") chooses each round's k from measured acceptance and pass costs. With per-position
acceptance a_i (the chance draft token i is accepted given 1..i-1 were), a round with k drafts emits
E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens and costs k * c_draft + c_target(k+1) (Leviathan et al.
2023, with measured rather than modelled costs); it takes the k that maximises E(k) / cost(k), k = 0
being plain decoding. One `Controller` per proposal kind holds the estimate ("model", the lookup's
"ngram1".."ngram8" by matched length). With several proposers (hybrid: a lookup and the draft model) it
offers the round to whichever is expected to emit more per second, counting what a paid proposer's catch-up
will cost after rounds it sat out.
Once it chose to draft, a model round alone goes on as far as the pass has room while the tokens it drafted,
by its confidence in each, make one more worth its cost (controller.DraftStop): long where the draft is sure.
When k = 0 wins it still probes now and then with one draft token (the wait doubling after each probe
that does not restart drafting), so it resumes once drafting pays again; a plain round's target
confidence also predicts what a model draft would have got there (`Calibration`), which moves the
estimate without a probe. Positions past the chosen k are never observed, so now and then it drafts
one more token than it would, to measure it again.

In a batch (`Batch`: its rows, the widest row planned so far this round, the batch's measured tokens
per second) the costs are those of a pass by the tokens it computes (rows x its widest row: rows are
right-padded), and a row's k maximises E(k) - rate * (what its k + 1 tokens add to the pass's cost + k
draft steps): the batch's tokens per second are highest when every row's last draft token is worth at
least what it costs at the batch's rate (at batch size 1 this is the request's own E(k) / cost(k)).

The estimates live in decoding/controller.py. Everything tunable is one frozen `PolicyConfig`; what requests learn (costs, acceptance, calibration, and
the history of outputs the suffix proposer drafts from) is one `PolicyState` that the Pair carries
between requests.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specrt.config import needs_draft_model
from specrt.decoding import sampling
from specrt.decoding.constraint import Constraint
from specrt.decoding.controller import DRAFT_EDGES, Batch, Calibration, Controller, CostModel, DraftStop, PolicyConfig
from specrt.decoding.proposers import (Found, GrammarProposer, History, LookupProposer, ModelProposer, Proposal,
                                       Proposer, Stop, SuffixProposer, below)
from specrt.decoding.tree import Grower, Tree


@dataclass
class PolicyState:
    """What requests learn and the next ones start from; the Pair keeps one."""

    costs: CostModel = field(default_factory=CostModel)
    # per kind, conditional acceptance per position, as the last request that drafted it ended
    acceptance: dict[str, list[float]] = field(default_factory=dict)
    calibration: Calibration = field(default_factory=Calibration)
    # the draft model's tokens' acceptance by its own confidence in each (controller.DraftStop)
    draft_calibration: Calibration = field(default_factory=lambda: Calibration(DRAFT_EDGES))
    # earlier requests' outputs, for the suffix proposer (None: every request starts from none)
    history: History | None = None
    # per tree branch family, [tokens its nodes added, tokens they were expected to add] (decoding/tree.py)
    tree: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Round:
    """What one round did, for the policy and the stats."""

    proposer: Proposer | None
    planned: int  # the k the policy chose
    proposal: Proposal
    accepted: int  # n: drafts accepted
    new: list[int]  # the tokens the round emitted: n drafts and the target's next token
    logits: np.ndarray  # the verify pass's target logits [k'+1, V]
    draft_s: float  # this row's share of the round's draft passes
    verify_s: float
    width: int = 0  # tokens the verify pass computed, every row's padding included (0: this row's k + 1)
    tree: Tree | None = None  # what the pass verified when more than the proposal (its chain)
    path: tuple[int, ...] = ()  # with a tree: the nodes its walk accepted (`accepted` counts the chain's only)

    @property
    def taken(self) -> int:  # draft tokens emitted
        return len(self.path) if self.tree is not None else self.accepted

    @property
    def nodes(self) -> int:  # draft tokens verified
        return len(self.tree) if self.tree is not None else self.k

    @property
    def k(self) -> int:  # drafts verified
        return len(self.proposal.tokens)


class Policy(Protocol):
    max_k: int  # the most drafts a round may take

    def start(self, prompt: list[int]) -> None: ...
    def plan(self, seq: list[int], limit: int, left: int, batch: Batch | None = None) -> tuple[Proposer | None, int]:
        """(who drafts, how many tokens, at most `limit`); `left`: tokens the request may still emit;
        `batch`: the round is a batch's, with other rows in it."""
    def stop(self, confidence_stop: float) -> Stop | None:
        """Whether the round's drafting stops after a token, before the k planned (proposers.Stop);
        `confidence_stop`: the request's."""
    def grow(self, seq: list[int], proposal: Proposal, limit: int, fits: Callable[[Sequence[int]], bool],
             batch: Batch | None = None) -> Tree | None:
        """The tree the round verifies instead of `proposal` (at most `limit` nodes, each path one the request's
        constraint `fits`), None: the chain; `batch`: the round is a batch's, its pass `batch.widest` wide so far."""
    def commit(self, valid: int) -> None: ...
    def observe(self, r: Round) -> None: ...
    def finish(self, new_tokens: int) -> dict:
        """Stats fields it reports at the end of the request."""


class _Base:
    def __init__(self, proposers: Sequence[Proposer], max_k: int, state: PolicyState, config: PolicyConfig):
        self.proposers, self.max_k, self.state, self.c = tuple(proposers), max_k if proposers else 0, state, config
        self.lookup = next((p for p in proposers if p.free), None)
        self.model = next((p for p in proposers if not p.free), None)
        self.spent = 0.0  # seconds of draft and verify passes

    def plan(self, seq: list[int], limit: int, left: int, batch: Batch | None = None) -> tuple[Proposer | None, int]:
        raise NotImplementedError

    def stop(self, confidence_stop: float) -> Stop | None:
        """When this round's drafts stop before the k it planned (the request's `confidence_stop`: a threshold)."""
        return below(confidence_stop)

    def grow(self, seq: list[int], proposal: Proposal, limit: int, fits: Callable[[Sequence[int]], bool],
             batch: Batch | None = None) -> Tree | None:
        return None

    def start(self, prompt: list[int]) -> None:
        for p in self.proposers:
            p.start(prompt)
        self.spent = 0.0

    def commit(self, valid: int) -> None:
        for p in self.proposers:
            p.commit(valid)

    def observe(self, r: Round) -> None:
        self.observe_costs(r)

    def observe_costs(self, r: Round) -> None:
        """What the round's passes cost (a round that teaches no estimate, e.g. a grammar-forced one)."""
        costs, prop = self.state.costs, r.proposal
        if prop.passes:  # per draft step; a catch-up pass after rounds without drafting is not one
            costs.observe_draft(r.draft_s - prop.catchup_s, prop.passes - (prop.catchup_s > 0))
            if prop.catchup_s:
                costs.observe_catchup(prop.catchup_s, prop.catchup_tokens)
        costs.observe_target(r.width or r.k + 1, r.verify_s)
        self.spent += r.draft_s + r.verify_s

    def finish(self, new_tokens: int) -> dict:
        c1 = self.state.costs.target(1)
        # tokens after the first, vs one target pass each
        return {"measured_speedup": (new_tokens - 1) * c1 / self.spent} if c1 and self.spent else {}


class Fixed(_Base):
    """k drafts a round (fewer when the request ends sooner). With a lookup and a model proposer, the
    lookup's proposal when it is at least `min_len` long and continues a match of at least `min_match`
    tokens (a 1-token match is right ~20% of the time, the model's first token ~80% on code). Its rounds
    verify chains: a pass has room for k drafts (api/requests.check), which the chain takes."""

    def __init__(self, k: int, proposers: Sequence[Proposer], state: PolicyState | None = None,
                 config: PolicyConfig = PolicyConfig()):
        super().__init__(proposers, k, state or PolicyState(), config)

    def plan(self, seq: list[int], limit: int, left: int, batch: Batch | None = None) -> tuple[Proposer | None, int]:
        if limit <= 0:
            return None, 0
        if self.lookup is not None:
            found = self.lookup.find(seq, limit)
            if self.model is None or (len(found.tokens) >= min(self.c.min_len, limit) and found.matched >= self.c.min_match):
                return self.lookup, limit
        return self.model, limit


class Auto(_Base):
    """draft_len="auto" (module docstring). `trees`: a round may verify a tree (decoding/tree.py): the model's
    chain with its runner-ups and the lookup's continuation where it parts from the chain."""

    def __init__(self, proposers: Sequence[Proposer], max_k: int, state: PolicyState | None = None,
                 config: PolicyConfig = PolicyConfig(), trees: bool = False):
        super().__init__(proposers, max_k, state or PolicyState(), config)
        self.grower = Grower(self.state.tree, config.tree_probe_every) if trees else None
        if trees and self.model is not None:
            self.model.runner_up = config.tree_alternatives

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        costs = self.state.costs
        # Controllers plan with the costs as they were when the request started, so their choices (and the
        # random draws) depend only on that snapshot, the seed and the tokens. A snapshot lacking a cost
        # they need (a fresh, untuned pair) would freeze them on their opening guess: they follow the live one.
        complete = bool(costs.target_s) and (costs.draft_s is not None or self.model is None)
        self.costs = copy.deepcopy(costs) if complete else costs
        self.autos: dict[str, Controller] = {}
        self.predicted_tokens = self.predicted_s = 0.0
        self.calib = self.state.calibration if self.model is not None else None
        self._stop: DraftStop | None = None  # this round's, when its drafts stop by their confidence
        # this round's (proposer, controller, whether planned, what the lookup found)
        self._plan: tuple[Proposer | None, Controller | None, bool, Found | None] = (None, None, False, None)

    def controller(self, kind: str) -> Controller | None:
        """The kind's controller, made on first use from what earlier requests learned (a kind not seen
        yet starts from its family's); None for a lookup that found nothing."""
        if kind == "ngram":
            return None
        if kind not in self.autos:
            family = "ngram" if kind.startswith(("ngram", "suffix")) else "model"
            prior = self.state.acceptance
            self.autos[kind] = Controller(self.max_k, self.costs, self.c, free_draft=family == "ngram",
                                          accept=list(prior.get(kind) or prior.get(family, [])))
        return self.autos[kind]

    def plan(self, seq: list[int], limit: int, left: int, batch: Batch | None = None) -> tuple[Proposer | None, int]:
        self._plan, self._stop = (None, None, False, None), None
        if limit <= 0:
            return None, 0
        # 1. The offers, in order: each free proposer's proposal where it found one, then each paid proposer.
        offers, found = [], None
        for p in self.proposers:
            if not p.free:
                offers.append((p, self.controller(p.kind)))
                continue
            f = p.find(seq, limit)
            found = found or f  # the first lookup's, scored in full after the round (observe)
            if len(f.tokens) and (a := self.controller(f.kind)) is not None:
                offers.append((p, a))
        if not offers:  # a lookup alone that found nothing: a round without drafts
            self._plan = (self.lookup, None, True, found)
            return self.lookup, limit
        # 2. The first offer, unless every offer's rate is known and a later one's is higher.
        src, auto = offers[0]
        if len(offers) > 1:
            rates = [a.best(limit, self._extra_s(p, seq), batch)[1] for p, a in offers]
            if None not in rates:
                src, auto = offers[max(range(len(offers)), key=lambda i: (rates[i], -i))]
        k = auto.choose(limit, src.behind(seq), left, batch)
        # 3. A lookup proposal that does not pay leaves the round to the first paid proposer; one that drafts
        #    counts, for every paid proposer, to its next probe.
        paid = [(p, a) for p, a in offers if not p.free]
        if src.free and paid:
            if k == 0:
                src, auto = paid[0]
                k = auto.choose(limit, src.behind(seq), left, batch)
            else:
                for _, a in paid:
                    a.wait()
        self._plan = (src, auto, True, found)
        # 4. A model round alone that drafts (not a probe) may go to the pass's room: it stops where its tokens so
        #    far, by the draft's confidence in them, make one more not worth its cost (controller.DraftStop).
        if self.c.draft_stop and batch is None and not src.free and k and not auto.probing:
            k = min(limit, self.max_k)
            self._stop = DraftStop(auto, self.state.draft_calibration, k, widen=auto.widened)
        return src, k

    def stop(self, confidence_stop: float) -> Stop | None:
        if self._stop is None:
            return below(confidence_stop)
        self._stop.also = confidence_stop
        return self._stop

    def grow(self, seq: list[int], proposal: Proposal, limit: int, fits: Callable[[Sequence[int]], bool],
             batch: Batch | None = None) -> Tree | None:
        src, auto, planned, found = self._plan
        if self.grower is None or auto is None or src is None or src.free:
            return None
        k = len(proposal.tokens)
        reach = [1.0]
        for a in auto.accept[:k]:
            reach.append(reach[-1] * a)
        lookup = accept = None
        if found is not None and len(found.tokens) and (la := self.controller(found.kind)) is not None:
            lookup, accept = found.tokens, la.accept
        width, rate = self.costs.target, None
        if batch is not None:  # a batch's pass computes rows x its widest row: a node costs only where it widens
            width = lambda w: self.costs.target(batch.rows * max(w, batch.widest))  # noqa: E731
            rate = batch.rate  # against the tokens the batch's seconds give
        return self.grower.grow(proposal, reach, lookup, accept or (), auto.expected_tokens(k), auto.cost(k),
                                width, limit, fits, rate)

    def _extra_s(self, p: Proposer, seq: list[int]) -> float:
        """What a round by `p` costs besides its passes: for a paid proposer that is behind, its catch-up pass;
        for a free one, leaving each caught-up paid proposer costs it a catch-up pass when it drafts again
        (about a draft step; once it is behind, that pass is its own round's to pay)."""
        if not p.free:
            behind = p.behind(seq)
            return self.controller(p.kind).catchup_cost(behind) if behind > 2 else 0.0
        return sum((self.costs.draft_s or 0.0) for q in self.proposers if not q.free and q.behind(seq) <= 2)

    def observe(self, r: Round) -> None:
        super().observe(r)
        src, auto, planned, found = self._plan
        if auto is not None:  # what the controller expected of this round
            self.predicted_tokens += auto.expected_tokens(r.k)
            self.predicted_s += auto.cost(r.k)
        scored = None
        if planned and found is not None and found.matched:
            # The lookup proposal is scored in full against what the target emitted, whether this round
            # verified all, part or none of it: a point-mass token is accepted exactly when the target's
            # token equals it (greedy), or with p_target(token). So positions past k are measured too.
            shown, new = found.tokens, r.new
            m = next((i for i, (a, b) in enumerate(zip(shown, new)) if a != b), min(len(shown), len(new)))
            scored = self.controller(found.kind)
            scored.observe(m if m == len(new) else min(len(shown), m + 1), m)
        if auto is not None and auto is not scored:
            auto.observe(r.k, r.accepted)
        if src is not None and src is self.model and r.proposal.tops is not None:
            # each drafted token up to the first rejected one, by the draft's confidence in it
            for i, top in enumerate(r.proposal.tops[:r.accepted + 1].tolist()):
                self.state.draft_calibration.observe(top, i < r.accepted)
        if r.tree is not None:
            self.grower.observe(r.tree, r.path)
        calib, model = self.calib, self.model
        if calib is not None and ((r.k and src is model) or (r.k == 0 and calib.ready)) and model.kind in self.autos:
            # the target's confidence at the first position: learned against what a model draft got there;
            # in a plain round, what it predicts steers the estimate
            top = sampling.top_prob(r.logits[0])
            if r.k:
                calib.observe(top, r.accepted > 0)
            elif (predicted := calib.predict(top)) is not None:
                self.autos[model.kind].follow(predicted)

    def finish(self, new_tokens: int) -> dict:
        out = super().finish(new_tokens)
        estimates = {n: [round(x, 4) for x in a.accept] for n, a in self.autos.items()}
        self.state.acceptance.update(estimates)  # where the next request starts
        c1 = self.state.costs.target(1)
        if "measured_speedup" in out:
            out.update(rounds_skipped=sum(a.rounds_skipped for a in self.autos.values()), acceptance_estimate=estimates,
                       predicted_speedup=self.predicted_tokens * c1 / self.predicted_s if self.predicted_s else 0.0)
        return out


class Forced:
    """Grammar-forced rounds around any policy: where a constrained request's grammar allows one continuation
    only, its tokens are drafted free (proposers.GrammarProposer) in place of the policy's proposer when there
    are at least `first` of them, or when the policy would draft none. A forced round teaches the policy's
    estimates nothing (the grammar is no proposer's), only what its passes cost."""

    def __init__(self, policy: Fixed | Auto, forced: GrammarProposer, first: int):
        self.policy, self.forced, self.first = policy, forced, first
        self.max_k = policy.max_k
        self._forced = False  # this round's

    @property
    def model(self) -> Proposer | None:
        return self.policy.model

    def start(self, prompt: list[int]) -> None:
        self.policy.start(prompt)

    def plan(self, seq: list[int], limit: int, left: int, batch: Batch | None = None) -> tuple[Proposer | None, int]:
        n = len(self.forced.find(seq, limit).tokens) if limit > 0 else 0
        self._forced = n >= self.first
        if not self._forced:
            src, k = self.policy.plan(seq, limit, left, batch)
            self._forced = bool(n) and not k
            if not self._forced:
                return src, k
        return self.forced, n

    def grow(self, seq: list[int], proposal: Proposal, limit: int, fits: Callable[[Sequence[int]], bool],
             batch: Batch | None = None) -> Tree | None:
        return None if self._forced else self.policy.grow(seq, proposal, limit, fits, batch)

    def stop(self, confidence_stop: float) -> Stop | None:
        return None if self._forced else self.policy.stop(confidence_stop)

    def commit(self, valid: int) -> None:
        self.policy.commit(valid)

    def observe(self, r: Round) -> None:
        (self.policy.observe_costs if self._forced else self.policy.observe)(r)

    def finish(self, new_tokens: int) -> dict:
        return self.policy.finish(new_tokens)


def build(draft_len: int | str, drafter: str, max_k: int, state: PolicyState | None = None,
          model: Callable[..., ModelProposer] | None = None, ngram_max: int = 16,
          config: PolicyConfig = PolicyConfig(), constraint: Constraint | None = None, tree: bool = False) -> Policy:
    """The policy for a request: `drafter` "model" | "ngram" | "suffix" | "hybrid"; `model(skip=)`
    makes the model proposer (None: the pair has no draft model); `state.history` is what the suffix
    proposer searches besides the request (none: only the request, like prompt lookup); `constraint`: the
    request's grammar, whose forced tokens it drafts too (`Forced`; draft_len 0 is the target alone: none);
    `tree`: an auto policy's rounds may verify trees (the target takes them, decoding/tree.py)."""
    if draft_len == 0:
        return Fixed(0, (), state, config)
    proposers: list[Proposer] = []
    history = state.history if state is not None else None
    if drafter == "suffix" or (drafter == "hybrid" and draft_len == "auto" and history is not None):
        proposers.append(SuffixProposer(history if history is not None else History(), ngram_max,
                                        min_share=config.suffix_share))
    elif drafter in ("ngram", "hybrid"):
        proposers.append(LookupProposer(ngram_max))
    if needs_draft_model(drafter):
        proposers.append(model(skip=config.skip if drafter == "hybrid" else None))
    policy = (Auto(proposers, max_k, state, config, tree) if draft_len == "auto"
              else Fixed(int(draft_len), proposers, state, config))
    return Forced(policy, GrammarProposer(constraint), config.forced_first) if constraint is not None else policy
