"""Export: the manifest, the integrity checks on load, tokenizer compatibility, atomic output, int4."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import specrt
from _helpers import WORDS, copy_pair, export
from specrt.engines.ort import gqa_has_query_seqlens
from specrt.errors import ConfigError, ExportError, PairError
from specrt.export.graph import lean_io_names
from specrt.export.pair import ExportConfig
from specrt.manifest import FORMAT_NAME, FORMAT_VERSION, LEAN_KV_LAYOUT, read_manifest, sha256_file


def _partials(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".partial-" in p.name]


# ---------------------------------------------------------------- the manifest


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_manifest_describes_the_pair(request, model_type):
    d = request.getfixturevalue({"qwen2": "qwen_dir", "llama": "llama_dir"}[model_type])
    raw = json.loads((d / "manifest.json").read_text())
    assert raw["format"] == FORMAT_NAME and raw["format_version"] == FORMAT_VERSION == 1
    assert raw["kv_layout"] == LEAN_KV_LAYOUT == "batch,kv_heads,seq,head_dim"
    assert raw["vocab_size"] == 320  # the tokenizer's ids, not the 384/352 output rows
    assert raw["eos_token_ids"] == [2]
    assert raw["max_len"] == 256 and raw["max_draft_len"] == 8
    assert raw["created_by"].startswith("specrt")
    for name in raw["tokenizer_files"]:
        assert (d / name).is_file()
    assert "tokenizer.json" in raw["tokenizer_files"]

    for role, layers, width in (("target", 4, 384), ("draft", 2, 352)):
        e = raw[role]
        assert e["model_type"] == model_type and e["precision"] == "fp32" and e["dtype"] == "float32"
        assert (e["num_layers"], e["num_kv_heads"], e["head_dim"], e["logits_width"]) == (layers, 2, 16, width)
        assert e["quantization"] is None and e["graph"] == "lean"
        ins, outs = lean_io_names(layers, gqa_has_query_seqlens())
        assert list(e["inputs"]) == ins and list(e["outputs"]) == outs
        for n in ("input_ids", "logit_index"):
            assert e["inputs"][n]["dtype"] == "int64"
        for n in ("seqlens_k", "query_seqlens"):
            assert n not in e["inputs"] or e["inputs"][n] == {"dtype": "int32", "shape": ["batch"]}
        assert e["inputs"]["total_sequence_length"] == {"dtype": "int32", "shape": [1]}
        assert e["inputs"]["input_ids"]["shape"] == ["batch", "seq"]
        assert e["inputs"]["logit_index"]["shape"] == ["n_logits"]
        assert e["outputs"]["logits"] == {"dtype": "float32", "shape": ["n_logits", width]}
        for i in range(layers):
            for n in (f"past_key.{i}", f"past_value.{i}"):
                assert e["inputs"][n] == {"dtype": "float32", "shape": ["batch", 2, "capacity", 16]}
            for n in (f"present_key.{i}", f"present_value.{i}"):
                assert e["outputs"][n] == {"dtype": "float32", "shape": ["batch", 2, "capacity", 16]}
        # every file of the graph folder is listed, with its sha256
        assert e["path"] == f"{role}/model.onnx"
        on_disk = sorted(f"{role}/{p.name}" for p in (d / role).iterdir() if not p.name.startswith("."))
        assert sorted(e["files"]) == on_disk
        for name, digest in e["files"].items():
            assert sha256_file(d / name) == digest


def test_each_past_feeds_only_its_attention_which_writes_the_present(qwen_dir, int4_dir):
    """The cache is read and written in place by one GroupQueryAttention per layer: no past K/V reaches any
    other op (a Concat, Transpose or Cast would copy the cache every step), and that op's present outputs
    are the graph's (bound to the same buffers as the past)."""
    import onnx

    for d in (qwen_dir, int4_dir):
        for role in ("target", "draft"):
            e = getattr(read_manifest(d), role)
            graph = onnx.load(str(d / e.path), load_external_data=False).graph
            for i in range(e.num_layers):
                pk, pv, nk, nv = e.kv_names(i)
                users = {name: [n for n in graph.node if name in n.input and n.op_type != "Shape"]  # Shape reads no data
                         for name in (pk, pv)}
                assert [n.op_type for n in users[pk]] == ["GroupQueryAttention"], (role, pk, users[pk])
                assert users[pv] == users[pk]
                node = users[pk][0]
                assert list(node.input[3:5]) == [pk, pv] and list(node.output[1:3]) == [nk, nv]


