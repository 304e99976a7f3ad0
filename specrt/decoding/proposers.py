"""Proposers: whatever proposes the draft tokens the target verifies.

A proposal is `tokens [k'] (k' <= k)` with `p_draft [k', V]`, or None for point masses (the proposal
is deterministic, or greedy), which the rejection test handles exactly: d is accepted with probability
p_target(d). After verification the round tells every proposer how much of the sequence is committed,
so a model proposer rolls its cache back. Which proposer drafts and how far is the policy's choice
(decoding/policy.py); the round (decoding/decode.py) knows neither by name.

A model proposer's draft loop is a coroutine (`steps`): it yields the tokens each draft pass reads and
is sent that pass's logits row. `propose` drives it over the proposer's own engine (batch 1); batched
decoding drives many rows' coroutines in lockstep through one batched pass per position.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from specrt.config import HISTORY_CAP, SamplingConfig
from specrt.decoding import sampling
from specrt.decoding.constraint import Constraint
from specrt.engines.base import Engine
from specrt.errors import ConfigError


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # [k'] int64
    p_draft: np.ndarray | None = None  # [k', V] warped draft distributions; None: point masses
    passes: int = 0  # draft model passes it took (a catch-up pass included)
    catchup_s: float = 0.0  # time of its first pass when that read > 2 tokens (catching up), else 0
    catchup_tokens: int = 0  # how many tokens that pass read
    # a model draft's next choices (when asked for, for a tree): per position, the m likeliest tokens other than
    # the drafted one, likeliest first (-1: none), and their draft probabilities
    runner_up: np.ndarray | None = None  # [k', m] int64
    runner_up_p: np.ndarray | None = None  # [k', m]
    tops: np.ndarray | None = None  # [k']: a model draft's probability of its likeliest token at each position

    def cut(self, n: int) -> Proposal:
        """Its first n tokens (what a grammar allows of it)."""
        if n >= len(self.tokens):
            return self
        part = lambda a: None if a is None else a[:n]  # noqa: E731
        return Proposal(self.tokens[:n], part(self.p_draft), self.passes, self.catchup_s, self.catchup_tokens,
                        part(self.runner_up), part(self.runner_up_p), part(self.tops))


NOTHING = Proposal(np.empty(0, np.int64))


@dataclass(frozen=True)
class Found:
    """What a proposer that needs no pass (a lookup) would propose for a sequence."""

    tokens: np.ndarray  # up to k tokens (empty: nothing to propose)
    matched: int  # length of the suffix of the sequence they continue (0: no match)
    kind: str  # the estimate auto learns it under: "ngram1".."ngram8", "suffix1".."suffix8"; "ngram": nothing
    name: str  # "ngram" | "suffix": what the stats count its rounds by
Steps = Generator[list[int], np.ndarray, Proposal]  # yields a pass's tokens, is sent its logits row [W]
# asked after each drafted token with the draft's probability of its likeliest token there: stop drafting?
Stop = Callable[[float], bool]


def below(threshold: float) -> Stop | None:
    """A request's `confidence_stop`: stop after a token drafted with less confidence than this (0: never)."""
    return (lambda top: top < threshold) if threshold else None


class Proposer(Protocol):
    name: str  # of its last proposal: "model" | "ngram" | "suffix", what the stats count rounds by
    kind: str  # of its last proposal: what its acceptance is learned under (auto keeps one estimate per kind)
    free: bool  # proposing costs (next to) nothing: no model pass

    def start(self, prompt: list[int]) -> None: ...
    def find(self, seq: list[int], k: int) -> Found | None:
        """What it would propose, when that is known without a pass (None: not known). A query: it changes
        nothing but what `propose` may reuse for the same sequence."""
    def behind(self, seq: list[int]) -> int:
        """Tokens its next proposal reads before it can draft (what a catch-up costs)."""
    def steps(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
              stop: Stop | None = None, constraint: Constraint | None = None) -> Steps:
        """Its proposal's coroutine; under a `constraint` a model drafts from its masked distributions."""
    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
                stop: Stop | None = None) -> Proposal: ...
    def commit(self, valid: int) -> None:
        """The first `valid` tokens of the sequence are committed."""


def spread(x: np.ndarray, ids: np.ndarray | None, vocab: int, fill: float = 0.0, dtype=None) -> np.ndarray:
    """Values over the draft's output ids [..., W] -> over all ids [..., vocab]: with a restricted output
    vocabulary (`ids`, see export/vocab.py) entry j stands for token ids[j] and every other id gets `fill`
    (a distribution's 0 by default), in `dtype` (default x's)."""
    if ids is None:
        return x[..., :vocab]
    full = np.full(x.shape[:-1] + (vocab,), fill, dtype or x.dtype)
    full[..., ids] = x
    return full


