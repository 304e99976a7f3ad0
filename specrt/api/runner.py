"""The one door into the round: a loaded pair's rows, policies and hooks, wired in one place.

Every way of decoding (`Pair.generate`/`stream`/`generate_batch`, the server's scheduler, `specrt batch`,
`specrt bench`) goes through a `Runner` made by `Pair.runner`: the round (decoding/decode.Decoder) over
either the pair's own batch-1 engines (a request alone, keeping what its caches hold across requests) or a
batch of rows over batch engines that share the pair's loaded sessions (decoding/batch.Ragged). decoding/
knows engines and rows only; what a pair is (its manifest, grammars, tuned costs, lock) stays here.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from specrt.config import GenerationConfig
from specrt.decoding.batch import Ragged
from specrt.decoding.constraint import Constraint
from specrt.decoding.decode import Decoder, Request, Result, Single, Totals
from specrt.decoding.policy import PolicyState, build
from specrt.decoding.proposers import ModelProposer, model_drafter
from specrt.errors import ConfigError


class Runner:
    """Decodes requests on `pair` (see the module docstring). `batch_size` None: alone, on the pair's batch-1
    engines; an integer: that many rows, whose KV caches are allocated now (ConfigError at once when they do
    not fit). A batch's rows plan with their own copy of what the pair learned (acceptance), and the costs of
    their batch's passes."""

    def __init__(self, pair, batch_size: int | None = None):
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"batch size must be an integer >= 1, got {batch_size!r}")
        self.pair, self.batched = pair, batch_size is not None
        m = pair.manifest
        if self.batched:
            width = m.max_draft_len + 1
            cache_len = m.max_len + width  # the rotary tables of a lean graph cover this many positions
            target = Ragged(pair.batch_engine("target", batch_size, cache_len, width), width)
            draft = lambda: Ragged(pair.batch_engine("draft", batch_size, cache_len, 1), width)  # noqa: E731
            self.state = PolicyState(acceptance=copy.deepcopy(pair.state.acceptance), history=pair.state.history)
        else:
            target, draft, self.state = Single(pair.target, pair.prompt_cache), lambda: Single(pair.draft), pair.state
        self.decoder = Decoder(target, draft, m.vocab_size, frozenset(m.eos_token_ids), self.policy,
                               text=pair.text_stream, history=pair.state.history, share_prefix=pair.share_prefix,
                               constrain=pair.grammars.start, check=self._check)

    @property
    def batch_size(self) -> int:
        return self.decoder.B

    @property
    def totals(self) -> Totals:
        return self.decoder.totals

    def reset_totals(self) -> None:
        self.decoder.totals = Totals(batch_size=self.decoder.B)

    def policy(self, r: int, cfg: GenerationConfig, constraint: Constraint | None = None, state: PolicyState | None = None):
        """Row r's policy and proposers for a request (decoding/policy.build): alone, the draft model keeps its
        cache's prefix across requests (the pair's DraftMemory); a batch row's draft is its row of the batch."""
        p = self.pair

        def model(skip: int | None) -> ModelProposer:  # one rule for both: the same window and skip
            engine = self.decoder.draft.e.row(r) if self.batched else p.draft
            memory = None if self.batched else p.draft_memory
            return model_drafter(engine, p.manifest.vocab_size, p.draft_ids, memory, cfg.draft_window, p.device)(skip)

        # trees where the target's pass takes them, alone or in a batch
        tree = cfg.tree == "auto" and self.decoder.target.trees
        return build(cfg.draft_len, cfg.drafter, p.manifest.max_draft_len, state or self.state,
                     model if p.draft is not None else None, cfg.ngram_max, p.policy_config, constraint, tree)

    def _check(self, req: Request) -> None:
        self.pair.check(req.prompt, req.cfg, batched=self.batched)

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Any, Result | ConfigError]]:
        """(key, Result) per request in order of completion, (key, ConfigError) for one that cannot start; the
        pair is held while this is iterated (a `generate` meanwhile raises ConfigError)."""
        if not self.batched:
            self.pair._begin()
            try:
                yield from self.decode(requests)
            finally:
                self.pair._end()
            return
        for rows in self.decoder.made:
            rows.reset()  # rows of a run that was abandoned midway
        with self.pair.exclusive():  # the batch engines share the pair's sessions
            yield from self.decode(requests)

    def decode(self, requests: Iterable[Request]) -> Iterator[tuple[Any, Result | ConfigError]]:
        """`run` for a caller that holds the pair already."""
        if not self.batched and not self.pair.share_prefix:
            self.pair.forget_caches()
        yield from self.decoder.run(requests)

    def close(self) -> None:
        if self.batched:
            for rows in self.decoder.made:
                rows.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
