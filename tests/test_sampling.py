"""specrt.decoding.sampling: warping, drawing, and the statistics of the lossless accept/resample test."""
from __future__ import annotations

import numpy as np
import pytest

from _helpers import P_MIN, binom_pvalue, chi2_pvalue
from specrt.config import SamplingConfig
from specrt.decoding.sampling import Coupled, accept_coupled, accept_greedy, accept_sample, draw, warp
from specrt.errors import ConfigError


# ---------------------------------------------------------------- warp


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def test_warp_temperature_is_softmax():
    logits = np.random.default_rng(0).normal(size=(3, 17)).astype(np.float32)
    for t in (0.3, 1.0, 2.5):
        p = warp(logits, SamplingConfig(temperature=t))
        assert p.dtype == np.float64 and p.shape == (3, 17)
        np.testing.assert_allclose(p, _softmax(logits.astype(np.float64) / t), rtol=1e-12)


@pytest.mark.parametrize("t", [5e-324, 1e-310, 1e-300, 1e-12, 1e300, np.finfo(np.float64).max])
def test_a_temperature_too_small_to_divide_by_is_greedy_and_warping_never_gives_nan(t):
    """logits / 5e-324 overflows to inf and inf - inf is NaN (the probe's 'erererer'): every float64
    temperature warps to a distribution, the tiniest ones to the argmax (ties shared), the hugest to uniform."""
    logits = np.random.default_rng(1).normal(scale=8, size=(4, 50)).astype(np.float32)
    logits[3, [7, 9]] = logits[3].max() + 1  # a tie at the top
    for cfg in (SamplingConfig(temperature=t), SamplingConfig(temperature=t, top_k=5, top_p=0.9)):
        p = warp(logits, cfg)
        assert np.isfinite(p).all() and np.allclose(p.sum(-1), 1.0)
        if t <= 1e-300:
            for row in range(3):
                assert p[row, logits[row].argmax()] == 1.0
            assert p[3, 7] == p[3, 9] == 0.5
        if t >= 1e300 and cfg.top_k == 0:
            np.testing.assert_allclose(p, 1 / 50)


def test_generate_at_a_temperature_too_small_to_divide_by_gives_the_greedy_text(qwen_pair):
    greedy = qwen_pair.generate("def add(a, b):", max_new_tokens=12, draft_len=2, drafter="model").tokens
    for t in (5e-324, 1e-310, 1e-300):
        out = qwen_pair.generate("def add(a, b):", max_new_tokens=12, draft_len=2, drafter="model", temperature=t,
                                 seed=3)
        assert out.tokens == greedy, t


def test_warp_top_k_keeps_k_largest():
    logits = np.random.default_rng(1).normal(size=(4, 20))
    for k in (1, 3, 19):
        p = warp(logits, SamplingConfig(temperature=1.0, top_k=k))
        assert ((p > 0).sum(-1) == k).all()
        top = np.argsort(-logits, -1)[:, :k]
        for r in range(4):
            assert set(np.flatnonzero(p[r])) == set(top[r])
            np.testing.assert_allclose(p[r, top[r]], _softmax(logits[r, top[r]]), rtol=1e-12)
    # top_k >= V and top_k = 0 are no-ops
    for k in (0, 20, 50):
        np.testing.assert_allclose(warp(logits, SamplingConfig(1.0, top_k=k)), _softmax(logits), rtol=1e-12)


def test_warp_top_p_smallest_set_reaching_mass():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_allclose(warp(logits, SamplingConfig(1.0, top_p=0.5)), [[1, 0, 0, 0]], atol=1e-12)
    np.testing.assert_allclose(warp(logits, SamplingConfig(1.0, top_p=0.51)), [[0.625, 0.375, 0, 0]], atol=1e-12)
    np.testing.assert_allclose(warp(logits, SamplingConfig(1.0, top_p=0.9)), [[0.5 / .95, 0.3 / .95, 0.15 / .95, 0]],
                               atol=1e-12)
    np.testing.assert_allclose(warp(logits, SamplingConfig(1.0, top_p=0.01)), [[1, 0, 0, 0]], atol=1e-12)


def _nucleus_by_full_sort(p, top_p):
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(len(p), bool)
    keep[order[mass_before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])
