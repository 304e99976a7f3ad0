"""The engine protocol: what the decode loop may ask of a model."""
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
    # what lets a prompt prefix be reused exactly (runtime/prefix.py).
    prefill_chunk: int | None

    def forward(self, tokens: np.ndarray, logit_positions: np.ndarray) -> np.ndarray:
        """tokens [B, S] int64 -> logits [B, N, V] float32 for the N requested positions of S."""
        ...

    def truncate(self, length: int) -> None:
        ...

    def close(self) -> None:
        ...
