"""Constrained decoding: a request's grammar (a JSON schema, a regular expression, a Lark grammar) as the set
of tokens allowed at each position, computed by llguidance (docs/drafting.md, "Structured output").

Speculation stays exact under a constraint because every distribution the round compares is masked the
same way: the target's logits at every verified position and the draft model's at every drafted one get
-inf outside the tokens the grammar allows after the sequence so far, before warping. Verification then
compares the constrained draft with the constrained target, and the output is distributed as constrained
sampling from the target alone (greedy: token for token). A proposal that leaves the grammar is cut at its
first forbidden token before the target pass; where the grammar allows one continuation only, its bytes are
proposed at no draft cost (`forced`), and accepted with the target's probability like any draft.

A `Constraint` holds the matcher of the committed sequence (llguidance's `LLMatcher`, made by
api/grammars.py) and a copy that a round's drafts go into; the mask after each drafted prefix is computed
once a round, and drafting and verification share it. A tree of drafts (decoding/tree.py) is masked the same
way, each node's position after the tokens down to it; a branch the grammar refuses (`fits`) is not grown.
"""
from __future__ import annotations

import re
import time
from collections.abc import Sequence

import numpy as np

from specrt.errors import first_line

# how llguidance writes a special token inside forced bytes
_SPECIAL = re.compile(rb"\xff\[(\d+)\]")