def test_top_p_on_a_real_vocabulary_is_the_full_sorts_set_bit_for_bit(scale):
    """At 151,936 tokens top-p sorts only the likeliest few thousand when the set ends among them (flat
    logits: it does not, and all are sorted): the same bits as sorting all, ties at the cut included."""
    rng = np.random.default_rng(int(scale * 10))
    logits = rng.normal(scale=scale, size=(3, 151936)).astype(np.float32)
    logits[1, :20000] = np.round(logits[1, :20000])  # many exact ties
    logits[2, :3000] = logits[2].max() + 1.0  # a tie across the head's boundary
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        base = warp(logits, SamplingConfig(0.7))
        got = warp(logits, SamplingConfig(0.7, top_p=top_p))
        for r in range(3):
            assert np.array_equal(got[r], _nucleus_by_full_sort(base[r], top_p)), (r, top_p)


def test_top_p_over_a_peaked_distribution_sorts_the_few_likely_tokens_with_the_full_sorts_bits():
    """A language model's distribution: a few likely tokens over a long tail. The set is found among the tokens
    within 1e-6 of the likeliest (ties at that level, and sets that end past them, too): the full sort's bits."""
    from specrt.decoding import sampling

    rng = np.random.default_rng(3)
    logits = rng.normal(scale=1.0, size=(4, 151936)).astype(np.float32)
    logits[:, :40] += np.linspace(24.0, 8.0, 40, dtype=np.float32)  # a few likely tokens
    logits[1, 100:400] = logits[1, :40].max() - np.float32(np.log(1e6))  # a tie run near the level
    logits[2, :3] = 40.0  # three sure tokens, tied
    logits[3, :40] -= 30.0  # flat: the set ends past every level's candidates
    base = warp(logits, SamplingConfig(1.0))
    real, sorted_lengths = np.argsort, {}
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        for r in range(4):
            calls = []
            np.argsort = lambda a, *x, **k: calls.append(len(a)) or real(a, *x, **k)
            try:
                got = sampling._nucleus(base[r].copy(), top_p)
            finally:
                np.argsort = real
            assert np.array_equal(got, _nucleus_by_full_sort(base[r], top_p)), (r, top_p)
            sorted_lengths[r, top_p] = calls[-1]
    # the few likely ones alone (three tied tokens hold 2/3 below top_p 0.9: the set may go on, the head is sorted)
    assert all(sorted_lengths[r, p] < 400 for r in (0, 1) for p in (0.05, 0.5, 0.9)) and sorted_lengths[2, 0.5] == 3
    assert sorted_lengths[2, 0.9] == 2048
    assert sorted_lengths[3, 0.999] == 151936  # flat: all of them


@pytest.mark.parametrize("top_k", [0, 40])
def test_top_p_and_top_k_over_a_restricted_vocabulary_are_the_full_sorts_bits(top_k):
    """A draft over a restricted vocabulary gives most ids -inf (zero probability, mostly in one run at the end):
    top-k and top-p look only at the rest, with the same bits as the plain definitions over all."""
    rng = np.random.default_rng(7)
    logits = np.full((3, 151936), -np.inf, np.float32)
    logits[0, :49152] = rng.normal(scale=1.0, size=49152)
    logits[1, rng.permutation(151936)[:49152]] = rng.normal(scale=3.0, size=49152)
    logits[2, :30] = np.round(rng.normal(size=30))  # fewer live tokens than top_k, ties among them
    for top_p in (0.5, 0.95, 1.0):
        base = warp(logits, SamplingConfig(0.8))
        if top_k:
            z = logits.astype(np.float64)
            z = (z - z.max(axis=-1, keepdims=True)) / 0.8
            finite = np.where(np.isfinite(z), z, -np.inf)
            kth = np.sort(finite, axis=-1)[:, -top_k, None]
            z = np.where(z < kth, -np.inf, z)
            base = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
        got = warp(logits, SamplingConfig(0.8, top_k=top_k, top_p=top_p))
        for r in range(3):
            want = base[r] if top_p == 1.0 else _nucleus_by_full_sort(base[r], top_p)
            assert np.array_equal(got[r], want), (r, top_p)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (40, 1.0), (0, 0.9), (20, 0.8)])
