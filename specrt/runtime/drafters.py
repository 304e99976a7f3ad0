"""Drafters: whatever proposes the k tokens the target verifies.

A drafter proposes `(tokens [k'], p_draft [k', V] or None)` for k' <= k; None means point masses
(the proposal is deterministic), which the rejection test handles exactly: d is accepted with
probability p_target(d). After verification the loop tells the drafter how much of the sequence
is now committed, so a model drafter can roll its cache back.
"""
from __future__ import annotations

import time

import numpy as np

from specrt.config import SamplingConfig
from specrt.engines.base import Engine
from specrt.runtime import sampling


def expand_logits(rows: np.ndarray, ids: np.ndarray | None, vocab: int) -> np.ndarray:
    """Draft logits [..., W] -> [..., vocab]. With a restricted output vocabulary (`ids`, see
    export/vocab.py) row j stands for token ids[j] and every other id gets -inf, i.e. probability 0
    after warping: the draft distribution renormalised over the kept ids, which keeps the test exact."""
    if ids is None:
        return rows[..., :vocab]
    full = np.full(rows.shape[:-1] + (vocab,), -np.inf, np.float32)
    full[..., ids] = rows
    return full


def greedy_pick(rows: np.ndarray, ids: np.ndarray | None, vocab: int, want_top: bool) -> tuple[int, float]:
    """(argmax token, its probability or 1.0 when not wanted) from draft logits rows [W], no expansion."""
    lg = rows[:vocab] if ids is None else rows
    j = int(lg.argmax())
    top = 1.0 / np.exp(lg - lg[j]).sum() if want_top else 1.0
    return (j if ids is None else int(ids[j])), top


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
    """The draft model's catch-up window when none is asked for (0: no limit). On the CPU a pass costs by
    the token it reads (int4 0.5B draft: ~2.6 ms a token, a 150-token prompt ~11 target steps), and
    reading only the last 32 drafted better than reading it all or the last 16 or 64 (bench/RESULTS.md,
    ninth sitting). On a GPU a pass over a few hundred tokens costs about one step: the draft keeps it all."""
    return 32 if device == "cpu" else 0


