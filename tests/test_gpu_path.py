"""The parts of the GPU path a CPU can check: the fp16 and int4-fp16 lean graphs, the portable graph,
device selection and its errors, the GPU memory check, KV offsets, and TensorRT's profiles, chunking,
metadata checks, operator support, alignment and build calls (against a stand-in module: TensorRT itself
is not installed here, see engines/trt.py)."""
from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specrt
from _helpers import export
from specrt.cli import main
from specrt.engines import trt
from specrt.engines.ort import kv_offset
from specrt.errors import ConfigError, ExportError, PairError
from specrt.export import trt_build
from specrt.export.pair import ExportConfig
from specrt.manifest import read_manifest


def _onnx_domains(path):
    import onnx

    return {n.domain for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_portable_graph_has_only_standard_ops_and_matches_the_default_graph(portable_dir, qwen_dir):
    m = specrt.load(portable_dir, device="cpu").manifest
    assert m.target.portable and m.draft.portable
    assert _onnx_domains(portable_dir / m.target.path) <= {"", "ai.onnx"}
    assert "com.microsoft" in _onnx_domains(qwen_dir / m.target.path)
    ids = np.random.default_rng(0).integers(3, 320, size=30)
    with specrt.load(portable_dir, device="cpu") as a, specrt.load(qwen_dir, device="cpu") as b:
        for pair in (a, b):
            pair.target.forward(ids[None, :20], np.array([19]))
        for i in range(20, 30):  # verify-style and single steps through the cache
            la = a.target.forward(ids[None, i:i + 1], np.array([0]))
            lb = b.target.forward(ids[None, i:i + 1], np.array([0]))
            np.testing.assert_allclose(la, lb, atol=1e-4, rtol=1e-4)
        for prompt in ("def fib(n):", "class Stack:"):
            assert a.generate(prompt, max_new_tokens=24, draft_len=3).tokens == \
                b.generate(prompt, max_new_tokens=24, draft_len=0).tokens


def test_fp16_pair(fp16_dir, portable_dir):
    """fp16 weights and caches in the lean graph; on the CPU too, greedy speculative == greedy target-only."""
    import onnx

    with specrt.load(fp16_dir, device="cpu") as pair:
        m = pair.manifest
        assert m.target.precision == "fp16" and m.target.dtype == "float16" and m.target.graph == "lean"
        assert m.for_gpu and not m.portable
        assert m.target.inputs["past_key.0"]["dtype"] == "float16"
        assert m.target.outputs["logits"]["dtype"] == "float32"
        g = onnx.load(str(fp16_dir / m.target.path))
        big = [t for t in g.graph.initializer if np.prod(t.dims) >= 1024]
        assert big and all(t.data_type == onnx.TensorProto.FLOAT16 for t in big)
        assert pair.target.keys[0].dtype == np.float16
        assert pair.memory.weights["target"] < 0.6 * specrt.load(portable_dir, device="cpu").memory.weights["target"]
        for prompt in ("def quicksort(xs):", "import numpy as np\n"):
            want = pair.generate(prompt, max_new_tokens=32, draft_len=0).tokens
            for k in (1, 3, "auto"):
                assert pair.generate(prompt, max_new_tokens=32, draft_len=k).tokens == want


def _no_cuda(monkeypatch):
    import specrt.engines.ort as ort_mod

    monkeypatch.setattr(ort_mod, "cuda_available", lambda: "no CUDA device is visible (test)")


def test_device_selection_without_cuda(fp16_dir, qwen_dir, monkeypatch):
    _no_cuda(monkeypatch)
    with pytest.raises(PairError, match=r"cannot run on cuda: no CUDA device is visible"):
        specrt.load(fp16_dir, device="cuda")
    with specrt.load(fp16_dir) as pair:  # auto: a GPU pair stays on the CPU, with a note
        assert pair.device == "cpu" and "made for a GPU" in pair.device_note
    with specrt.load(qwen_dir) as pair:  # a CPU pair on auto: nothing to note
        assert pair.device == "cpu" and pair.device_note is None
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        specrt.load(qwen_dir, device="gpu")
    with pytest.raises(PairError, match="has no TensorRT engines; build them"):
        specrt.load(fp16_dir, device="tensorrt")


def test_cli_device_note_and_errors(fp16_dir, monkeypatch):
    _no_cuda(monkeypatch)
    r = CliRunner().invoke(main, ["generate", str(fp16_dir), "--prompt", "def f(x):", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert "note: running on the CPU: this pair is made for a GPU" in r.stderr
    r = CliRunner().invoke(main, ["generate", str(fp16_dir), "--prompt", "x", "--device", "cuda"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "cannot run on cuda" in r.stderr


def test_cuda_refuses_a_cpu_pair_and_checks_gpu_memory(qwen_dir, fp16_dir, monkeypatch):
    import specrt.engines.ort as ort_mod

    monkeypatch.setattr(ort_mod, "cuda_available", lambda: None)  # pretend a GPU is there
    with pytest.raises(PairError, match="exported for the CPU .*--precision fp16"):
        specrt.load(qwen_dir, device="cuda")
    monkeypatch.setenv("SPECRT_GPU_MEM_AVAILABLE_BYTES", str(1 << 20))
    with pytest.raises(PairError, match=r"not enough GPU memory on cuda:0 to load .* needs about .*1\.0 MB are available"):
        specrt.load(fp16_dir, device="cuda")


def test_int4_with_fp16_activations(work, hf_tiny):
    """int4 weights with fp16 activations and caches (edge GPUs): made for a GPU, and on the CPU too greedy
    speculative == greedy target-only."""
    d = work / "pair-int4-fp16"
    export(*hf_tiny["qwen2"], d, precision="int4", activations="fp16", accuracy_level=0)
    with specrt.load(d, device="cpu") as pair:
        m = pair.manifest
        assert (m.target.precision, m.target.dtype, m.target.graph) == ("int4", "float16", "lean") and m.for_gpu
        assert pair.target.keys[0].dtype == np.float16
        for prompt in ("def quicksort(xs):", "class Stack:"):
            want = pair.generate(prompt, max_new_tokens=32, draft_len=0).tokens
            assert pair.generate(prompt, max_new_tokens=32, draft_len=3).tokens == want
    with pytest.raises(ExportError, match="--activations fp16 does not go with --precision fp32"):
        ExportConfig(target="a", draft=None, out=Path("b"), activations="fp16")


def test_batch_needs_the_lean_graph(portable_dir):
    
    from specrt.engines.select import batch_engine

    with specrt.load(portable_dir, device="cpu") as pair:
        with pytest.raises(ConfigError, match="batched decoding runs on the lean onnxruntime graph, and this pair "
                                              "has standard-op .* re-export"):
            batch_engine(pair.dir, pair.target, 64, 1, 2)
        with pytest.raises(ConfigError, match="lean onnxruntime graph"):
            pair.runner(2)
    base = types.SimpleNamespace(device="tensorrt", entry=types.SimpleNamespace(graph="portable"))
    with pytest.raises(ConfigError, match="TensorRT engines run one sequence"):
        batch_engine(portable_dir, base, 64, 1, 2)


def test_kv_offset_is_where_the_delta_engine_writes(portable_dir):
    qwen_pair = specrt.load(portable_dir, device="cpu")
    e = qwen_pair.target
    ids = np.arange(3, 13)[None]
    e.truncate(0)
    e.forward(ids, np.array([9]))
    entry = e.entry
    off = kv_offset(7, 1, entry.num_kv_heads, entry.head_dim, 4)
    assert e.keys[0][7:].ctypes.data == e.keys[0].ctypes.data + off
    assert kv_offset(0, 4, 2, 64, 2) == 0 and kv_offset(5, 4, 2, 64, 2) == 5 * 4 * 2 * 64 * 2
    qwen_pair.close()


# --- TensorRT: profiles, chunking, metadata, build calls -------------------------------------------------

def test_trt_profiles_cover_prefill_verify_and_step(portable_dir):
    m = read_manifest(portable_dir)
    tp = trt.profiles(m.target, "target", m.max_len, m.max_draft_len, 64)
    dp = trt.profiles(m.draft, "draft", m.max_len, m.max_draft_len, 64)
    assert [p["name"] for p in tp] == ["verify", "prefill"] and [p["name"] for p in dp] == ["step", "prefill"]
    verify, prefill = tp
    assert verify["seq"] == [1, m.max_draft_len + 1, m.max_draft_len + 1] and prefill["seq"] == [1, 64, 64]
    for p, entry in [(p, m.target) for p in tp] + [(p, m.draft) for p in dp]:
        assert set(p["shapes"]) == set(entry.inputs)  # every input has a range in every profile
        for name, (lo, opt, hi) in p["shapes"].items():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (p["name"], name)
        lo, opt, hi = p["shapes"]["past_key.0"]
        assert lo[0] == 0 and hi[0] == m.max_len - 1 and hi[2:] == [entry.num_kv_heads, entry.head_dim]
        assert p["shapes"]["attention_mask"][2] == [1, m.max_len]
        assert p["shapes"]["input_ids"][2] == [1, p["seq"][2]]
    assert dp[0]["seq"] == [1, 1, 2]  # one-token steps, and the two-token catch-up
    assert trt.pick_profile(tp, 1) == 0 and trt.pick_profile(tp, m.max_draft_len + 1) == 0
    assert trt.pick_profile(tp, m.max_draft_len + 2) == 1 and trt.pick_profile(tp, 65) == -1
    assert trt.pick_profile(dp, 2) == 0 and trt.pick_profile(dp, 3) == 1


def test_trt_prompt_chunks():
    chunks = trt.plan_chunks(600, np.array([0, 255, 256, 599]), 256)
    assert [(a, b) for a, b, _, _ in chunks] == [(0, 256), (256, 512), (512, 600)]
    assert [c[2].tolist() for c in chunks] == [[0, 255], [0], [87]]
    assert [c[3].tolist() for c in chunks] == [[0, 1], [2], [3]]
    assert len(trt.plan_chunks(5, np.array([4]), 256)) == 1
    with pytest.raises(ValueError):
        trt.plan_chunks(10, np.array([10]), 4)


def test_trt_engine_metadata_is_checked():
    meta = {"tensorrt_version": "10.13.0", "compute_capability": "8.7"}
    trt.check_engine_meta(meta, "10.13.0", "8.7", "p")
    with pytest.raises(PairError, match=r"built with TensorRT 10.13.0, this machine has 11.4.1 .*specrt build-engines p"):
        trt.check_engine_meta(meta, "11.4.1", "8.7", "p")
    with pytest.raises(PairError, match=r"compute capability 8.7, this GPU is 9.0; rebuild"):
        trt.check_engine_meta(meta, "10.13.0", "9.0", "p")
    with pytest.raises(PairError, match="has no TensorRT engines"):
        trt.check_engine_meta(None, "10.13.0", "9.0", "p")


def test_trt_missing_is_a_clear_error(hf_tiny, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_trt(name, *a, **kw):
        if name == "tensorrt":
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_trt)
    r = CliRunner().invoke(main, ["export", "--target", str(hf_tiny["qwen2"][0]), "--out", str(tmp_path / "p"),
                                  "--precision", "fp16", "--engine", "tensorrt"])
    assert r.exit_code == 2 and "TensorRT is not installed here" in r.stderr
    assert not (tmp_path / "p").exists()
    r = CliRunner().invoke(main, ["export", "--target", str(hf_tiny["qwen2"][0]), "--out", str(tmp_path / "q"),
                                  "--precision", "int4", "--engine", "tensorrt"])
    assert r.exit_code == 2 and "use --precision fp16" in r.stderr


class _FakeTrt:
    """Records what build_engine asks of TensorRT (the 10.x/11.x Python API names)."""
    __version__ = "10.99.0"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class NetworkDefinitionCreationFlag:
        STRONGLY_TYPED = 1

    class MemoryPoolType:
        WORKSPACE = 0

    def __init__(self):
        self.calls = []
        fake = self

        class Net:
            names: list = []

            @property
            def num_inputs(self):
                return len(self.names)

            def get_input(self, i):
                return types.SimpleNamespace(name=self.names[i])

        class Parser:
            num_errors = 0

            def __init__(self, net, logger):
                self.net = net

            def parse_from_file(self, path):  # the network's inputs are the graph's
                import onnx

                fake.calls.append(("parse", Path(path).name))
                self.net.names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
                return True

        class Profile:
            def __init__(self):
                self.shapes = {}

            def set_shape(self, name, lo, opt, hi):
                self.shapes[name] = (lo, opt, hi)

        class Config:
            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("workspace", size))

            def create_timing_cache(self, blob):
                return blob

            def set_timing_cache(self, cache, ignore_mismatch):
                pass

            def add_optimization_profile(self, p):
                fake.calls.append(("profile", p.shapes))

            def get_timing_cache(self):
                return types.SimpleNamespace(serialize=lambda: b"cache")

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls.append(("flags", flags))
                return Net()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, net, cfg):
                return b"plan"

        self.Builder, self.OnnxParser = Builder, Parser


def test_trt_build_sets_every_input_of_every_profile(trt_dir, tmp_path):
    m = read_manifest(trt_dir)
    fake = _FakeTrt()
    profs = trt.profiles(m.target, "target", m.max_len, m.max_draft_len, 32)
    trt_build.build_engine(fake, trt_dir / m.target.path, profs, tmp_path / "t.plan", tmp_path / "timing.cache", 1 << 30)
    assert ("flags", 1 << 1) in fake.calls  # strongly typed: precision comes from the fp16 graph
    added = [c[1] for c in fake.calls if c[0] == "profile"]
    assert len(added) == 2 and all(set(a) == set(m.target.inputs) for a in added)
    assert added[0]["input_ids"] == ((1, 1), (1, m.max_draft_len + 1), (1, m.max_draft_len + 1))
    assert (tmp_path / "t.plan").read_bytes() == b"plan" and (tmp_path / "timing.cache").read_bytes() == b"cache"


def test_build_engines_refuses_a_contrib_graph(qwen_dir, monkeypatch):
    monkeypatch.setattr(trt, "require_tensorrt", lambda error=ExportError: _FakeTrt())
    m = specrt.load(qwen_dir, device="cpu").manifest
    with pytest.raises(ExportError, match="contrib ops, which TensorRT cannot parse"):
        trt_build.build_pair_engines(qwen_dir, m)


def test_manifest_without_engines_still_reads(qwen_dir):
    raw = json.loads((qwen_dir / "manifest.json").read_text())
    assert raw["engines"] is None and raw["target"]["graph"] == "lean" and "portable" not in raw["target"]


def test_manifest_of_an_older_specrt_still_loads(qwen_dir, portable_dir, tmp_path):
    """Manifests written before the lean graph said `portable` and had no `graph`: they read as the delta
    graphs they were (and load through the delta engine)."""
    from _helpers import copy_pair

    d = copy_pair(portable_dir, tmp_path / "old")
    raw = json.loads((d / "manifest.json").read_text())
    for role in ("target", "draft"):
        raw[role].pop("graph")
        raw[role]["portable"] = True
    (d / "manifest.json").write_text(json.dumps(raw))
    m = read_manifest(d)
    assert m.target.graph == "portable" and m.portable and m.target.kv_names(0)[2] == "new_key.0"
    with specrt.load(d, device="cpu") as old, specrt.load(portable_dir, device="cpu") as new:
        assert old.generate("def f(x):", max_new_tokens=8).tokens == new.generate("def f(x):", max_new_tokens=8).tokens
    raw["target"]["portable"] = raw["draft"]["portable"] = False
    (d / "manifest.json").write_text(json.dumps(raw))
    assert read_manifest(d).target.graph == "contrib"


def test_trt_parser_support_check(portable_dir, trt_dir, qwen_dir, tmp_path):
    """A static check of a graph against TensorRT's ONNX parser table: the portable graphs pass (fp32 and
    fp16); the lean graph's contrib ops and an int64 CumSum are reported."""
    import onnx
    from onnx import TensorProto, helper

    for d in (portable_dir, trt_dir):
        m = read_manifest(d)
        for e in m.entries():
            assert trt_build.check_parser_support(d / e.path) == [], (d, e.path)
    lean = trt_build.check_parser_support(qwen_dir / read_manifest(qwen_dir).target.path)
    assert any("GroupQueryAttention (com.microsoft) is not an ONNX operator" in p for p in lean)
    g = helper.make_graph([helper.make_node("CumSum", ["x", "axis"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
                          [helper.make_tensor("axis", TensorProto.INT64, [], [0])])
    onnx.save(helper.make_model(g), str(tmp_path / "cumsum.onnx"))
    assert trt_build.check_parser_support(tmp_path / "cumsum.onnx") == ["CumSum on INT32 (x): the parser takes FP32, FP16"]


def test_trt_needs_256_byte_slots(fp16_portable_dir, trt_dir, monkeypatch):
    """New K/V are bound at slot offsets: TensorRT needs them 256-byte aligned. The tiny fp16 pair's slot is
    64 bytes (2 KV heads x 16 x 2): refused with the numbers, at build and at load."""
    m = read_manifest(fp16_portable_dir)
    with pytest.raises(PairError, match=r"KV slot is 64 bytes \(2 KV heads x head_dim 16 x 2\), not a multiple of "
                                        r"the 256 bytes TensorRT needs .*--device cuda"):
        trt.check_alignment(m.target, "target")
    monkeypatch.setattr(trt, "require_tensorrt", lambda error=ExportError: _FakeTrt())
    with pytest.raises(ExportError, match="not a multiple of the 256 bytes"):
        trt_build.build_pair_engines(fp16_portable_dir, m)
    trt.check_alignment(read_manifest(trt_dir).target, "target")  # 2 x 64 x 2 = 256


def test_auto_falls_back_to_cuda_when_the_engines_do_not_load(trt_dir, monkeypatch):
    """--device auto on a pair with TensorRT engines that do not load here: onnxruntime's CUDA provider runs
    its graphs, with a note saying why (onnxruntime's CPU provider stands in for the GPU here)."""
    import sys

    import specrt.api.pair as pair_mod
    import specrt.engines.ort as ort_mod
    from specrt.engines import select

    m = read_manifest(trt_dir)
    monkeypatch.setattr(pair_mod, "read_manifest", lambda d: dataclasses.replace(m, engines={"tensorrt_version": "x"}))
    monkeypatch.setattr(ort_mod, "cuda_available", lambda: None)
    monkeypatch.setitem(sys.modules, "tensorrt", _FakeTrt())
    real = select.open_engine

    def engine(pair_dir, m, role, max_logits, threads, device):
        if device == "tensorrt":
            raise PairError("the TensorRT engines in p were built with TensorRT x (stand-in)")
        return real(pair_dir, m, role, max_logits, threads, "cpu")

    monkeypatch.setattr(select, "open_engine", engine)
    monkeypatch.setenv("SPECRT_GPU_MEM_AVAILABLE_BYTES", str(1 << 40))
    with specrt.load(trt_dir) as pair:
        assert pair.device == "cuda"
        assert pair.notes == ["TensorRT engines not used: the TensorRT engines in p were built with TensorRT x "
                              "(stand-in); running on onnxruntime's CUDA provider"]
        assert pair.generate("def f(x):", max_new_tokens=4).tokens
    with pytest.raises(PairError, match="built with TensorRT x"):  # asked for by name: no fallback
        specrt.load(trt_dir, device="tensorrt")


def test_build_engines_command_writes_plans_and_manifest(trt_dir, tmp_path, monkeypatch):
    import sys

    from _helpers import copy_pair

    pair_dir = copy_pair(trt_dir, tmp_path / "p")
    monkeypatch.setitem(sys.modules, "tensorrt", _FakeTrt())
    monkeypatch.setattr(trt, "gpu_identity", lambda device_id=0: ("8.7", "Orin (stand-in)"))
    r = CliRunner().invoke(main, ["build-engines", str(pair_dir), "--prefill-chunk", "64"])
    assert r.exit_code == 0, r.output
    meta = json.loads((pair_dir / "manifest.json").read_text())["engines"]
    assert meta["tensorrt_version"] == "10.99.0" and meta["compute_capability"] == "8.7"
    for role in ("target", "draft"):
        assert (pair_dir / meta[role]["plan"]).read_bytes() == b"plan"
        assert [p["name"] for p in meta[role]["profiles"]] == (["verify", "prefill"] if role == "target" else ["step", "prefill"])
    assert (pair_dir / "timing.cache").is_file()
    with specrt.load(pair_dir, device="cpu") as pair:  # the graphs still run on onnxruntime
        assert pair.generate("def f(x):", max_new_tokens=4).tokens
    r = CliRunner().invoke(main, ["build-engines", str(pair_dir), "--prefill-chunk", "0"])
    assert r.exit_code == 2 and "--prefill-chunk must be >= 1" in r.stderr
    try:
        import cuda  # noqa: F401
    except ImportError:  # the runtime engine needs cuda-python: a clear error, not a traceback
        r = CliRunner().invoke(main, ["generate", str(pair_dir), "--prompt", "x", "--device", "tensorrt"])
        assert r.exit_code == 2 and "cuda-python is not installed" in r.stderr