def test_a_draft_step_samples_its_own_ids_as_it_would_all_of_them(top_k, top_p):
    """A sampled draft step warps the logits of the draft's restricted ids alone and spreads the result over all
    ids (proposers.spread): the distribution of warping all ids (-inf elsewhere) but for the sum's rounding, and
    a draw of it (by one uniform, or coupled noise) the same token as the same draw over all ids."""
    from specrt.decoding.proposers import expand_logits, spread
    from specrt.decoding.sampling import sample

    rng = np.random.default_rng(11)
    V = 151936
    ids = np.sort(rng.choice(V, 49152, replace=False))
    cfg = SamplingConfig(0.9, top_k=top_k, top_p=top_p)
    noise = Coupled(5)
    for trial in range(6):
        rows = rng.normal(scale=2.5, size=len(ids)).astype(np.float32)
        own = warp(rows[None], cfg)[0]
        every = warp(expand_logits(rows, ids, V)[None], cfg)[0]
        got = spread(own, ids, V)
        assert got.shape == (V,) and np.count_nonzero(got[np.setdiff1d(np.arange(V), ids)]) == 0
        np.testing.assert_allclose(got, every, rtol=1e-12, atol=0)
        for u in (0.0, 0.3, 0.77, 1 - 2 ** -53):
            assert int(ids[draw(own, u)]) == draw(every, u)
        for pos in range(5):
            assert sample(own, noise, pos, ids) == sample(every, noise, pos)
        assert sample(own, np.random.default_rng(trial), 0, ids) == sample(every, np.random.default_rng(trial), 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.8, 5, 0.9),
                                                     (2.0, 40, 0.95), (0.5, 2, 0.3)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    import torch
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = np.random.default_rng(2).normal(scale=2.0, size=(6, 50)).astype(np.float32)
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    scores = procs(torch.zeros((6, 1), dtype=torch.long), torch.tensor(logits, dtype=torch.float64))
    want = torch.softmax(scores, -1).numpy()
    got = warp(logits, SamplingConfig(temperature, top_k, top_p))
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, atol=1e-9)


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.2)])
def test_sampling_config_rejects(kw):
    with pytest.raises(ConfigError):
        SamplingConfig(**kw)


# ---------------------------------------------------------------- draw


def test_draw_inverse_cdf_never_picks_zero_mass():
    dist = np.array([0.0, 0.2, 0.0, 0.0, 0.5, 0.3, 0.0])
    us = (np.arange(100_000) + 0.5) / 100_000
    counts = np.bincount([draw(dist, u) for u in us[::10]], minlength=7)
    assert counts[dist == 0].sum() == 0
    np.testing.assert_allclose(counts / counts.sum(), dist, atol=1e-3)
    assert draw(dist, 0.0) == 1
    assert draw(dist, np.nextafter(1.0, 0.0)) == 5
    assert draw(dist * 7.0, 0.3) == draw(dist, 0.3)  # unnormalised is fine
    assert draw(np.array([0.0, 0.0, 1.0]), 0.0) == 2


# ---------------------------------------------------------------- accept_greedy


def test_accept_greedy():
    logits = np.zeros((4, 6))
    logits[np.arange(4), [2, 4, 1, 5]] = 1.0  # argmax per position: 2 4 1 5
    assert accept_greedy(np.array([2, 4, 1]), logits) == (3, 5)
    assert accept_greedy(np.array([2, 4, 0]), logits) == (2, 1)
    assert accept_greedy(np.array([3, 4, 1]), logits) == (0, 2)
    assert accept_greedy(np.array([], np.int64), logits[:1]) == (0, 2)


# ---------------------------------------------------------------- accept_sample, exact edge cases


def test_accept_sample_edges():
    pt = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    pd = np.array([[0.5, 0.5, 0.0]])
    # p_target(d) == 0: always rejected, resampled from max(pt - pd, 0) = [0, 0, .5]
    for u0 in (1e-12, 0.3, 0.999):
        assert accept_sample(np.array([0]), pd, pt, np.array([u0, 0.7])) == (0, 2)
    # p_draft(d) == 0 (cannot happen for a token the draft drew, but must still reject)
    assert accept_sample(np.array([2]), pd, pt, np.array([0.0, 0.1]))[0] == 0
    # pt >= pd: always accepted, then the bonus from pt[1]
    assert accept_sample(np.array([1]), pd, pt, np.array([0.999, 0.1])) == (1, 0)
    # point mass drafter: residual is pt with the draft token removed
    assert accept_sample(np.array([1]), None, pt, np.array([0.9, 0.0])) == (0, 2)
    assert accept_sample(np.array([1]), None, pt, np.array([0.4, 0.0])) == (1, 0)
    # no drafts at all: one token from pt[0]
    assert accept_sample(np.array([], np.int64), np.empty((0, 3)), pt[:1], np.array([0.0])) == (0, 1)


def test_accept_sample_never_accepts_zero_target_mass_even_at_u_zero():
    pt = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    pd = np.array([[0.5, 0.5, 0.0]])
    assert accept_sample(np.array([0]), pd, pt, np.array([0.0, 0.7])) == (0, 2)


# ---------------------------------------------------------------- accept_sample, statistics


