"""Batched speculative decoding (decoding/batch.py): every request gets exactly what it gets alone.

Greedy: token for token. Sampling: each row draws from its own generator in the order a lone run
would, so seeded batch results equal seeded lone results draw for draw (which also proves the
distribution: it is the lone run's, whose losslessness test_decode.py checks statistically).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specrt.api.pair import generate_batch
from specrt.api.requests import check
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.batch import Ragged
from specrt.decoding.decode import Request
from specrt.engines.select import batch_engine
from specrt.errors import ConfigError

from _helpers import needs_kernels

TEXT_PROMPTS = ["def quicksort(xs):", "class Stack:\n    def push(self, x):", "The quick brown", "x"]
ID_PROMPTS = [[5], [40, 41, 42, 43], list(range(3, 60))]
PROMPTS = TEXT_PROMPTS + ID_PROMPTS  # 7 prompts: more than any batch size here, so slots are refilled
MAX_NEW = [40, 12, 33, 1, 25, 40, 7]  # rows finish at different rounds
COUNTS = ("target_passes", "draft_passes", "rounds", "proposed", "accepted", "new_tokens", "draft_len_hist",
          "rounds_by_drafter", "accepted_per_position", "proposed_per_position")


def _same(batch, alone, what=""):
    assert batch.tokens == alone.tokens, f"{what}: diverges at {_first_diff(batch.tokens, alone.tokens)}"
    assert batch.text == alone.text and batch.finish_reason == alone.finish_reason, what
    for k in COUNTS:
        assert batch.stats[k] == alone.stats[k], f"{what}: stats[{k!r}] {batch.stats[k]} != {alone.stats[k]}"


def _alone(pair, prompt, cfg):
    return pair.run(prompt, cfg)


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _requests(pair, k, sampling=SamplingConfig(), seeds=None, max_new=MAX_NEW, prompts=PROMPTS):
    seeds = seeds or [0] * len(prompts)
    return [Request(i, pair.encode(p), GenerationConfig(max_new_tokens=n, draft_len=k, sampling=sampling, seed=s))
            for i, (p, n, s) in enumerate(zip(prompts, max_new, seeds))]


def _run_batch(pair, reqs, B, totals=None):
    with pair.runner(B) as dec:
        out = dict(dec.run(reqs))
        if totals is not None:
            totals.update(dec.totals.as_dict())
    assert sorted(out) == sorted(r.key for r in reqs)
    return out


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("k", [0, 2, 4])
def test_greedy_batch_equals_alone(pairs, model_type, k):
    pair = pairs[model_type]
    reqs = _requests(pair, k)
    alone = [_alone(pair, r.prompt, r.cfg) for r in reqs]
    for B in (1, 2, 3):
        tot = {}
        got = _run_batch(pair, reqs, B, tot)
        for r, a in zip(reqs, alone):
            _same(got[r.key], a, f"{model_type} k={k} B={B} prompt {r.key}")
        assert tot["requests"] == len(reqs) and tot["new_tokens"] == sum(len(a.tokens) for a in alone)
        assert tot["prefills"] == len(reqs)
        if B > 1:
            assert tot["target_passes"] < sum(a.stats["target_passes"] - 1 for a in alone)  # passes are shared
        if k:
            assert 0 < tot["acceptance_rate"] < 1


@pytest.mark.parametrize("k", [0, 3])
def test_batch_equals_alone_without_query_seqlens(noq_pair, k):
    """Graphs for onnxruntime < 1.32 (no query_seqlens): multi-token passes go row by row, one-token passes
    stay batched; every request still gets exactly its lone output, greedy and seeded sampling."""
    for sampling in (SamplingConfig(), SamplingConfig(0.9)):
        reqs = _requests(noq_pair, k, sampling, seeds=[3 * i + 1 for i in range(len(PROMPTS))])
        alone = [_alone(noq_pair, r.prompt, r.cfg) for r in reqs]
        got = _run_batch(noq_pair, reqs, 3)
        for r, a in zip(reqs, alone):
            _same(got[r.key], a, f"k={k} {sampling} prompt {r.key}")


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9), (2.0, 0, 1.0)])
@pytest.mark.parametrize("k", [0, 2, 3])
def test_seeded_sampling_batch_equals_alone(stat_pair, qwen_pair, temperature, top_k, top_p, k):
    """Same draws in the same order per row: seeded batch results are the seeded lone results."""
    sampling = SamplingConfig(temperature, top_k, top_p)
    words = ["alpha beta", "gamma", "delta eps zeta eta", "theta theta", "beta", "eta alpha gamma", "zeta"]
    for pair, prompts in ((stat_pair, words), (qwen_pair, PROMPTS)):
        max_new = [min(n, pair.manifest.max_len - 10) for n in MAX_NEW]
        reqs = _requests(pair, k, sampling, seeds=[11 * i + 1 for i in range(len(prompts))], max_new=max_new,
                         prompts=prompts)
        alone = [_alone(pair, r.prompt, r.cfg) for r in reqs]
        for B in (2, 3):
            got = _run_batch(pair, reqs, B)
            for r, a in zip(reqs, alone):
                _same(got[r.key], a, f"T={temperature} k={k} B={B} prompt {r.key}")


def test_int4_accuracy_level_0_batch_equals_alone(int4_pair):
    """int4 weights with fp32 activations: batch and lone passes agree as in fp32. (At accuracy level 4,
    int8 activations, kernels round differently per batch shape: outputs may part at a near-tie.)"""
    for sampling in (SamplingConfig(), SamplingConfig(0.9, 20, 0.95)):
        reqs = _requests(int4_pair, 3, sampling, seeds=list(range(len(PROMPTS))))
        alone = [_alone(int4_pair, r.prompt, r.cfg) for r in reqs]
        got = _run_batch(int4_pair, reqs, 3)
        for r, a in zip(reqs, alone):
            _same(got[r.key], a, f"{sampling} prompt {r.key}")


def test_many_seeds_and_eos(stat_pair):
    """The 11-word pair ends with EOS often: rows stop on their own, at every point of a round."""
    pair = stat_pair
    prompt = pair.encode("alpha beta")
    reqs = [Request(s, prompt, GenerationConfig(max_new_tokens=12, draft_len=3, seed=s,
                                                sampling=SamplingConfig(1.0))) for s in range(60)]
    alone = {r.key: _alone(pair, r.prompt, r.cfg) for r in reqs}
    got = _run_batch(pair, reqs, 4)
    reasons = {a.finish_reason for a in alone.values()}
    assert reasons == {"eos", "length"}
    for key, a in alone.items():
        _same(got[key], a, f"seed {key}")


def test_rows_follow_the_pairs_policy_settings(qwen_pair, monkeypatch):
    """A row's policy takes the pair's PolicyConfig, as the request alone does (hybrid's min_match here)."""
    from specrt.decoding.policy import PolicyConfig

    monkeypatch.setattr(qwen_pair, "policy_config", dataclasses.replace(PolicyConfig(), min_match=1))
    prompt = list(range(3, 40)) + list(range(3, 20))
    cfg = GenerationConfig(max_new_tokens=40, draft_len=3, drafter="hybrid")
    alone = _alone(qwen_pair, prompt, cfg)
    assert alone.stats["rounds_by_drafter"].get("ngram", 0) > 0  # 1-token matches drafted
    _same(_run_batch(qwen_pair, [Request(0, prompt, cfg)], 2)[0], alone, "min_match=1")


def test_mixed_requests_in_one_batch(pairs):
    """Per-request settings differ inside one batch: greedy and sampling, k 0..8, model/ngram/hybrid
    drafters, confidence stop, stop strings, max_new_tokens 1; long generations fill rows to max_len."""
    rng = np.random.default_rng(7)
    for pair in pairs.values():
        m = pair.manifest
        reqs = []
        for i in range(16):
            L = int(rng.integers(1, 100))
            prompt = [int(t) for t in rng.integers(3, m.vocab_size, L)]
            if i % 4 == 0:  # repetitive: the n-gram drafter finds matches, hybrid skips the model for rounds
                prompt = (prompt[:6] * 12)[:L]
            k = int(rng.choice([0, 1, 2, 4, 8]))
            cfg = GenerationConfig(
                max_new_tokens=1 if i == 5 else int(rng.integers(2, m.max_len - L - k - 1)), draft_len=k, seed=i,
                drafter=str(rng.choice(["model", "ngram", "hybrid"])), confidence_stop=float(rng.choice([0.0, 0.3])),
                sampling=SamplingConfig(*[(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 0.9)][i % 3]))
            reqs.append(Request(i, prompt, cfg))
        alone = {r.key: _alone(pair, r.prompt, r.cfg) for r in reqs}
        for j, r in enumerate(reqs):  # every third request stops at a string from the middle of its text
            text = alone[r.key].text
            stop = text[len(text) // 2: len(text) // 2 + 2]
            if j % 3 == 0 and len(text) > 10 and "\ufffd" not in stop:
                reqs[j] = dataclasses.replace(r, cfg=dataclasses.replace(r.cfg, stop=(stop,)))
                alone[r.key] = _alone(pair, r.prompt, reqs[j].cfg)
        assert {a.finish_reason for a in alone.values()} >= {"stop", "length"}
        for B in (3, 8):
            tot = {}
            got = _run_batch(pair, reqs, B, tot)
            for r in reqs:
                _same(got[r.key], alone[r.key], f"B={B} request {r.key} {r.cfg}")
            assert tot["requests"] == len(reqs)


def test_fewer_requests_than_slots_and_reuse(qwen_pair):
    """Idle slots ride along; one decoder runs several batches; the pair's own generate still works."""
    pair = qwen_pair
    reqs = _requests(pair, 3)[:2]
    alone = [_alone(pair, r.prompt, r.cfg) for r in reqs]
    with pair.runner(5) as dec:
        for _ in range(2):
            got = dict(dec.run(reqs))
            for r, a in zip(reqs, alone):
                _same(got[r.key], a)
        assert list(dec.run([])) == []
    for r, a in zip(reqs, alone):
        _same(_alone(pair, r.prompt, r.cfg), a)


def test_generate_batch_api(qwen_pair):
    pair = qwen_pair
    tot = {}
    res = generate_batch(pair, PROMPTS[:5], batch_size=2, max_new_tokens=16, draft_len=2, temperature=0.9,
                         seed=[1, 2, 3, 4, 5], stop=["\n\n"], totals=tot)
    for i, p in enumerate(PROMPTS[:5]):
        _same(res[i], pair.generate(p, max_new_tokens=16, draft_len=2, temperature=0.9, seed=i + 1, stop=["\n\n"]))
        assert res[i].stats["batch_size"] == 2
    assert tot["batch_size"] == 2 and tot["tokens_per_s"] > 0
    chat = generate_batch(pair, ["hello there"], batch_size=1, max_new_tokens=8, chat=True, draft_len=0)[0]
    assert chat.tokens == pair.generate("hello there", chat=True, max_new_tokens=8, draft_len=0).tokens
    with pytest.raises(ConfigError, match="seeds"):
        generate_batch(pair, PROMPTS[:2], seed=[1])


@pytest.mark.parametrize("which", ["qwen_pair", "noq_pair"])
def test_rows_match_batch_one(request, which):
    """Logits of batched passes over rows of their own lengths (padding, rejected drafts, catch-up chunks,
    rows sitting out) equal a batch-1 pass over each row's sequence, up to float rounding."""
    pair = request.getfixturevalue(which)
    m = pair.manifest
    rng = np.random.default_rng(3)
    B = 3
    rows = Ragged(batch_engine(pair.dir, pair.target, m.max_len + 9, 9, B), 9)
    seqs = [[int(t) for t in rng.integers(3, 300, n)] for n in (5, 30, 12)]
    for r, s in enumerate(seqs):
        first, _ = rows.prefill(r, s)
        pair.target.truncate(0)
        np.testing.assert_array_equal(first, pair.target.forward(np.array([s]), np.array([len(s) - 1]))[0, 0])

    def alone(seq, n):
        pair.target.truncate(0)
        return pair.target.forward(np.array([seq]), np.arange(len(seq) - n, len(seq)))[0]

    for step in range(12):
        feeds = {r: [int(t) for t in rng.integers(3, 300, int(rng.integers(1, 6)))] for r in range(B) if (step + r) % 4}
        last = step % 2 == 0
        if step == 6:
            feeds[1] = [int(t) for t in rng.integers(3, 300, 25)]  # longer than a pass: chunked catch-up
        lg = {r: v.copy() for r, v in rows.forward(feeds, last=last).items()}
        assert sorted(lg) == sorted(feeds)
        for r, f in feeds.items():
            seqs[r] = seqs[r] + f
            n = 1 if last else len(f)
            np.testing.assert_allclose(lg[r], alone(seqs[r], n), atol=1e-4)
            keep = len(seqs[r]) - int(rng.integers(0, len(f)))  # reject some of what was fed
            seqs[r] = seqs[r][:keep]
            rows.keep(r, keep)
            assert rows.count(r) == keep
    rows.release(0)
    assert rows.count(0) == 0
    rows.close()


@pytest.mark.parametrize("which", ["qwen_pair", pytest.param("int4_default_pair", marks=needs_kernels)])
def test_a_pass_computes_only_the_rows_it_spans(request, which):
    """Rows that sit out of a pass beyond its first and last rows are not computed as padding: the pass runs
    on a view of the rows it spans (1 and 2 of 4 here, then 3 alone), writes those rows' caches only, and
    gives the logits the whole padded batch gives (the same bits where the kernels are row-exact)."""
    pair = request.getfixturevalue(which)
    m, rng, B = pair.manifest, np.random.default_rng(5), 4
    made = [Ragged(batch_engine(pair.dir, pair.target, m.max_len + 9, 9, B), 9) for _ in range(2)]
    for rows in made:
        for r in range(B):
            rows.prefill(r, [int(t) for t in np.random.default_rng(r).integers(3, 300, 6 + 3 * r)])
    spanned, whole = made
    whole.span = lambda rows: (0, B)  # the same passes over every row, the others as padding
    shapes = []
    run = type(spanned.e).forward_ragged

    def spy(e, tokens, *a, **kw):
        shapes.append(tokens.shape)
        return run(e, tokens, *a, **kw)

    type(spanned.e).forward_ragged = spy
    try:
        for feeds in ({1: [7, 8, 9], 2: [10]}, {3: [11, 12]}, {0: [13], 3: [14]}):
            shapes.clear()
            before = [[k[r].copy() for k in spanned.e.keys] for r in range(B)]
            got = {r: v.copy() for r, v in spanned.forward(feeds, last=False).items()}
            lo, hi = min(feeds), max(feeds) + 1
            assert shapes == [(hi - lo, max(map(len, feeds.values())))]
            want = {r: v.copy() for r, v in whole.forward(feeds, last=False).items()}
            assert shapes[1:] == [(B, max(map(len, feeds.values())))]
            assert spanned.e.lengths.tolist() == whole.e.lengths.tolist()
            for r in feeds:
                if pair.target.row_exact:
                    np.testing.assert_array_equal(got[r], want[r])
                else:  # fp32, onnxruntime's kernels: matrix products shaped by the pass
                    np.testing.assert_allclose(got[r], want[r], atol=1e-4)
            for r in set(range(B)) - set(feeds):  # rows outside the pass: not a slot written
                for i, k in enumerate(spanned.e.keys):
                    np.testing.assert_array_equal(k[r], before[r][i])
    finally:
        type(spanned.e).forward_ragged = run
    assert spanned.span([1, 2]) == (1, 3) and spanned.span([]) == (0, B)
    for rows in made:
        rows.close()


def test_bad_requests(qwen_pair):
    pair, m = qwen_pair, qwen_pair.manifest
    ok = GenerationConfig(max_new_tokens=8, draft_len=2)
    check(m, [5], dataclasses.replace(ok, draft_len="auto"), batched=True)  # auto is a batch row's too
    check(m, [5], dataclasses.replace(ok, draft_window=16), batched=True)  # a row reads by the lone run's window
    with pytest.raises(ConfigError, match="max_draft_len"):
        check(m, [5], dataclasses.replace(ok, draft_len=m.max_draft_len + 1), batched=True)
    with pytest.raises(ConfigError, match="max_len"):
        check(m, list(range(3, 3 + m.max_len)), ok, batched=True)
    with pytest.raises(ConfigError, match="max_new_tokens <="):
        check(m, [5], dataclasses.replace(ok, max_new_tokens=m.max_len), batched=True)
    with pytest.raises(ConfigError, match="no draft model"):
        check(dataclasses.replace(m, draft=None), [5], ok, batched=True)
    check(dataclasses.replace(m, draft=None), [5], dataclasses.replace(ok, drafter="ngram"), batched=True)
    with pytest.raises(ConfigError, match="empty"):
        check(m, [], ok, batched=True)
    with pytest.raises(ConfigError, match="batch size"):
        pair.runner(0)
    with pair.runner(2) as dec:  # auto is a batch row's too
        (_, res), = dec.run([Request(0, [5, 6, 7], dataclasses.replace(ok, draft_len="auto"))])
    assert res.tokens == pair.generate([5, 6, 7], max_new_tokens=ok.max_new_tokens, draft_len=0).tokens


def test_batch_that_does_not_fit_in_memory_is_refused(qwen_pair, monkeypatch):
    from specrt.api import memory
    from specrt.api.memory import kv_bytes

    m = qwen_pair.manifest
    need = kv_bytes(m, 4, m.max_len + m.max_draft_len + 1)
    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match="use a batch size <= 3"):
        qwen_pair.runner(4)
    qwen_pair.runner(3).close()


@needs_kernels
@pytest.mark.parametrize("k", [0, 3])
def test_int4_default_level_batch_equals_alone(int4_default_pair, k):
    """int4 at accuracy level 4 (int8 activations) through specrt's kernel, whose rows never depend on the
    pass around them: batch rows are their lone runs, greedy and seeded sampling."""
    assert int4_default_pair.target.kernel.swapped == int4_default_pair.target.kernel.total > 0
    for sampling in (SamplingConfig(), SamplingConfig(0.9, 20, 0.95)):
        reqs = _requests(int4_default_pair, k, sampling, seeds=list(range(len(PROMPTS))))
        alone = [_alone(int4_default_pair, r.prompt, r.cfg) for r in reqs]
        for B in (2, 3):
            got = _run_batch(int4_default_pair, reqs, B)
            for r, a in zip(reqs, alone):
                _same(got[r.key], a, f"{sampling} B={B} prompt {r.key}")
