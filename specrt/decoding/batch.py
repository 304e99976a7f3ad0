"""Batched speculative decoding: B sequences share every draft pass and every target verify pass.

Each of the B rows ("slots") of the batch runs its own request with its own settings (sampling,
seed, stop strings, max_new_tokens, a draft_len 0..max_draft_len or auto, drafter model, ngram or
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
compacted (a row that verified a tree moves its accepted path's few slots to follow its sequence, as a
request alone does); the C - max_len spare slots are room for a padded pass at a full row.

*Refill.* A new request's prompt is prefilled by batch-1 passes over its own row of the batch caches
(`LeanEngine.row`): the passes a lone run makes, with the same inputs, so its first token is the lone
run's, and nothing else is computed or copied. A row keeps what its prompt shares with the previous
request it ran (a job's shared instruction), exactly as a lone run keeps it (decoding/prefix.py).

*onnxruntime before 1.32* has no GroupQueryAttention `query_seqlens`: one call then cannot give
several rows several tokens each, and the engine runs such passes (verifies, catch-ups) one row at a
time; one-token passes (draft steps, plain decoding) stay batched.

*Idle rows.* A pass computes the rows from the first that takes part to the last (`span`: a view of those
rows of the engine, LeanEngine.rows), not the whole batch: when the queue is empty, finished rows sit out of
every pass, and the tail of a job, a server's partial batch and a draft step of few rows cost what their
rows cost (an idle row between two active ones is computed as padding; a new request takes the lowest free
row). A row alone in its pass plans its rounds as a request alone does. Engines that replay captured CUDA
graphs compute every row.

*Exactness.* A row runs the round of a request alone (decoding/decode.Decoder: a request alone is a
batch of one): its own `np.random.Generator(seed)`, one uniform for the first token, one per drafted
token, k+1 for the accept test, in the same order, with the same k per round (fixed draft_len,
limited by the tokens left), and the same end of request. So a row's output equals its lone output whenever the
logits agree: token for token in greedy, and draw for draw in sampling. Batched passes can differ
from batch-1 passes in the last bits (other GEMM shapes); on fp32 models that changes nothing but an
exact near-tie (the tests find none); int4 at accuracy level 4 rounds differently per batch shape
(see the README), so there greedy batch and lone text can part at a near-tie, both faithful to the
weights. A row at `draft_len="auto"` plans each round against what widening the batch's padded pass
costs at the batch's rate (decoding/policy.py), so its lengths follow timings: greedy output is
unchanged, a sampled row is a faithful sample but not draw for draw its lone run's. A row's draft
reads its prompt by the lone run's catch-up rule (proposers.model_drafter), so a row equals it.
"""
from __future__ import annotations

import numpy as np

from specrt.decoding.prefix import PromptCache

__all__ = ["Ragged"]

PAD_ID = 0  # token fed in padded positions (never written to a cache, their logits never read)


class Ragged:
    """A ragged batch engine's rows, each holding its own sequence (see the module docstring); the
    decoding/decode.Rows of a batch."""

    def __init__(self, engine, max_width: int):
        self.e = engine
        self.batch = engine.batch
        self.max_width = max_width  # widest pass: longer catch-ups go in chunks
        self.passes = 0
        self.trees = bool(getattr(engine, "trees", False))  # its pass takes parent pointers (decoding/tree.py)
        self.prompts = [PromptCache() for _ in range(engine.batch)]  # what each row's slots keep of its last prompt

    def count(self, r: int) -> int:
        """Tokens of row r's sequence in the cache (= the position of its next token)."""
        return int(self.e.lengths[r])

    def prefill(self, r: int, prompt: list[int], share_prefix: bool = True) -> tuple[np.ndarray, int]:
        """Row r := `prompt`, read by batch-1 passes over the row as a lone run reads it (what it shares with
        the row's previous prompt kept as a lone run keeps it, decoding/prefix.py); returns (the last
        position's logits [W], the prompt tokens kept)."""
        if not share_prefix:
            self.prompts[r].forget()
        return self.prompts[r].read(self.e.row(r), prompt)

    def reset(self) -> None:
        """Forget every row (after an interrupted run)."""
        self.e.truncate(0)
        for p in self.prompts:
            p.forget()

    def release(self, r: int, seq: list[int] | None = None) -> None:
        if seq is not None:
            self.prompts[r].extend(self.e.row(r), seq)  # what decoding wrote, where that is exact
        self.e.set_length(r, 0)

    def keep(self, r: int, n: int, moved: list[tuple[int, int]] = ()) -> None:
        """Row r keeps the first n tokens of its sequence, after each (src, dst) of `moved`: slot dst gets
        what slot src holds (a tree's accepted path)."""
        if moved:
            src, dst = zip(*moved)
            self.e.move(r, src, dst)
        self.e.set_length(r, min(n, self.count(r)))

    def forward(self, feeds: dict[int, list[int]], last: bool,
                parents: dict[int, list[int]] | None = None) -> dict[int, np.ndarray]:
        """Append feeds[r] to row r (other rows sit out). Returns {r: logits [n, W]}: last=True, n = 1 (the
        row's last fed token); else every fed position. `parents[r]` (with `trees`): row r's tokens are a tree
        (decode.Rows.forward); the other rows' each follow the one before."""
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
        return {**out, **self._call(feeds, last, parents)}

    def span(self, rows) -> tuple[int, int]:
        """The rows lo .. hi - 1 a pass over `rows` computes: from the first to the last of them, or every row
        where the engine's passes are captured whole (CUDA graphs)."""
        rows = list(rows)
        if getattr(self.e, "captures", False) or not rows:
            return 0, self.batch
        return min(rows), max(rows) + 1

    def _call(self, feeds: dict[int, list[int]], last: bool,
              parents: dict[int, list[int]] | None = None) -> dict[int, np.ndarray]:
        S = max(len(t) for t in feeds.values())
        if S > self.max_width:
            raise ValueError(f"pass of width {S} > {self.max_width}")
        lo, hi = self.span(feeds)
        e = self.e.rows(lo, hi)  # rows outside the span sit out without being computed as padding
        tokens = np.full((e.batch, S), PAD_ID, np.int64)
        counts = np.zeros(e.batch, np.int64)
        rows, index = sorted(feeds), []
        for r in rows:
            n, at = len(feeds[r]), (r - lo) * S
            tokens[r - lo, :n], counts[r - lo] = feeds[r], n
            index.extend([at + n - 1] if last else range(at, at + n))
        tree = None
        if parents:
            tree = np.broadcast_to(np.arange(-1, S - 1), (e.batch, S)).copy()  # rows without a tree: chains
            for r, p in parents.items():
                tree[r - lo, :len(p)] = p
        self.passes += 1
        logits = e.forward_ragged(tokens, counts, np.array(index, np.int64), parents=tree)  # [N, W]
        out, at = {}, 0
        for r in rows:
            n = 1 if last else len(feeds[r])
            out[r], at = logits[at:at + n], at + n
        return out

    def close(self) -> None:
        self.e.close()