def _simulate(p_draft, p_target, n, seed, draft_tokens=None):
    """Run accept_sample n times with draft tokens drawn from p_draft (or fixed, for point masses).

    Returns (accepted counts [n], emitted tokens [n, k+1] padded with -1)."""
    rng = np.random.default_rng(seed)
    k = p_target.shape[0] - 1
    V = p_target.shape[1]
    if draft_tokens is None:
        d = np.stack([rng.choice(V, size=n, p=p_draft[i]) for i in range(k)], 1)
    else:
        d = np.broadcast_to(np.asarray(draft_tokens), (n, k))
    u = rng.random((n, k + 1))
    acc = np.empty(n, np.int64)
    emitted = np.full((n, k + 1), -1, np.int64)
    for s in range(n):
        a, t = accept_sample(d[s], p_draft, p_target, u[s])
        acc[s] = a
        emitted[s, :a] = d[s, :a]
        emitted[s, a] = t
    return acc, emitted


def _check_positions(acc, emitted, p_target):
    """Emitted token j (present when the first j drafts were accepted) ~ p_target[j]."""
    V = p_target.shape[1]
    for j in range(p_target.shape[0]):
        rows = acc >= j
        if rows.sum() < 2000:
            continue
        counts = np.bincount(emitted[rows, j], minlength=V)
        p = chi2_pvalue(counts, p_target[j])
        assert p > P_MIN, f"position {j}: p={p:.2e}, counts {counts}, want {np.round(p_target[j] * rows.sum())}"


def _random_pair(seed, V=10, k=3):
    rng = np.random.default_rng(seed)
    pd = rng.dirichlet(np.full(V, 0.7), size=k)
    pt = rng.dirichlet(np.full(V, 0.7), size=k + 1)
    return pd, pt


def test_accept_sample_is_lossless():
    pd, pt = _random_pair(10)
    acc, emitted = _simulate(pd, pt, 100_000, seed=11)
    _check_positions(acc, emitted, pt)
    # The first draft is accepted with probability sum(min(pd, pt)) = 1 - TV(pd, pt).
    expect = np.minimum(pd[0], pt[0]).sum()
    assert 0.2 < expect < 0.9
    assert binom_pvalue(int((acc >= 1).sum()), len(acc), expect) > P_MIN
    # Given all drafts accepted, the bonus token ~ p_target[k].
    full = acc == 3
    assert full.sum() > 2000
    assert chi2_pvalue(np.bincount(emitted[full, 3], minlength=10), pt[3]) > P_MIN


def test_accept_sample_disjoint_supports():
    """p_draft puts mass where p_target has none and vice versa."""
    V = 10
    pd = np.array([[0.3, 0.3, 0.2, 0.2, 0, 0, 0, 0, 0, 0],
                   [0, 0, 0, 0, 0.1, 0.1, 0.4, 0.4, 0, 0]], float)
    pt = np.array([[0, 0, 0.25, 0.25, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05],
                   [0.1, 0.1, 0.1, 0.1, 0, 0, 0.3, 0.3, 0, 0],
                   [0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0.5]], float)
    acc, emitted = _simulate(pd, pt, 60_000, seed=12)
    _check_positions(acc, emitted, pt)
    assert binom_pvalue(int((acc >= 1).sum()), len(acc), np.minimum(pd[0], pt[0]).sum()) > P_MIN
    # a draft token with p_target 0 is never emitted at that position
    assert not np.isin(emitted[:, 0], [0, 1]).any()


def test_accept_sample_completely_disjoint():
    """No overlap: every draft is rejected and the token comes from p_target."""
    pd = np.array([[0.5, 0.5, 0, 0]])
    pt = np.array([[0, 0, 0.4, 0.6], [0.25, 0.25, 0.25, 0.25]])
    acc, emitted = _simulate(pd, pt, 20_000, seed=13)
    assert (acc == 0).all()
    _check_positions(acc, emitted, pt)


@pytest.mark.parametrize("draft_tokens", [[3, 1], [0, 0]])
def test_accept_sample_point_mass_draft(draft_tokens):
    """p_draft=None (a prompt-lookup drafter): token 0 of pt[0] has zero mass in the second case."""
    rng = np.random.default_rng(14)
    pt = rng.dirichlet(np.ones(8), size=3)
    pt[:, 0] = 0.0
    pt /= pt.sum(1, keepdims=True)
    acc, emitted = _simulate(None, pt, 60_000, seed=15, draft_tokens=draft_tokens)
    _check_positions(acc, emitted, pt)
    expect = pt[0, draft_tokens[0]]
    assert binom_pvalue(int((acc >= 1).sum()), len(acc), expect) > P_MIN


