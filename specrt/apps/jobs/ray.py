"""`specrt batch --ray` (the `ray` extra): the driver reads, validates and writes as a local job does; Ray actors
each load the pair once (from PAIR_DIR, which must exist at that path on every node) and decode shards of
records. Ray is imported when a job asks for it, never by importing this module."""
from __future__ import annotations

import logging
import math
import os
import socket
from pathlib import Path
from typing import Any

from specrt.api.pair import load
from specrt.apps.jobs.input import JobError, Record, needs_draft
from specrt.apps.jobs.output import JobOutput, result_record
from specrt.apps.jobs.progress import Progress
from specrt.apps.jobs.sizing import BatchSizer
from specrt.config import HISTORY_CAP, GenerationConfig
from specrt.decoding.decode import Request
from specrt.errors import first_line


class RayWorker:
    """A Ray actor (wrapped by ray.remote at run time): loads the pair once, decodes shards."""

    def __init__(self, pair_dir: str, batch_size, threads: int, draft_model: bool = True,
                 history_cap: int = HISTORY_CAP):
        self.pair = load(pair_dir, threads=threads, device="cpu", draft_model=draft_model, history_cap=history_cap)
        self.runner = BatchSizer(self.pair, batch_size)

    def run(self, shard: list[tuple[str, list[int], GenerationConfig]]) -> tuple[list[tuple[str, Any]], int | None]:
        done = list(self.runner.results(Request(k, p, c) for k, p, c in shard))
        return done, self.runner.chosen


def start_ray(address: str, init: dict | None):
    """Import Ray and start a local instance ("local") or join a cluster. Returns (the ray module,
    whether this job connected it and so shuts it down at the end). A process already connected to
    Ray (a notebook, a test) keeps its connection: the job runs there and leaves it on."""
    try:
        import ray
    except ImportError:
        raise JobError("--ray needs Ray: pip install 'ray[default]' (or specrt[ray])") from None
    if address not in ("local", "auto"):  # ray.init retries an unreachable address for minutes: probe it first
        _probe(address)
    if ray.is_initialized():
        return ray, False
    kw = {"address": address, "include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if address == "local":
        kw.update(object_store_memory=256 * 1024 * 1024, num_cpus=os.cpu_count())
    kw.update(init or {})
    try:
        ray.init(**kw)
    except Exception as e:  # ray raises ConnectionError, RuntimeError, ValueError... with long texts
        msg = first_line(e)
        raise JobError(f"cannot start or join Ray at {address}: {msg}") from None
    return ray, True


def _probe(address: str) -> None:
    """JobError unless a TCP connection to the cluster's HOST:PORT (or ray://HOST:PORT) opens within 5 s."""
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise JobError(f"bad Ray address {address!r}: expected HOST:PORT, ray://HOST:PORT, auto or local")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise JobError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def run_on_ray(ray, pair_dir: Path, pending: list[Record], batch_size, out: JobOutput, bar: Progress,
               actors: int | None, cpus_per_actor: int, log, history_cap: int = HISTORY_CAP) -> int | str:
    """Decode `pending` in shards on Ray actors, writing each result as it comes back. Returns the batch
    size the actors ran at ("2,4" when auto chose differently on different actors)."""
    cpus = int(ray.cluster_resources().get("CPU", 1))
    n = actors or max(1, cpus // cpus_per_actor)
    size = 32 if batch_size == "auto" else max(8, 4 * int(batch_size))
    size = max(1, min(size, math.ceil(len(pending) / n)))
    shards = [pending[i:i + size] for i in range(0, len(pending), size)]
    log(f"ray: {n} actors x {cpus_per_actor} CPU, {len(shards)} shards of <= {size} records")
    Worker = ray.remote(num_cpus=cpus_per_actor)(RayWorker)
    workers = [Worker.remote(str(pair_dir.resolve()), batch_size, cpus_per_actor, needs_draft(pending),
                             history_cap) for _ in range(n)]
    ids = {r.key: r.id for r in pending}
    queue = list(reversed(shards))
    inflight = {}
    chosen = set()

    def submit(w):
        if queue:
            shard = queue.pop()
            inflight[w.run.remote([(r.key, r.prompt, r.cfg) for r in shard])] = w

    for w in workers:  # two shards per actor in flight: no idle gap between shards
        submit(w)
        submit(w)
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1)
        w = inflight.pop(ready[0])
        try:
            done, b = ray.get(ready[0])
        except Exception as e:
            raise JobError(f"a Ray actor failed: {first_line(e, last=True)}; "
                           "the records written so far are kept, rerun to resume") from None
        chosen.add(b)
        for key, res in done:
            out.write(result_record(ids[key], res))
            bar.update(res)
        submit(w)
    return ",".join(str(b) for b in sorted(chosen)) if len(chosen) > 1 else next(iter(chosen))
