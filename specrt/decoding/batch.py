"""Batched speculative decoding: B sequences share every draft pass and every target verify pass.

Each of the B rows ("slots") of the batch runs its own request with its own settings (sampling,
seed, stop strings, max_new_tokens, a fixed draft_len 0..max_draft_len, drafter model, ngram or
hybrid): it accepts its own number of draft tokens per round (ragged), stops on its own (EOS, its
stop strings, its max_new_tokens), and a finished slot is refilled from the request queue at once,
so the batch stays full until the queue runs dry. A round is: draft passes (one per drafted
position, shared by every row still drafting; rows done drafting sit out), one verify pass shared
by all rows, then accept/commit per row. A pass costs more at batch B than at batch 1; what
batching buys is aggregate tokens/s.

Design
------
*Engines.* Per model, one batch-B lean engine (engines/ort.LeanEngine) that shares the pair's
already-loaded onnxruntime session (the weights are not loaded twice), with its own caches
`[B, Hkv, C, D]`, C = max_len + max_draft_len + 1. The lean graph gives every row its own length: a
pass appends each row's tokens at that row's length (right-padded to the widest row; the padding is
never written), and a row that rejects drafts simply gets a shorter length. The caches are never
copied or compacted; the C - max_len spare slots are room for a padded pass at a full row.

*Refill.* A new request's prompt is prefilled by batch-1 passes over its own row of the batch caches
(`LeanEngine.row`): the passes a lone run makes, with the same inputs, so its first token is the lone
run's, and nothing else is computed or copied. A row keeps what its prompt shares with the previous
request it ran (a job's shared instruction), exactly as a lone run keeps it (decoding/prefix.py).

*onnxruntime before 1.32* has no GroupQueryAttention `query_seqlens`: one call then cannot give
several rows several tokens each, and the engine runs such passes (verifies, catch-ups) one row at a
time; one-token passes (draft steps, plain decoding) stay batched.

*Idle rows.* When the queue is empty, finished rows sit out of every pass; the tail of a job therefore
runs below full batch.

*Exactness.* Each row has its own `np.random.Generator(seed)` and draws exactly as
`spec.decode.decode` would for that request alone: one uniform for the first token, one per
drafted token, k+1 for the accept test, in the same order, with the same k per round (fixed
draft_len, limited by the tokens left). So a row's output equals its lone output whenever the
logits agree: token for token in greedy, and draw for draw in sampling. Batched passes can differ
from batch-1 passes in the last bits (other GEMM shapes); on fp32 models that changes nothing but an
exact near-tie (the tests find none); int4 at accuracy level 4 rounds differently per batch shape
(see the README), so there greedy batch and lone text can part at a near-tie, both faithful to the
weights. `draft_len="auto"` is not supported (its choices depend on per-request timings). A row's draft
reads its prompt by the lone run's catch-up rule (spec.proposers.model_drafter), so a row equals it.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specrt.config import GenerationConfig
from specrt.decoding import sampling
from specrt.decoding.decode import Result, Stats, emit
from specrt.decoding.policy import PolicyState, Round, build
from specrt.decoding.prefix import PromptCache
from specrt.decoding.proposers import NOTHING, ModelProposer, Proposal, model_drafter
from specrt.errors import ConfigError

PAD_ID = 0  # token fed in padded positions (never written to a cache, their logits never read)
# What a request iterator yields for "none now, ask again next round" (a server's queue being empty):
# free slots stay free, and `run` returns once no row is left.
WAIT = object()


@dataclass(frozen=True)
class Request:
    """One generation: `key` is returned with its result, `prompt` token ids, `cfg` its settings;
    `on_text(chunk)` sees its text as rounds emit it, `cancel()` returning True ends it after a round
    (finish reason "cancelled")."""

    key: Any
    prompt: list[int]
    cfg: GenerationConfig
    on_text: Callable[[str], None] | None = None
    cancel: Callable[[], bool] | None = None


@dataclass
class BatchTotals:
    """What the batch as a whole did (per-request numbers are in each result's stats)."""

    batch_size: int = 0
    requests: int = 0
    new_tokens: int = 0
    target_passes: int = 0  # batched verify passes (prefills are batch-1, counted apart)
    draft_passes: int = 0  # batched draft passes, catch-up chunks included
    prefills: int = 0
    proposed: int = 0
    accepted: int = 0
    row_rounds: int = 0  # sum over verify passes of the rows taking part
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        d["acceptance_rate"] = self.accepted / self.proposed if self.proposed else 0.0
        d["occupancy"] = self.row_rounds / (self.target_passes * self.batch_size) if self.target_passes else 0.0
        return d


class Rows:
    """A batch engine's rows, each holding its own sequence (see the module docstring)."""

    def __init__(self, engine, max_width: int):
        self.e = engine
        self.max_width = max_width  # widest pass: longer catch-ups go in chunks
        self.passes = 0
        self.prompts = [PromptCache() for _ in range(engine.batch)]  # what each row's slots keep of its last prompt

    def count(self, r: int) -> int:
        """Tokens of row r's sequence in the cache (= the position of its next token)."""
        return int(self.e.lengths[r])

    def prefill(self, r: int, prompt: list[int]) -> tuple[np.ndarray, int]:
        """Row r := `prompt`, read by batch-1 passes over the row as a lone run reads it (what it shares with
        the row's previous prompt kept as a lone run keeps it, decoding/prefix.py); returns (the last
        position's logits [W], the prompt tokens kept)."""
        return self.prompts[r].read(self.e.row(r), prompt)

    def reset(self) -> None:
        """Forget every row (after an interrupted run)."""
        self.e.truncate(0)
        for p in self.prompts:
            p.forget()

    def release(self, r: int) -> None:
        self.e.set_length(r, 0)

    def keep(self, r: int, n: int) -> None:
        """Row r keeps the first n tokens of its sequence."""
        self.e.set_length(r, min(n, self.count(r)))

    def forward(self, feeds: dict[int, list[int]], last: bool) -> dict[int, np.ndarray]:
        """Append feeds[r] to row r (other rows sit out). Returns {r: logits [n, W]}: last=True, n = 1 (the
        row's last fed token); else every fed position."""
        out = {}
        if last and any(len(t) > self.max_width for t in feeds.values()):
            # A proposer that is behind (its prompt, what lookup rounds emitted) reads it in the pass a lone
            # run makes: a batch-1 pass over its own row.
            feeds = dict(feeds)
            for r in [r for r, t in feeds.items() if len(t) > self.max_width]:
                t = feeds.pop(r)
                out[r] = self.e.row(r).forward(np.array([t]), np.array([len(t) - 1]))[0].copy()  # [1, W]
                self.passes += 1
            if not feeds:
                return out
        return {**out, **self._call(feeds, last)}

    def _call(self, feeds: dict[int, list[int]], last: bool) -> dict[int, np.ndarray]:
        e = self.e
        S = max(len(t) for t in feeds.values())
        if S > self.max_width:
            raise ValueError(f"pass of width {S} > {self.max_width}")
        tokens = np.full((e.batch, S), PAD_ID, np.int64)
        counts = np.zeros(e.batch, np.int64)
        rows, index = sorted(feeds), []
        for r in rows:
            n = len(feeds[r])
            tokens[r, :n], counts[r] = feeds[r], n
            index.extend([r * S + n - 1] if last else range(r * S, r * S + n))
        self.passes += 1
        logits = e.forward_ragged(tokens, counts, np.array(index, np.int64))  # [N, W]
        out, at = {}, 0
        for r in rows:
            n = 1 if last else len(feeds[r])
            out[r], at = logits[at:at + n], at + n
        return out

    def close(self) -> None:
        self.e.close()


@dataclass
class _Row:
    req: Request
    stream: Any
    start: float
    rng: np.random.Generator
    stats: Stats
    seq: list[int]
    out: list[int] = field(default_factory=list)
    reason: str = ""
    policy: Any = None  # a Fixed policy over this row's proposers (decoding/policy.py)
    proposer: Any = None  # this round's
    k: int = 0  # drafts this round's plan asked for

    @property
    def cfg(self) -> GenerationConfig:
        return self.req.cfg


class BatchDecoder:
    """Speculative decoding of many requests over a batch of `batch_size` slots.

    Holds the pair while `run` is iterated (a `pair.generate` meanwhile raises ConfigError) and builds
    batch engines over the pair's loaded sessions, on the pair's device.
    """

    def __init__(self, pair, batch_size: int):
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        self.pair, self.B = pair, batch_size
        m = pair.manifest
        self.vocab, self.eos = m.vocab_size, frozenset(m.eos_token_ids)
        self.width = m.max_draft_len + 1
        self.cache_len = m.max_len + self.width  # the rotary tables of a lean graph cover this many positions
        target = pair.batch_engine("target", batch_size, self.cache_len, self.width)
        self.target = Rows(target, self.width)
        self._draft = None  # made on first need: a target-only job allocates no draft cache
        self.totals = BatchTotals(batch_size=batch_size)

    @property
    def draft(self) -> Rows:
        if self._draft is None:
            draft = self.pair.batch_engine("draft", self.B, self.cache_len, 1)
            self._draft = Rows(draft, self.width)
        return self._draft

    def check(self, prompt: list[int], cfg: GenerationConfig) -> None:
        """Raise ConfigError for a request this decoder cannot run (the pair's check of a batch row)."""
        self.pair.check(prompt, cfg, batched=True)

    # ------------------------------------------------------------------ the loop

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Any, Any]]:
        """Yield (key, Result) for each request, in order of completion. Requests are pulled lazily,
        one whenever a slot is free; an iterator may yield WAIT for "none now"."""
        it = iter(requests)
        rows: list[_Row | None] = [None] * self.B
        for cache in (self.target, self._draft):
            if cache is not None:
                cache.reset()  # rows of a run that was abandoned midway
        exhausted = False
        t0, c0 = time.perf_counter(), self._draft_passes()
        hold = getattr(self.pair, "exclusive", None)  # the pair's batch-1 engines are ours while this runs
        try:
            with hold() if hold is not None else contextlib.nullcontext():
                while True:
                    for r in range(self.B):
                        while rows[r] is None and not exhausted:
                            req = next(it, None)
                            if req is None:
                                exhausted = True
                                break
                            if req is WAIT:
                                break
                            row = self._start(r, req)
                            if row.reason:  # done at its first token
                                yield self._finish(r, row)
                            else:
                                rows[r] = row
                    active = [(r, row) for r, row in enumerate(rows) if row is not None]
                    if not active:
                        break
                    self._round(active)
                    for r, row in active:
                        if row.reason:
                            rows[r] = None
                            yield self._finish(r, row)
        finally:
            self.totals.wall_s += time.perf_counter() - t0
            self.totals.draft_passes += self._draft_passes() - c0

    def _draft_passes(self) -> int:
        return self._draft.passes if self._draft else 0

    def _start(self, r: int, req: Request) -> _Row:
        self.check(req.prompt, req.cfg)
        cfg, prompt = req.cfg, list(req.prompt)
        k = cfg.draft_len
        row = _Row(req=req, stream=self.pair.text_stream(cfg.stop), start=time.perf_counter(),
                   rng=np.random.default_rng(cfg.seed), seq=list(prompt),
                   stats=Stats(draft_len=k, proposed_at=[0] * k, accepted_at=[0] * k, prompt_tokens=len(prompt)))
        if not getattr(self.pair, "share_prefix", True):
            self.target.prompts[r].forget()
        logits, row.stats.prompt_cached = self.target.prefill(r, prompt)
        x = sampling.pick(logits[: self.vocab], cfg.sampling, row.rng)
        self.totals.prefills += 1
        row.stats.target_passes += 1
        row.stats.ttft_s = time.perf_counter() - row.start

        def model(skip: int | None) -> ModelProposer:  # the lone run's window and skip; no memory across requests
            return model_drafter(self.draft.e.row(r), self.vocab, self.pair.draft_ids, None, cfg.draft_window,
                                 self.pair.device)(skip)

        state = PolicyState(history=self.pair.state.history)  # a fixed policy learns nothing else to keep
        row.policy = build(k, cfg.drafter, self.pair.manifest.max_draft_len, state, model=model, ngram_max=cfg.ngram_max,
                           config=self.pair.policy_config)
        row.policy.start(prompt)  # a model proposer reads the prompt in its first draft pass, as alone
        self.totals.requests += 1
        self._emit(row, [x])
        return row

    def _emit(self, row: _Row, new: list[int]) -> None:
        """decode.decode's stop checks: never past EOS or max_new_tokens; stop strings end it too."""
        new, reason = emit(new, self.eos, row.cfg.max_new_tokens - len(row.out))
        row.out += new
        row.seq += new
        if new:
            chunk = row.stream.feed(new)
            if chunk and row.req.on_text is not None:
                row.req.on_text(chunk)
            if row.stream.stopped:
                reason = "stop"
        if reason or len(row.out) >= row.cfg.max_new_tokens:
            row.reason = reason or "length"
        elif row.req.cancel is not None and row.req.cancel():
            row.reason = "cancelled"

    def _finish(self, r: int, row: _Row):
        self.target.release(r)
        if self._draft is not None:
            self._draft.release(r)
        tail = row.stream.finish()
        if tail and row.req.on_text is not None:
            row.req.on_text(tail)
        tokens = row.out
        if row.stream.stopped:
            tokens = tokens[: row.stream.n_tokens]  # tokens accepted past the stop string are not output
        if self.pair.state.history is not None:
            self.pair.state.history.add(tokens)  # later rows draft from it (the suffix proposer)
        st = row.stats
        st.new_tokens = len(tokens)
        st.wall_s = time.perf_counter() - row.start
        self.totals.new_tokens += len(tokens)
        stats = st.as_dict()
        stats["batch_size"] = self.B
        return row.req.key, Result(tokens=tokens, text=row.stream.text, finish_reason=row.reason, stats=stats)

    def _round(self, active: list[tuple[int, _Row]]) -> None:
        # 1. Plan: each row's policy (a fixed k, limited by the tokens the row has left, as decode does).
        for r, row in active:
            left = row.cfg.max_new_tokens - len(row.out)
            row.proposer, row.k = row.policy.plan(row.seq, min(row.policy.max_k, left - 1), left)
        # 2. Draft: the rows' proposers step in lockstep, one batched draft pass per drafted position.
        drafts = self._propose([(r, row) for r, row in active if row.k])
        # 3. Verify every row's last token and drafts in one batched target pass.
        logits = self.target.forward({r: [row.seq[-1], *drafts.get(r, NOTHING).tokens] for r, row in active}, last=False)
        self.totals.target_passes += 1
        self.totals.row_rounds += len(active)
        # 4. Accept, commit and emit per row.
        for r, row in active:
            draft, lg = drafts.get(r, NOTHING), logits[r][:, : self.vocab]  # [k'+1, V]
            n, t = sampling.accept(draft.tokens, draft.p_draft, lg, row.cfg.sampling, row.rng)
            new = [*draft.tokens[:n].tolist(), t]
            self.target.keep(r, len(row.seq) + n)  # the target had seq[:-1]; it keeps seq[-1] and n drafts
            row.policy.commit(len(row.seq) + n)
            row.stats.count(Round(row.proposer, row.k, draft, n, new, lg, 0.0, 0.0))
            self.totals.proposed += len(draft.tokens)
            self.totals.accepted += n
            self._emit(row, new)

    def _propose(self, rows: list[tuple[int, _Row]]) -> dict[int, Proposal]:
        """Each row's proposal: its proposer's steps (proposers.ModelProposer.steps), driven together."""
        done, steps, feeds = {}, {}, {}
        for r, row in rows:
            g = row.proposer.steps(row.seq, row.k, row.cfg.sampling, row.rng, row.cfg.confidence_stop)
            try:
                feeds[r], steps[r] = next(g), g
            except StopIteration as s:  # needs no pass (a lookup)
                done[r] = s.value
        while feeds:
            logits = self.draft.forward(feeds, last=True)
            feeds = {}
            for r, g in list(steps.items()):
                try:
                    feeds[r] = g.send(logits[r][0])  # [W]
                except StopIteration as s:
                    del steps[r]
                    done[r] = s.value
        return done

    def close(self) -> None:
        self.target.close()
        if self._draft is not None:
            self._draft.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