def expand_logits(rows: np.ndarray, ids: np.ndarray | None, vocab: int) -> np.ndarray:
    """Draft logits [..., W] -> [..., vocab], every id outside a restricted vocabulary at -inf, i.e. probability 0
    after warping: the draft distribution renormalised over the kept ids, which keeps the test exact."""
    return spread(rows, ids, vocab, -np.inf, np.float32)


def greedy(rows: np.ndarray, ids: np.ndarray | None, vocab: int, m: int = 0) -> tuple[int, float, list[tuple[int, float]]]:
    """(argmax token, its probability, the m next likeliest as `runner_up` gives them) from draft logits rows [W],
    no expansion; the softmax's weights computed once for both."""
    lg = rows[:vocab] if ids is None else rows
    j = int(lg.argmax())
    z = np.exp(lg - lg[j])
    s = z.sum()
    alts = [(a if ids is None or a < 0 else int(ids[a]), q / float(s)) for a, q in runner_up(z, j, m)] if m else []
    return (j if ids is None else int(ids[j])), float(1.0 / s), alts


def runner_up(p: np.ndarray, t: int, m: int = 1) -> list[tuple[int, float]]:
    """The m likeliest tokens of distribution p [V] other than t, likeliest first ((-1, 0.0) past the ones with
    any probability), with their probabilities; p is left as it was (m argmaxes: cheaper than a partition for a
    few)."""
    taken, saved, out = [t], [float(p[t])], []
    p[t] = -1.0
    for _ in range(m):
        j = int(p.argmax())
        if p[j] <= 0:
            break
        out.append((j, float(p[j])))
        taken.append(j), saved.append(float(p[j]))
        p[j] = -1.0
    p[taken] = saved
    return out + [(-1, 0.0)] * (m - len(out))


class DraftMemory:
    """What the draft's cache slots hold across requests: the sequence of the request that last used
    it (a live reference; slots below its length hold its tokens). Kept by the Pair."""

    def __init__(self):
        self.seq: list[int] = []
        self.off = 0  # the position in `seq` of the token the first slot holds (a windowed draft)

    def forget(self) -> None:
        self.seq, self.off = [], 0

    def keep(self, n: int) -> None:
        """Keep only the first n tokens (the slots past them count as empty)."""
        self.seq = self.seq[:n]


def default_window(device: str) -> int:
    """The draft model's catch-up window when none is asked for (0: no limit), the one place that decides
    it for a request alone and for a row of the batched decoder alike. On the CPU a pass costs by the token
    it reads, and reading only the last 32 drafted better than reading it all or the last 16 or 64
    (bench/RESULTS.md). On a GPU a pass over a few hundred tokens costs about one step: no limit."""
    return 32 if device == "cpu" else 0


def model_drafter(engine: Engine, vocab: int, ids: np.ndarray | None, memory: DraftMemory | None,
                  draft_window: int | None, device: str) -> Callable[[int | None], ModelProposer]:
    """What builds a request's ModelProposer (given the policy's `skip`) from its `draft_window` (None: the
    device's default): one rule for a request alone and for a batch row, so both draft, and draw, alike."""
    window = (default_window(device) if draft_window is None else draft_window) or None

    def model(skip: int | None) -> ModelProposer:
        skip = min(skip, window) if skip and window else None  # an unwindowed draft reads what it missed
        return ModelProposer(engine, vocab, ids, memory, window, skip=skip)

    return model


