"""The speculative round (docs/design.md, "The round"), over the rows of a batch: a request alone is a
batch of one.

Invariant: the last emitted token is not yet in the target's cache; a proposer's next input is the
part of the committed sequence its cache has not seen. Who drafts and how far is the policy's
(decoding/policy.py); what a draft is, the proposer's (decoding/proposers.py); the accept test, sampling's;
which engine a row lives in, its `Rows` (`Single` here: one batch-1 engine; batch.Ragged: a row of a
batched engine). `Decoder` starts a request, runs rounds over every row still going, and ends a request
the same way whatever the rows are, so a request's output and what it leaves behind (the history of
outputs, the cache's kept prefix) do not depend on whether it ran alone or in a batch.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from specrt.config import GenerationConfig, Grammar
from specrt.decoding import sampling
from specrt.decoding.constraint import FREE, Constraint, Free, MinTokens
from specrt.decoding.policy import Batch, Policy, Round
from specrt.decoding.prefix import PromptCache
from specrt.decoding.proposers import NOTHING, History, Proposal
from specrt.decoding.tree import Tree
from specrt.engines.base import Engine
from specrt.errors import ConfigError

# What a request iterator yields for "none now, ask again next round" (a server's queue being empty):
# free rows stay free, and `Decoder.run` returns once no row is left.
WAIT = object()


@dataclass(frozen=True)
class Result:
    tokens: list[int]  # generated ids, prompt and EOS excluded
    text: str  # decoded generated text (ends before a stop string)
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    stats: dict  # see Stats.as_dict


@dataclass(frozen=True)
class Request:
    """One generation: `key` is returned with its result, `prompt` token ids, `cfg` its settings;
    `on_text(chunk)` sees its text as rounds emit it, `cancel()` returning True ends it after a round
    (finish reason "cancelled"; before its prompt is read: no tokens)."""

    key: Any
    prompt: list[int]
    cfg: GenerationConfig
    on_text: Callable[[str], None] | None = None
    cancel: Callable[[], bool] | None = None


@dataclass
class Stats:
    draft_len: int | str = 0
    target_passes: int = 0
    draft_passes: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)  # rounds that drafted, by proposer name
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)  # draft tokens accepted, by proposer name
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # rounds per draft length actually used
    rounds_skipped: int = 0  # auto: rounds the guard ran without drafting
    tree_rounds: int = 0  # rounds that verified a tree (more than their chain)
    accepted_by_branch: dict[str, int] = field(default_factory=dict)  # draft tokens a tree's branches added, by family
    predicted_speedup: float = 0.0  # auto/fixed: E(tokens)/cost from the cost model, vs one target pass a token
    measured_speedup: float = 0.0  # tokens / (draft + verify time) vs the measured one-token target pass
    acceptance_estimate: dict[str, list[float]] = field(default_factory=dict)  # auto: per drafter, conditional acceptance per position at the end
    new_tokens: int = 0
    prompt_tokens: int = 0
    prompt_cached: int = 0  # prompt tokens whose target cache entries were kept from an earlier request
    ttft_s: float = 0.0
    wall_s: float = 0.0
    batch_size: int = 1  # rows of the batch it ran in
    # structured output (None/empty: free text): whether the output is a complete match of its grammar,
    # why the grammar could not go on, and the seconds its token masks took
    grammar_complete: bool | None = None
    grammar_error: str = ""
    mask_ms: float = 0.0

    def count(self, r: Round) -> None:
        """Add one round."""
        self.rounds += 1
        self.target_passes += 1
        self.draft_passes += r.proposal.passes
        if r.planned:
            name = r.proposer.name
            self.rounds_by_drafter[name] = self.rounds_by_drafter.get(name, 0) + 1
            self.accepted_by_drafter[name] = self.accepted_by_drafter.get(name, 0) + r.accepted  # its chain's
        self.draft_len_hist[r.k] = self.draft_len_hist.get(r.k, 0) + 1
        self.proposed += r.nodes
        self.accepted += r.taken
        depth = r.k
        if r.tree is not None:
            self.tree_rounds += 1
            depth = r.tree.depth()
            if r.taken > r.accepted:  # its walk left the chain by a branch
                fam = r.tree.family[r.path[r.accepted] - r.tree.chain]
                self.accepted_by_branch[fam] = self.accepted_by_branch.get(fam, 0) + r.taken - r.accepted
        for i in range(depth):  # per depth: rounds whose proposal reached it, and whose accepted path did
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < r.taken

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("proposed_at"), d.pop("accepted_at")
        d["acceptance_rate"] = self.accepted / self.proposed if self.proposed else 0.0
        d["accepted_per_position"] = [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]
        d["proposed_per_position"] = list(self.proposed_at)
        d["tree_nodes"] = self.proposed / self.rounds if self.rounds else 0.0  # draft tokens verified per round
        d["tokens_per_target_pass"] = self.new_tokens / self.target_passes if self.target_passes else 0.0
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        decode_s = self.wall_s - self.ttft_s
        d["decode_tokens_per_s"] = (self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0
        return d


@dataclass
class Totals:
    """What the batch as a whole did (per-request numbers are in each result's stats)."""

    batch_size: int = 0
    requests: int = 0
    new_tokens: int = 0
    target_passes: int = 0  # verify passes (prefills counted apart)
    draft_passes: int = 0  # draft passes, catch-up chunks included
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


class Rows(Protocol):
    """One model's engine seen as the rows of a batch, each holding its own sequence."""

    batch: int
    passes: int  # passes run so far
    trees: bool  # forward takes tokens with parent pointers

    def prefill(self, r: int, prompt: list[int], share_prefix: bool) -> tuple[np.ndarray, int]:
        """Row r := `prompt` (keeping what its slots kept of earlier prompts where that is exact, when
        `share_prefix`); returns (the last position's logits [W], the prompt tokens kept)."""
    def forward(self, feeds: dict[int, list[int]], last: bool,
                parents: dict[int, list[int]] | None = None) -> dict[int, np.ndarray]:
        """Append feeds[r] to row r (other rows sit out). Returns {r: logits [n, W]}: last=True, n = 1 (the
        row's last fed token); else every fed position. `parents[r]` (with `trees`): row r's tokens are a tree,
        each following the one its parent names (-1: the row's sequence), written in the slots that follow."""
    def keep(self, r: int, n: int, moved: list[tuple[int, int]] = ()) -> None:
        """Row r keeps the first n tokens of its sequence, after each (src, dst) of `moved`: slot dst gets
        what slot src holds."""
    def release(self, r: int, seq: list[int] | None = None) -> None:
        """Row r's request ended; `seq` (prompt + output, None: its prompt was never read) is what its slots
        hold, which a later prompt may keep where that is exact."""
    def span(self, rows: Iterable[int]) -> tuple[int, int]:
        """The rows lo .. hi - 1 a pass over `rows` computes (rows between them are padding)."""


class Single:
    """One batch-1 engine as the only row of a batch (a request alone; `prompt_cache`: what the engine's
    cache kept of earlier prompts, decoding/prefix.py)."""

    batch = 1

    def __init__(self, engine: Engine, prompt_cache: PromptCache | None = None):
        self.e, self.passes = engine, 0
        self.prompts, self.keeps = prompt_cache or PromptCache(), prompt_cache is not None
        self.trees = bool(getattr(engine, "trees", False))

    def prefill(self, r: int, prompt: list[int], share_prefix: bool = True) -> tuple[np.ndarray, int]:
        if not share_prefix:
            self.prompts.forget()
        return self.prompts.read(self.e, prompt)

    def forward(self, feeds: dict[int, list[int]], last: bool,
                parents: dict[int, list[int]] | None = None) -> dict[int, np.ndarray]:
        (r, t), = feeds.items()
        self.passes += 1
        at = np.array([len(t) - 1]) if last else np.arange(len(t))
        if parents:
            return {r: self.e.forward_ragged(np.array([t]), np.array([len(t)]), at, parents=np.array([parents[r]]))}
        return {r: self.e.forward(np.array([t]), at)[0]}  # [n, W]

    def span(self, rows: Iterable[int]) -> tuple[int, int]:
        return 0, 1

    def keep(self, r: int, n: int, moved: list[tuple[int, int]] = ()) -> None:
        if moved:
            src, dst = zip(*moved)
            self.e.move(0, src, dst)
        self.e.truncate(min(n, self.e.length))

    def release(self, r: int, seq: list[int] | None = None) -> None:
        if seq is not None and self.keeps:
            self.prompts.extend(self.e, seq)  # what decoding wrote, where that is exact


class TokenStream:
    """A request's output without text (no tokenizer): `on_tokens(new)` sees each round's tokens and
    returns True to end the request (finish reason "stop")."""

    text = ""

    def __init__(self, on_tokens: Callable[[list[int]], bool] | None = None):
        self.on_tokens, self.stopped, self.n_tokens = on_tokens, False, 0

    def feed(self, new: list[int]) -> str:
        self.n_tokens += len(new)
        self.stopped = bool(self.on_tokens is not None and self.on_tokens(new))
        return ""

    def finish(self) -> str:
        return ""


def emit(new: list[int], eos_ids: frozenset[int], room: int) -> tuple[list[int], str]:
    """The part of a round's tokens that is output: never past EOS (reason "eos") or `room` tokens."""
    for i, t in enumerate(new):
        if t in eos_ids:
            return new[:min(i, room)], "eos"
    return new[:room], ""


@dataclass
class _Refused:
    """A request that could not start: `result` says why."""

    req: Request
    result: ConfigError


@dataclass
class _Row:
    req: Request
    stream: Any  # api/text.TextStream, or TokenStream
    policy: Policy
    stats: Stats
    rng: np.random.Generator | sampling.Coupled  # its randomness (sampling.source)
    seq: list[int]
    constraint: Constraint | Free | MinTokens = FREE  # what its output must follow: grammar, min_tokens, or nothing
    grammar: Constraint | None = None  # its grammar's state (structured output)
    start: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    reason: str = ""
    read: bool = False  # its prompt is in the target's cache
    proposer: Any = None  # this round's
    k: int = 0  # drafts this round's plan asked for
    result: Result | None = None

    @property
    def cfg(self) -> GenerationConfig:
        return self.req.cfg


def _accept(row: _Row, draft: Proposal, tree: Tree | None, lg: np.ndarray) -> tuple[list[int], list[int], int]:
    """A round's test (sampling.py) for a row that verified `draft` or `tree` with target logits `lg`: (the accepted
    tree nodes, the tokens it emits: accepted drafts and the target's next, how many of them are the chain's)."""
    cfg, pos = row.cfg.sampling, len(row.seq)
    if tree is None:
        n, t = sampling.accept(draft.tokens, draft.p_draft, lg, cfg, row.rng, pos)
        return [], [*draft.tokens[:n].tolist(), t], n
    path, t = sampling.accept_tree(tree.tokens, tree.parents, draft.p_draft, lg, cfg, row.rng, pos)
    return path, [*tree.tokens[path].tolist(), t], tree.on_chain(path)


class Decoder:
    """Decodes requests over the `target.batch` rows of `target` (and of the draft model's rows, made by
    `draft()` on first need: a target-only run allocates no draft cache). `policy(r, cfg, constraint)` builds
    a request's policy and proposers for row r; `text(stop)` its text stream (None: no text, TokenStream);
    `history`: where every finished request's output goes (the suffix proposer drafts from it);
    `constrain(grammar)`: a constrained request's Constraint (api/grammars.Grammars.start); `check(req)` raises
    ConfigError for a request these rows cannot run (it then ends alone, the others go on)."""

    def __init__(self, target: Rows, draft: Callable[[], Rows], vocab: int, eos_ids: frozenset[int],
                 policy: Callable[[int, GenerationConfig, Constraint | None], Policy],
                 text: Callable[[tuple[str, ...]], Any] | None = None, history: History | None = None,
                 share_prefix: bool = True, constrain: Callable[[Grammar], Constraint] | None = None,
                 check: Callable[[Request], None] | None = None):
        self.target, self._make_draft, self._draft = target, draft, None
        self.constrain, self.check = constrain, check or (lambda req: None)
        self.vocab, self.eos, self.policy_for, self.history = vocab, eos_ids, policy, history
        self.text, self.share_prefix = text or (lambda stop: TokenStream()), share_prefix
        self.B = target.batch
        self.totals = Totals(batch_size=self.B)
        # the rounds' tokens and seconds lately (EMA): the rate a row of a batch plans against (policy.Batch)
        self._tokens, self._seconds = 0.0, 0.0

    @property
    def draft(self) -> Rows:
        if self._draft is None:
            self._draft = self._make_draft()
        return self._draft

    @property
    def made(self) -> list[Rows]:
        """The rows made so far: the target's, and the draft model's once a request needed them."""
        return [self.target] + ([self._draft] if self._draft is not None else [])

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Any, Result | ConfigError]]:
        """Yield (key, Result) for each request, in order of completion; (key, ConfigError) for one that
        cannot start (its grammar, its settings on this decoder): the others run on. Requests are pulled
        lazily, one whenever a row is free; an iterator may yield WAIT for "none now"."""
        for row in self.finished(requests):
            yield row.req.key, row.result

    def finished(self, requests: Iterable[Request]) -> Iterator[_Row]:
        """`run`, yielding each finished row (its `result`, and its `stats` as a Stats), or a request that could
        not start (`result`: the ConfigError)."""
        it, rows, exhausted = iter(requests), [None] * self.B, False
        t0, c0 = time.perf_counter(), self._draft_passes()
        try:
            while True:
                for r in range(self.B):
                    while rows[r] is None and not exhausted:
                        req = next(it, None)
                        if req is None:
                            exhausted = True
                        elif req is WAIT:
                            break
                        else:
                            try:
                                row = self._start(r, req)
                            except ConfigError as e:  # this request's own: it ends with it, the rest go on
                                yield _Refused(req, e)
                                continue
                            if row.reason:  # done at its first token, or cancelled
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
        return self._draft.passes if self._draft is not None else 0

    def _round(self, active: list[tuple[int, _Row]]) -> None:
        # 1. Plan: each row's policy picks who drafts and how far (a round emits at most k + 1 tokens); in a
        #    batch, against what widening the padded pass beyond the rows planned before it costs, at its rate
        #    (the pass computes the rows from the first active one to the last: one of them is a request alone).
        rate, widest = (self._tokens / self._seconds if self._seconds else 0.0), 1
        lo, hi = self.target.span(r for r, _ in active)
        for r, row in active:
            left = row.cfg.max_new_tokens - len(row.out)
            batch = Batch(hi - lo, widest, rate) if hi - lo > 1 and rate else None
            row.proposer, row.k = row.policy.plan(row.seq, min(row.policy.max_k, left - 1), left, batch)
            widest = max(widest, row.k + 1)
        # 2. Draft: the rows' proposers step in lockstep, one draft pass per drafted position; a proposal is cut
        #    at its first token the row's constraint forbids (its grammar, its min_tokens).
        t0 = time.perf_counter()
        drafts, steps = self._propose([(r, row) for r, row in active if row.k])
        going = dict(active)
        for r in drafts:
            drafts[r] = drafts[r].cut(going[r].constraint.cut(drafts[r].tokens))
        # 3. Grow: where the target takes trees, a row's policy may verify more than its chain: branches other
        #    parts propose without a pass (decoding/tree.py), each a path the row's constraint allows; in a batch,
        #    against what widening the padded pass beyond the rows' drafts (and the trees before it) costs.
        trees, widest = {}, 1 + max((len(d.tokens) for d in drafts.values()), default=0)
        if self.target.trees:
            for r, row in active:
                limit = min(row.policy.max_k, row.cfg.max_new_tokens - len(row.out) - 1)
                batch = Batch(hi - lo, widest, rate) if hi - lo > 1 and rate else None
                if tree := row.policy.grow(row.seq, drafts.get(r, NOTHING), limit, row.constraint.fits, batch):
                    trees[r], widest = tree, max(widest, 1 + len(tree))
        # 4. Verify every row's last token and its drafts (or tree) in one target pass.
        t1 = time.perf_counter()
        feeds = {r: [row.seq[-1], *(trees[r] if r in trees else drafts.get(r, NOTHING)).tokens.tolist()]
                 for r, row in active}
        logits = self.target.forward(feeds, last=False, parents={r: t.feed_parents() for r, t in trees.items()})
        t2 = time.perf_counter()
        width = (hi - lo) * max(map(len, feeds.values()))  # what the pass computed: rows are right-padded
        self.totals.target_passes += 1
        self.totals.row_rounds += len(active)
        emitted = 0
        for r, row in active:
            # 5. Accept a prefix of the row's drafts (a path of its tree), and one more token from the target (from
            #    logits masked by the row's constraint after the drafts before each position, as the drafts' were).
            draft, tree, L = drafts.get(r, NOTHING), trees.get(r), len(row.seq)
            prefixes = tree.prefixes() if tree is not None else [draft.tokens[:i] for i in range(len(draft.tokens) + 1)]
            lg = row.constraint.mask(logits[r][:, :self.vocab], prefixes)  # [nodes + 1, V]
            path, new, on = _accept(row, draft, tree, lg)
            n = len(new) - 1
            moved = [(L + c, L + j) for j, c in enumerate(path) if c != j]  # a tree's node i sits in slot L + i
            # 6. Commit: the verified slots stay (a tree's accepted path moved to follow the sequence); rejected
            #    ones go by moving the lengths back. The proposers keep what the chain got right.
            self.target.keep(r, L + n, moved)  # the target had seq[:-1]; it keeps seq[-1] and n drafts
            row.policy.commit(L + on)
            share = draft.passes / steps if steps else 1.0  # of the draft passes, those it took part in
            done = Round(row.proposer, row.k, draft, on, new, lg, draft_s=(t1 - t0) * share, verify_s=t2 - t1,
                         width=width, tree=tree, path=tuple(path))
            row.policy.observe(done)
            row.stats.count(done)
            self.totals.proposed += done.nodes
            self.totals.accepted += n
            # 7. Emit, and end the request at EOS, a stop string, max_new_tokens or its cancel.
            before = len(row.out)
            self._emit(row, new)
            emitted += len(row.out) - before
        self._tokens = 0.8 * self._tokens + 0.2 * emitted
        self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - t0)

    def _propose(self, rows: list[tuple[int, _Row]]) -> tuple[dict[int, Proposal], int]:
        """Each row's proposal: its proposer's steps (proposers.ModelProposer.steps), driven together; and
        how many draft passes that took."""
        done, steps, feeds, catchup, passes = {}, {}, {}, {}, 0
        for r, row in rows:
            g = row.proposer.steps(row.seq, row.k, row.cfg.sampling, row.rng, row.policy.stop(row.cfg.confidence_stop),
                                   row.constraint)
            try:
                feeds[r], steps[r] = next(g), g
            except StopIteration as s:  # needs no pass (a lookup)
                done[r] = s.value
        while feeds:
            t0 = time.perf_counter()
            logits = self.draft.forward(feeds, last=True)
            passes += 1
            for r, feed in feeds.items():
                if len(feed) > 2 and r not in catchup:  # catching up on what it missed: not a draft step's cost
                    catchup[r] = (time.perf_counter() - t0, len(feed))
            feeds = {}
            for r, g in list(steps.items()):
                try:
                    feeds[r] = g.send(logits[r][0])  # [W]
                except StopIteration as s:
                    del steps[r]
                    done[r] = s.value
        for r, (seconds, tokens) in catchup.items():
            done[r] = replace(done[r], catchup_s=seconds, catchup_tokens=tokens)
        return done, passes

    def _start(self, r: int, req: Request) -> _Row:
        cfg = req.cfg
        self.check(req)
        cancelled = req.cancel is not None and req.cancel()  # while it waited: no grammar, no prompt read
        grammar = self.constrain(cfg.grammar) if cfg.grammar is not None and not cancelled else None
        constraint = grammar or FREE
        if cfg.min_tokens:
            constraint = MinTokens(constraint, cfg.min_tokens, self.eos, self.vocab)
        policy = self.policy_for(r, cfg, grammar)
        k = policy.max_k
        row = _Row(req=req, stream=self.text(cfg.stop), policy=policy,
                   rng=sampling.source(cfg.seed, cfg.sampling.method == "coupled"),
                   seq=list(req.prompt), constraint=constraint, grammar=grammar, stats=Stats(draft_len=cfg.draft_len if k else 0, proposed_at=[0] * k,
                                                     accepted_at=[0] * k, prompt_tokens=len(req.prompt),
                                                     batch_size=self.B))
        self.totals.requests += 1
        if cancelled:
            row.reason = "cancelled"
            return row
        # The target reads the prompt (but what its row kept of an earlier one); the last position gives
        # the first token.
        logits, row.stats.prompt_cached = self.target.prefill(r, row.seq, self.share_prefix)
        logits = constraint.mask(logits[None, :self.vocab], [()])[0]
        x = sampling.pick(logits[:self.vocab], cfg.sampling, row.rng, len(row.seq))
        row.read = True
        self.totals.prefills += 1
        row.stats.target_passes = 1
        row.stats.ttft_s = time.perf_counter() - row.start
        policy.start(row.seq)  # a model proposer reads the prompt in its first draft pass
        self._emit(row, [x])
        return row

    def _emit(self, row: _Row, new: list[int]) -> None:
        """Output a round's tokens: never past EOS or max_new_tokens; a stop string or the cancel ends it."""
        new, reason = emit(new, self.eos, row.cfg.max_new_tokens - len(row.out))
        row.out += new
        row.seq += new
        row.constraint.commit(new)
        if not reason:
            reason, why = row.constraint.end()
            row.stats.grammar_error = why or row.stats.grammar_error
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

    def _finish(self, r: int, row: _Row) -> _Row:
        """A request's end, the same for every row: free its rows, cut its output at the stop string, add
        the output to the history, and make its Result."""
        self.target.release(r, row.seq if row.read else None)
        if self._draft is not None:
            self._draft.release(r, None)
        tail = row.stream.finish()
        if tail and row.req.on_text is not None:
            row.req.on_text(tail)
        tokens = row.out[:row.stream.n_tokens] if row.stream.stopped else row.out  # not past the stop string
        if self.history is not None:
            self.history.add(tokens)  # later requests draft from it (the suffix proposer)
        st = row.stats
        if row.read:
            for name, value in row.policy.finish(len(row.out)).items():
                setattr(st, name, value)
        st.new_tokens, st.wall_s = len(tokens), time.perf_counter() - row.start
        if row.grammar is not None:
            c = row.grammar
            # a stop string cut the output short of what the grammar took: the text returned is what counts
            st.grammar_complete = c.matches(row.stream.text) if row.stream.stopped and row.cfg.stop else c.complete
            st.mask_ms = round(1e3 * c.mask_s, 3)
        self.totals.new_tokens += len(tokens)
        row.result = Result(tokens=tokens, text=row.stream.text, finish_reason=row.reason, stats=st.as_dict())
        return row


