"""The GPU path on a real CUDA device (onnxruntime's CUDA provider). Skipped, with the reason, where
onnxruntime has no CUDA provider or no GPU is visible; bench/gpu/check.sh runs these on a GPU machine.

What they establish: logits on the GPU match the CPU's for the same graph (lean fp16, lean int4 with fp16
activations, portable fp32); captured CUDA graphs replay what uncaptured passes compute; greedy
speculative decoding on the GPU equals greedy target-only there; batched decoding runs on the GPU; the
caches live in GPU memory and no pass copies a cache-sized tensor (onnxruntime's profile lists every
copy node)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specrt.engines.ort import _cuda_provider, _preload_cuda_libraries, cuda_available, ort_engine, session_options

WHY = cuda_available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no CUDA: {WHY}")


@pytest.fixture(scope="module")
def int4_fp16_dir(work, hf_tiny):
    from _helpers import export

    export(*hf_tiny["qwen2"], work / "pair-int4-fp16-gpu", precision="int4", activations="fp16", accuracy_level=0)
    return work / "pair-int4-fp16-gpu"


def _engines(pair_dir, role="target", max_logits=64, **kw):
    from specrt.manifest import read_manifest

    m = read_manifest(pair_dir)
    entry = getattr(m, role)
    return (ort_engine(pair_dir, entry, m.max_len, max_logits, device="cpu", threads=1),
            ort_engine(pair_dir, entry, m.max_len, max_logits, device="cuda", **kw))


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 320, size=n).astype(np.int64)


def _calls(eng, ids):
    """Prefill 24, a 4-token verify, a rollback of 3, then single steps and 3-token verifies: the logits seen."""
    rows = [eng.forward(ids[None, :24], np.arange(24))[0].copy(),
            eng.forward(ids[None, 24:28], np.arange(4))[0].copy()]
    eng.truncate(25)
    rows += [eng.forward(ids[None, i:i + 1], np.array([0]))[0].copy() for i in range(25, 40)]
    for i in range(40, 52, 3):
        rows.append(eng.forward(ids[None, i:i + 3], np.arange(3))[0].copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("which,atol", [("portable", 2e-3), ("fp16", 0.1), ("int4_fp16", 0.1)])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_cuda_logits_match_cpu(request, which, atol, role):
    cpu, gpu = _engines(request.getfixturevalue(f"{which}_dir"), role)
    ids = _ids(52, seed=3)
    want, got = _calls(cpu, ids), _calls(gpu, ids)
    np.testing.assert_allclose(got, want, atol=atol * max(np.abs(want).max(), 1.0), rtol=0)
    assert gpu.keys[0].device_name().lower() == "cuda"


@pytest.mark.parametrize("which", ["fp16", "int4_fp16"])
def test_captured_cuda_graphs_replay_the_uncaptured_passes(request, which):
    """The lean graph's passes are captured per shape and replayed: the same logits as without capture, and
    the captured shapes are the ones decoding uses (one-token steps, verify widths)."""
    d = request.getfixturevalue(f"{which}_dir")
    _, plain = _engines(d, cuda_graph=False)
    _, captured = _engines(d)
    assert captured.captures and captured.note is None, captured.note
    ids = _ids(52, seed=4)
    for _ in range(2):  # the second round replays every graph the first captured
        a, b = _calls(plain, ids), _calls(captured, ids)
        plain.truncate(0), captured.truncate(0)
        np.testing.assert_allclose(b, a, atol=1e-2 * max(np.abs(a).max(), 1.0), rtol=0)
    assert {(1, 1, 1), (1, 3, 3), (1, 4, 4)} <= set(captured._graphs.ids)


@pytest.mark.parametrize("which", ["portable", "fp16", "int4_fp16"])
def test_greedy_speculative_equals_target_only_on_cuda(request, which):
    """Token for token, except at a numerical near-tie: the GPU's one-token and multi-token passes use
    different kernels, so their logits differ in the last bits (first H200 run, with TF32 on: one flip,
    at the 40th token of one prompt, in both the fp32 and the fp16 pair). `specrt check` applies the
    same rule (apps/check.py)."""
    import specrt
    from specrt.apps.check import first_divergence, noise_threshold

    with specrt.load(request.getfixturevalue(f"{which}_dir"), device="cuda") as pair:
        assert pair.device == "cuda"
        threshold, _ = noise_threshold(pair.manifest.target)
        equal = 0
        for prompt in ("def quicksort(xs):", "class Stack:\n    def push(self, x):", "import numpy as np\n"):
            ids = pair.encode(prompt)
            for k in (1, 2, 4):
                r = first_divergence(pair, ids, 40, k)
                assert r["equal"] or abs(r["margin"]) < threshold, (prompt, k, r["index"], r["margin"])
                equal += r["equal"]
        assert equal >= 6, f"only {equal} of 9 runs equal token for token"
        res = pair.generate("def quicksort(xs):", max_new_tokens=40, draft_len="auto")
        assert res.stats["accepted"] > 0  # the layer-skip draft agrees often: drafts were really verified


def test_batch_on_cuda(fp16_dir):
    """Batched speculative decoding on the GPU: per-row lengths through the same graph; each request gets
    its lone output (up to fp16 near-ties between batch shapes), and passes are shared."""
    import specrt
    from specrt.api.pair import generate_batch

    prompts = ["def quicksort(xs):", "class Stack:", "import numpy as np\n", "x", "The quick brown"]
    with specrt.load(fp16_dir, device="cuda") as pair:
        tot = {}
        got = generate_batch(pair, prompts, batch_size=3, max_new_tokens=24, draft_len=2, totals=tot)
        alone = [pair.generate(p, max_new_tokens=24, draft_len=2, draft_window=0) for p in prompts]
        same = sum(g.tokens == a.tokens for g, a in zip(got, alone))
        assert same >= 4, f"{same} of {len(prompts)} equal"
        assert all(len(g.tokens) == len(a.tokens) or g.finish_reason == "eos" for g, a in zip(got, alone))
        assert tot["target_passes"] < sum(a.stats["target_passes"] for a in alone)


def test_fp32_lean_graph_is_refused_on_cuda(qwen_dir):
    import specrt
    from specrt.errors import PairError

    with pytest.raises(PairError, match="fp32 activations.*--precision fp16"):
        specrt.load(qwen_dir, device="cuda")


@pytest.mark.parametrize("which", ["fp16", "portable"])
def test_no_cache_sized_copy_per_pass(request, which, tmp_path):
    """Profile a prefill, 20 steps and 3-token verifies: every copy onnxruntime made between host and device
    is listed with its size; none is as large as one token's K/V of one layer, and every op that touches
    weights or caches ran on the GPU."""
    import onnxruntime as ort

    from specrt.manifest import read_manifest

    d = request.getfixturevalue(f"{which}_dir")
    m = read_manifest(d)
    so = session_options()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    _preload_cuda_libraries()
    sess = ort.InferenceSession(str(d / m.target.path), so,
                                providers=[_cuda_provider(0, m.target.dtype), "CPUExecutionProvider"])
    eng = ort_engine(d, m.target, m.max_len, 8, session=sess, device="cuda", cuda_graph=False)
    ids = _ids(80, seed=5)
    eng.forward(ids[None, :40], np.array([39]))
    for i in range(40, 60):
        eng.forward(ids[None, i:i + 1], np.array([0]))
    for i in range(60, 78, 3):
        eng.forward(ids[None, i:i + 3], np.arange(3))
    trace = json.load(open(sess.end_profiling()))
    nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert nodes, "the profile recorded no node"
    copies = [e for e in nodes if e["args"].get("op_name") in ("MemcpyToHost", "MemcpyFromHost")]
    kv_step = m.target.num_kv_heads * m.target.head_dim * np.dtype(m.target.dtype).itemsize
    big = [(e["name"], e["args"].get("output_size")) for e in copies if int(e["args"].get("output_size", 0)) >= kv_step]
    assert not big, f"copies of KV size: {big[:5]}"
    heavy = {"MatMul", "MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization", "Softmax", "Concat"}
    ran = [e for e in nodes if e["args"].get("op_name") in heavy]
    off = sorted({e["args"].get("op_name") for e in ran if e["args"].get("provider") != "CUDAExecutionProvider"})
    assert ran and not off, f"ops that touch weights or caches ran off the GPU: {off}"