class ModelProposer:
    """A small draft model with its own KV cache, which holds a stretch of the sequence from position
    `off` on (0 unless windowed). `ids`: the token ids of its logits rows when its output vocabulary is
    restricted. `memory`: with one, a request keeps the cache entries of the prefix its prompt shares
    with the previous request's sequence (a system prompt, earlier turns) instead of reading them
    again; exact, since those entries are what a fresh read computes, and the draft only steers.
    `window`: the most tokens one catch-up pass reads (None: no limit); further behind (the prompt,
    what n-gram or plain rounds emitted) it starts over from the last `window` tokens, which may cost
    acceptance, never correctness. `skip`: once it has drafted in the request, a catch-up reads only
    the last `skip` tokens it missed and keeps the slots before them (slot j then holds seq[off + j]
    only from the last gap on, and the memory is dropped: the slots are no longer a prefix)."""

    name = "model"
    free = False

    def __init__(self, engine: Engine, vocab: int, ids: np.ndarray | None = None, memory: DraftMemory | None = None,
                 window: int | None = None, kind: str = "model", skip: int | None = None):
        self.engine, self.vocab, self.ids, self.memory, self.window = engine, vocab, ids, memory, window
        self.kind, self.skip = kind, skip
        self.runner_up = 0  # its proposals carry each position's next this many choices (a tree's policy sets it)
        self.off = 0  # the position in the sequence of the token the first cache slot holds
        self.fresh = True  # not drafted yet in this request: its first pass reads the prompt (up to `window`)

    def find(self, seq: list[int], k: int) -> None:
        return None

    def behind(self, seq: list[int]) -> int:
        n = self._unread(seq)
        if self.skip is not None and not self.fresh:
            n = min(n, self.skip)
        return n if self.window is None else min(n, self.window)

    def _unread(self, seq: list[int]) -> int:
        return len(seq) - self.off - self.engine.length

    def start(self, prompt: list[int]) -> None:
        # No prefill: the first proposal reads the prompt (a catch-up pass), so a request in which the
        # policy never drafts never pays for the draft's prefill.
        keep, self.off, self.fresh = 0, 0, True
        if self.memory is not None:
            prev, off = self.memory.seq, self.memory.off
            # slots past len(prev) may hold rejected drafts
            n = max(min(self.engine.length, len(prev) - off, len(prompt) - off), 0)
            same = np.asarray(prev[off:off + n], np.int64) == np.asarray(prompt[off:off + n], np.int64)
            keep = n if same.all() else int(same.argmin())
            self.off = off if keep else 0
            self.memory.seq, self.memory.off = list(prompt[:self.off + keep]), self.off
        self.engine.truncate(keep)

    def steps(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
              stop: Stop | None = None, constraint: Constraint | None = None) -> Steps:
        """Draft up to k tokens; stop where `stop` says after a token (given the draft's top probability there,
        which the proposal keeps), or where the `constraint` allows no token. Under a constraint each position's
        logits are masked as the target's will be (decoding/constraint.py), so the draft's distributions are the
        constrained ones."""
        if self.skip is not None and not self.fresh and self._unread(seq) > self.skip:
            # Read only the last `skip` tokens of what it missed; the cache keeps what came before, with a
            # gap (the skipped tokens' positions go to the ones after them).
            self.off = len(seq) - self.skip - self.engine.length
            if self.memory is not None:
                self.memory.forget()
                self.memory = None
        elif self.window is not None and (self._unread(seq) > self.window or
                                          self.fresh and self.off != max(0, len(seq) - self.window)):
            # start over from the last `window` tokens; a request's first read always sees those (the prompt
            # from its start if shorter), whatever the memory kept, so that what the draft sees depends on
            # the request alone
            self.off = max(0, len(seq) - self.window)
            self.engine.truncate(0)
        feed = seq[self.off + self.engine.length:]  # whatever the draft has not seen, x_last included
        self.fresh = False
        if self.memory is not None:  # the live sequence: its committed tokens from `off` on are what the slots hold
            self.memory.seq, self.memory.off = seq, self.off
        d, p, passes, alt, tops = [], None if cfg.greedy else [], 0, [], []
        for _ in range(k):
            rows = yield feed  # [W]
            passes += 1
            allowed = constraint.allowed(d) if constraint is not None else None
            if allowed is not None:
                rows = expand_logits(rows, self.ids, self.vocab)
                rows[~allowed] = -np.inf
                if rows.max() == -np.inf:  # nothing the grammar allows is in the draft's vocabulary
                    break
            ids = None if allowed is not None else self.ids
            if p is None:
                t, top, alts = greedy(rows, ids, self.vocab, self.runner_up)
            else:
                # warped over the draft's own ids (a third of the vocabulary when restricted: a third of the
                # work), then spread over all ids for the acceptance test
                q = sampling.warp(rows[None, :self.vocab], cfg)[0]
                t, top = sampling.sample(q, rng, len(seq) + len(d), ids), q.max()
                p.append(spread(q, ids, self.vocab))  # [V]
            d.append(t)
            tops.append(float(top))
            if self.runner_up:  # from the logits in hand: no pass
                m = self.runner_up
                alt.append(alts if p is None else runner_up(p[-1], t, m))
            feed = [t]
            if stop is not None and stop(top):
                break
        more = {}
        if alt:
            a = np.array(alt, np.float64).reshape(len(alt), self.runner_up, 2)
            more = dict(runner_up=a[..., 0].astype(np.int64), runner_up_p=a[..., 1])
        return Proposal(np.array(d, np.int64), np.stack(p) if p else None, passes=passes, tops=np.array(tops), **more)

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
                stop: Stop | None = None, constraint: Constraint | None = None) -> Proposal:
        steps, catchup = self.steps(seq, k, cfg, rng, stop, constraint), (0.0, 0)
        feed = next(steps)
        while True:
            t0 = time.perf_counter()
            rows = self.engine.forward(np.array([feed]), np.array([len(feed) - 1]))[0, 0]  # [W]
            if len(feed) > 2:  # catching up after rounds without drafting: not the cost of a draft step
                catchup = (time.perf_counter() - t0, len(feed))
            try:
                feed = steps.send(rows)
            except StopIteration as done:
                return replace(done.value, catchup_s=catchup[0], catchup_tokens=catchup[1])

    def commit(self, valid: int) -> None:
        self.engine.truncate(min(self.engine.length, valid - self.off))


