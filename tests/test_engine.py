"""onnxruntime engines: exported logits match torch, verify == single steps, rollback leaves the cache in
place, ragged batched passes == each row alone (the lean graph; the portable one where it applies)."""
from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.ort import LeanEngine, ort_engine


def _engine(pair, role="target", max_logits=64, batch=1, max_len=None):
    entry = getattr(pair.manifest, role)
    return ort_engine(pair.dir, entry, max_len or pair.manifest.max_len, max_logits, batch=batch, threads=1)


def _prefix(eng, kind, layer, n, row=0):
    """The first n cache slots of one layer's K or V, [n, Hkv, D], whatever the engine's layout."""
    buf = (eng.keys if kind == "k" else eng.values)[layer]
    return buf[row, :, :n].transpose(1, 0, 2) if isinstance(eng, LeanEngine) else buf[:n, row]


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
    """The cache is [B, Hkv, C, D] per layer holding post-rotary keys, as the manifest says."""
    pair = pairs[model_type]
    m = pair.manifest
    assert m.kv_layout == m.target.kv_layout == "batch,kv_heads,seq,head_dim"
    ids = _ids(12, seed=2)
    _, cache = _torch_forward(torch_models[model_type, "target"], ids)
    eng = _engine(pair)
    eng.forward(ids[None], np.array([11]))
    assert eng.keys[0].shape == (1, m.target.num_kv_heads, m.max_len, m.target.head_dim)
    for i in range(m.target.num_layers):
        layer = cache.layers[i]
        np.testing.assert_allclose(eng.keys[i][0, :, :12], layer.keys[0].numpy(), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(eng.values[i][0, :, :12], layer.values[0].numpy(), atol=2e-5, rtol=1e-5)
        assert not eng.keys[i][:, :, 12:].any()  # nothing written past the valid prefix
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
    np.testing.assert_allclose(verify, single, atol=3e-5, rtol=1e-5)  # float rounding of other kernel shapes
    assert a.length == b.length == 9 + k + 1
    for i in range(pair.manifest.target.num_layers):
        for kind in "kv":
            np.testing.assert_allclose(_prefix(a, kind, i, a.length), _prefix(b, kind, i, b.length), atol=3e-5)
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
    before_k = [_prefix(eng, "k", i, n).copy() for i in range(L)]
    before_v = [_prefix(eng, "v", i, n).copy() for i in range(L)]
    buffers = [(eng.keys[i].ctypes.data, eng.values[i].ctypes.data) for i in range(L)]

    eng.forward(_ids(junk, seed=7)[None], np.arange(junk))  # rejected drafts
    assert eng.length == n + junk
    eng.truncate(n)
    assert eng.length == n
    replay = eng.forward(seq[None, n:], np.arange(6))[0].copy()

    # The cache stayed in place (same buffers) and the valid prefix was never touched.
    assert [(eng.keys[i].ctypes.data, eng.values[i].ctypes.data) for i in range(L)] == buffers
    for i in range(L):
        assert _prefix(eng, "k", i, n).tobytes() == before_k[i].tobytes()
        assert _prefix(eng, "v", i, n).tobytes() == before_v[i].tobytes()

    # Same as never having seen the junk (bit for bit: the same calls on the same cache contents) ...
    clean = _engine(pair)
    clean.forward(seq[None, :n], np.array([n - 1]))
    np.testing.assert_array_equal(replay, clean.forward(seq[None, n:], np.arange(6))[0])
    # ... and as a fresh prefill of the whole sequence.
    fresh = _engine(pair)
    want = fresh.forward(seq[None], np.arange(n, n + 6))[0].copy()
    np.testing.assert_allclose(replay, want, atol=1e-5, rtol=1e-5)
    for i in range(L):
        np.testing.assert_allclose(_prefix(eng, "k", i, n + 6), _prefix(fresh, "k", i, n + 6), atol=1e-5)
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


@pytest.mark.parametrize("which", ["qwen_dir", "noq_dir"])
def test_ragged_passes_equal_each_row_alone(request, which):
    """Rows with their own lengths in one batch engine: prefills through `row(r)`, passes where rows feed
    different numbers of tokens (or sit out), rollbacks of single rows. Every row's logits and cache equal
    a batch-1 engine's over that row's sequence. `noq_dir` lacks query_seqlens (onnxruntime < 1.32's
    graphs): there the engine runs multi-token ragged passes row by row, with the same results."""
    import specrt

    with specrt.load(request.getfixturevalue(which), threads=1) as pair:
        m = pair.manifest
        B, W, C = 3, m.max_draft_len + 1, m.max_len + m.max_draft_len + 1
        eng = _engine(pair, max_logits=W, batch=B, max_len=C)
        assert eng.ragged == (which == "qwen_dir")
        rng = np.random.default_rng(11)
        seqs = [list(_ids(n, seed=20 + n)) for n in (5, 31, 12)]
        for r, s in enumerate(seqs):
            eng.row(r).forward(np.array([s]), np.array([len(s) - 1]))
        assert eng.lengths.tolist() == [5, 31, 12]
        for step in range(8):
            counts = np.array([int(rng.integers(0 if r == step % B else 1, W + 1)) for r in range(B)])
            S = int(counts.max())
            tokens = np.zeros((B, S), np.int64)
            index = []
            for r in range(B):
                tokens[r, :counts[r]] = _ids(int(counts[r]), seed=100 * step + r)
                index += [r * S + j for j in range(counts[r])]
            got = eng.forward_ragged(tokens, counts, np.array(index)).copy()
            at = 0
            for r in range(B):
                n = int(counts[r])
                seqs[r] = seqs[r] + list(tokens[r, :n])
                alone = _engine(pair, max_logits=C)
                want = alone.forward(np.array([seqs[r]]), np.arange(len(seqs[r]) - n, len(seqs[r])))[0]
                np.testing.assert_allclose(got[at:at + n], want, atol=1e-4, rtol=1e-4)
                for i in range(m.target.num_layers):
                    np.testing.assert_allclose(_prefix(eng, "k", i, len(seqs[r]), row=r),
                                               _prefix(alone, "k", i, len(seqs[r])), atol=1e-5)
                alone.close()
                at += n
                keep = len(seqs[r]) - int(rng.integers(0, n + 1))  # reject some of what was fed
                seqs[r] = seqs[r][:keep]
                eng.set_length(r, keep)
            assert eng.lengths.tolist() == [len(s) for s in seqs]
        with pytest.raises(ValueError, match="cannot truncate row"):
            eng.set_length(0, len(seqs[0]) + 1)
        eng.close()


def test_row_view_is_its_row_of_the_buffers(qwen_pair):
    """`row(r)` is a batch-1 engine over row r: its prefill writes that row only, its length is lengths[r]."""
    m = qwen_pair.manifest
    eng = _engine(qwen_pair, batch=3)
    ids = _ids(9, seed=12)
    view = eng.row(1)
    assert view is eng.row(1) and view.batch == 1
    want = _engine(qwen_pair).forward(ids[None], np.arange(9))[0]
    np.testing.assert_allclose(view.forward(ids[None], np.arange(9))[0], want, atol=1e-5)
    assert eng.lengths.tolist() == [0, 9, 0] and view.length == 9
    for i in range(m.target.num_layers):
        assert eng.keys[i][1, :, :9].any() and not eng.keys[i][0].any() and not eng.keys[i][2].any()
    eng.set_length(1, 4)
    assert view.length == 4
    eng.close()


@pytest.mark.parametrize("which", ["qwen_dir", "noq_dir"])
def test_chunked_prefill_equals_one_pass(request, which):
    """A pass wider than `prefill_chunk` runs in chunks: the same logits and cache as one pass, rows of a
    batch included (ragged counts, and rows whose tokens end before the last chunk)."""
    import specrt

    with specrt.load(request.getfixturevalue(which), threads=1) as pair:
        m = pair.manifest
        entry = m.target
        one = ort_engine(pair.dir, entry, m.max_len, 64, batch=2, threads=1)
        chunked = ort_engine(pair.dir, entry, m.max_len, 64, batch=2, threads=1, prefill_chunk=7)
        tokens = np.stack([_ids(40, seed=30), _ids(40, seed=31)])
        counts = np.array([40, 23])
        index = np.array([39, 0, 10, 40 + 22, 40 + 7])
        want = one.forward_ragged(tokens, counts, index).copy() if one.ragged else None
        got = chunked.forward_ragged(tokens, counts, index).copy()
        if want is None:  # no query_seqlens: rows one by one
            want = np.concatenate([one.row(0).forward(tokens[:1], np.array([39, 0, 10]))[0].copy(),
                                   one.row(1).forward(tokens[1:, :23], np.array([22, 7]))[0].copy()])
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)
        assert chunked.lengths.tolist() == [40, 23] == one.lengths.tolist()
        for i in range(entry.num_layers):
            for r in range(2):
                np.testing.assert_allclose(_prefix(chunked, "k", i, counts[r], row=r), _prefix(one, "k", i, counts[r], row=r),
                                           atol=3e-5)


