"""Tokens with parent pointers (a tree of new tokens in one pass) through specrt's attention: each token's
logits and cache entries are the bits of the chain of its ancestors computed alone; slot moves bring one
root-to-leaf path to consecutive slots, after which the cache is that chain's; the kernel gives a tree the
same bits on every instruction set; invalid parents are refused in one line."""
from __future__ import annotations

import numpy as np
import pytest

from specrt.engines import int4
from specrt.engines.ort import LeanEngine, ort_engine

from _helpers import KERNELS_RUN, needs_kernels

built = pytest.mark.skipif(int4.library() is None, reason=f"the kernel library is not built: {int4.unavailable()}")

# Two rows' trees: row 0 two roots (0 and 5) with branches; row 1 three tokens under one root, then padding
# whose parents are nonsense (ignored). -1: the row's cached tokens.
PARENTS = np.array([[-1, 0, 0, 1, 2, -1, 5], [-1, 0, 0, 2, 99, 99, 99]])
COUNTS = np.array([7, 4])
PROMPTS = (20, 13)


def _path(parents, i: int) -> list[int]:
    """Token i's ancestors by depth, i last."""
    path = [i]
    while parents[path[0]] >= 0:
        path.insert(0, int(parents[path[0]]))
    return path


def _engine(pair, batch: int = 1, **kw) -> LeanEngine:
    """An engine of its own caches on the pair's target session."""
    t, m = pair.target, pair.manifest
    return ort_engine(pair.dir, m.target, m.max_len, 16, batch=batch, session=t.session, kernel=t.kernel, **kw)


@pytest.fixture
def exact(int4_default_pair):
    """The int4 pair whose every matmul and attention node is specrt's: rows exact whatever the pass."""
    if not KERNELS_RUN:
        pytest.skip(f"specrt's kernels do not run here: {int4.unavailable() or 'SPECRT_INT4_KERNEL=off'}")
    assert int4_default_pair.target.kernel.invariant and int4_default_pair.target.trees
    return int4_default_pair


def _tree_pass(pair, rng):
    """A batch-2 engine after its prompts and one pass of PARENTS' trees; (engine, prompts, tokens, logits)."""
    e = _engine(pair, batch=2)
    V = pair.manifest.vocab_size
    prompts = [rng.integers(3, V, n) for n in PROMPTS]
    for r, p in enumerate(prompts):
        e.row(r).forward(p[None], np.array([len(p) - 1]))
    tokens = rng.integers(3, V, PARENTS.shape)
    S = PARENTS.shape[1]
    index = np.concatenate([r * S + np.arange(COUNTS[r]) for r in range(2)])
    logits = e.forward_ragged(tokens, COUNTS, index, PARENTS).copy()
    return e, prompts, tokens, logits


def _chain(pair, prompt, tokens) -> tuple[LeanEngine, np.ndarray]:
    """A batch-1 engine after the prompt's pass and then one pass of `tokens`, and its logits for them."""
    c = _engine(pair)
    c.forward(prompt[None], np.array([len(prompt) - 1]))
    return c, c.forward(np.asarray(tokens)[None], np.arange(len(tokens)))[0].copy()


@needs_kernels
def test_each_token_of_a_tree_has_its_chains_bits(exact):
    """Every token's logits, and the keys and values it writes (at slot P + i), are the bits of the chain of
    its ancestors run after the same prompt in its own pass (where the token sits at position P + depth)."""
    rng = np.random.default_rng(0)
    e, prompts, tokens, logits = _tree_pass(exact, rng)
    assert e.lengths.tolist() == [PROMPTS[0] + 7, PROMPTS[1] + 4]
    at = 0
    for r in range(2):
        P = PROMPTS[r]
        for i in range(COUNTS[r]):
            path = _path(PARENTS[r], i)
            c, want = _chain(exact, prompts[r], tokens[r, path])
            np.testing.assert_array_equal(logits[at + i], want[-1], err_msg=f"row {r} token {i} path {path}")
            for layer in range(exact.manifest.target.num_layers):
                for mine, theirs in ((e.keys, c.keys), (e.values, c.values)):
                    np.testing.assert_array_equal(mine[layer][r, :, P + i], theirs[layer][0, :, P + len(path) - 1])
                    np.testing.assert_array_equal(mine[layer][r, :, :P], theirs[layer][0, :, :P])
            c.close()
        at += COUNTS[r]
    e.close()


@needs_kernels
def test_a_chain_given_as_parents_is_the_plain_pass(exact):
    rng = np.random.default_rng(1)
    V = exact.manifest.vocab_size
    prompt, toks = rng.integers(3, V, 9), rng.integers(3, V, (1, 5))
    out = []
    for parents in (None, np.arange(-1, 4)[None]):
        e = _engine(exact)
        e.forward(prompt[None], np.array([8]))
        out.append(e.forward_ragged(toks, np.array([5]), np.arange(5), parents).copy())
        e.close()
    np.testing.assert_array_equal(out[0], out[1])