class LookupProposer:
    """Prompt lookup: find the earlier occurrences of the longest suffix of the sequence (up to
    `max_ngram` tokens) and propose what followed the first of them. No model at all; it shines where
    the answer repeats the input (code edits, quoting).

    How often a proposal is right depends mostly on how long a suffix it matched (greedy outputs of the
    1.5B target on 15 prompts: the first token is accepted 21% of the time after a 1-token match, 46%
    after 2, ~80% after 3-7 and 84-95% after 8 or more), so `find` names each proposal's kind by that
    length ("ngram1", "ngram2", "ngram3" = 3-7, "ngram8" = 8 or more) and auto keeps one estimate per
    kind: a long copy gets long drafts. Among equally long matches the first wins: in an edit the first
    occurrence is mostly the source being copied (the prompt's code), later ones coincidental repeats.
    """

    name = "ngram"
    free = True

    def __init__(self, max_ngram: int = 16, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = self.kind = "ngram"  # of the last proposal
        self._found, self._at = None, (-1, 0)  # the last `find` and its (len(seq), k), which `propose` reuses

    def start(self, prompt: list[int]) -> None:
        self.name = self.kind = "ngram"
        self._found, self._at = None, (-1, 0)

    def behind(self, seq: list[int]) -> int:
        return 0

    def find(self, seq: list[int], k: int) -> Found:
        self._found, self._at = self._search(seq, k), (len(seq), k)
        return self._found

    def _search(self, seq: list[int], k: int) -> Found:
        tokens, n = self.match(seq, k)
        return Found(tokens, n, self._kind("ngram", n), "ngram")

    def _kind(self, family: str, n: int) -> str:
        """The kind of a proposal that continues an n-token match ("ngram" alone: nothing matched)."""
        if not n:
            return "ngram"
        return f"{family}8" if n >= 8 else f"{family}{min(n, 3)}"

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
                stop: Stop | None = None) -> Proposal:
        if self._found is not None and self._at[0] == len(seq) and self._at[1] >= k:  # what the last find found
            found = self._found
        else:
            found = self.find(seq, k)
        self.name, self.kind = found.name, found.kind
        return Proposal(found.tokens[:k])

    def steps(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
              stop: Stop | None = None, constraint: Constraint | None = None) -> Steps:
        return self.propose(seq, k, cfg, rng)  # what leaves a constraint is cut by the round
        yield  # a generator that needs no pass

    def match(self, seq: list[int], k: int) -> tuple[np.ndarray, int]:
        """(up to k proposed tokens, length of the suffix they continue; 0 = no match)."""
        arr = np.asarray(seq, np.int64)
        ends, n = longest_suffix(arr, arr, self.max_ngram)  # earlier occurrences of the sequence's end
        if not len(ends) or n < self.min_ngram:
            return np.empty(0, np.int64), 0
        return arr[ends[0] + 1: ends[0] + 1 + k].copy(), n

    def commit(self, valid: int) -> None:
        pass


class History:
    """The outputs of earlier requests on one pair (a batch job's, a conversation's, a server's), for the
    suffix proposer: one append-only token buffer, requests separated by -1 (no match crosses one),
    holding at most `cap` tokens; the oldest requests go first. 4 bytes a token."""

    def __init__(self, cap: int = HISTORY_CAP):
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
            raise ConfigError(f"the suffix history's cap must be an integer >= 1 (tokens), got {cap!r}")
        self.cap = int(cap)
        self.buf = np.empty(0, np.int32)
        self.requests = 0

    def __len__(self) -> int:
        return len(self.buf)

    def clear(self) -> None:
        self.buf, self.requests = np.empty(0, np.int32), 0

    def add(self, tokens) -> None:
        """One request's output."""
        t = np.asarray(tokens, np.int32)
        t = t[max(0, len(t) - (self.cap - 1)):]  # one slot goes to the separator
        if not len(t):
            return
        buf = np.concatenate([self.buf, t, [-1]]).astype(np.int32, copy=False)
        if len(buf) > self.cap:  # drop whole requests from the front until it fits (the new one always does)
            seps = np.flatnonzero(buf == -1)
            cut = int(seps[np.searchsorted(seps, len(buf) - 1 - self.cap)]) + 1
            self.requests -= int(np.count_nonzero(buf[:cut] == -1))
            buf = buf[cut:].copy()
        self.buf = buf
        self.requests += 1


