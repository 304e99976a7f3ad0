"""Tree proposals: a round's drafted chain plus branches its pass has room for (docs/design.md, "Trees").

A tree's nodes are tokens with parent pointers (-1: the round's last emitted token, the root; a parent comes
before its children; siblings are distinct tokens). Nodes 0..chain-1 are the chain the policy's proposer
drafted; the others are branches other parts propose from what they already hold, without a pass: the draft
model's next choices at each drafted position (from the logits it drafted with), and a lookup's continuation
of the sequence where it parts from the chain. The target verifies them all in one pass (each node sees the
cache and its ancestors only) and sampling.accept_tree walks the accepted path.

`Grower` chooses the branch nodes under a budget. A node's gain is the tokens it is expected to add: the
chance the walk reaches its parent and the target's token there is the node's (a runner-up: the chain's
acceptance up to its depth times the draft's probability of it; a lookup node: the chance the chain fails
where the branch starts times the lookup's own acceptance down to it), scaled by what such nodes measured
against what they were expected to add (`learned`, per family). Nodes are taken best first while a node's
gain per the seconds it adds to the pass (the measured cost by width) beats the round's expected tokens per
second without it (a batch row's: the batch's tokens per second, and its pass already as wide as the widest
row), the tree fits the pass (`limit` nodes), and the request's constraint allows the node's path. Now and
then (`probe_every` rounds) the best node of each family goes in whatever it is expected to pay, so a family
once judged useless is measured again.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specrt.decoding.proposers import Proposal

# a family's measured and expected tokens count as this many rounds' worth of its prior (1:1) to start with
PRIOR = 1.0
DECAY = 0.98  # the weight a family's sums keep at each round that tried it
RUNNER_UP = ("runner_up", "third_choice", "later_choice")  # the draft's next choices' families, by rank


@dataclass(frozen=True)
class Tree:
    tokens: np.ndarray  # [m] int64
    parents: np.ndarray  # [m] int64: -1 the root, else an earlier node
    chain: int  # nodes 0..chain-1: the drafted chain, node i the child of node i-1
    family: tuple[str, ...]  # per node past the chain: what proposed it ("runner_up", "lookup")
    expected: dict[str, float]  # per family, the tokens its nodes were expected to add (before `learned`)

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self) -> int:
        d = [0] * len(self.tokens)
        for i, p in enumerate(self.parents.tolist()):
            d[i] = 1 if p < 0 else d[p] + 1
        return max(d, default=0)

    def on_chain(self, path: Sequence[int]) -> int:
        """How many of a path's leading nodes are the chain's."""
        return next((j for j, c in enumerate(path) if c != j), len(path))

    def prefixes(self) -> list[tuple[int, ...]]:
        """The drafted tokens before each of the pass's positions [root, *nodes]: () for the root, then the
        tokens from the root down to each node."""
        out: list[tuple[int, ...]] = [()]
        for t, p in zip(self.tokens.tolist(), self.parents.tolist()):
            out.append(out[p + 1] + (t,))
        return out

    def feed_parents(self) -> list[int]:
        """The parents of the pass's tokens [root, *nodes], as indices among them."""
        return [-1, *(p + 1 if p >= 0 else 0 for p in self.parents.tolist())]


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root down to `node` (-1: none)."""
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


@dataclass
class Branch:
    """A candidate node: its parent node (-1 the root; None: the node its lookup's previous token became),
    token, expected gain, family."""

    parent: int | None
    token: int
    gain: float
    family: str


class Grower:
    """Chooses a round's tree (the module docstring); `learned` is the policy state's per family
    [measured tokens, expected tokens], updated by `observe`."""

    def __init__(self, learned: dict[str, list[float]], probe_every: int = 16):
        self.learned, self.probe_every, self.rounds = learned, probe_every, 0

    def scale(self, family: str) -> float:
        got, expected = self.learned.get(family, (0.0, 0.0))
        return (got + PRIOR) / (expected + PRIOR)

    def grow(self, chain: Proposal, reach: Sequence[float], lookup: np.ndarray | None, lookup_accept: Sequence[float],
             expected_tokens: float, cost: float, width_cost: Callable[[int], float | None], limit: int,
             fits: Callable[[Sequence[int]], bool] | None = None, rate: float | None = None) -> Tree | None:
        """The tree for a round whose proposer drafted `chain`: `reach[d]` the chance the chain's first d tokens
        are accepted (d = 0..k), `lookup` a lookup's continuation of the sequence (None: none) with its
        conditional acceptance per position, `expected_tokens` and `cost` (seconds) those of the round as a chain,
        `width_cost(w)` a pass of w tokens' seconds, `limit` the most nodes, `fits(path)` whether a node whose
        tokens from the root are `path` may be verified (the request's constraint); `rate`: a batch's tokens per
        second, which a node's seconds take from every row (None: the round's own, expected tokens / cost). None:
        a chain is best."""
        self.rounds += 1
        k = len(chain.tokens)
        if k == 0 and lookup is None:
            return None
        tokens, parents = list(chain.tokens.tolist()), list(range(-1, k - 1))
        kids = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
        cands: list[tuple[Branch, int]] = []  # (branch, index among the lookup's nodes or -1)
        if chain.runner_up is not None:  # each rank its own family: a third choice is calibrated apart
            fams = [RUNNER_UP[min(j, len(RUNNER_UP) - 1)] for j in range(chain.runner_up.shape[1])]
            scale = [self.scale(f) for f in fams]
            for d, (ts, ps) in enumerate(zip(chain.runner_up.tolist(), chain.runner_up_p.tolist())):
                for t, p, f, s in zip(ts, ps, fams, scale):
                    if t >= 0:
                        cands.append((Branch(d - 1, t, reach[d] * p * s, f), -1))
        if lookup is not None and len(lookup):
            f = lookup.tolist()
            at = next((j for j in range(min(len(f), k)) if f[j] != tokens[j]), min(len(f), k))
            if at < len(f):
                s = self.scale("lookup")
                miss = 1.0 - (reach[at + 1] / reach[at] if at < k and reach[at] > 0 else 0.0)
                g = reach[at] * min(lookup_accept[at] if at < len(lookup_accept) else 0.0, miss) * s
                for j in range(at, len(f)):
                    if j > at:
                        g *= lookup_accept[j] if j < len(lookup_accept) else 0.0
                    cands.append((Branch(None if j > at else at - 1, f[j], g, "lookup"), j - at))
        if not cands:
            return None
        # best first; a lookup node needs its parent, which comes before it (its gain is no larger)
        order = sorted(range(len(cands)), key=lambda i: (-cands[i][0].gain, i))
        probe = self.probe_every and self.rounds % self.probe_every == 0
        probed: set[str] = set()
        width, family, expected = 1 + k, [], {}
        last_lookup = None  # the node the lookup's previous node became
        taken_lookup = 0
        c_now = width_cost(width)
        for i in order:
            b, j = cands[i]
            if len(tokens) >= limit:
                break
            if j > 0 and j != taken_lookup:  # its parent is not in
                continue
            parent = last_lookup if b.parent is None else b.parent
            node = kids.get((parent, b.token))
            if node is None:  # a token the tree does not hold there yet: it widens the pass
                c_next = width_cost(width + 1)
                extra = c_next - c_now if c_next is not None and c_now is not None else None
                if rate is None:
                    pays = extra is not None and cost > 0 and b.gain * cost > expected_tokens * extra
                else:
                    pays = extra is not None and b.gain > rate * extra
                if not (pays or probe and b.family not in probed):
                    continue
                if fits is not None and not fits(_path(tokens, parents, parent) + [b.token]):
                    continue
                probed.add(b.family)
                node = len(tokens)
                tokens.append(b.token)
                parents.append(parent)
                kids[(parent, b.token)] = node
                family.append(b.family)
                width, c_now = width + 1, c_next
                expected_tokens, cost = expected_tokens + b.gain, cost + (extra or 0.0)
            expected[b.family] = expected.get(b.family, 0.0) + b.gain / self.scale(b.family)
            if j >= 0:
                last_lookup, taken_lookup = node, j + 1
        if not family:
            return None
        return Tree(np.array(tokens, np.int64), np.array(parents, np.int64), k, tuple(family), expected)

    def observe(self, tree: Tree, path: Sequence[int]) -> None:
        """What the round's tree added: the tokens its walk took past the chain, to the family of the node
        where it left the chain."""
        on = tree.on_chain(path)
        left_by = tree.family[path[on] - tree.chain] if on < len(path) else None
        for fam, e in tree.expected.items():
            got, exp = self.learned.get(fam, (0.0, 0.0))
            gain = len(path) - on if fam == left_by else 0.0
            self.learned[fam] = [DECAY * got + gain, DECAY * exp + e]