def decode(target: Engine, policy: Policy, prompt: list[int], cfg: GenerationConfig, vocab: int,
           eos_ids: frozenset[int], on_tokens: Callable[[list[int]], bool] | None = None,
           prompt_cache: PromptCache | None = None, constraint: Constraint | None = None) -> tuple[list[int], str, Stats]:
    """One request alone on batch-1 engines: the target, and the draft model's that `policy` drafts with.
    Returns (tokens, finish reason "eos" | "length" | "stop", stats).

    `on_tokens(new)` sees each round's emitted tokens (EOS excluded) and returns True to stop. Only the
    first `vocab` logits are used, which masks padding rows of larger output matrices. `prompt_cache`:
    what the target's cache kept of earlier prompts (decoding/prefix.py; None: the prompt is read whole).
    `constraint`: the request's grammar state (cfg.grammar then names it; `policy` drafts its forced tokens
    when built with it).
    """
    model = getattr(policy, "model", None)
    dec = Decoder(Single(target, prompt_cache), lambda: Single(model.engine), vocab, eos_ids, lambda r, c, g: policy,
                  text=lambda stop: TokenStream(on_tokens), constrain=lambda g: constraint)
    row, = dec.finished([Request(0, prompt, cfg)])
    if isinstance(row.result, ConfigError):
        raise row.result
    return row.result.tokens, row.result.finish_reason, row.stats
