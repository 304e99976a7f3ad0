"""The speculative round (DESIGN §4), batch 1.

Invariant: the last emitted token is not yet in the target's cache; a proposer's next input is the
part of the committed sequence its cache has not seen. Who drafts and how far is the policy's
(decoding/policy.py); what a draft is, the proposer's (decoding/proposers.py); the accept test, sampling's.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from specrt.config import GenerationConfig
from specrt.decoding import sampling
from specrt.decoding.policy import Policy, Round
from specrt.decoding.prefix import PromptCache
from specrt.decoding.proposers import NOTHING
from specrt.engines.base import Engine


@dataclass(frozen=True)
class Result:
    tokens: list[int]  # generated ids, prompt and EOS excluded
    text: str  # decoded generated text (ends before a stop string)
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: dict  # see Stats.as_dict


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
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)  # rounds that drafted, by proposer name
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)  # draft tokens accepted, by proposer name
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # rounds per draft length actually used
    rounds_skipped: int = 0  # auto: rounds the guard ran without drafting
    predicted_speedup: float = 0.0  # auto/fixed: E(tokens)/cost from the cost model, vs one target pass a token
    measured_speedup: float = 0.0  # tokens / (draft + verify time) vs the measured one-token target pass
    acceptance_estimate: dict[str, list[float]] = field(default_factory=dict)  # auto: per drafter, conditional acceptance per position at the end
    new_tokens: int = 0
    prompt_tokens: int = 0
    prompt_cached: int = 0  # prompt tokens whose target cache entries were kept from an earlier request
    ttft_s: float = 0.0
    wall_s: float = 0.0

    def count(self, r: Round) -> None:
        """Add one round."""
        self.rounds += 1
        self.target_passes += 1
        self.draft_passes += r.proposal.passes
        if r.planned:
            name = r.proposer.name
            self.rounds_by_drafter[name] = self.rounds_by_drafter.get(name, 0) + 1
            self.accepted_by_drafter[name] = self.accepted_by_drafter.get(name, 0) + r.accepted
        self.draft_len_hist[r.k] = self.draft_len_hist.get(r.k, 0) + 1
        self.proposed += r.k
        self.accepted += r.accepted
        for i in range(r.k):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < r.accepted

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


def emit(new: list[int], eos_ids: frozenset[int], room: int) -> tuple[list[int], str]:
    """The part of a round's tokens that is output: never past EOS (reason "eos") or `room` tokens."""
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[:min(i, room)], "eos"
    return new[:room], ""


def decode(target: Engine, policy: Policy, prompt: list[int], cfg: GenerationConfig, vocab: int,
           eos_ids: frozenset[int], on_tokens: Callable[[list[int]], bool] | None = None,
           prompt_cache: PromptCache | None = None) -> tuple[list[int], str, Stats]:
    """Generate after `prompt`. Returns (tokens, finish reason "eos" | "length" | "stop", stats).

    `on_tokens(new)` sees each round's emitted tokens (EOS excluded) and returns True to stop. Only the
    first `vocab` logits are used, which masks padding rows of larger output matrices. `prompt_cache`:
    what the target's cache kept of earlier prompts (decoding/prefix.py; None: the prompt is read whole).
    """
    rng, k = np.random.default_rng(cfg.seed), policy.max_k
    stats = Stats(draft_len=cfg.draft_len if k else 0, proposed_at=[0] * k, accepted_at=[0] * k,
                  prompt_tokens=len(prompt))
    start = time.perf_counter()
    # 1. Prefill: the target reads the prompt (but the whole chunks it kept of an earlier one); its last
    #    position gives the first token.
    logits, stats.prompt_cached = (prompt_cache or PromptCache()).read(target, prompt)
    new, seq, out = [sampling.pick(logits[:vocab], cfg.sampling, rng)], list(prompt), []
    stats.target_passes, stats.ttft_s = 1, time.perf_counter() - start
    policy.start(prompt)
    while True:
        # 2. Emit, and stop at EOS, at max_new_tokens, or when the caller says so.
        new, reason = emit(new, eos_ids, cfg.max_new_tokens - len(out))
        out += new
        seq += new
        if on_tokens is not None and new and on_tokens(new):
            reason = "stop"
        if reason or len(out) >= cfg.max_new_tokens:
            break
        # 3. Plan: who drafts and how far (a round emits at most k + 1 tokens).
        left = cfg.max_new_tokens - len(out)
        proposer, k = policy.plan(seq, min(policy.max_k, left - 1), left)
        # 4. Draft up to k tokens (p_draft None: point masses, or greedy).
        t0 = time.perf_counter()
        draft = proposer.propose(seq, k, cfg.sampling, rng, cfg.confidence_stop) if k else NOTHING
        d = draft.tokens  # [k'] k' <= k
        # 5. Verify the last token and all drafts in one target pass.
        base, t1 = target.length, time.perf_counter()  # the target has seen seq[:-1]
        logits = target.forward(np.array([[seq[-1], *d]]), np.arange(len(d) + 1))[0, :, :vocab]  # [k'+1, V]
        t2 = time.perf_counter()
        # 6. Accept a prefix of the drafts, and one more token from the target.
        n, t = sampling.accept(d, draft.p_draft, logits, cfg.sampling, rng)
        new = [*d[:n].tolist(), t]
        # 7. Commit: the verified slots stay; rejected ones go by moving the lengths back.
        target.truncate(base + 1 + n)
        policy.commit(len(seq) + n)
        r = Round(proposer, k, draft, n, new, logits, draft_s=t1 - t0, verify_s=t2 - t1)
        policy.observe(r)
        stats.count(r)
    if prompt_cache is not None:
        prompt_cache.extend(target, seq)  # what decoding wrote, where that is exact
    stats.new_tokens, stats.wall_s = len(out), time.perf_counter() - start
    for name, value in policy.finish(len(out)).items():
        setattr(stats, name, value)
    return out, reason or "length", stats