@needs_kernels
@pytest.mark.parametrize("leaves", [(4, 3), (6, 1), (3, 0)])
def test_moving_a_path_to_consecutive_slots_gives_the_chains_cache(exact, leaves):
    """After the tree pass, each row keeps one root-to-leaf path: slot moves bring it to slots P, P + 1, ...,
    the length is cut there, and the next pass's logits and cache are the bits of that path run as a chain.
    Row 1 moves through its row view (`row(1).move(0, ...)`)."""
    rng = np.random.default_rng(2)
    e, prompts, tokens, _ = _tree_pass(exact, rng)
    paths = [_path(PARENTS[r], leaf) for r, leaf in enumerate(leaves)]
    for r, path in enumerate(paths):
        P = PROMPTS[r]
        mover, row = (e, r) if r == 0 else (e.row(r), 0)
        mover.move(row, P + np.array(path), P + np.arange(len(path)))
        e.set_length(r, P + len(path))
    nxt = rng.integers(3, exact.manifest.vocab_size, (2, 1))
    got = e.forward_ragged(nxt, np.array([1, 1]), np.array([0, 1])).copy()
    for r, path in enumerate(paths):
        c, _ = _chain(exact, prompts[r], tokens[r, path])
        want = c.forward(nxt[r:r + 1], np.array([0]))[0, 0]
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r} path {path}")
        n = PROMPTS[r] + len(path) + 1
        for layer in range(exact.manifest.target.num_layers):
            np.testing.assert_array_equal(e.keys[layer][r, :, :n], c.keys[layer][0, :, :n])
            np.testing.assert_array_equal(e.values[layer][r, :, :n], c.values[layer][0, :, :n])
        c.close()
    e.close()


def test_slot_moves_gather_before_they_write(int4_default_pair):
    e = _engine(int4_default_pair, batch=2)
    for buf in (*e.keys, *e.values):
        buf[...] = np.arange(buf.shape[2], dtype=np.float32)[None, None, :, None]
    e.lowest_write[:] = e.max_len
    e.move(1, [5, 6, 9], [4, 5, 6])  # overlapping: slot 5 is read before it is written
    for buf in (*e.keys, *e.values):
        assert buf[1, :, 3:8, 0].tolist() == [[3, 5, 6, 9, 7]] * buf.shape[1]
        assert buf[0, 0, :10, 0].tolist() == list(range(10))  # the other row untouched
    assert e.lowest_write.tolist() == [e.max_len, 4]
    for bad in (([1], [1, 2]), ([1, 2], [3, 3]), ([e.max_len], [0]), ([0], [-1])):
        with pytest.raises(ValueError):
            e.move(0, *bad)
    with pytest.raises(ValueError, match="no row 2"):
        e.move(2, [1], [0])
    e.close()


@built
def test_the_kernel_gives_a_tree_the_same_bits_with_and_without_avx2():
    from test_kernel import _attention_hash

    tree = _attention_hash(big=2)
    assert tree == _attention_hash(base=True, big=2)
    assert tree != _attention_hash(big=1)  # the trees changed the problem


@built
def test_the_operator_computes_each_tree_token_as_its_chain(tmp_path):
    """One specrt.Attention node: each tree token's output is the bits of the same query at the end of a chain
    of its ancestors (their keys and values written by that chain's own pass); padding outputs are zeros."""
    from test_kernel import _attention_case, _gqa_graph, _session

    rng = np.random.default_rng(3)
    H, Hkv, D, C, cos, sin = _attention_case(rng, H=6, Hkv=2, D=64, C=48)
    ours, kernel = _session(_gqa_graph(tmp_path / "gqa.onnx", H, Hkv, D, C, cos, sin, 0.125), "auto")
    assert kernel.trees and int4.TREE_INPUT in {i.name for i in ours.get_inputs()}
    B, S = PARENTS.shape
    P = np.array(PROMPTS)
    qkv = rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float32)
    past = [rng.standard_normal((B, Hkv, C, D)).astype(np.float32) for _ in range(2)]

    def run(b, rows, parents, n):  # row b's cache with the query rows `rows` of qkv
        feeds = {"qkv": qkv[b:b + 1, rows], "past_key": past[0][b:b + 1].copy(), "past_value": past[1][b:b + 1].copy(),
                 "seqlens_k": np.array([P[b] + n - 1], np.int32), "total": np.array([C], np.int32),
                 "qlens": np.array([n], np.int32), int4.TREE_INPUT: np.asarray(parents, np.int32)[None]}
        return ours.run(None, feeds)

    feeds = {"qkv": qkv, "past_key": past[0], "past_value": past[1], "seqlens_k": (P + COUNTS - 1).astype(np.int32),
             "total": np.array([C], np.int32), "qlens": COUNTS.astype(np.int32), int4.TREE_INPUT: PARENTS.astype(np.int32)}
    out, keys, values = ours.run(None, feeds)
    for b in range(B):
        assert not out[b, COUNTS[b]:].any()
        for i in range(COUNTS[b]):
            path = _path(PARENTS[b], i)
            o, k, v = run(b, path, np.arange(-1, len(path) - 1), len(path))
            np.testing.assert_array_equal(out[b, i], o[0, -1], err_msg=f"row {b} token {i}")
            np.testing.assert_array_equal(keys[b, :, P[b] + i], k[0, :, P[b] + len(path) - 1])
            np.testing.assert_array_equal(values[b, :, P[b] + i], v[0, :, P[b] + len(path) - 1])
    bad = {**feeds, int4.TREE_INPUT: np.array([[-1, 0, 2, 1, 2, -1, 5], [-1, 0, 0, 2, 0, 0, 0]], np.int32)}
    with pytest.raises(Exception, match="specrt.Attention: tree_parents: row 0, token 2: parent 2 is neither -1"):
        ours.run(None, bad)