@pytest.mark.parametrize("which", ["qwen_dir", "llama_dir", "int4_dir"])
def test_lean_graph_nodes_per_layer(request, which):
    """A decoder layer is a handful of fused ops: (target nodes - draft nodes) / (layer difference)."""
    from collections import Counter

    import onnx

    d = request.getfixturevalue(which)
    m = read_manifest(d)
    ops = {role: Counter(n.op_type for n in onnx.load(str(d / e.path), load_external_data=False).graph.node)
           for role, e in (("target", m.target), ("draft", m.draft))}
    per_layer = {op: (ops["target"][op] - ops["draft"][op]) / (m.target.num_layers - m.draft.num_layers)
                 for op in ops["target"] | ops["draft"]}
    per_layer = {op: n for op, n in per_layer.items() if n}
    matmul = "MatMulNBits" if which == "int4_dir" else "MatMul"
    want = {matmul: 4, "GroupQueryAttention": 1, "SkipSimplifiedLayerNormalization": 2, "Split": 1, "Sigmoid": 1,
            "Mul": 2}
    if m.target.model_type == "qwen2":
        want["Add"] = 1  # the q/k/v bias
    assert per_layer == want
    assert sum(per_layer.values()) <= 12


def test_read_manifest_roundtrip(qwen_dir):
    m = read_manifest(qwen_dir)
    assert m.target.kv_names(1) == ("past_key.1", "past_value.1", "present_key.1", "present_value.1")
    assert json.loads(m.to_json()) == json.loads((qwen_dir / "manifest.json").read_text())


# ---------------------------------------------------------------- integrity on load


def _edit_manifest(d: Path, fn):
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("role", ["target", "draft"])
def test_tampered_graph_is_refused(qwen_dir, tmp_path, role):
    d = copy_pair(qwen_dir, tmp_path / "p")
    specrt.load(d).close()  # a clean load first (may leave a verification stamp)
    f = d / role / "model.onnx"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(PairError, match="sha256"):
        specrt.load(d)


def test_missing_graph_file_is_refused(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    (d / "draft" / "model.onnx").unlink()
    with pytest.raises(PairError, match="missing graph file"):
        specrt.load(d)


def test_unreadable_graph_without_verification_is_a_pair_error(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    f = d / "target" / "model.onnx"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(PairError, match="cannot load"):
        specrt.load(d, verify=False)


def test_graph_not_matching_manifest_io_is_refused(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")

    def rename(m):
        m["target"]["inputs"]["seqlens_renamed"] = m["target"]["inputs"].pop("seqlens_k")

    _edit_manifest(d, rename)
    with pytest.raises(PairError, match="does not match its manifest"):
        specrt.load(d)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(format_version=2), "format version 2"),
    (lambda m: m.update(format_version=None), "format version"),
    (lambda m: m.update(format="something-else"), "not a specrt manifest"),
    (lambda m: m.pop("target"), "corrupt manifest"),
    (lambda m: m.update(unknown_field=1), "corrupt manifest"),
    (lambda m: m["target"].pop("num_layers"), "corrupt manifest"),
])
def test_bad_manifest_is_a_pair_error(qwen_dir, tmp_path, edit, match):
    d = copy_pair(qwen_dir, tmp_path / "p")
    _edit_manifest(d, edit)
    with pytest.raises(PairError, match=match):
        specrt.load(d)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00garbage", b""])
def test_corrupt_manifest_file(qwen_dir, tmp_path, content):
    d = copy_pair(qwen_dir, tmp_path / "p")
    (d / "manifest.json").write_bytes(content)
    with pytest.raises(PairError):
        specrt.load(d)


def test_missing_pair_folder_and_missing_manifest(tmp_path):
    with pytest.raises(PairError, match="not found"):
        specrt.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PairError, match="no manifest.json"):
        specrt.load(tmp_path / "empty")


