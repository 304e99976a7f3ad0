"""All sampling math in one place: warping, drawing, and the lossless accept/resample test.

Pure functions on numpy arrays. `p_draft` is the draft model's warped distribution, `p_target`
the target's; both are warped by the same function with the same settings, so the speculative
output is distributed exactly as plain sampling from the warped target (Leviathan et al. 2023,
Chen et al. 2023). Every random decision takes its uniform variates from the caller, so a seed
reproduces and the number of draws per round is fixed.
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
        kth = np.partition(z, -cfg.top_k, axis=-1)[:, -cfg.top_k, None]  # [N, 1]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if cfg.top_p < 1.0:
        p = np.stack([_nucleus(row, cfg.top_p) for row in p])
    return p


def _nucleus(p: np.ndarray, top_p: float, head: int = 2048) -> np.ndarray:
    """p [V] with only the smallest set of most likely tokens whose mass reaches top_p kept, renormalised.
    Tokens in order of falling probability, ties by id (a stable sort). The set is nearly always within the
    few thousand likeliest tokens: those are sorted alone (a full sort of 151,936 costs ~10 ms a row), and
    their mass is summed in the same order as over all, so the result is the same bits; else all are sorted."""
    order = None
    if len(p) > 2 * head:
        cut = np.partition(p, -head)[-head]
        cand = np.flatnonzero(p >= cut)  # every token tied with the cut too
        order = cand[np.argsort(-p[cand], kind="stable")]
        sorted_p = p[order]
        mass_before = np.cumsum(sorted_p) - sorted_p
        if mass_before[-1] < top_p:  # the set may go on past the candidates
            order = None
    if order is None:
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        mass_before = np.cumsum(sorted_p) - sorted_p
    kept = order[mass_before < top_p]  # the first token always has mass_before 0
    out = np.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def top_prob(logits: np.ndarray) -> float:
    """The largest probability of softmax(logits [V]): how sure the model is of its likeliest token."""
    return float(1.0 / np.exp(logits - logits.max()).sum())


def draw(dist: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a (possibly unnormalised) distribution [V] with one uniform u in [0, 1)."""
    cdf = np.cumsum(dist)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(dist) - 1))


def pick(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    """One token from logits [V]: the argmax (greedy), else a draw from the warped distribution."""
    if cfg.greedy:
        return int(logits.argmax())
    return draw(warp(logits[None], cfg)[0], rng.random())


def accept(draft_tokens: np.ndarray, p_draft: np.ndarray | None, target_logits: np.ndarray, cfg: SamplingConfig,
           rng: np.random.Generator) -> tuple[int, int]:
    """One round's test: draft_tokens [k], p_draft [k, V] or None, target_logits [k+1, V] -> (n accepted,
    next token). Greedy takes no random numbers; sampling exactly k+1 uniforms, so a seed reproduces."""
    if cfg.greedy:
        return accept_greedy(draft_tokens, target_logits)
    return accept_sample(draft_tokens, p_draft, warp(target_logits, cfg), rng.random(len(draft_tokens) + 1))


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