@needs_kernels
def test_invalid_parents_are_refused(exact, monkeypatch):
    e = _engine(exact, batch=2)
    tokens = np.full((2, 3), 5)
    for parents, what in (([[-1, 0, 2], [-1, -1, -1]], "row 0, token 2: parent 2"),
                          ([[-1, 0, 1], [-1, -2, 0]], "row 1, token 1: parent -2"),
                          ([[-1, 0, 1], [0, 0, 0]], "row 1, token 0: parent 0")):
        with pytest.raises(ValueError, match=what):
            e.forward_ragged(tokens, np.array([3, 3]), np.array([0]), np.array(parents))
    with pytest.raises(ValueError, match="shape"):
        e.forward_ragged(tokens, np.array([3, 3]), np.array([0]), np.array([[-1, 0], [-1, 0]]))
    assert e.lengths.tolist() == [0, 0]  # nothing ran
    chunked = _engine(exact, prefill_chunk=2)
    with pytest.raises(ValueError, match="one pass"):
        chunked.forward_ragged(tokens[:1], np.array([3]), np.array([0]), np.array([[-1, 0, 0]]))
    e.close(), chunked.close()
    monkeypatch.setenv(int4.ENV, "off")  # onnxruntime's attention: no input for parents
    m = exact.manifest
    plain = ort_engine(exact.dir, m.target, m.max_len, 16, threads=1)
    assert not plain.trees and not plain.kernel.trees and plain.kernel.trees_why == f"{int4.ENV}=off"
    with pytest.raises(ValueError, match="takes no parent pointers"):
        plain.forward_ragged(tokens[:1], np.array([3]), np.array([0]), np.array([[-1, 0, 0]]))
    plain.forward_ragged(tokens[:1], np.array([3]), np.array([0]))  # without parents: as always
    plain.close()


@built
def test_the_tree_input_takes_input_ids_dimensions(int4_default_pair):
    model, kernel = int4.plan(int4_default_pair.dir / int4_default_pair.manifest.target.path, "auto")
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    assert kernel.trees and kernel.trees_why is None
    assert inputs[int4.TREE_INPUT] == inputs["input_ids"] == ["batch", "seq"]
    attention = [n for n in model.graph.node if n.domain == int4.DOMAIN and n.op_type == int4.ATTENTION]
    assert attention and all(len(n.input) == 10 and n.input[9] == int4.TREE_INPUT for n in attention)


@built
def test_no_tree_input_where_an_attention_node_stays_onnxruntimes(tmp_path):
    import onnx
    from onnx import helper

    from test_kernel import _attention_case, _gqa_graph

    H, Hkv, D, C, cos, sin = _attention_case(np.random.default_rng(5))
    path = _gqa_graph(tmp_path / "gqa.onnx", H, Hkv, D, C, cos, sin, 0.125)
    model = onnx.load(str(path))
    model.graph.node[0].attribute.append(helper.make_attribute("softcap", 30.0))  # what specrt's refuses
    onnx.save(model, str(path))
    graph, kernel = int4.plan(path, "auto")
    assert graph is None and kernel.attention == 0 and not kernel.trees
    assert kernel.trees_why == "onnxruntime's GroupQueryAttention on 1 of 1 attention nodes (1 with softcap, local " \
                               "window or smooth softmax)"


def test_rows_run_one_by_one_take_their_parents(noq_dir):
    """A graph without query_seqlens runs a ragged pass row by row: each row with its own parents (fp32
    matmuls are onnxruntime's, so against the chain within float rounding)."""
    import specrt

    with specrt.load(noq_dir, threads=1) as pair:
        if not pair.target.trees:
            pytest.skip(f"no trees here: {pair.target.kernel.trees_why if pair.target.kernel else 'no kernel'}")
        assert not pair.target.ragged
        rng = np.random.default_rng(4)
        e, prompts, tokens, logits = _tree_pass(pair, rng)
        at = 0
        for r in range(2):
            for i in range(COUNTS[r]):
                c, want = _chain(pair, prompts[r], tokens[r, _path(PARENTS[r], i)])
                np.testing.assert_allclose(logits[at + i], want[-1], atol=1e-4, rtol=1e-4)
                c.close()
            at += COUNTS[r]
        e.close()
