"""The server's Prometheus metrics (GET /metrics), named as vLLM names its own where one exists."""
from __future__ import annotations

import collections
import time


class Metrics:
    """Prometheus metrics, named as vLLM names its own where one exists (prefix `specrt:`)."""

    def __init__(self, scheduler_ref):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("specrt:request_success", "Requests finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.errors = Counter("specrt:request_errors", "Requests refused or failed, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("specrt:prompt_tokens", "Prompt tokens read", registry=r)
        self.prompt_cached = Counter("specrt:prefix_cache_hits", "Prompt tokens whose cache entries were kept from "
                                     "an earlier request", registry=r)
        self.generation_tokens = Counter("specrt:generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("specrt:e2e_request_latency_seconds", "Time from queueing to the last token",
                                 registry=r, buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))
        self.ttft = Histogram("specrt:time_to_first_token_seconds", "Time from the start of a run to its first token",
                              registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.queue_time = Histogram("specrt:request_queue_time_seconds", "Time waiting in the queue", registry=r,
                                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20))
        self.tps = Gauge("specrt:generation_tokens_per_second", "Tokens generated per second over the last 30 s",
                         registry=r)
        self.tps.set_function(self._rate)
        self.running = Gauge("specrt:num_requests_running", "Requests running", registry=r)
        self.running.set_function(lambda: scheduler_ref().running)
        self.waiting = Gauge("specrt:num_requests_waiting", "Requests waiting in the queue", registry=r)
        self.waiting.set_function(lambda: scheduler_ref().waiting)
        self.drafts = Counter("specrt:spec_decode_num_drafts", "Rounds that verified a draft", registry=r)
        self.draft_tokens = Counter("specrt:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specrt:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_at = Counter("specrt:spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.proposed_at = Counter("specrt:spec_decode_num_draft_tokens_per_pos",
                                   "Draft tokens proposed at each draft position", ["position"], registry=r)
        self.acceptance = Gauge("specrt:spec_decode_draft_acceptance_rate", "Accepted over proposed draft tokens",
                                registry=r)
        self.acceptance.set_function(lambda: self._accepted / self._proposed if self._proposed else 0.0)
        self._accepted = self._proposed = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (when, tokens) of finished requests

    def _rate(self) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 30.0:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / 30.0

    def finished(self, job, res) -> None:
        st = res.stats
        self.requests.labels(res.finish_reason).inc()
        self.prompt_tokens.inc(st.get("prompt_tokens", 0))
        self.prompt_cached.inc(st.get("prompt_cached", 0))
        self.generation_tokens.inc(len(res.tokens))
        self._recent.append((time.monotonic(), len(res.tokens)))
        self._rate()  # drops what is older than the window, scraped or not
        self.latency.observe(time.perf_counter() - job.queued_at)
        self.queue_time.observe(job.started_at - job.queued_at)
        if st.get("ttft_s"):
            self.ttft.observe(st["ttft_s"])
        self.drafts.inc(sum(n for k, n in st.get("draft_len_hist", {}).items() if int(k) > 0))
        self.draft_tokens.inc(st.get("proposed", 0))
        self.accepted.inc(st.get("accepted", 0))
        self._proposed += st.get("proposed", 0)
        self._accepted += st.get("accepted", 0)
        for i, (p, rate) in enumerate(zip(st.get("proposed_per_position", []), st.get("accepted_per_position", []))):
            self.proposed_at.labels(str(i)).inc(p)
            self.accepted_at.labels(str(i)).inc(round(p * rate))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