def test_missing_tokenizer_is_a_pair_error(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    (d / "tokenizer.json").unlink()
    with pytest.raises(PairError, match="tokenizer"):
        specrt.load(d)


def test_verified_graphs_are_not_hashed_again(qwen_dir, tmp_path, monkeypatch):
    import specrt.manifest as manifest

    d = copy_pair(qwen_dir, tmp_path / "p")
    specrt.load(d).close()
    calls = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p, *a, **kw: calls.append(p) or real(p, *a, **kw))
    specrt.load(d).close()
    assert calls == []


# ---------------------------------------------------------------- tokenizer compatibility


def test_identical_tokenizers_and_padded_output_rows(qwen_dir, same_dir):
    # same_dir: one checkpoint twice; qwen_dir: 384 target rows vs 352 draft rows over a 320-id tokenizer
    assert read_manifest(same_dir).vocab_size == 320
    m = read_manifest(qwen_dir)
    assert (m.vocab_size, m.target.logits_width, m.draft.logits_width) == (320, 384, 352)


def _swap_tokenizer(src: Path, dst: Path, tok) -> Path:
    shutil.copytree(src, dst)
    tok.save(str(dst / "tokenizer.json"))
    return dst


@pytest.mark.parametrize("which", ["bpe300", "words"])
def test_different_tokenizers_are_refused(hf_tiny, tmp_path, which):
    from specrt.export.tiny import make_tokenizer, make_word_tokenizer

    tok = make_tokenizer(vocab_size=300) if which == "bpe300" else make_word_tokenizer(WORDS)
    target, draft = hf_tiny["qwen2"]
    other = _swap_tokenizer(draft, tmp_path / "draft", tok)
    with pytest.raises(ExportError, match=r"tokenizers differ at \d+ ids: \d+ \(") as e:
        export(target, other, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not _partials(tmp_path)


def test_model_with_fewer_output_rows_than_tokenizer_ids_is_refused(hf_tiny, tmp_path):
    target, draft = hf_tiny["qwen2"]
    small = tmp_path / "draft"
    shutil.copytree(draft, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 300
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="ids up to 319 but the draft model has only 300 output rows"):
        export(target, small, tmp_path / "out")
    assert not _partials(tmp_path)


# ---------------------------------------------------------------- the output folder


def test_export_refuses_non_empty_out_and_overwrite_replaces_only_a_pair(hf_tiny, tmp_path):
    target, draft = hf_tiny["qwen2"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for overwrite in (False, True):  # a folder that is not a pair is never replaced
        with pytest.raises(ExportError, match="not empty"):
            export(target, draft, out, overwrite=overwrite)
        assert (out / "keep.txt").read_text() == "mine" and not _partials(tmp_path)
    (out / "keep.txt").unlink()
    export(target, draft, out, max_len=32)
    export(target, draft, out, overwrite=True, max_len=64)
    assert not _partials(tmp_path)
    with specrt.load(out) as pair:
        assert pair.manifest.max_len == 64
        assert len(pair.generate("def", max_new_tokens=4).tokens) == 4


def test_export_into_empty_existing_folder(hf_tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    export(*hf_tiny["qwen2"], out, max_len=32, max_draft_len=2)
    assert read_manifest(out).max_draft_len == 2


def test_export_out_is_an_existing_file(hf_tiny, tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ExportError):
        export(*hf_tiny["qwen2"], tmp_path / "out")


def test_unsupported_architecture_is_refused_and_cleaned_up(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from specrt.export.tiny import _save_tokenizer, make_tokenizer

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320, n_positions=64)).save_pretrained(src)
    _save_tokenizer(make_tokenizer(), src)
    with pytest.raises(ExportError, match="'gpt2' is not supported"):
        export(src, src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _partials(tmp_path)


@pytest.mark.parametrize("source,match", [
    ("does/not/exist/anywhere", "model source not found"),
    ("./relative-missing", "model source not found"),
])
def test_source_not_found(hf_tiny, tmp_path, source, match):
    with pytest.raises(ExportError, match=match):
        export(source, hf_tiny["qwen2"][1], tmp_path / "out")
    assert not _partials(tmp_path)


def test_source_folder_without_config_and_non_gguf_file(hf_tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        export(tmp_path / "empty", hf_tiny["qwen2"][1], tmp_path / "out")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ExportError, match="not a .gguf file"):
        export(tmp_path / "weights.bin", hf_tiny["qwen2"][1], tmp_path / "out")
    assert not _partials(tmp_path)


@pytest.mark.parametrize("kw,match", [
    (dict(precision="int8"), "unknown precision"),
    (dict(max_len=8), "max_len"),
    (dict(max_draft_len=0), "max_draft_len"),
    (dict(max_draft_len=65), "max_draft_len"),
    (dict(block_size=48), "block_size"),
    (dict(accuracy_level=5), "accuracy_level"),
    (dict(embedding_bits=3), "embedding_bits must be 0"),
    (dict(embedding_block_size=24), "embedding_block_size"),
])
def test_export_config_validation(kw, match):
    with pytest.raises(ExportError, match=match):
        ExportConfig(target="a", draft="b", out=Path("c"), **kw)


def test_target_only_pair(hf_tiny, tmp_path):
    """No draft model: draft_len 0 and the prompt-lookup drafter work; the model drafters are refused."""
    export(hf_tiny["qwen2"][0], None, tmp_path / "solo", max_len=64)
    m = read_manifest(tmp_path / "solo")
    assert m.draft is None and not (tmp_path / "solo" / "draft").exists()
    with specrt.load(tmp_path / "solo") as pair:
        assert pair.draft is None and pair.default_drafter == "ngram"
        base = pair.generate("def", max_new_tokens=20, draft_len=0)
        assert len(base.tokens) == 20
        res = pair.generate("def", max_new_tokens=20, draft_len=4)  # default drafter: ngram
        assert res.tokens == base.tokens and res.stats["draft_passes"] == 0
        for drafter in ("model", "hybrid"):
            with pytest.raises(ConfigError, match="no draft model"):
                pair.generate("def", max_new_tokens=5, draft_len=2, drafter=drafter)


# ---------------------------------------------------------------- int4


@pytest.mark.parametrize("which,level", [("int4_dir", 0), ("int4_default_dir", 4)])
def test_int4_manifest_and_graph(request, which, level):
    import onnx

    d = request.getfixturevalue(which)
    m = read_manifest(d)
    for e in (m.target, m.draft):
        assert e.precision == "int4"
        assert e.quantization == {"method": "MatMulNBits", "bits": 4, "block_size": 128, "accuracy_level": level,
                                  "symmetric": False}
        for name, digest in e.files.items():
            assert sha256_file(d / name) == digest
        proto = onnx.load(str(d / e.path), load_external_data=False)
        ops = [n.op_type for n in proto.graph.node]
        # fused qkv, o, fused gate/up, down per layer + lm_head; only activation x activation MatMuls remain
        assert ops.count("MatMulNBits") == 4 * e.num_layers + 1
        assert ops.count("GroupQueryAttention") == e.num_layers
        # the input embedding: int4, blocks of 32 (the default for int4 pairs)
        assert e.embedding == {"op": "GatherBlockQuantized", "bits": 4, "block_size": 32, "symmetric": False}
        assert ops.count("GatherBlockQuantized") == 1 and "Gather" in ops  # the embedding; Gather: the logits rows
        inits = {i.name for i in proto.graph.initializer}
        assert not any(n.op_type == "MatMul" and set(n.input) & inits for n in proto.graph.node)
        for n in proto.graph.node:
            if n.op_type == "MatMulNBits":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                assert (attrs["bits"], attrs["block_size"], attrs.get("accuracy_level", 0)) == (4, 128, level)
                assert len(n.input) >= 4 and n.input[3]  # A, B, scales, zero_points: asymmetric by default


@pytest.mark.parametrize("which", ["int4_dir", "int4_default_dir"])
def test_sliced_output_matrix_gives_the_same_logits(request, tmp_path, which, monkeypatch):
    """slice_wide_matmuls (what bounds the load-time peak of the output matrix's prepacking) splits a wide
    MatMulNBits into slices joined by a Concat: every pass's logits stay bit for bit those of the one op.
    Here the tiny layers' gate/up matmuls are sliced too, which leaves their gated activation outside the
    kernel (engines/int4._fuse_glu takes an unsliced gate/up only): both graphs load without that fold, so
    the slicing alone is compared."""
    import onnx

    from specrt.engines import int4

    monkeypatch.setattr(int4, "_fuse_glu", lambda *a: 0)

    from specrt.export.traced import _save, slice_wide_matmuls

    d = request.getfixturevalue(which)
    m = read_manifest(d)
    sliced = copy_pair(d, tmp_path / "sliced")
    rows = 128  # the output matrix in three slices, the last one narrower

    def widths(path):
        return [onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "N"))
                for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]

    before = widths(d / m.target.path)
    wide = [n for n in before if n > rows]  # the output matrix, and here the tiny layers' gate/up too
    assert m.target.logits_width in wide
    graph = sliced / m.target.path
    proto = onnx.load(str(graph))
    assert slice_wide_matmuls(proto, rows) == len(wide)
    _save(proto, graph)
    after = widths(sliced / m.target.path)
    assert max(after) <= rows and sum(after) == sum(before)
    assert len(after) == len(before) + sum(-(-n // rows) - 1 for n in wide)
    a = specrt.load(d, use_tuned=False)
    b = specrt.load(sliced, verify=False, use_tuned=False)
    try:
        ids = np.random.default_rng(0).integers(0, m.vocab_size, size=(1, 30))
        for lo, hi in ((0, 17), (17, 18), (18, 23), (23, 30)):
            rows_out = np.arange(max(0, hi - lo - m.max_draft_len - 1), hi - lo)
            la = np.array(a.target.forward(ids[:, lo:hi], rows_out))
            lb = np.array(b.target.forward(ids[:, lo:hi], rows_out))
            assert la.shape == lb.shape == (1, len(rows_out), m.target.logits_width)
            assert np.array_equal(la, lb)
    finally:
        a.close()
        b.close()


def test_quantized_embedding_matches_its_reference(tmp_path):
    """quantize_blocks writes what onnxruntime's GatherBlockQuantized reads: the op returns exactly the
    numpy dequantization, for 4 and 8 bits, close to the table."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specrt.export.quant import quantize_blocks

    table = np.random.default_rng(0).standard_normal((50, 64)).astype(np.float32)
    for bits, tol in ((4, 0.25), (8, 0.015)):
        q, scales, zero = quantize_blocks(table, bits, 16)
        vals = q if bits == 8 else np.stack([q & 15, q >> 4], -1).reshape(50, 64)
        zp = zero if bits == 8 else np.stack([zero & 15, zero >> 4], -1).reshape(50, -1)[:, :4]
        deq = ((vals.reshape(50, 4, 16).astype(np.float32) - zp[..., None]) * scales[..., None]).reshape(50, 64)
        node = helper.make_node("GatherBlockQuantized", ["data", "idx", "scales", "zp"], ["out"], domain="com.microsoft",
                                gather_axis=0, quantize_axis=1, block_size=16, bits=bits)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("idx", TensorProto.INT64, ["N"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 64])],
                              [numpy_helper.from_array(q, "data"), numpy_helper.from_array(scales, "scales"),
                               numpy_helper.from_array(zero, "zp")])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        idx = np.array([0, 7, 49, 7])
        out = sess.run(None, {"idx": idx})[0]
        np.testing.assert_array_equal(out, deq[idx])
        assert np.abs(out - table[idx]).max() < tol


@pytest.mark.parametrize("bits", [0, 8])
def test_embedding_bits_option(work, hf_tiny, bits):
    """--embedding-bits 0 keeps the table; 8 quantizes it to int8; int4 weights either way, greedy
    speculative still equal to target-only (accuracy level 0)."""
    import onnx

    d = work / f"pair-int4-emb{bits}"
    export(*hf_tiny["qwen2"], d, precision="int4", accuracy_level=0, embedding_bits=bits, embedding_block_size=16)
    m = read_manifest(d)
    ops = [n.op_type for n in onnx.load(str(d / m.target.path), load_external_data=False).graph.node]
    assert ops.count("GatherBlockQuantized") == (1 if bits else 0)
    assert m.target.embedding == ({"op": "GatherBlockQuantized", "bits": 8, "block_size": 16, "symmetric": False}
                                  if bits else None)
    with specrt.load(d, threads=1) as pair:
        want = pair.generate("def quicksort(xs):", max_new_tokens=24, draft_len=0).tokens
        assert pair.generate("def quicksort(xs):", max_new_tokens=24, draft_len=3).tokens == want


def test_fp32_pairs_keep_their_embeddings(qwen_dir):
    m = read_manifest(qwen_dir)
    assert m.target.embedding is None and m.draft.embedding is None


def test_int4_symmetric_blocks(work, hf_tiny, qwen_pair):
    """--symmetric --block-size 32: no zero points in the graph, recorded in the manifest; the logits stay
    close to fp32, and (accuracy level 0) speculative greedy equals target-only."""
    import onnx

    import specrt

    d = work / "pair-int4-sym"
    export(*hf_tiny["qwen2"], d, precision="int4", block_size=32, symmetric=True, accuracy_level=0)
    m = read_manifest(d)
    assert m.target.quantization == {"method": "MatMulNBits", "bits": 4, "block_size": 32, "accuracy_level": 0,
                                     "symmetric": True}
    proto = onnx.load(str(d / m.target.path), load_external_data=False)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) == 3 or not n.input[3] for n in nbits)  # A, B, scales; no zero points
    ids = np.array([[40, 41, 42, 43, 44, 45]])
    with specrt.load(d, threads=1) as pair:
        pair.target.truncate(0), qwen_pair.target.truncate(0)
        a = pair.target.forward(ids, np.array([5]))[0, 0, :320].copy()
        b = qwen_pair.target.forward(ids, np.array([5]))[0, 0, :320].copy()
        assert np.corrcoef(a, b)[0, 1] > 0.5
        base = pair.generate("def quicksort(xs):", max_new_tokens=32, draft_len=0).tokens
        assert pair.generate("def quicksort(xs):", max_new_tokens=32, draft_len=4).tokens == base


def test_int4_logits_close_to_fp32(int4_pair, qwen_pair):
    ids = np.array([[40, 41, 42, 43, 44, 45]])
    int4_pair.target.truncate(0), qwen_pair.target.truncate(0)
    a = int4_pair.target.forward(ids, np.array([5]))[0, 0, :320].copy()
    b = qwen_pair.target.forward(ids, np.array([5]))[0, 0, :320].copy()
    # Random tiny weights lose a lot to 4 bits (a torch simulation of symmetric block-32 int4 gives ~0.76).
    assert np.corrcoef(a, b)[0, 1] > 0.5


INT4_PROMPTS = ["def quicksort(xs):", "class Stack:", [40, 41, 42, 43], list(range(3, 40))]


@pytest.mark.parametrize("prompt", INT4_PROMPTS, ids=lambda p: repr(p)[:16])
def test_int4_greedy_speculative_equals_target_only(int4_pair, prompt):
    """accuracy_level 0: one-token and verify passes compute the same numbers, so greedy outputs are equal."""
    base = int4_pair.generate(prompt, max_new_tokens=48, draft_len=0)
    assert len(base.tokens) == 48
    for k in (1, 2, 4, 8):
        res = int4_pair.generate(prompt, max_new_tokens=48, draft_len=k)
        assert res.tokens == base.tokens, f"draft_len {k}"
    samp = int4_pair.generate(prompt, max_new_tokens=16, draft_len=4, temperature=0.8, seed=1)
    assert len(samp.tokens) == 16 and 0 <= samp.stats["acceptance_rate"] <= 1


@pytest.mark.parametrize("prompt", INT4_PROMPTS, ids=lambda p: repr(p)[:16])
def test_int4_default_level_greedy_agrees_up_to_near_ties(int4_default_pair, prompt):
    """accuracy_level 4 quantizes activations per call; a divergence is only allowed at a numerical near-tie."""
    from specrt.apps.check import first_divergence

    ids = int4_default_pair.encode(prompt)
    for k in (1, 4, 8):
        r = first_divergence(int4_default_pair, ids, 48, k)
        assert r["equal"] or abs(r["margin"]) < 1e-2, (k, r["index"], r["margin"])


# ---------------------------------------------------------------- after a crash in the middle of an export


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)  # that process has exited (a pid is reused only after the whole pid range)


def _hidden(out: Path, kind: str = "old") -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.{kind}-*"))


def test_old_pair_hidden_by_a_crash_is_restored_when_out_is_missing(qwen_dir, hf_tiny, tmp_path):
    """A crash between _swap_in's two renames leaves only `.out.old-PID`: the next export puts it back
    (and, without --overwrite, then refuses to replace it)."""
    out = tmp_path / "out"
    copy_pair(qwen_dir, out.parent / f".out.old-{_dead_pid()}")
    with pytest.raises(ExportError, match="not empty"):
        export(*hf_tiny["qwen2"], out)
    assert read_manifest(out) == read_manifest(qwen_dir) and not _hidden(out)


def test_recover_removes_what_a_finished_swap_left(qwen_dir, tmp_path):
    from specrt.export.pair import recover

    out = copy_pair(qwen_dir, tmp_path / "out")
    dead = _dead_pid()
    copy_pair(qwen_dir, tmp_path / f".out.old-{dead}")
    (tmp_path / f".out.partial-{dead}").mkdir()
    (tmp_path / ".out.old-1").mkdir()  # pid 1 is alive: an export still running is left alone
    (tmp_path / ".other.old-5").mkdir()  # another folder's
    recover(out, log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.old-5", ".out.old-1", "out"]
    assert read_manifest(out) == read_manifest(qwen_dir)


def test_recover_keeps_the_old_pair_beside_an_incomplete_out(qwen_dir, tmp_path):
    from specrt.export.pair import recover

    out = tmp_path / "out"
    out.mkdir()  # not a pair (no manifest): the hidden one is all the user has
    old = copy_pair(qwen_dir, tmp_path / f".out.old-{_dead_pid()}")
    recover(out, log=lambda s: None)
    assert old.is_dir() and not any(out.iterdir())


# ---------------------------------------------------------------- sources: hub files, GGUF end tokens


def test_hub_download_fetches_the_chat_template(monkeypatch, tmp_path):
    import fnmatch

    pytest.importorskip("huggingface_hub")
    from specrt.export import load

    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked.update(repo=repo_id, patterns=allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    assert load._download_from_hub("org/model") == tmp_path
    assert asked["patterns"] == list(load.HUB_FILES)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "model.safetensors", "tokenizer.model"):
        assert any(fnmatch.fnmatch(name, p) for p in asked["patterns"]), name
    assert not any(fnmatch.fnmatch("pytorch_model.bin", p) for p in asked["patterns"])


def test_gguf_eos_ids_add_the_tokenizers_end_tokens(tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models

    from specrt.export.load import Source, eos_ids
    from specrt.export.tiny import make_tokenizer

    tok = make_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config = SimpleNamespace(eos_token_id=7)  # a GGUF's metadata: one id
    gguf = Source("m.gguf", "gguf", tmp_path, "m.gguf")
    assert eos_ids(gguf, config, tmp_path / "tokenizer.json") == [7, end, im_end]
    assert eos_ids(gguf, SimpleNamespace(eos_token_id=im_end), tmp_path / "tokenizer.json") == [im_end, end]
    assert eos_ids(Source(str(tmp_path), "hf", tmp_path), config, tmp_path / "tokenizer.json") == [7]  # HF: as configured
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>")).save(str(tmp_path / "plain.json"))
    assert eos_ids(gguf, config, tmp_path / "plain.json") == [7]  # a tokenizer without them adds nothing


# ---------------------------------------------------------------- the one manifest writer


def test_write_manifest_replaces_atomically(qwen_dir, tmp_path, monkeypatch):
    import dataclasses
    import os

    from specrt.manifest import write_manifest

    d = copy_pair(qwen_dir, tmp_path / "p")
    m = read_manifest(d)
    write_manifest(d, dataclasses.replace(m, max_draft_len=3))
    assert read_manifest(d).max_draft_len == 3 and sorted(p.name for p in d.glob(".manifest*")) == []
    before = (d / "manifest.json").read_bytes()

    def fail(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_manifest(d, m)
    assert (d / "manifest.json").read_bytes() == before and sorted(p.name for p in d.glob(".manifest*")) == []


# ---------------------------------------------------------------- the memory preflight


def test_export_memory_reading_honours_the_override(monkeypatch):
    from specrt.export import pair

    monkeypatch.setenv("SPECRT_MEM_AVAILABLE_BYTES", "12345")
    assert pair._mem_available() == 12345
    monkeypatch.setenv("SPECRT_MEM_AVAILABLE_BYTES", "lots")
    with pytest.raises(ConfigError, match="SPECRT_MEM_AVAILABLE_BYTES"):
        pair._mem_available()
    monkeypatch.delenv("SPECRT_MEM_AVAILABLE_BYTES")
    avail = pair._mem_available()
    assert avail is None or avail > 0  # Linux: MemAvailable, in bytes
