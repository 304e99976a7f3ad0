"""The graph builder (export/builder.py) against the traced export it replaces, on the tiny pairs of every family:
the same graph, byte-equal weights (int4 blocks, scales and zero points included), the same outputs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specrt
from _gguf import write_gguf
from _helpers import export
from specrt.errors import ExportError
from specrt.manifest import read_manifest

FAMILIES = ("qwen2", "llama", "qwen3", "mistral")
F32_STEP = float(np.finfo(np.float32).eps)  # one float32 step at 1: the rotary tables' largest difference


def _weights(path: Path):
    """Per op type, in node order: (input index, value) of each constant input; and each node's attributes."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weights, attrs = defaultdict(list), defaultdict(list)
    fp32 = next(v for v in model.graph.input if v.name == "past_key.0").type.tensor_type.elem_type == 1
    for n in model.graph.node:
        if n.op_type == "Cast" and fp32:
            continue  # the tracer's float32-to-float32 Casts (embeddings, logits): no node at all in the built graph
        weights[n.op_type] += [(i, consts[x]) for i, x in enumerate(n.input) if x in consts]
        attrs[n.op_type].append(sorted((a.name, helper.get_attribute_value(a)) for a in n.attribute))
    io = [(v.name, v.type.tensor_type.elem_type) for v in [*model.graph.input, *model.graph.output]]
    return weights, attrs, io


