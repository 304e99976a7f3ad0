"""The target's prompt prefix kept across requests, reused only where that is exact.

A new request often starts with what the previous one started with: a batch job's shared instruction,
a chat template's system part, the earlier turns of a conversation. Reading those tokens again is most
of a short request's prompt time on the CPU. Reusing the cache entries is only safe if they are the
very entries a fresh read of the new prompt computes.

On an engine whose rows are exact (`row_exact`: specrt's CPU kernels on every matmul and attention node,
engines/int4.py), a row's entries do not depend on the passes that wrote them, so every token of the
prefix the new prompt shares with the previous one is kept, and the rest is read.

Elsewhere, int4 weights at accuracy level 4 round a row differently depending on the shape of the pass
that computed it (a pass of odd width rounds its last row apart from the rest), so entries written by
other passes (decoding, a prompt split elsewhere) would make the same prompt answer differently
depending on what ran before. So the prompt is always read the same way: in passes of `chunk` tokens
from position 0 (what the engine does with a wide call, `Engine.prefill_chunk`), and only whole chunks of
an earlier prompt are kept; the rest is read in the same passes a fresh read makes, from the same inputs.

Either way a request's cache and logits are bit for bit those of a fresh read, whatever came before, so
greedy and seeded output never depend on the order of requests. An engine that reads a wide call in one
pass (`prefill_chunk` None) and is not exact reuses nothing.
"""
from __future__ import annotations

import numpy as np

from specrt.engines.base import Engine


class PromptCache:
    """The tokens whose entries in one engine's cache (one row's, in a batch) came from a prompt's read (whole
    chunks of it, unless the engine is exact): slots below `len(tokens)` hold them, as a fresh read of
    `tokens` computes them."""

    def __init__(self):
        self.tokens: list[int] = []

    def forget(self) -> None:
        """Nothing is kept (someone else wrote the slots)."""
        self.tokens = []

    def keep(self, n: int) -> None:
        """Keep at most the first n tokens."""
        self.tokens = self.tokens[:n]

    def reusable(self, prompt: list[int], chunk: int | None, intact: int | None = None) -> int:
        """Slots a read of `prompt` can keep: whole chunks of the prefix it shares (chunk 1: all of it), its
        last token always read (its logits give the first token), none at or past `intact` (the lowest slot
        written since)."""
        if not chunk:
            return 0
        n = min(len(self.tokens), len(prompt) - 1, len(self.tokens) if intact is None else intact)
        if n < chunk:
            return 0
        same = np.asarray(self.tokens[:n], np.int64) == np.asarray(prompt[:n], np.int64)
        shared = n if same.all() else int(same.argmin())
        return shared // chunk * chunk

    def read(self, engine: Engine, prompt: list[int]) -> tuple[np.ndarray, int]:
        """Put `prompt` in the engine's cache (batch 1, or a row view) and return (the last position's logits
        [W], how many prompt tokens came from the cache)."""
        # what is kept comes in units of this many tokens: 1 where any passes write a fresh read's entries
        chunk = 1 if getattr(engine, "row_exact", False) else getattr(engine, "prefill_chunk", None)
        keep = self.reusable(prompt, chunk, int(engine.lowest_write[0]) if chunk else None)
        self.tokens = []  # until the read is complete, nothing in the slots is certain
        if keep > engine.length:
            engine.reclaim(keep)  # a finished batch row: its slots were freed, not written
        engine.truncate(keep)
        logits = engine.forward(np.array([prompt[keep:]]), np.array([len(prompt) - keep - 1]))[0, 0]
        if chunk:
            self.tokens = list(prompt[:len(prompt) // chunk * chunk])
            engine.lowest_write[:] = engine.max_len  # from here on, any pass below len(tokens) is someone else's
        return logits, keep

    def extend(self, engine: Engine, seq: list[int]) -> None:
        """After a generation that read its prompt through this cache and decoded `seq` (prompt + output): on
        an exact engine the slots decoding wrote hold a fresh read's entries too, so the tokens in them count
        (a conversation's next turn keeps the previous answer); elsewhere nothing changes."""
        if not getattr(engine, "row_exact", False) or int(engine.lowest_write[0]) < len(self.tokens):
            return  # decoding's entries are not a fresh read's, or someone else wrote below the prompt
        if seq[:len(self.tokens)] == self.tokens:
            self.tokens = list(seq[:min(int(engine.length), len(seq))])
            engine.lowest_write[:] = engine.max_len