class ModelDrafter:
    """A small draft model with its own KV cache. Its cache holds a stretch of the sequence from
    position `off` on (0 unless windowed). `ids`: the token ids of its logits rows when its output
    vocabulary is restricted. `memory`: with one, a request keeps the cache entries of the prefix its
    prompt shares with the previous request's sequence (a system prompt, the earlier turns of a
    conversation) instead of reading them again. That is exact: those entries are what a fresh read
    would compute, and the draft only steers proposals, so the output cannot change either way.
    `window`: the most tokens one catch-up pass reads (None: no limit). A draft further behind (the
    prompt, at the start of a request; what n-gram rounds or plain rounds emitted) starts over from
    the last `window` tokens: it drafts with less context, which may cost acceptance, never
    correctness, and a catch-up never costs more than reading `window` tokens. `skip` (set by
    HybridDrafter): once it has drafted in the request, a catch-up reads only the last `skip`
    tokens it missed and keeps the slots before them; slot j then holds seq[off + j] only from the
    last gap on, and the memory is dropped (the slots are no longer a prefix of the sequence)."""

    name = kind = "model"
    skip: int | None = None  # after its first draft of a request, a catch-up reads at most this many tokens (None: all)

    def __init__(self, engine: Engine, vocab: int, ids: np.ndarray | None = None, memory: DraftMemory | None = None,
                 window: int | None = None):
        self.engine, self.vocab, self.ids, self.memory, self.window = engine, vocab, ids, memory, window
        self.off = 0  # the position in the sequence of the token the first cache slot holds
        self.catchup_s = 0.0  # time of the last propose's first pass when it caught up on > 2 tokens
        self.catchup_tokens = 0  # how many tokens that pass read
        self.fresh = True  # not drafted yet in this request: its first pass reads the prompt (up to `window`)

    def pick(self, seq: list[int], k: int, judged: bool = False):
        return self

    def behind(self, seq: list[int]) -> int:
        """Tokens its next pass reads first: what it has not read of `seq`, at most `window` (at most
        `skip` once it has drafted in the request)."""
        n = self._unread(seq)
        if self.skip is not None and not self.fresh:
            n = min(n, self.skip)
        return n if self.window is None else min(n, self.window)

    def _unread(self, seq: list[int]) -> int:
        return len(seq) - self.off - self.engine.length

    def start(self, prompt: list[int]) -> None:
        # No prefill here: the first propose feeds the prompt (a catch-up pass), so a request in which
        # auto never drafts never pays for the draft's prefill.
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

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator,
                confidence_stop: float = 0.0):
        """Draft up to k tokens; stop after a token whose top probability is below `confidence_stop`."""
        d = np.empty(k, np.int64)
        p_draft = None if cfg.greedy else np.empty((k, self.vocab))  # [k, V]
        if self.skip is not None and not self.fresh and self._unread(seq) > self.skip:
            # Read only the last `skip` tokens of what it missed: its cache keeps what came before, with
            # a gap (the skipped tokens' positions go to the ones after them). The draft's view is then
            # not the sequence, which may cost acceptance, never correctness; the draft cache no longer
            # holds a prefix of the sequence, so the next request does not reuse it.
            self.off = len(seq) - self.skip - self.engine.length
            if self.memory is not None:
                self.memory.forget()
                self.memory = None
        elif self.window is not None and self._unread(seq) > self.window:
            self.off = len(seq) - self.window  # start over from the last `window` tokens
            self.engine.truncate(0)
        inp = seq[self.off + self.engine.length:]  # whatever the draft has not seen, x_last included
        self.fresh = False
        if self.memory is not None:  # the live sequence: its committed tokens from `off` on are what the slots hold
            self.memory.seq, self.memory.off = seq, self.off
        self.catchup_s, self.catchup_tokens = 0.0, 0
        for i in range(k):
            t0 = time.perf_counter()
            rows = self.engine.forward(np.array([inp]), np.array([len(inp) - 1]))[0, 0]  # [W]
            if len(inp) > 2:  # catching up after rounds without drafting: not the cost of a draft step
                self.catchup_s, self.catchup_tokens = time.perf_counter() - t0, len(inp)
            if cfg.greedy:
                d[i], top = greedy_pick(rows, self.ids, self.vocab, bool(confidence_stop))
            else:
                p_draft[i] = sampling.warp(expand_logits(rows, self.ids, self.vocab)[None], cfg)[0]
                d[i] = sampling.draw(p_draft[i], rng.random())
                top = p_draft[i].max()
            inp = [int(d[i])]
            if top < confidence_stop:
                return d[: i + 1], None if p_draft is None else p_draft[: i + 1], i + 1
        return d, p_draft, k  # k draft passes

    def commit(self, valid: int) -> None:
        """The first `valid` tokens of the sequence are committed: drop cache slots past them."""
        self.engine.truncate(min(self.engine.length, valid - self.off))


