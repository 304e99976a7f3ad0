"""The speculative decode loop (DESIGN §4), batch 1.

Invariant: the last emitted token is not yet in either cache; each model's next input is the
part of the committed sequence its cache has not seen (for the draft this includes the catch-up
token d_k when all drafts were accepted).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from specrt.config import GenerationConfig
from specrt.engines.base import Engine
from specrt.runtime import sampling
from specrt.runtime.adaptive import AutoDraftLen, Calibration, CostModel
from specrt.runtime.drafters import ModelDrafter


@dataclass
class Stats:
    draft_len: int | str = 0
    target_passes: int = 0
    draft_passes: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # rounds per draft length actually used
    rounds_skipped: int = 0  # auto: rounds the guard ran without drafting
    predicted_speedup: float = 0.0  # auto/fixed: E(tokens)/cost from the cost model, vs one target pass a token
    measured_speedup: float = 0.0  # tokens / (draft + verify time) vs the measured one-token target pass
    acceptance_estimate: dict[str, list[float]] = field(default_factory=dict)  # auto: per drafter, conditional acceptance per position at the end
    new_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("proposed_at"), d.pop("accepted_at")
        d["acceptance_rate"] = self.accepted / self.proposed if self.proposed else 0.0
        d["accepted_per_position"] = [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]
        d["proposed_per_position"] = list(self.proposed_at)
        d["tokens_per_target_pass"] = self.new_tokens / self.target_passes if self.target_passes else 0.0
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        decode_s = self.wall_s - self.ttft_s
        d["decode_tokens_per_s"] = (self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0
        return d


def decode(target: Engine, drafter, prompt: list[int], cfg: GenerationConfig, vocab: int,
           eos_ids: frozenset[int], on_tokens: Callable[[list[int]], bool] | None = None,
           costs: CostModel | None = None, max_draft_len: int = 8, prior: dict[str, list[float]] | None = None,
           probes: dict[str, tuple[int, int]] | None = None,
           calibration: Calibration | None = None) -> tuple[list[int], str, Stats]:
    """Generate after `prompt`. Returns (tokens, finish reason "eos" | "length" | "stop", stats).

    `drafter` is a runtime.drafters drafter (or a bare draft Engine, or None for target-only).
    `on_tokens(new)` sees each batch of accepted tokens (EOS excluded) and returns True to stop.
    Only the first `vocab` logits are used, which masks padding rows of larger output matrices.
    `costs` collects measured pass times (shared across requests); with draft_len "auto" an
    AutoDraftLen controller per proposal kind picks each round's k from them and from the acceptance
    seen so far (`prior`: what earlier requests learned, by kind). Kinds: "model" ("hybrid-model" inside
    hybrid), and for n-gram proposals "ngram1", "ngram2", "ngram3" (3-7), "ngram8" (8+) by matched suffix
    length (a longer match is far more often right); a "model" or "ngram" entry in `prior` seeds kinds
    of its family not seen yet.
    `probes` (updated in place) carries each controller's probe schedule across requests, so a draft
    that stopped paying is not re-probed (and its cache caught up, which costs about a prefill) at the
    start of every request. `calibration` (updated in place, carried likewise) relates the draft
    model's acceptance to the target's confidence; in plain rounds auto follows what it predicts.
    """
    if drafter is not None and not hasattr(drafter, "propose"):
        drafter = ModelDrafter(drafter, vocab)
    costs = costs if costs is not None else CostModel()
    adaptive = cfg.draft_len == "auto" and drafter is not None
    # The controllers plan with the costs as they were when the request started, so their choices
    # (and with them the random draws) depend only on that snapshot, the seed and the tokens: a seed
    # reproduces for the same snapshot. New measurements go to the shared model for later requests.
    # A snapshot that lacks a cost the controllers need (the first request of a fresh, untuned pair)
    # would freeze them on their opening guess for the whole request: they then follow the live model.
    needs_draft = adaptive and drafter.name != "ngram"
    complete = bool(costs.target_s) and (costs.draft_s is not None or not needs_draft)
    snapshot = (copy.deepcopy(costs) if complete else costs) if adaptive else None
    autos: dict[str, AutoDraftLen] = {}  # draft_len "auto": one controller per proposal kind, made on first use

    def controller(kind: str) -> AutoDraftLen | None:
        """The kind's controller: "model", or "ngram1".."ngram8" by matched length; None when not auto
        or when the n-gram drafter found nothing to propose."""
        if not adaptive or kind == "ngram":
            return None
        if kind not in autos:
            family = "ngram" if kind.startswith("ngram") else "model"  # seeds a kind not seen yet
            seen = (prior or {}).get(kind) or (prior or {}).get(family, [])
            autos[kind] = AutoDraftLen(max_draft_len, snapshot, free_draft=family == "ngram",
                                       accept=list(seen)[:max_draft_len])
            if probes and kind in probes:
                autos[kind].probe_state = probes[kind]
        return autos[kind]

    # The draft model's controller follows the target's confidence through plain rounds (Calibration).
    model = drafter if drafter is not None and drafter.name == "model" else getattr(drafter, "model", None)
    calib = (calibration if calibration is not None else Calibration()) if adaptive and model is not None else None
    k = (max_draft_len if adaptive else cfg.draft_len) if drafter is not None else 0
    greedy, rng = cfg.sampling.greedy, np.random.default_rng(cfg.seed)
    stats = Stats(draft_len="auto" if adaptive else k, proposed_at=[0] * k, accepted_at=[0] * k, prompt_tokens=len(prompt))
    predicted_tokens = predicted_s = spent = 0.0
    start = time.perf_counter()

    def pick(logits: np.ndarray) -> int:  # one token from logits [V]
        if greedy:
            return int(logits.argmax())
        return sampling.draw(sampling.warp(logits[None], cfg.sampling)[0], rng.random())

    # Prefill the target with the prompt; its last-position logits give the first token. (The draft
    # model reads the prompt in its first propose: no draft prefill when auto never drafts.)
    target.truncate(0)
    x = pick(target.forward(np.array([prompt]), np.array([len(prompt) - 1]))[0, 0, :vocab])
    stats.target_passes += 1
    stats.ttft_s = time.perf_counter() - start
    if k:
        drafter.start(prompt)
    seq, out = list(prompt), []
    served = 0  # rounds an n-gram proposal drafted
    new, reason = [x], ""
    while True:
        # 5. Stop checks: never emit past EOS or max_new_tokens.
        for i, t in enumerate(new):
            if t in eos_ids:
                new, reason = new[:i], "eos"
                break
        new = new[: cfg.max_new_tokens - len(out)]
        out += new
        seq += new
        if on_tokens is not None and new and on_tokens(new):
            reason = "stop"
        if reason or len(out) >= cfg.max_new_tokens:
            break
        # A round emits at most k_now + 1 tokens: draft no further than max_new_tokens allows.
        limit = min(k, cfg.max_new_tokens - len(out) - 1)
        src = drafter.pick(seq, limit, adaptive) if drafter is not None and limit > 0 else drafter  # hybrid: n-gram or model
        auto = controller(src.kind) if limit > 0 else None
        lookup = getattr(drafter, "ngram", drafter) if adaptive and limit > 0 else None  # the n-gram drafter, if any
        hybrid_ngram = auto is not None and src.name == "ngram" and drafter.name == "hybrid"
        if hybrid_ngram:  # use the proposal expected to pay more
            # Leaving a caught-up draft model for an n-gram round costs it a catch-up pass when it drafts
            # again (about one draft step); once it is behind, more n-gram rounds add little to that pass,
            # and it is the model's round that pays it: reading what it is behind by (at the start of a
            # request, the whole prompt) before its first draft step.
            model_auto = controller(drafter.model.kind)
            behind = drafter.model.behind(seq)
            switch_s = (model_auto.costs.draft_s or 0.0) if behind <= 2 else 0.0
            catchup_s = model_auto.catchup_cost(behind) if behind > 2 else 0.0
            rates = [auto.best(limit, switch_s)[1], model_auto.best(limit, catchup_s)[1]]
            if None not in rates and rates[1] > rates[0]:
                src, auto = drafter.model, controller(drafter.model.kind)
        left = cfg.max_new_tokens - len(out)
        # hybrid's model may expect to draft for about the part of the rounds no n-gram proposal served so far
        share = (stats.rounds - served + 1) / (stats.rounds + 2) if drafter is not None and drafter.name == "hybrid" else 1.0
        k_now = auto.choose(limit, src.behind(seq), left, share) if auto else limit
        if k_now == 0 and hybrid_ngram and src.name == "ngram":  # the n-gram proposal does not pay: maybe the model's
            src, auto = drafter.model, controller(drafter.model.kind)
            k_now = auto.choose(limit, src.behind(seq), left, share)
        elif k_now and hybrid_ngram and src.name == "ngram":  # a round without the model: counts to its next probe
            controller(drafter.model.kind).wait()
        stats.rounds += 1

        # 1. Draft up to k_now tokens (p_draft None: point masses, or greedy).
        d, p_draft = np.empty(0, np.int64), None
        t0 = time.perf_counter()
        if k_now:
            d, p_draft, passes = src.propose(seq, k_now, cfg.sampling, rng, cfg.confidence_stop)
            if passes:  # per draft step; a catch-up pass after rounds without drafting is not one
                costs.observe_draft(time.perf_counter() - t0 - src.catchup_s, passes - (src.catchup_s > 0))
                if src.catchup_s:
                    costs.observe_catchup(src.catchup_s, src.catchup_tokens)
            stats.draft_passes += passes
            stats.rounds_by_drafter[src.name] = stats.rounds_by_drafter.get(src.name, 0) + 1
            served += src.name == "ngram"
        k_now = len(d)
        stats.draft_len_hist[k_now] = stats.draft_len_hist.get(k_now, 0) + 1

        # 2. Verify x_last and all drafts in one target pass.
        base = target.length  # the target has seen seq[:-1]
        t1 = time.perf_counter()
        logits = target.forward(np.array([[seq[-1], *d]]), np.arange(k_now + 1))[0, :, :vocab]  # [k+1, V]
        t2 = time.perf_counter()
        costs.observe_target(k_now + 1, t2 - t1)
        stats.target_passes += 1

        # 3. Accept a prefix of the drafts and take one more token from the target.
        if greedy:
            n, t = sampling.accept_greedy(d, logits)
        else:
            n, t = sampling.accept_sample(d, p_draft, sampling.warp(logits, cfg.sampling), rng.random(k_now + 1))

        new = [int(v) for v in d[:n]] + [t]
        if auto:  # what the controller expected of this round
            predicted_tokens += auto.expected_tokens(k_now)
            predicted_s += auto.cost(k_now)
        scored = None
        if lookup is not None and lookup.name == "ngram" and lookup.matched:
            # The n-gram proposal is scored in full against what the target emitted, whether this round
            # verified all of it, part of it or none of it (a plain round, a hybrid round the model
            # drafted): a point-mass draft token is accepted exactly when the target's token equals it
            # (greedy), or with p_target(token), the chance that the emitted sample equals it. So its kind's
            # estimate keeps learning where it would otherwise stick, and positions past k are measured too.
            shadow = lookup.proposal
            m = next((i for i, (a, b) in enumerate(zip(shadow, new)) if a != b), min(len(shadow), len(new)))
            scored = controller(lookup.kind)
            scored.observe(m if m == len(new) else min(len(shadow), m + 1), m)
        if auto and auto is not scored:  # then what it saw
            auto.observe(k_now, n)
        if calib is not None and ((k_now and src is model) or (k_now == 0 and calib.ready)) and model.kind in autos:
            # How sure the target was of its token at the first position: learned against what a model
            # draft there got (accepted or not); in a plain round, what that predicts steers the estimate.
            top = sampling.top_prob(logits[0])
            if k_now:
                calib.observe(top, n > 0)
            elif (predicted := calib.predict(top)) is not None:
                autos[model.kind].follow(predicted)

        # 4. Commit: keep the verified slots; rejected ones are dropped by moving the length back.
        target.truncate(base + 1 + n)
        if drafter is not None:
            drafter.commit(len(seq) + n)
        spent += t2 - t0
        stats.proposed += k_now
        stats.accepted += n
        for i in range(k_now):
            stats.proposed_at[i] += 1
            stats.accepted_at[i] += i < n

    stats.new_tokens = len(out)
    stats.wall_s = time.perf_counter() - start
    c1 = costs.target(1)
    if c1 and spent:
        stats.measured_speedup = (len(out) - 1) * c1 / spent  # tokens after the first, vs one pass each
        if adaptive:
            stats.rounds_skipped = sum(a.rounds_skipped for a in autos.values())
            stats.acceptance_estimate = {n: [round(x, 4) for x in a.accept] for n, a in autos.items()}
            stats.predicted_speedup = predicted_tokens * c1 / predicted_s if predicted_s else 0.0
    if probes is not None:
        probes.update({n: a.probe_state for n, a in autos.items()})
    return out, reason or "length", stats
