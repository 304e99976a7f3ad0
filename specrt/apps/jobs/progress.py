"""What a running job shows: its progress bar and its log lines."""
from __future__ import annotations

import sys
import time

from specrt.errors import SpecrtError


class Progress:
    """A job's counts (records, tokens, acceptance) and, when enabled, its progress bar on stderr."""

    def __init__(self, total: int, enabled: bool):
        self.tokens = self.proposed = self.accepted = self.records = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rec", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                            desc="batch")

    def update(self, res) -> None:
        self.records += 1
        if res is not None and not isinstance(res, SpecrtError):
            s = res.stats
            self.tokens += s["new_tokens"]
            self.proposed += s["proposed"]
            self.accepted += s["accepted"]
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n == self.bar.total or self.records % 8 == 0:
                self.bar.set_postfix_str(f"{self.rate:.1f} tok/s, acceptance {self.acceptance:.0%}", refresh=False)

    @property
    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log_above_bar(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)  # above a running progress bar, not through it
