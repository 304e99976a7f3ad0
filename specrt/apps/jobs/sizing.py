"""Decoding a job's requests on one loaded pair, at a fixed batch size or the one measured fastest ("auto")."""
from __future__ import annotations

import time

from specrt.errors import ConfigError, SpecrtError

AUTO_SIZES = (1, 2, 4, 8)


class BatchSizer:
    """Decodes requests on one loaded pair with a fixed batch size, or "auto": the first records run at
    each of AUTO_SIZES in turn (their results are kept), and the fastest aggregate tokens/s wins.
    Rows with draft_len "auto" choose each round's length against the cost of the batch's pass and its
    rate (decoding/policy.py), at any batch size: drafting that does not pay in a batch is not done."""

    def __init__(self, pair, batch_size: int | str, log=None):
        self.pair, self.log = pair, log or (lambda s: None)
        self.chosen = None if batch_size == "auto" else int(batch_size)
        self.measured: dict[int, float] = {}
        self._dec = None

    def results(self, requests):
        reqs, i = list(requests), 0
        if self.chosen is None:
            for b in AUTO_SIZES:
                n = max(2 * b, 4)
                if len(reqs) - i < n:
                    break
                tokens, t0 = 0, time.perf_counter()
                try:
                    dec = self.pair.runner(b)
                except ConfigError as e:  # its KV caches do not fit: neither will larger batches
                    self.log(f"batch size auto: {b} skipped ({e})")
                    break
                with dec:
                    for key, res in dec.run(reqs[i:i + n]):
                        tokens += 0 if isinstance(res, SpecrtError) else len(res.tokens)
                        yield key, res
                self.measured[b] = tokens / (time.perf_counter() - t0)
                i += n
            if self.measured:
                self.chosen = max(self.measured, key=self.measured.get)
                self.log("batch size auto: " + ", ".join(f"{b}: {v:.1f} tok/s" for b, v in self.measured.items())
                         + f" -> {self.chosen}")
            else:
                self.chosen = max(1, min(4, len(reqs)))
                self.log(f"batch size auto: too few records to measure, using {self.chosen}")
        if i < len(reqs):
            if self._dec is None or self._dec.batch_size != self.chosen:
                self.close()
                self._dec = self.pair.runner(self.chosen)
            yield from self._dec.run(reqs[i:])

    def close(self) -> None:
        if self._dec is not None:
            self._dec.close()
            self._dec = None
