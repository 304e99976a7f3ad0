"""The engine protocols: what the algorithm (decoding/) may ask of a model. Engines know nothing of speculation."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Engine(Protocol):
    """One exported model with its own preallocated KV cache.

    The cache holds `length` valid slots. `forward` appends its tokens to the cache and returns
    logits for the requested positions; `truncate` rolls rejected slots back in O(1) (the next
    forward simply binds a shorter past).
    """

    length: int
    max_len: int
    batch: int
    # A wider forward runs in passes of this many tokens from its first one (None: one pass). Optional;
    # what lets a prompt prefix be reused exactly (decoding/prefix.py).
    prefill_chunk: int | None
    # Optional (False when absent): a row's numbers never depend on the pass around it, so slots written by
    # any passes over the same tokens hold what a fresh read computes (decoding/prefix.py keeps any prefix).
    row_exact: bool

    def forward(self, tokens: np.ndarray, logit_positions: np.ndarray) -> np.ndarray:
        """tokens [B, S] int64 -> logits [B, N, V] float32 for the N requested positions of S."""
        ...

    def truncate(self, length: int) -> None:
        ...

    def close(self) -> None:
        ...


class RaggedEngine(Engine, Protocol):
    """An engine whose `batch` rows each hold their own length: what batched decoding (decoding/batch.py) and
    keeping a prompt's prefix across requests (decoding/prefix.py) ask for. engines/ort.LeanEngine implements it.

    `length` and `truncate` act on every row (batch 1 is the usual case)."""

    lengths: np.ndarray  # [batch] int64: row r holds lengths[r] valid slots
    # [batch] int64: per row, the lowest slot a pass has written since a caller set it (max_len: none), so
    # that a caller keeping slots across requests sees when other code wrote over them
    lowest_write: np.ndarray
    # Optional (False when absent): forward_ragged takes tokens with parent pointers, and `move` slot moves.
    trees: bool

    def forward_ragged(self, tokens: np.ndarray, counts: np.ndarray, logit_index: np.ndarray,
                       parents: np.ndarray | None = None) -> np.ndarray:
        """Row r appends tokens[r, :counts[r]] ([B, S], right-padded; 0: the row sits out); returns logits
        [N, V] for the flat positions `logit_index` [N] (row * S + position). With `trees`, `parents` [B, S]
        gives tokens with parent pointers: token i follows token parents[r, i] of the call (-1: the row's
        cached tokens) instead of token i - 1, and computes as the continuation of that chain of ancestors
        (still written at slot lengths[r] + i)."""
        ...

    def move(self, r: int, src: np.ndarray, dst: np.ndarray) -> None:
        """With `trees`: row r's cache slots dst[i] get what slots src[i] hold (every layer's keys and values)."""
        ...

    def set_length(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` slots (0: the row is free)."""
        ...

    def reclaim(self, length: int) -> None:
        """Every row's first `length` slots count again after a truncate below them (the caller knows that
        nothing wrote them since)."""
        ...

    def row(self, r: int) -> RaggedEngine:
        """A batch-1 engine over row r's part of the same caches (a write there is row r's)."""
        ...

    def rows(self, lo: int, hi: int) -> RaggedEngine:
        """An engine of batch hi - lo over rows lo .. hi - 1 of the same caches (all rows: this engine), so
        that a pass leaving the other rows out does not compute them as padding."""
        ...
