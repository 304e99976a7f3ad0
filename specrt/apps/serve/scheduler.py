"""A server's requests on one Pair: a bounded queue and one worker thread that owns the pair.

One request waiting runs alone (`Pair.run`: the pair's batch-1 engines). With more than one waiting they
run as the rows of a batch (`Pair.runner(batch_size)`, api/runner.py), continuously: a finished row takes the next waiting
request, and the batch ends when no row is left. Either way a request runs the same round with the same
settings (decoding/decode.Decoder); a row at draft_len auto plans against the cost of the batch's pass
(decoding/policy.py). `batch_draft_len`, when given, replaces auto for batched rows.

Nothing here knows HTTP: a job hands its text chunks, then its Result (or an exception), to the
`deliver` callback it was submitted with, from the worker thread.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specrt.api.requests import as_batch_row
from specrt.config import GenerationConfig
from specrt.decoding.decode import WAIT, Request
from specrt.errors import ConfigError, SpecrtError

log = logging.getLogger("specrt.serve")


class QueueFull(Exception):
    """The queue holds `max_queue` waiting requests already."""


class ShuttingDown(Exception):
    """The server is stopping: a waiting or running request ends with this."""


@dataclass(eq=False)
class Job:
    """One request: its token ids, its settings, and where its output goes."""

    prompt: list[int]
    cfg: GenerationConfig
    deliver: Callable[[Any], None]  # str chunks, then a Result, or an exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0
    batched: bool = False

    def cancel(self) -> None:
        """End this job at its next round (a client that went away)."""
        self.cancelled.set()


class Scheduler:
    """Runs submitted jobs on `pair` in a worker thread (see the module docstring).

    `batch_size` 1 runs every job alone. `on_finish(job, result)` is called (in the worker) for each
    job that ran, e.g. to count metrics."""

    def __init__(self, pair, max_queue: int = 16, batch_size: int = 4, batch_draft_len: int | None = None,
                 on_finish: Callable[[Job, Any], None] | None = None):
        if max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {max_queue}")
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        self.pair, self.max_queue, self.batch_size = pair, max_queue, batch_size
        self.batch_draft_len = None if batch_draft_len is None else min(batch_draft_len, pair.manifest.max_draft_len)
        self.on_finish = on_finish or (lambda job, res: None)
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        # Made now, so that a batch whose KV caches do not fit is refused at start (ConfigError).
        self._decoder = None
        if batch_size > 1:
            self._decoder = pair.runner(batch_size)
        self.running = 0
        self.recent_s: collections.deque[float] = collections.deque(maxlen=32)  # seconds of recent jobs
        self._thread = threading.Thread(target=self._work, name="specrt-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the server's side

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt: list[int], cfg: GenerationConfig, deliver: Callable[[Any], None]) -> Job:
        """Queue a job; QueueFull when `max_queue` are waiting, ShuttingDown after close()."""
        job = Job(prompt, cfg, deliver)
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue's length in recent jobs' time, over the batch."""
        typical = sorted(self.recent_s)[len(self.recent_s) // 2] if self.recent_s else 1.0
        return max(1, round(typical * (self.waiting + 1) / self.batch_size))

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, end waiting ones with ShuttingDown, cancel running ones (their consumers get
        ShuttingDown too) and wait for the worker."""
        with self._cv:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cv.notify_all()
        for job in waiting:
            job.deliver(ShuttingDown("the server is shutting down"))
        self._thread.join(timeout)
        if not self._thread.is_alive():
            with self._cv:
                decoder, self._decoder = self._decoder, None
            if decoder is not None:
                decoder.close()

    # ------------------------------------------------------------------ the worker

    def _next(self, block: bool) -> Job | None:
        with self._cv:
            while block and not self._waiting and not self._closing:
                self._cv.wait()
            if self._closing or not self._waiting:
                return None
            job = self._waiting.popleft()
            job.started_at = time.perf_counter()
            self.running += 1
            return job

    def _work(self) -> None:
        while (job := self._next(block=True)) is not None:
            if self.batch_size > 1 and self._waiting:
                self._batch(job)
            else:
                self._alone(job)

    def _stop_fn(self, job: Job) -> Callable[[], bool]:
        return lambda: job.cancelled.is_set() or self._closing

    def _alone(self, job: Job) -> None:
        try:
            res = self.pair.run(job.prompt, job.cfg, on_text=job.deliver, cancel=self._stop_fn(job))
        except Exception as e:  # noqa: BLE001 - the job's consumer reports it; the server goes on
            self._fail(job, e)
        else:
            self._done(job, res)

    def _batch(self, first: Job) -> None:
        jobs: dict[int, Job] = {}

        def requests():
            job = first
            while True:
                if job is None and (job := self._next(block=False)) is None:
                    yield WAIT
                    continue
                job.batched, jobs[id(job)] = True, job
                cfg = job.cfg if self.batch_draft_len is None else as_batch_row(job.cfg, self.batch_draft_len)
                yield Request(id(job), job.prompt, cfg, job.deliver, self._stop_fn(job))
                job = None

        try:
            for key, res in self._decoder.run(requests()):
                if isinstance(res, SpecrtError):  # that request's own: the batch goes on
                    self._fail(jobs.pop(key), res)
                else:
                    self._done(jobs.pop(key), res)
        except Exception as e:  # noqa: BLE001 - every row of the batch ends with it; the server goes on
            for job in jobs.values():
                self._fail(job, e)

    def _done(self, job: Job, res) -> None:
        with self._cv:
            self.running -= 1
        self.recent_s.append(time.perf_counter() - job.started_at)
        try:
            self.on_finish(job, res)
        except Exception as e:  # noqa: BLE001 - counting must never stop the worker
            log.error("on_finish failed: %s: %s", type(e).__name__, e)
        if res.finish_reason == "cancelled" and self._closing and not job.cancelled.is_set():
            job.deliver(ShuttingDown("the server is shutting down"))
        else:
            job.deliver(res)

    def _fail(self, job: Job, e: Exception) -> None:
        with self._cv:
            self.running -= 1
        if not isinstance(e, SpecrtError):
            log.error("request failed: %s: %s", type(e).__name__, e)
        job.deliver(e)