def test_accept_sample_bonus_when_draft_equals_target():
    rng = np.random.default_rng(16)
    pt = rng.dirichlet(np.ones(10), size=4)
    acc, emitted = _simulate(pt[:3], pt, 40_000, seed=17)
    assert (acc == 3).all()  # u * p <= p always holds
    _check_positions(acc, emitted, pt)


# ---------------------------------------------------------------- coupled (Gumbel-max) sampling


def test_coupled_picks_are_exact_samples_over_seeds_and_over_positions():
    p = np.array([0.4, 0.0, 0.25, 0.2, 0.1, 0.05])
    by_seed = np.bincount([Coupled(s).pick(p, 17) for s in range(6000)], minlength=6)
    by_pos = np.bincount([Coupled(5).pick(p, t) for t in range(6000)], minlength=6)
    assert chi2_pvalue(by_seed, p) > P_MIN and chi2_pvalue(by_pos, p) > P_MIN
    # a sparse row of a real vocabulary takes the ids path, a dense one the whole-vocabulary path
    big = np.zeros(151936)
    big[[5, 70000, 151935]] = [0.5, 0.3, 0.2]
    counts = np.bincount([Coupled(s).pick(big, 3) for s in range(3000)], minlength=151936)[[5, 70000, 151935]]
    assert counts.sum() == 3000 and chi2_pvalue(counts, np.array([0.5, 0.3, 0.2])) > P_MIN
    # after top-k and top-p: a sample of the warped distribution, nothing outside it
    logits = np.random.default_rng(4).normal(scale=2.0, size=(1, 40))
    warped = warp(logits, SamplingConfig(0.8, top_k=8, top_p=0.9))[0]
    counts = np.bincount([Coupled(s).pick(warped, 0) for s in range(6000)], minlength=40)
    assert counts[warped == 0].sum() == 0 and chi2_pvalue(counts, warped) > P_MIN


def test_coupled_noise_is_a_function_of_seed_position_and_id_alone():
    ids = np.array([3, 9, 150000, 42])
    full = Coupled(11).exponential(8, np.arange(151936))
    np.testing.assert_array_equal(Coupled(11).exponential(8, ids), full[ids])
    assert not np.array_equal(Coupled(11).exponential(9, ids), full[ids])
    assert not np.array_equal(Coupled(12).exponential(8, ids), full[ids])
    assert (full > 0).all() and np.isfinite(full).all()
    assert abs(full.mean() - 1.0) < 0.01  # a standard exponential


def test_coupled_verification_emits_the_target_only_sample_whatever_was_drafted():
    rng = np.random.default_rng(0)
    p_target = rng.dirichlet(np.ones(30) * 0.3, size=5)  # positions 10..14
    noise = Coupled(4)
    alone = [noise.pick(p_target[j], 10 + j) for j in range(5)]
    assert accept_coupled(np.array(alone[:4]), p_target, noise, 10) == (4, alone[4])  # all accepted, bonus
    for k in range(4):
        for wrong in range(30):
            draft = np.array(alone[:k] + [wrong] + alone[k + 1:4])
            n, t = accept_coupled(draft, p_target, noise, 10)
            assert (n, t) == ((4, alone[4]) if wrong == alone[k] else (k, alone[k]))


def test_a_coupled_draft_agrees_with_the_target_as_often_as_their_distributions_allow():
    """Same noise: a draft q close to p picks the target's token most of the time (P >= 1 - TV(p, q)),
    independent noise only sum(p * q)."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(50))
    q = 0.9 * p + 0.1 * rng.dirichlet(np.ones(50))
    agree = np.mean([Coupled(s).pick(p, 0) == Coupled(s).pick(q, 0) for s in range(3000)])
    assert agree >= 1 - 0.5 * np.abs(p - q).sum() - 0.02
    assert agree > 3 * float(p @ q)


def test_the_bounded_coupled_pick_is_the_exact_argmax_over_every_token():
    """pick computes exact scores only where the log-free bound p / (1 - u) reaches the best: the same token
    as argmax(p / e) over all, on peaked, flat and sparse rows of a real vocabulary."""
    V, rng = 151936, np.random.default_rng(3)
    for trial in range(60):
        noise = Coupled(trial)
        p = rng.dirichlet(np.ones(V) * (0.02, 1.0)[trial % 2]) if trial % 3 else np.zeros(V)
        if trial % 3 == 0:
            p[rng.choice(V, 40, replace=False)] = rng.dirichlet(np.ones(40))
        assert noise.pick(p, trial) == int(np.argmax(p / noise.exponential(trial, np.arange(V))))