class _CapturingSession:
    """Stands in for a session created with CUDA graph capture: records the graph id each call names
    (None: no run options, which onnxruntime runs as graph 0: captured once, then replayed)."""

    def __init__(self):
        self.ids = []

    def io_binding(self):
        class _IO:
            def __getattr__(self, name):
                return lambda *a, **k: None
        return _IO()

    def run_with_iobinding(self, io, run_options=None):
        self.ids.append(None if run_options is None else run_options.get_run_config_entry("gpu_graph_id"))


def test_uncaptured_calls_on_a_capturing_session_name_no_graph(noq_dir):
    """On CUDA, a batch engine without query_seqlens runs multi-token ragged passes row by row through row
    views of its session, which captures CUDA graphs: every such call must name graph -1, else onnxruntime
    captures the first as graph 0 and replays it for every later call (found on an H200: batched outputs
    all wrong). Engines of other batch sizes share the session, so they draw graph ids from one counter."""
    from specrt.engines.ort import _CudaGraphs
    from specrt.manifest import read_manifest

    entry = read_manifest(noq_dir).target
    session = _CapturingSession()
    n = entry.num_layers
    bufs = ([None] * n, [None] * n, [0] * n, [0] * n)
    eng = LeanEngine(None, entry, 64, 8, batch=3, session=session, device="cuda", cuda_graph=True, buffers=bufs)
    assert eng.captures and not eng.ragged
    tokens = np.ones((3, 2), np.int64)
    eng.forward_ragged(tokens, np.array([2, 1, 2]), np.array([0, 1, 2, 4, 5]))
    assert session.ids == ["-1", "-1", "-1"] and eng.lengths.tolist() == [2, 1, 2]
    other = LeanEngine(None, entry, 64, 8, batch=1, session=session, device="cuda", cuda_graph=True, buffers=bufs)
    a, b = _CudaGraphs(eng), _CudaGraphs(other)
    assert [next(a._ids), next(b._ids), next(a._ids)] == [1, 2, 3]