def longest_suffix(hay: np.ndarray, seq: np.ndarray, max_ngram: int) -> tuple[np.ndarray, int]:
    """(positions e in hay, n): hay[e-n+1..e] == the last n tokens of seq, with n as large as any match
    allows (at most max_ngram), each e followed by a token (not -1, not the end). -1 matches nothing."""
    if len(seq) < 1 or len(hay) < 2:
        return np.empty(0, np.int64), 0
    ends = np.flatnonzero((hay[:-1] == seq[-1]) & (hay[1:] >= 0))
    if not len(ends):
        return ends, 0
    n = 1
    while n < min(max_ngram, len(seq)):
        longer = ends[ends >= n]
        longer = longer[hay[longer - n] == seq[-1 - n]]
        if not len(longer):
            break
        ends, n = longer, n + 1
    return ends, n


def frequent_continuation(hay: np.ndarray, ends: np.ndarray, k: int, min_share: float = 0.0) -> np.ndarray:
    """Up to k tokens following the positions `ends` in hay, each the most frequent next token among the
    occurrences that agree so far (ties: the one seen last); stops at a -1, the end of hay, or where that
    token follows less than `min_share` of those occurrences (where earlier outputs disagree)."""
    out = []
    for j in range(1, k + 1):
        ends = ends[ends + j < len(hay)]
        nxt = hay[ends + j]
        keep = nxt >= 0
        ends, nxt = ends[keep], nxt[keep]
        if not len(nxt):
            break
        values, last, counts = np.unique(nxt[::-1], return_index=True, return_counts=True)
        if counts.max() < min_share * len(nxt):
            break
        best = np.flatnonzero(counts == counts.max())
        t = values[best[np.argmin(last[best])]]  # the tied token whose latest occurrence is latest
        out.append(int(t))
        ends = ends[nxt == t]
    return np.array(out, np.int64)


class SuffixProposer(LookupProposer):
    """Prompt lookup plus the outputs of earlier requests (SuffixDecoding, Oliaro et al. 2024): the
    longest suffix of the sequence is matched in the request's own sequence and in the History; a longer
    match in the history wins, and it proposes the most frequent continuation there (a point mass, so
    verification stays exact) while at least `min_share` of the matching occurrences agree on it. A match in the request itself proposes what prompt lookup would. Its
    proposals' kinds are "suffix1".."suffix8" by matched length when they come from the history, the
    lookup's otherwise, so auto learns (and turns off) each apart."""

    def __init__(self, history: History, max_ngram: int = 16, min_ngram: int = 1, min_share: float = 0.5):
        super().__init__(max_ngram, min_ngram)
        self.history, self.min_share = history, min_share

    def _search(self, seq: list[int], k: int) -> Found:
        own, n_own = self.match(seq, k)
        ends, n = longest_suffix(self.history.buf, np.asarray(seq, np.int64), self.max_ngram)
        if n > n_own and n >= self.min_ngram:
            tokens = frequent_continuation(self.history.buf, ends, k, self.min_share)
            if len(tokens):
                return Found(tokens, n, self._kind("suffix", n), "suffix")
        return Found(own, n_own, self._kind("ngram", n_own), "ngram")


class GrammarProposer:
    """The tokens a request's grammar allows as the only continuation (decoding/constraint.py): a free
    proposal of point masses, which the target accepts with its own (constrained) probability."""

    name = kind = "grammar"
    free = True

    def __init__(self, constraint: Constraint):
        self.constraint = constraint

    def start(self, prompt: list[int]) -> None:
        pass

    def behind(self, seq: list[int]) -> int:
        return 0

    def find(self, seq: list[int], k: int) -> Found:
        return Found(np.array(self.constraint.forced(k), np.int64), 0, "grammar", "grammar")

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
                stop: Stop | None = None, constraint: Constraint | None = None) -> Proposal:
        return Proposal(self.find(seq, k).tokens)

    def steps(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator | sampling.Coupled,
              stop: Stop | None = None, constraint: Constraint | None = None) -> Steps:
        return self.propose(seq, k, cfg, rng)
        yield  # a generator that needs no pass

    def commit(self, valid: int) -> None:
        pass