def _prefill_logits(path: Path, ids: np.ndarray, capacity: int = 32) -> np.ndarray:
    """Logits of every position of `ids` [1, S] from an empty cache, by onnxruntime alone."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    S = ids.shape[1]
    feeds = {"input_ids": ids, "seqlens_k": np.array([S - 1], np.int32), "logit_index": np.arange(S),
             "total_sequence_length": np.array([capacity], np.int32), "query_seqlens": np.array([S], np.int32)}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            feeds[i.name] = np.zeros([1, i.shape[1], capacity, i.shape[3]], np.float16 if "16" in i.type else np.float32)
    return sess.run(["logits"], {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})[0]


def _same_graph(built: Path, traced: Path) -> None:
    (wb, ab, iob), (wt, at, iot) = _weights(built), _weights(traced)
    assert iob == iot and set(wb) == set(wt)
    for op in wt:
        b, t = wb[op], wt[op]
        if op == "Reshape":  # qwen3's four per layer come in another order
            b, t = (sorted(x, key=lambda p: (p[0], p[1].tolist())) for x in (b, t))
        assert len(b) == len(t), op
        for (i, x), (j, y) in zip(b, t):
            assert (i, x.shape, x.dtype) == (j, y.shape, y.dtype), op
            if op == "GroupQueryAttention":  # the rotary tables: float64 cosines rounded, torch's float32 ones
                np.testing.assert_allclose(x.astype(np.float64), y, rtol=0, atol=F32_STEP)
            else:
                assert x.tobytes() == y.tobytes(), (op, i)  # weights, int4 blocks, scales, zero points, tables
        assert sorted(ab[op]) == sorted(at[op]), op


@pytest.mark.parametrize("precision", ["fp32", "int4", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_builder_writes_the_traced_pair(hf_families, tmp_path, family, precision):
    target, draft = hf_families[family]
    built = export(target, draft, tmp_path / "built", precision=precision, draft_vocab=200)
    traced = export(target, draft, tmp_path / "traced", precision=precision, draft_vocab=200, trace=True)
    for role in ("target", "draft"):
        b, t = getattr(built, role).__dict__, getattr(traced, role).__dict__
        assert {k: v for k, v in b.items() if k not in ("files", "weights")} == \
               {k: v for k, v in t.items() if k not in ("files", "weights")}
        for kind in ("packed", "mapped", "row"):  # "other": the tracer merges equal norm weights (all ones here)
            assert b["weights"][kind] == t["weights"][kind]
        _same_graph(tmp_path / "built" / role / "model.onnx", tmp_path / "traced" / role / "model.onnx")
        ids = np.random.default_rng(0).integers(3, 300, (1, 12))
        lb, lt = (_prefill_logits(tmp_path / d / role / "model.onnx", ids) for d in ("built", "traced"))
        np.testing.assert_allclose(lb, lt, rtol=0, atol=1e-4 * np.abs(lt).max())  # the rotary tables alone
        assert (lb.argmax(-1) == lt.argmax(-1)).all()
    prompt = [5, 17, 42, 99, 7]
    with specrt.load(tmp_path / "built", threads=1) as pb, specrt.load(tmp_path / "traced", threads=1) as pt:
        for k in (0, 3):
            cfg = dict(max_new_tokens=24, draft_len=k)
            assert pb.run(prompt, pb.config(**cfg)).tokens == pt.run(prompt, pt.config(**cfg)).tokens


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_tensors_read_as_transformers_loads_them(torch_models, tmp_path, arch):
    """Each tensor dequantized by gguf, llama's q and k put back in Hugging Face order as transformers' GGUF
    loading does; row ranges are rows of the whole."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from specrt.export.weights import _gguf_names, open_gguf

    model = torch_models[(arch, "target")]
    hf = write_gguf(tmp_path / "m.gguf", arch, model)
    tensors = open_gguf(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    c = model.config
    processor = LlamaTensorProcessor({"num_attention_heads": c.num_attention_heads,
                                      "num_key_value_heads": c.num_key_value_heads})
    names = _gguf_names(c.num_hidden_layers)
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        if arch == "llama":
            want = processor.process(want, t.name).weights
        got = tensors.rows(names[t.name])
        assert got.dtype == np.float32 and got.tobytes() == want.astype(np.float32).tobytes(), t.name
        np.testing.assert_allclose(got, hf[names[t.name]], rtol=0, atol=0.02)  # Q8_0 of the same rows: order right
        if got.ndim == 2:
            assert tensors.rows(names[t.name], 3, 7).tobytes() == got[3:7].tobytes()


def test_bf16_shards_build_the_traced_pair(hf_tiny, torch_models, tmp_path):
    """A bfloat16 checkpoint in several safetensors files: widened on read as torch widens it."""
    import copy

    import torch

    src = tmp_path / "bf16"
    copy.deepcopy(torch_models[("llama", "target")]).to(torch.bfloat16).save_pretrained(src, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((hf_tiny["llama"][0] / name).read_bytes())
    assert (src / "model.safetensors.index.json").is_file()
    export(src, None, tmp_path / "built", precision="int4")
    export(src, None, tmp_path / "traced", precision="int4", trace=True)
    _same_graph(tmp_path / "built" / "target" / "model.onnx", tmp_path / "traced" / "target" / "model.onnx")


def test_the_builder_needs_no_torch(hf_tiny, tmp_path):
    """An int4 export of a Hugging Face folder in a process where torch cannot be imported; --trace there
    says what it needs."""
    target, draft = hf_tiny["qwen2"]
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` raises ImportError
        "from pathlib import Path\n"
        "from specrt.errors import ExportError\n"
        "from specrt.export.pair import ExportConfig, export_pair\n"
        f"cfg = dict(target={str(target)!r}, draft={str(draft)!r}, precision='int4', max_len=64)\n"
        f"export_pair(ExportConfig(out=Path({str(tmp_path / 'pair')!r}), **cfg), log=lambda s: None)\n"
        "try:\n"
        f"    export_pair(ExportConfig(out=Path({str(tmp_path / 'traced')!r}), trace=True, **cfg), log=lambda s: None)\n"
        "except ExportError as e:\n"
        "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "traces the model with torch, which is not installed" in r.stdout and "specrt[trace]" in r.stdout
    assert read_manifest(tmp_path / "pair").target.quantization["method"] == "MatMulNBits"


def test_what_the_builder_does_not_write_names_trace(hf_tiny, tmp_path):
    target = tmp_path / "yarn"
    target.mkdir()
    for p in hf_tiny["qwen2"][0].iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((target / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 1024}
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="rope type 'yarn'.*--trace exports it through torch"):
        export(target, None, tmp_path / "pair")
    assert not (tmp_path / "pair").exists()
    export(target, None, tmp_path / "pair", trace=True)  # transformers knows yarn


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}])
def test_rope_types_match_transformers(rope):
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specrt.export.builder import Shape, inverse_frequencies

    c = LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                    num_hidden_layers=1, vocab_size=32, rope_parameters={"rope_theta": 500000.0, **rope})
    want, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](c, torch.device("cpu"))
    assert scaling == 1.0
    np.testing.assert_array_equal(inverse_frequencies(Shape.of(c)), want.numpy())


def test_dry_run_prints_the_estimate_and_writes_nothing(hf_tiny, tmp_path):
    from specrt.cli import main

    target, draft = hf_tiny["qwen2"]
    out = tmp_path / "pair"
    r = CliRunner().invoke(main, ["export", "--target", str(target), "--draft", str(draft), "--out", str(out),
                                  "--precision", "int4", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "target: qwen2, 4 layers" in r.stdout and "draft: qwen2, 2 layers" in r.stdout
    assert "written layer by layer, int4): peak memory about" in r.stdout
    assert not out.exists() and not list(tmp_path.glob(".pair.*"))


def test_export_refuses_what_memory_cannot_hold(hf_tiny, tmp_path, monkeypatch):
    from specrt.cli import main

    monkeypatch.setenv("SPECRT_MEM_AVAILABLE_BYTES", str(100 << 20))
    target, draft = hf_tiny["qwen2"]
    r = CliRunner().invoke(main, ["export", "--target", str(target), "--out", str(tmp_path / "pair")])
    assert r.exit_code == 2
    assert re.match(r"Error: not enough memory: exporting needs about \d+\.\d GB", r.stderr)
    assert "(one layer at a time already)" in r.stderr and len(r.stderr.splitlines()) == 1


def test_wide_output_matrices_are_sliced_as_the_traced_export_slices_them(hf_tiny, tmp_path, monkeypatch):
    """An int4 CPU graph cuts a MatMulNBits wider than SLICE_ROWS into slices joined by a Concat (here 128 rows,
    so the tiny models' output matrices and gate/up matmuls are cut): the same slices, the same bytes."""
    from specrt.export import pair, traced

    monkeypatch.setattr(pair, "SLICE_ROWS", 128)
    monkeypatch.setattr(traced.slice_wide_matmuls, "__defaults__", (128,))
    target = hf_tiny["qwen2"][0]
    export(target, None, tmp_path / "built", precision="int4")
    export(target, None, tmp_path / "traced", precision="int4", trace=True)
    built = tmp_path / "built" / "target" / "model.onnx"
    weights, _, _ = _weights(built)
    assert len(weights["Concat"]) == 0 and len(_weights(built)[1]["Concat"]) == 4 + 1  # gate/up per layer, output
    _same_graph(built, tmp_path / "traced" / "target" / "model.onnx")