class NgramDrafter:
    """Prompt lookup: find the earlier occurrences of the longest suffix of the sequence (up to
    `max_ngram` tokens) and propose what followed the first of them.

    No model at all; it shines where the answer repeats the input (code edits, quoting). How often a
    proposal is right depends mostly on how long a suffix it matched (greedy outputs of the 1.5B target
    on 15 prompts: the first token is accepted 21% of the time after a 1-token match, 46% after 2,
    ~80% after 3-7 and 84-95% after 8 or more), so `pick` names each proposal's kind by that length
    ("ngram1", "ngram2", "ngram3" = 3-7, "ngram8" = 8 or more) and `draft_len="auto"` keeps one
    controller per kind: a long copy gets long drafts. Among equally long matches the first wins: in an
    edit the first occurrence is mostly the source being copied (the prompt's code), later ones
    coincidental repeats (bench/ngram_match.py: +5% tokens per target pass on edits at k=3, +11% at k=8,
    over the most recent 3-gram; the same on code and chat).
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 16, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.kind = "ngram"  # of the last pick: ngram1 / ngram2 / ngram3 / ngram8, or ngram when nothing matched
        self.matched = 0  # suffix length the last pick matched (0: none)
        self._picked = None  # (len(seq), k, proposal) of the last pick, reused by propose

    def start(self, prompt: list[int]) -> None:
        self._picked = None

    def behind(self, seq: list[int]) -> int:
        return 0  # nothing to catch up

    def pick(self, seq: list[int], k: int, judged: bool = False):
        d, n = self.match(seq, k)
        self._picked = (len(seq), k, d)
        self.matched = n
        self.kind = ("ngram8" if n >= 8 else f"ngram{min(n, 3)}") if n else "ngram"
        return self

    def propose(self, seq: list[int], k: int, cfg: SamplingConfig, rng: np.random.Generator,
                confidence_stop: float = 0.0):
        if self._picked and self._picked[0] == len(seq) and self._picked[1] >= k:
            return self._picked[2][:k], None, 0  # what pick found for this very sequence
        return self.lookup(seq, k), None, 0

    @property
    def proposal(self) -> np.ndarray:
        """What the last pick found (empty before any)."""
        return self._picked[2] if self._picked else np.empty(0, np.int64)

    def match(self, seq: list[int], k: int) -> tuple[np.ndarray, int]:
        """(up to k proposed tokens, length of the suffix they continue; 0 = no match)."""
        arr = np.asarray(seq, np.int64)
        if len(arr) < 2:
            return np.empty(0, np.int64), 0
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier occurrences of the last token (where they end)
        n = 1
        while len(ends) and n < self.max_ngram:  # keep the occurrences that also match one token further back
            longer = ends[ends >= n]
            longer = longer[arr[longer - n] == arr[-1 - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if not len(ends) or n < self.min_ngram:
            return np.empty(0, np.int64), 0
        return arr[ends[0] + 1: ends[0] + 1 + k].copy(), n

    def lookup(self, seq: list[int], k: int) -> np.ndarray:
        return self.match(seq, k)[0]

    def commit(self, valid: int) -> None:
        pass


class HybridDrafter:
    """Take the n-gram proposal when it is at least `min_len` long and continues a match of at least
    `min_match` tokens, else ask the draft model. A 1-token match is right ~20% of the time (the
    model draft's first token ~80% on code): verifying it costs a target pass for ~1.2 tokens, less
    than plain decoding gives, so at a fixed draft length it goes to the model. With
    `draft_len="auto"` every proposal is offered (`judged`): auto weighs each kind's measured
    acceptance against the model draft's, and on edits a 1-token match is right far more often."""

    name = "hybrid"
    min_match = 2

    skip = 8  # a windowed draft model's catch-up after its first draft of a request reads at most this many tokens

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter, min_len: int = 2):
        self.model, self.ngram, self.min_len = model, ngram, min_len
        # Here the model drafts mostly where no n-gram matched, the hard places: its acceptance (and
        # auto's state) there is not the model drafter's on its own, so it is learned under its own kind.
        model.kind = "hybrid-model"
        # The model falls behind over every n-gram round. Where a pass costs by the token it reads (a
        # windowed draft, i.e. the CPU), catching up on a 20-30 token copy costs two target steps, more
        # than the few model rounds before the next copy save on the edits; reading only the last
        # `skip` tokens of it costs half a step and drafted as well (bench/RESULTS.md, eleventh sitting).
        if self.skip and model.window is not None and model.skip is None:
            model.skip = min(self.skip, model.window)

    def start(self, prompt: list[int]) -> None:
        self.model.start(prompt)
        self.ngram.start(prompt)

    def pick(self, seq: list[int], k: int, judged: bool = False):
        """The drafter this round would use: the n-gram one when its proposal and match are long enough
        (`judged`: when it has any; the caller judges it)."""
        ng = self.ngram.pick(seq, k)
        if judged:
            return ng if len(ng.proposal) else self.model
        return ng if len(ng.proposal) >= min(self.min_len, k) and ng.matched >= self.min_match else self.model

    def propose(self, seq, k, cfg, rng, confidence_stop: float = 0.0):
        return self.pick(seq, k).propose(seq, k, cfg, rng, confidence_stop)

    def commit(self, valid: int) -> None:
        self.model.commit(valid)
