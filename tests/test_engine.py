"""OrtEngine: exported logits match torch, verify == single steps, rollback leaves the cache in place."""
from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.ort import OrtEngine


def _engine(pair, role="target", max_logits=64, batch=1):
    entry = getattr(pair.manifest, role)
    return OrtEngine(pair.dir, entry, pair.manifest.max_len, max_logits, batch=batch, threads=1)


def _ids(n, seed=0, vocab=320):
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int64)


def _torch_forward(model, ids):
    import torch

    with torch.no_grad():
        out = model(torch.tensor(ids[None]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return out.logits[0].numpy(), cache


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_ort_logits_match_torch(pairs, torch_models, model_type, role):
    pair = pairs[model_type]
    model = torch_models[model_type, role]
    ids = _ids(24, seed=1)
    want, _ = _torch_forward(model, ids)  # [S, rows]
    eng = _engine(pair, role)
    got = eng.forward(ids[None], np.arange(24))[0].copy()  # [S, rows]
    assert got.shape == want.shape == (24, getattr(pair.manifest, role).logits_width)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # And token by token through the cache (prefill 10, then 14 single steps).
    eng.truncate(0)
    steps = [eng.forward(ids[None, :10], np.arange(10))[0].copy()]
    for i in range(10, 24):
        steps.append(eng.forward(ids[None, i:i + 1], np.array([0]))[0].copy())
    np.testing.assert_allclose(np.concatenate(steps), want, atol=1e-4, rtol=1e-4)
    eng.close()


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_kv_cache_layout_matches_torch_cache(pairs, torch_models, model_type):
    """The cache is sequence-major [max_len, B, Hkv, D] holding post-rotary keys, as the manifest says."""
    pair = pairs[model_type]
    m = pair.manifest
    assert m.kv_layout == "seq,batch,kv_heads,head_dim"
    ids = _ids(12, seed=2)
    _, cache = _torch_forward(torch_models[model_type, "target"], ids)
    eng = _engine(pair)
    eng.forward(ids[None], np.array([11]))
    assert eng.keys[0].shape == (m.max_len, 1, m.target.num_kv_heads, m.target.head_dim)
    for i in range(m.target.num_layers):
        layer = cache.layers[i]
        k = layer.keys[0].numpy().transpose(1, 0, 2)  # [Hkv, S, D] -> [S, Hkv, D]
        v = layer.values[0].numpy().transpose(1, 0, 2)
        np.testing.assert_allclose(eng.keys[i][:12, 0], k, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(eng.values[i][:12, 0], v, atol=2e-5, rtol=1e-5)
        assert not eng.keys[i][12:].any()  # nothing written past the valid prefix
    eng.close()


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_call_equals_single_steps(pairs, model_type, k):
    pair = pairs[model_type]
    prompt, rest = _ids(9, seed=3), _ids(k + 1, seed=4)
    a, b = _engine(pair), _engine(pair)
    a.forward(prompt[None], np.array([8]))
    verify = a.forward(rest[None], np.arange(k + 1))[0].copy()  # [k+1, V]
    b.forward(prompt[None], np.array([8]))
    single = np.concatenate([b.forward(rest[None, i:i + 1], np.array([0]))[0].copy() for i in range(k + 1)])
    np.testing.assert_allclose(verify, single, atol=1e-5, rtol=1e-5)
    assert a.length == b.length == 9 + k + 1
    for i in range(pair.manifest.target.num_layers):
        np.testing.assert_allclose(a.keys[i][: a.length], b.keys[i][: b.length], atol=1e-5)
        np.testing.assert_allclose(a.values[i][: a.length], b.values[i][: b.length], atol=1e-5)
    a.close(), b.close()


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_logit_positions_select_rows(pairs, model_type):
    eng = _engine(pairs[model_type])
    ids = _ids(10, seed=5)
    full = eng.forward(ids[None], np.arange(10))[0].copy()
    eng.truncate(0)
    some = eng.forward(ids[None], np.array([9, 2, 5]))[0].copy()
    np.testing.assert_allclose(some, full[[9, 2, 5]], atol=1e-6)
    eng.close()


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("n,junk", [(7, 1), (7, 5), (1, 8)])
def test_rollback_then_replay_equals_fresh_prefill(pairs, model_type, n, junk):
    pair = pairs[model_type]
    L = pair.manifest.target.num_layers
    seq = _ids(n + 6, seed=6)
    eng = _engine(pair)
    eng.forward(seq[None, :n], np.array([n - 1]))
    before_k = [eng.keys[i][:n].copy() for i in range(L)]
    before_v = [eng.values[i][:n].copy() for i in range(L)]
    buffers = [(eng.keys[i].ctypes.data, eng.values[i].ctypes.data) for i in range(L)]

    eng.forward(_ids(junk, seed=7)[None], np.arange(junk))  # rejected drafts
    assert eng.length == n + junk
    eng.truncate(n)
    assert eng.length == n
    replay = eng.forward(seq[None, n:], np.arange(6))[0].copy()

    # The cache stayed in place (same buffers) and the valid prefix was never touched.
    assert [(eng.keys[i].ctypes.data, eng.values[i].ctypes.data) for i in range(L)] == buffers
    for i in range(L):
        assert eng.keys[i][:n].tobytes() == before_k[i].tobytes()
        assert eng.values[i][:n].tobytes() == before_v[i].tobytes()

    # Same as never having seen the junk (bit for bit: the same calls on the same cache contents) ...
    clean = _engine(pair)
    clean.forward(seq[None, :n], np.array([n - 1]))
    np.testing.assert_array_equal(replay, clean.forward(seq[None, n:], np.arange(6))[0])
    # ... and as a fresh prefill of the whole sequence.
    fresh = _engine(pair)
    want = fresh.forward(seq[None], np.arange(n, n + 6))[0].copy()
    np.testing.assert_allclose(replay, want, atol=1e-5, rtol=1e-5)
    for i in range(L):
        np.testing.assert_allclose(eng.keys[i][: n + 6], fresh.keys[i][: n + 6], atol=1e-5)
    for e in (eng, clean, fresh):
        e.close()


def test_forward_returns_view_of_reused_buffer(qwen_pair):
    eng = _engine(qwen_pair, max_logits=4)
    a = eng.forward(_ids(3, seed=8)[None], np.array([2]))
    first = a.copy()
    b = eng.forward(_ids(1, seed=9)[None], np.array([0]))
    assert np.shares_memory(a, b)
    assert not np.array_equal(a, first)  # documented: valid until the next call
    eng.close()


def test_batch_rows_are_independent(qwen_pair):
    ids = np.stack([_ids(6, seed=10), _ids(6, seed=11)])
    eng2 = _engine(qwen_pair, batch=2)
    both = eng2.forward(ids, np.arange(6)).copy()  # [2, 6, V]
    more = eng2.forward(ids[:, :1], np.array([0])).copy()
    for r in range(2):
        eng1 = _engine(qwen_pair)
        np.testing.assert_allclose(both[r], eng1.forward(ids[r:r + 1], np.arange(6))[0], atol=1e-5)
        np.testing.assert_allclose(more[r], eng1.forward(ids[r:r + 1, :1], np.array([0]))[0], atol=1e-5)
        eng1.close()
    eng2.close()


def test_engine_limits(qwen_pair):
    m = qwen_pair.manifest
    eng = _engine(qwen_pair, max_logits=2)
    with pytest.raises(ValueError, match="overflow"):
        eng.forward(np.zeros((1, m.max_len + 1), np.int64), np.array([0]))
    assert eng.length == 0
    with pytest.raises(ValueError, match="logit rows"):
        eng.forward(np.zeros((1, 3), np.int64), np.arange(3))
    assert eng.length == 0
    eng.forward(np.zeros((1, m.max_len - 1), np.int64), np.array([0]))
    eng.forward(np.zeros((1, 1), np.int64), np.array([0]))  # exactly full
    assert eng.length == m.max_len
    with pytest.raises(ValueError, match="overflow"):
        eng.forward(np.zeros((1, 1), np.int64), np.array([0]))
    with pytest.raises(ValueError):
        eng.truncate(m.max_len + 1)
    with pytest.raises(ValueError):
        eng.truncate(-1)
    eng.truncate(0)
    assert eng.length == 0
    eng.close()
