"""All sampling math in one place: warping, drawing, and the two lossless verifications.

Pure functions on numpy arrays. `p_draft` is the draft model's warped distribution, `p_target`
the target's; both are warped by the same function with the same settings.

*Rejection* (Leviathan et al. 2023, Chen et al. 2023): a draft token is accepted with probability
min(1, p_target / p_draft), else the token is drawn from the residual; the output is distributed
exactly as plain sampling from the warped target. Its uniforms come from the caller's generator in a
fixed order, so a seed reproduces for the same drafts, but other drafts give another sample.

*Coupled* (Gumbel-max): the token at sequence position t is argmax(log p_t + g_t), the noise g_t a
function of (seed, t) only (`Coupled`; computed as the equivalent exponential race argmax(p_t / e_t),
g = -log e). That is an exact sample of p_t; a draft model proposes argmax(log q_t + g_t) with the
same noise, and verification accepts a drafted token iff it is the
target's pick there, emitting the pick at the first mismatch. The output is then the target-only
sample itself, whatever drafted it: drafter, draft length, batch and timing cannot change it.
"""
from __future__ import annotations

import numpy as np

from specrt.config import SamplingConfig


def warp(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """logits [N, V] -> probabilities [N, V] (float64): temperature, then top-k, then top-p.

    The order is the one transformers' generate applies. top-p keeps the smallest set of most
    likely tokens whose mass reaches top_p (at least one token).
    """
    z = logits.astype(np.float64)  # [N, V]
    # shifted before dividing: at a temperature too small to divide by (1e-310, 5e-324) the largest logit
    # stays 0 and the rest go to -inf (greedy, ties shared), where logits / T would be inf - inf = NaN
    with np.errstate(over="ignore"):
        z = (z - z.max(axis=-1, keepdims=True)) / cfg.temperature
    if 0 < cfg.top_k < z.shape[-1]:
        for row in z:  # over the tokens any logit allows: a long run of -inf makes the partition slow
            live = row[row > -np.inf]
            if cfg.top_k < len(live):
                row[row < np.partition(live, -cfg.top_k)[-cfg.top_k]] = -np.inf
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if cfg.top_p < 1.0:
        p = np.stack([_nucleus(row, cfg.top_p) for row in p])
    return p


def _nucleus(p: np.ndarray, top_p: float, head: int = 2048, level: float = 1e-6) -> np.ndarray:
    """p [V] with only the smallest set of most likely tokens whose mass reaches top_p kept, renormalised.
    Tokens in order of falling probability, ties by id (a stable sort). Only tokens with any probability are
    looked at (a zero adds nothing kept or not, and a long run of zeros, as a draft's distribution over a
    restricted vocabulary has, makes numpy's partition ~20x slower). The set is a prefix of that order, so
    when the tokens at or above some probability hold top_p of the mass it lies among them: sorting those
    alone gives the same order and the same sums, so the same bits. Tried in turn: the tokens within `level`
    of the likeliest (one pass; on the int4 pair at T 0.8 the set of top-p 0.95 ends among them in 94% of
    the target's rows, a median of 42 tokens), the `head` likeliest (a partition), then all (a full sort of
    151,936 costs ~10 ms a row)."""
    ids = np.flatnonzero(p) if np.count_nonzero(p) < len(p) else None
    q = p if ids is None else p[ids]  # a target's distribution has no zeros: no copy
    for upper in (lambda: np.flatnonzero(q >= q.max() * level),
                  lambda: np.flatnonzero(q >= np.partition(q, -head)[-head]) if len(q) > 2 * head else None):
        cand = upper()  # an upper set: every token tied with its lowest too
        if cand is None or len(cand) > 2 * head:
            continue
        order = cand[np.argsort(-q[cand], kind="stable")]
        sorted_q = q[order]
        mass_before = np.cumsum(sorted_q) - sorted_q
        if mass_before[-1] >= top_p:  # the set ends among them
            break
    else:
        order = np.argsort(-q, kind="stable")
        sorted_q = q[order]
        mass_before = np.cumsum(sorted_q) - sorted_q
    kept = order[mass_before < top_p]  # the first token always has mass_before 0
    kept = kept if ids is None else ids[kept]
    out = np.zeros_like(p)
    out[kept] = p[kept]
    out /= out.sum()
    return out


def top_prob(logits: np.ndarray) -> float:
    """The largest probability of softmax(logits [V]): how sure the model is of its likeliest token."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


class Coupled:
    """The noise of coupled sampling for one seed: a standard exponential e per (position, token id)
    (g = -log e is a standard Gumbel), computed for any position and any ids without the ones before
    it, the same in every process and batch row. e = -log u, u in (0, 1) from the id-th output of a
    splitmix64 generator seeded by (seed, position): a counter times the golden-ratio increment, through
    splitmix64's output function (a bijection of 64-bit words mixing every input bit into every output bit)."""

    def __init__(self, seed: int):
        self.key = _mix(np.uint64(seed & (2**64 - 1)))

    def uniform(self, pos: int, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
            h = _mix(_mix(self.key ^ np.uint64(pos)) + ids.astype(np.uint64) * _GAMMA)
        # 52 random bits as the mantissa of a double in [1, 2) (no integer-to-float conversion), then
        # (2m + 1) / 2^53: exact, in (0, 1), and so is 1 - u
        return ((h >> np.uint64(12)) | np.uint64(0x3FF0000000000000)).view(np.float64) - (1.0 - 2.0 ** -53)

    def exponential(self, pos: int, ids: np.ndarray) -> np.ndarray:
        return -np.log(self.uniform(pos, ids))

    def pick(self, p: np.ndarray, pos: int, ids: np.ndarray | None = None) -> int:
        """argmax(p / e_pos) = argmax(log p + g_pos) over the tokens p [V] gives mass: an exact sample of p
        (a token without mass scores 0 and never wins). e = -log u >= 1 - u, so p / (1 - u) bounds a token's
        score without a logarithm: the exact scores are computed only where that bound reaches the exact
        score of the token with the best bound (with a margin for rounding), which picks the same token.
        `ids`: the token id each entry of p stands for (sorted; None: entry i is id i); the noise is the id's."""
        dense = ids is None and np.count_nonzero(p) > len(p) // 8
        at = np.arange(len(p)) if dense else np.flatnonzero(p)
        tokens = at if ids is None else ids[at]
        q, u = (p if dense else p[at]), self.uniform(pos, tokens)
        bound = q / (1.0 - u)
        i = int(np.argmax(bound))
        best = q[i] / -np.log(u[i])
        near = np.flatnonzero(bound * (1.0 + 1e-9) >= best)
        return int(tokens[near[np.argmax(q[near] / -np.log(u[near]))]])


_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix(x):
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def source(seed: int, coupled: bool) -> np.random.Generator | Coupled:
    """A request's randomness: the noise of coupled sampling, or the generator rejection draws from."""
    return Coupled(seed) if coupled else np.random.default_rng(seed)


def sample(p: np.ndarray, rng: np.random.Generator | Coupled, pos: int, ids: np.ndarray | None = None) -> int:
    """One token from the warped distribution p [V] at sequence position `pos`; `ids`: the token id each entry
    of p stands for (sorted; None: entry i is id i)."""
    if isinstance(rng, Coupled):
        return rng.pick(p, pos, ids)
    j = draw(p, rng.random())
    return j if ids is None else int(ids[j])


def draw(dist: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a (possibly unnormalised) distribution [V] with one uniform u in [0, 1)."""
    cdf = np.cumsum(dist)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(dist) - 1))


def pick(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator | Coupled, pos: int) -> int:
    """The token at sequence position `pos` from logits [V]: the argmax (greedy), else a sample of the
    warped distribution."""
    if cfg.greedy:
        return int(logits.argmax())
    return sample(warp(logits[None], cfg)[0], rng, pos)


def accept(draft_tokens: np.ndarray, p_draft: np.ndarray | None, target_logits: np.ndarray, cfg: SamplingConfig,
           rng: np.random.Generator | Coupled, pos: int) -> tuple[int, int]:
    """One round's test: draft_tokens [k] for positions pos.., p_draft [k, V] or None, target_logits
    [k+1, V] -> (n accepted, next token). Greedy takes no random numbers; rejection exactly k+1 uniforms,
    so a seed reproduces; coupled the noise of the positions it looks at."""
    if cfg.greedy:
        return accept_greedy(draft_tokens, target_logits)
    if isinstance(rng, Coupled):
        return accept_coupled(draft_tokens, warp(target_logits, cfg), rng, pos)
    return accept_sample(draft_tokens, p_draft, warp(target_logits, cfg), rng.random(len(draft_tokens) + 1))


def accept_coupled(draft_tokens: np.ndarray, p_target: np.ndarray, noise: Coupled, pos: int) -> tuple[int, int]:
    """Coupled verification: draft_tokens [k] for positions pos.., p_target [k+1, V] -> (n accepted, next
    token). Accept while the draft token is the target's pick at its position; the next token is the pick
    at the first mismatch (or the bonus position k)."""
    for n in range(len(draft_tokens) + 1):
        t = noise.pick(p_target[n], pos + n)
        if n == len(draft_tokens) or draft_tokens[n] != t:
            return n, t
    raise AssertionError("unreachable")


def accept_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """draft_tokens [k], target_logits [k+1, V] -> (n accepted, next token).

    Accept while the draft token is the target's argmax; the next token is the target's argmax at
    the first mismatch (or the bonus position k).
    """
    best = target_logits.argmax(axis=-1)  # [k+1]
    k = len(draft_tokens)
    n = int(np.argmin(np.append(draft_tokens == best[:k], False)))
    return n, int(best[n])


def accept_sample(draft_tokens: np.ndarray, p_draft: np.ndarray | None, p_target: np.ndarray,
                  u: np.ndarray) -> tuple[int, int]:
    """The lossless rejection test. draft_tokens [k], p_draft [k, V] (None: point masses, as from a
    prompt-lookup drafter), p_target [k+1, V], u [k+1] uniforms -> (n accepted, next token).

    Accept d_i with probability min(1, p_target(d_i) / p_draft(d_i)); p_draft(d_i) == 0 rejects.
    At the first rejection n, draw from normalize(max(p_target[n] - p_draft[n], 0)), or from
    p_target[n] if that residual has no mass. If all k are accepted, draw the bonus from p_target[k].
    """
    k = len(draft_tokens)
    rows = np.arange(k)
    pt = p_target[rows, draft_tokens]  # [k]
    pd = np.ones(k) if p_draft is None else p_draft[rows, draft_tokens]  # [k]
    with np.errstate(divide="ignore", invalid="ignore"):
        ok = (pd > 0) & (u[:k] * pd < pt)  # u < pt/pd without dividing (u in [0, 1), so P = min(1, pt/pd))
    n = int(np.argmin(np.append(ok, False)))
    if n == k:
        return n, draw(p_target[k], u[k])
    if p_draft is None:
        residual = p_target[n].copy()
        residual[draft_tokens[n]] = 0.0
    else:
        residual = np.maximum(p_target[n] - p_draft[n], 0.0)
    if residual.sum() <= 1e-12:
        residual = p_target[n]
    return n, draw(residual, u[k])


def accept_tree(tokens: np.ndarray, parents: np.ndarray, p_draft: np.ndarray | None, target_logits: np.ndarray,
                cfg: SamplingConfig, rng: np.random.Generator | Coupled, pos: int) -> tuple[list[int], int]:
    """A round's test on a tree: tokens [m] with parents [m] (-1: the round's last emitted token, the root; a
    parent comes before its children, siblings are distinct tokens), p_draft [c, V] or None for nodes 0..c-1 (a
    sampled chain: node i the child of node i-1, drawn from p_draft[i]; every other node is a point mass),
    target_logits [m+1, V] (row 0 the root's, row i+1 node i's) -> (the accepted path's nodes from the root
    down, the next token).

    Greedy follows the child equal to the target's argmax, coupled the child equal to the target's pick at that
    depth's position: either way the path and the next token are what the target alone emits there. Rejection
    tests a node's children in order, each against what is left of the target's distribution after the ones
    before it failed (recursive rejection sampling): a sampled child is accepted with min(1, r/q) and leaves
    max(r - q, 0); a point mass c is accepted with r(c) and leaves r without c. The token that ends the walk is
    drawn from what is left, so every step emits an exact sample of the target's distribution."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(np.asarray(parents).tolist()):
        children.setdefault(p, []).append(i)
    coupled, c = isinstance(rng, Coupled), 0 if p_draft is None else len(p_draft)
    node, path = -1, []
    while True:
        kids, row = children.get(node, []), target_logits[node + 1]
        if cfg.greedy or coupled:
            t = int(row.argmax()) if cfg.greedy else rng.pick(warp(row[None], cfg)[0], pos + len(path))
            nxt = next((i for i in kids if tokens[i] == t), None)
            if nxt is None:
                return path, t
        else:
            r, nxt = warp(row[None], cfg)[0], None
            for i in kids:
                u, d = rng.random(), int(tokens[i])
                if i < c:  # the sampled chain's child (node i - 1's or the root's): q = p_draft[i]
                    q = p_draft[i]
                    if q[d] > 0 and u * q[d] < r[d]:
                        nxt = i
                        break
                    rest = np.maximum(r - q, 0.0)
                else:
                    if u < r[d]:
                        nxt = i
                        break
                    rest = r.copy()
                    rest[d] = 0.0
                s = rest.sum()
                r = rest / s if s > 1e-12 else r  # nothing left: the children could only take r's mass
            if nxt is None:
                return path, draw(r, rng.random())
        path.append(nxt)
        node = nxt