class Constraint:
    """One request's grammar state (module docstring). `allowed(drafted)`: the tokens the grammar allows after
    the committed sequence and `drafted`; `commit(tokens)`: they are output.

    The matcher of the committed sequence takes only committed tokens; drafts go into a copy of it (a few
    microseconds), rolled back and forth within a round: llguidance's error state is permanent (its parser
    limits can be met at any token), so a draft that meets one only ends that draft, and a committed token
    that meets one ends the request (`error`)."""

    def __init__(self, matcher, tokenizer, vocab: int, start=None):
        self.m, self.tok, self.vocab = matcher, tokenizer, vocab
        self.start = start if start is not None else matcher.deep_copy()  # the matcher before any output
        self.eos = frozenset(getattr(tokenizer, "eos_tokens", ()))
        self.d, self.path = None, []  # the drafts' matcher and the tokens it holds past the committed sequence
        self.masks: dict[tuple[int, ...], np.ndarray] = {}  # this round's, by drafted prefix
        self.error = ""  # why the grammar cannot go on after the committed sequence (a parser limit met)
        self.mask_s = 0.0  # what computing masks cost this request

    @property
    def complete(self) -> bool:
        """The committed output is a complete match of the grammar."""
        return not self.error and self.m.is_accepting()

    def matches(self, text: str) -> bool:
        """Whether `text` alone is a complete match (what a stop string left of the committed output)."""
        m = self.start.deep_copy()
        return m.consume_tokens(self.tok.tokenize_str(text)) and m.is_accepting()

    @property
    def stopped(self) -> bool:
        """The committed output is a complete match that nothing may extend: only EOS can follow."""
        return not self.error and self.m.is_stopped()

    def _go(self, drafted: tuple[int, ...]) -> bool:
        """The drafts' matcher at the committed sequence + `drafted` (False: the grammar refuses them there)."""
        if self.d is None:
            self.d, self.path = self.m.deep_copy(), []
        common = 0
        for a, b in zip(self.path, drafted):
            if a != b:
                break
            common += 1
        if len(self.path) > common:
            if self.d.rollback(len(self.path) - common):
                del self.path[common:]
            else:  # start over from the committed sequence
                self.d, self.path, common = self.m.deep_copy(), [], 0
        for t in drafted[common:]:
            if not self.d.consume_token(t):
                self.d = None
                return False
            self.path.append(t)
        return True

    def allowed(self, drafted: Sequence[int] = ()) -> np.ndarray:
        """bool [vocab]: what may follow the committed sequence + `drafted` (nothing where `drafted` leaves the
        grammar or meets its limits)."""
        key = tuple(int(t) for t in drafted)
        if key in self.masks:
            return self.masks[key]
        if self.error or self.eos.intersection(key):  # nothing follows an end (nor can a matcher roll back past one)
            return np.zeros(self.vocab, bool)
        t0 = time.perf_counter()
        mask = np.zeros(self.vocab, bool)
        if self._go(key):
            bits = np.unpackbits(np.frombuffer(self.d.compute_bitmask(), np.uint8), bitorder="little")
            mask[:min(len(bits), self.vocab)] = bits[:self.vocab]
        self.mask_s += time.perf_counter() - t0
        self.masks[key] = mask
        return mask

    def valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a proposal) the grammar allows in a row after the committed sequence."""
        return self.m.validate_tokens([int(t) for t in tokens]) if len(tokens) and not self.error else 0

    def cut(self, tokens: Sequence[int]) -> int:
        """How many of a proposal's `tokens` may be verified: those the grammar allows in a row, up to the
        first after which it allows nothing (a dead end: the target could not pick a token there)."""
        n = self.valid(tokens)
        for i in range(n):
            if not self.allowed(tokens[:i + 1]).any():
                return i
        return n

    def forced(self, limit: int) -> list[int]:
        """Tokens that spell what the grammar allows as the only continuation of the committed sequence (at
        most `limit`): the forced bytes, tokenized; cut where the grammar would not take the tokenization."""
        if limit <= 0 or self.error:
            return []
        b = self.m.compute_ff_bytes()
        if not b:
            return []
        ids = []
        for i, part in enumerate(_SPECIAL.split(b)):  # text, special token id, text, ...
            ids += [int(part)] if i % 2 else (self.tok.tokenize_bytes(part) if part else [])
        ids = ids[:limit]
        return ids[:self.valid(ids)]

    def fits(self, drafted: Sequence[int]) -> bool:
        return fits(self, drafted)

    def mask(self, logits: np.ndarray, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """logits [n, V] of the positions after the committed sequence + prefixes[i] (a chain's drafts[:i], or
        the tokens down to a tree's node), masked (a copy)."""
        out = logits.copy()
        for i, drafted in enumerate(prefixes):
            a = self.allowed(drafted)
            out[i, ~a[:out.shape[1]]] = -np.inf
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """`tokens` follow the committed sequence (what a round emitted)."""
        for t in tokens:
            if not self.error and not self.m.consume_token(int(t)):
                self.error = f"the grammar cannot go on: {first_line(self.m.get_error())}"
        self.d, self.path, self.masks = None, [], {}

    def end(self) -> tuple[str, str]:
        """Whether the committed output ends the request: ("eos", "") where the grammar is complete and allows
        only EOS (which the target would pick), ("length", why) where it allows no token; ("", "") goes on."""
        if self.stopped:
            return "eos", ""
        if not self.allowed(()).any():
            return "length", self.error or "the grammar allows no token here (one the tokenizer cannot spell?)"
        return "", ""


def fits(c: Constraint | MinTokens, drafted: Sequence[int]) -> bool:
    """Whether `drafted` (a tree's path down to a node) may be verified under constraint `c`: its last token is
    allowed after the ones before it, and some token is allowed after it (a dead end would leave the target no
    token to pick there), as `cut` asks of a chain."""
    a = c.allowed(drafted[:-1])
    if a is not None and not a[int(drafted[-1])]:
        return False
    b = c.allowed(drafted)
    return b is None or bool(b.any())


class Free:
    """A request without a grammar: allows every token; the round asks it what it asks a Constraint."""

    def allowed(self, drafted: Sequence[int] = ()) -> None:  # None: nothing masked
        return None

    def cut(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def fits(self, drafted: Sequence[int]) -> bool:
        return True

    def mask(self, logits: np.ndarray, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        pass

    def end(self) -> tuple[str, str]:
        return "", ""


FREE = Free()


class MinTokens:
    """No end of text before the `n`-th output token (a request's `min_tokens`), around another constraint
    (`inner`: a grammar's, or FREE). The end tokens are masked at every position before it, in the target's
    logits and the draft's alike, and a proposal is cut at an end token there, so speculation compares the same
    masked distributions and the output is what the target alone gives under the same rule."""

    def __init__(self, inner: Constraint | Free, n: int, eos_ids: frozenset[int], vocab: int):
        self.inner, self.n, self.vocab = inner, n, vocab
        self.eos = np.array(sorted(t for t in eos_ids if t < vocab), np.int64)
        self.ends = frozenset(self.eos.tolist())
        self.out = 0  # tokens output so far

    def _open(self, i: int) -> bool:
        """Whether an end token may come as the output's token number out + i."""
        return self.out + i >= self.n

    def allowed(self, drafted: Sequence[int] = ()) -> np.ndarray | None:
        a = self.inner.allowed(drafted)
        if self._open(len(drafted)):
            return a
        a = np.ones(self.vocab, bool) if a is None else a.copy()
        a[self.eos] = False
        return a

    def cut(self, tokens: Sequence[int]) -> int:
        n = self.inner.cut(tokens)
        return next((i for i in range(n) if not self._open(i) and int(tokens[i]) in self.ends), n)

    def fits(self, drafted: Sequence[int]) -> bool:
        return fits(self, drafted)

    def mask(self, logits: np.ndarray, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        out = self.inner.mask(logits, prefixes)
        shut = [i for i, drafted in enumerate(prefixes) if not self._open(len(drafted))]
        if shut:
            out = out.copy() if out is logits else out
            out[np.ix_(shut, self.eos)] = -np.inf
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        self.inner.commit(tokens)
        self.out += len(tokens)

    def end(self) -> tuple[str, str]:
        reason, why = self.inner.end()
        if reason == "eos" and not self._open(0):
            return "length", f"the grammar is complete before min_tokens ({self.n}) tokens: nothing may follow"
        return reason, why
