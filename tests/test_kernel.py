"""specrt's int4 matmul (specrt/engines/kernels, docs/kernel.md): every path against the reference arithmetic,
bit for bit; rows independent of the call around them; the custom operator against onnxruntime's MatMulNBits;
the swap at load and what stays onnxruntime's; the Arm path under qemu-user; the build without a compiler."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specrt.engines import int4

from _helpers import KERNELS_RUN

ROOT = Path(__file__).resolve().parent.parent
built = pytest.mark.skipif(int4.library() is None, reason=f"the kernel library is not built: {int4.unavailable()}")
X86_PATHS = {"avx2": {"avx2", "fma"}, "avxvnni": {"avx2", "fma", "avx_vnni"}, "avx512": {"avx512f", "avx512bw"},
             "avx512vnni": {"avx512f", "avx512bw", "avx512_vnni"},
             "avx512amx": {"avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"}}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.split(":", 1)[-1].split())


def weights(rng, K: int, N: int, bs: int, zero_points: bool = True, bias: bool = False):
    """MatMulNBits' inputs for random 4-bit weights: B [N, nblk, bs/2], scales [N, nblk], zero points, bias."""
    nblk = -(-K // bs)
    B = rng.integers(0, 256, (N, nblk, bs // 2), dtype=np.uint8)
    scales = rng.uniform(1e-3, 0.05, (N, nblk)).astype(np.float32)
    zp = rng.integers(0, 256, (N, (nblk + 1) // 2), dtype=np.uint8) if zero_points else None
    b = rng.uniform(-2, 2, N).astype(np.float32) if bias else None
    return B, scales, zp, b


def _ptr(a):
    return None if a is None else a.ctypes.data


class Packed:
    def __init__(self, B, scales, zp, bias, K, N, bs, gated: bool = False):
        self.keep = (B, scales, zp, bias)
        self.K, self.N = K, N // 2 if gated else N
        lib = int4._lib()
        self.handle = (lib.specrt_int4_pack_gated(_ptr(B), _ptr(scales), _ptr(zp), K, N, bs) if gated else
                       lib.specrt_int4_pack(_ptr(B), _ptr(scales), _ptr(zp), _ptr(bias), K, N, bs))
        assert self.handle

    def __call__(self, A, path: str) -> np.ndarray:
        A = np.ascontiguousarray(A, np.float32)
        Y = np.full((len(A), self.N), np.nan, np.float32)
        rc = int4._lib().specrt_int4_matmul(self.handle, A.ctypes.data, len(A), Y.ctypes.data, path.encode(), 0, 0)
        assert rc == 0, f"path {path} cannot run here"
        return Y

    def __del__(self):
        int4._lib().specrt_int4_free(self.handle)


def reference(B, scales, zp, bias, K, N, bs, A) -> np.ndarray:
    A = np.ascontiguousarray(A, np.float32)
    Y = np.empty((len(A), N), np.float32)
    int4._lib().specrt_int4_reference(_ptr(B), _ptr(scales), _ptr(zp), _ptr(bias), K, N, bs, A.ctypes.data, len(A),
                                      Y.ctypes.data)
    return Y


def dequantized(B, scales, zp, bias, K, N, bs, A) -> np.ndarray:
    """The same quantities in float64 by other means: activations quantized per block as int4.h says, weights
    (q - zp) * scale; only the order of the sums differs from the kernel's."""
    nblk = B.shape[1]
    q = np.stack([B & 15, B >> 4], -1).reshape(N, nblk * bs)[:, :K].astype(np.float64)
    z = np.full((N, nblk), 8.0) if zp is None else np.stack([zp & 15, zp >> 4], -1).reshape(N, -1)[:, :nblk]
    W = (q - np.repeat(z, bs, 1)[:, :K]) * np.repeat(scales.astype(np.float64), bs, 1)[:, :K]
    Ap = np.zeros((len(A), nblk * bs), np.float32)
    Ap[:, :K] = A
    blocks = Ap.reshape(len(A), nblk, bs)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qa = np.clip(np.rint(blocks * inv), -127, 127)
    Aq = (qa * (amax / np.float32(127)).astype(np.float32)).reshape(len(A), -1)[:, :K].astype(np.float64)
    return Aq @ W.T + (0 if bias is None else bias)


def all_x86_paths():
    return list(X86_PATHS) if platform.machine() in ("x86_64", "AMD64") else []


@built
def test_every_path_the_cpu_has_is_offered():
    usable = int4.paths()
    assert usable[-1] == "scalar"
    flags = cpu_flags()
    for name, need in X86_PATHS.items():
        if platform.machine() == "x86_64" and need <= flags:
            assert name in usable, f"this CPU has {sorted(need)} but the library offers {usable}"
    if "asimddp" in flags:
        assert "neon-dotprod" in usable
    if {"asimddp", "i8mm"} <= flags:
        assert "neon-i8mm" in usable
    assert int4.unavailable() is None or not [p for p in usable if p != "scalar"]


@built
def test_the_reference_computes_the_quantized_matmul():
    rng = np.random.default_rng(0)
    for K, N, bs, zp, bias in ((300, 37, 32, True, False), (512, 64, 128, False, True), (1000, 5, 256, True, True)):
        B, s, z, b = weights(rng, K, N, bs, zp, bias)
        A = rng.standard_normal((7, K)).astype(np.float32) * 3
        got = reference(B, s, z, b, K, N, bs, A)
        want = dequantized(B, s, z, b, K, N, bs, A)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


SHAPES = [(300, 37, 32), (1536, 64, 128), (1000, 61, 64), (512, 33, 256), (128, 16, 128)]
ROWS = list(range(1, 17)) + [64, 70, 128]


@built
@pytest.mark.parametrize("path", ["scalar"] + all_x86_paths() + ["neon-dotprod", "neon-i8mm"])
def test_each_path_gives_the_reference_bits_and_rows_that_ignore_their_call(path):
    if path not in int4.paths():
        pytest.skip(f"path {path} is not on this CPU ({platform.machine()}; here: {', '.join(int4.paths())})")
    rng = np.random.default_rng(1)
    for i, (K, N, bs) in enumerate(SHAPES):
        B, s, z, b = weights(rng, K, N, bs, zero_points=i % 2 == 0, bias=i % 3 == 0)
        w = Packed(B, s, z, b, K, N, bs)
        A = rng.standard_normal((max(ROWS), K)).astype(np.float32) * rng.uniform(0.1, 10, (max(ROWS), 1)).astype(np.float32)
        want = reference(B, s, z, b, K, N, bs, A)
        for M in ROWS:
            np.testing.assert_array_equal(w(A[:M], path), want[:M], err_msg=f"K={K} N={N} bs={bs} M={M}")
        # any row, at any place in a call of any size: its own bits
        order = rng.permutation(13)
        np.testing.assert_array_equal(w(A[order], path), want[order])
        for r in (0, 5, 12):
            np.testing.assert_array_equal(w(A[r:r + 1], path)[0], want[r])


@built
def test_odd_activations():
    """Zero blocks, inf and NaN: a zero row gives the bias; inf or NaN in a row make that row NaN."""
    rng = np.random.default_rng(2)
    K, N, bs = 256, 20, 128
    B, s, z, b = weights(rng, K, N, bs, bias=True)
    w = Packed(B, s, z, b, K, N, bs)
    A = rng.standard_normal((4, K)).astype(np.float32)
    A[0] = 0
    A[1, :128] = 0  # one zero block
    A[2, 7] = np.inf
    A[3, 200] = np.nan
    for path in int4.paths():
        Y = w(A, path)
        np.testing.assert_array_equal(Y[0], b)
        assert np.isfinite(Y[1]).all() and np.isnan(Y[2]).all() and np.isnan(Y[3]).all()
        np.testing.assert_array_equal(Y[1], reference(B, s, z, b, K, N, bs, A[1:2])[0])


def silu_times(Y: np.ndarray) -> np.ndarray:
    """A gated MLP's activation of a matmul's output, in float64: silu(first half) * second half."""
    g, u = np.split(Y.astype(np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


@built
def test_a_gated_weight_gives_silu_of_its_gate_times_its_up_with_the_same_bits_on_every_path():
    rng = np.random.default_rng(11)
    for K, N, bs in ((300, 96, 32), (1536, 256, 128)):
        B, s, z, _ = weights(rng, K, N, bs)
        w = Packed(B, s, z, None, K, N, bs, gated=True)
        A = rng.standard_normal((13, K)).astype(np.float32) * rng.uniform(0.1, 10, (13, 1)).astype(np.float32)
        want = silu_times(reference(B, s, z, None, K, N, bs, A))
        first = w(A, int4.paths()[0])
        np.testing.assert_allclose(first, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        for path in int4.paths():  # one activation for every path: the same bits
            np.testing.assert_array_equal(w(A, path), first, err_msg=path)
            order = rng.permutation(13)
            np.testing.assert_array_equal(w(A[order], path), first[order])
            np.testing.assert_array_equal(w(A[5:6], path)[0], first[5])
    lib = int4._lib()
    B, s, z, _ = weights(rng, 128, 40, 128)
    assert not lib.specrt_int4_pack_gated(_ptr(B), _ptr(s), _ptr(z), 128, 40, 128)  # N / 2 not a multiple of 16


# ---------------------------------------------------------------- the custom operator in onnxruntime


def _matmulnbits(path: Path, K, N, bs, B, scales, zp, bias=None, level=4, extra=None):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales")]
    inputs = ["A", "B", "scales"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp"))
    inputs.append("zp" if zp is not None else "")
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        inputs += ["", "bias"]
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=K, N=N, bits=4, block_size=bs,
                            accuracy_level=level, **(extra or {}))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["b", "s", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", "s", N])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return path


def _session(path: Path, choice: str, threads: int = 1):
    import onnxruntime as ort

    from specrt.engines.ort import session_options

    so = session_options(threads)
    source, kernel = int4.session_source(path, so, choice)
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"]), kernel


@built
@pytest.mark.parametrize("zp,bias", [(True, False), (False, True)])
def test_the_operator_computes_what_matmulnbits_computes(tmp_path, zp, bias):
    rng = np.random.default_rng(3)
    K, N, bs = 1000, 300, 128
    B, s, z, b = weights(rng, K, N, bs, zp, bias)
    path = _matmulnbits(tmp_path / "m.onnx", K, N, bs, B, s, z, b)
    ours, kernel = _session(path, "auto", threads=2)
    theirs, off = _session(path, "off")
    assert kernel.swapped == kernel.total == 1 and kernel.path == int4.paths()[0]
    assert off.swapped == 0 and "SPECRT_INT4_KERNEL=off" in off.why
    for shape in ((1, 1), (1, 5), (2, 9), (1, 64), (3, 0)):
        A = rng.standard_normal((*shape, K)).astype(np.float32)
        y, want = ours.run(None, {"A": A})[0], theirs.run(None, {"A": A})[0]
        assert y.shape == want.shape == (*shape, N)
        if y.size:
            # onnxruntime quantizes the activations per block the same way; only the order of its sums differs
            np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
            np.testing.assert_array_equal(y.reshape(-1, N), reference(B, s, z, b, K, N, bs, A.reshape(-1, K)))


def _mlp(path: Path, K, N, bs, B, scales, zp, bias=None, extra_use=False, gate_second=False):
    """MatMulNBits then a constant bias Add (with `bias`), or then a gated MLP's activation: Split in halves,
    g * Sigmoid(g), times the other half (with `extra_use`, g is also an output of the graph; with
    `gate_second`, the gate is the second half)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(zp, "zp")]
    nodes = [helper.make_node("MatMulNBits", ["A", "B", "scales", "zp"], ["Y"], domain="com.microsoft", K=K, N=N,
                              bits=4, block_size=bs, accuracy_level=4)]
    outs = []
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        nodes.append(helper.make_node("Add", ["bias", "Y"], ["out"]))
        width = N
    else:
        inits.append(numpy_helper.from_array(np.array([N // 2, N // 2], np.int64), "halves"))
        gate, up = ("u", "g") if gate_second else ("g", "u")
        nodes += [helper.make_node("Split", ["Y", "halves"], ["g", "u"], axis=-1),
                  helper.make_node("Sigmoid", [gate], ["sg"]), helper.make_node("Mul", [gate, "sg"], ["act"]),
                  helper.make_node("Mul", ["act", up], ["out"])]
        width = N // 2
        if extra_use:
            outs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, ["b", "s", N // 2]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["b", "s", K])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "s", width]), *outs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=64)
    return path


@built
def test_a_bias_add_and_a_gated_activation_fold_into_the_matmul(tmp_path):
    """The bias Add becomes the kernel's bias (the same bits as the Add); the gated MLP's Split, Sigmoid and
    two Muls become its gated output (silu(gate) * up, close to onnxruntime's); an activation whose gate is
    used elsewhere stays as it is."""
    rng = np.random.default_rng(12)
    K, N, bs = 512, 192, 128
    B, s, z, b = weights(rng, K, N, bs, bias=True)
    A = rng.standard_normal((1, 7, K)).astype(np.float32)
    for case in ("bias", "glu", "glu used elsewhere", "gate second"):
        path = _mlp(tmp_path / f"{case}.onnx", K, N, bs, B, s, z, b if case == "bias" else None,
                    extra_use=case == "glu used elsewhere", gate_second=case == "gate second")
        model, _ = int4.plan(path, "auto")
        ops = [n.op_type for n in model.graph.node]
        ours, _ = _session(path, "auto", threads=2)
        theirs, _ = _session(path, "off")
        y, want = ours.run(None, {"A": A})[0], theirs.run(None, {"A": A})[0]
        plain = reference(B, s, z, None, K, N, bs, A.reshape(-1, K))
        if case == "bias":
            assert ops == ["Int4MatMul"]
            np.testing.assert_array_equal(y.reshape(-1, N), (plain + b).astype(np.float32))
        elif case == "gate second":  # not the layout the kernel's gated output has: the nodes stay
            assert ops == ["Int4MatMul", "Split", "Sigmoid", "Mul", "Mul"]
            np.testing.assert_allclose(y.reshape(-1, N // 2), silu_times(np.roll(plain, N // 2, axis=1)),
                                       rtol=1e-5, atol=1e-6 * np.abs(want).max())
        else:
            assert ops == (["Int4MatMul"] if case == "glu" else ["Int4MatMul", "Split", "Sigmoid", "Mul", "Mul"])
            np.testing.assert_allclose(y.reshape(-1, N // 2), silu_times(plain), rtol=1e-5,
                                       atol=1e-6 * np.abs(want).max())
        np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def rms_norm(a, skip, gamma, eps):
    """kernels/int4.h's rms_norm in numpy float32, one operation at a time in its order: s = a + skip, the
    squares summed in 8 partial sums (value i into sum i % 8), added ((0+1)+(2+3))+((4+5)+(6+7))."""
    s = (a + skip).astype(np.float32) if skip is not None else a.astype(np.float32)
    M, K = s.shape
    part = np.zeros((M, 8), np.float32)
    for i in range(0, K, 8):
        chunk = s[:, i:i + 8]
        part[:, :chunk.shape[1]] += chunk * chunk
    total = ((part[:, 0] + part[:, 1]) + (part[:, 2] + part[:, 3])) + ((part[:, 4] + part[:, 5]) + (part[:, 6] + part[:, 7]))
    inv = np.float32(1) / np.sqrt(total / np.float32(K) + np.float32(eps))
    return s, (s * inv[:, None]) * gamma


def _normed(path: Path, K, N, bs, B, scales, zp, gamma, kind: str):
    """A root-mean-square norm then MatMulNBits: `kind` "skip" (SkipSimplifiedLayerNormalization of A and S,
    its sum an output of the graph), "simple" (SimplifiedLayerNormalization of A), "used elsewhere" (the skip
    norm's output is also an output of the graph) or "bias" (a skip norm with a bias input)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(zp, "zp"), numpy_helper.from_array(gamma, "gamma"),
             numpy_helper.from_array(np.full(K, 0.25, np.float32), "beta")]
    info = lambda n, w: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", w])  # noqa: E731
    ins, outs = [info("A", K)], [info("Y", N)]
    if kind == "simple":
        nodes = [helper.make_node("SimplifiedLayerNormalization", ["A", "gamma"], ["x"], axis=-1, epsilon=1e-6)]
    else:
        ins.append(info("S", K))
        outs.append(info("sum", K))
        nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["A", "S", "gamma"] + (["beta"] if kind == "bias" else []),
                                  ["x", "", "", "sum"], domain="com.microsoft", epsilon=1e-6)]
        if kind == "used elsewhere":
            outs.append(info("x", K))
    nodes.append(helper.make_node("MatMulNBits", ["x", "B", "scales", "zp"], ["Y"], domain="com.microsoft", K=K, N=N,
                                  bits=4, block_size=bs, accuracy_level=4))
    g = helper.make_graph(nodes, "g", ins, outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=64)
    return path


@built
def test_a_norm_folds_into_the_matmul_after_it(tmp_path):
    """A SkipSimplifiedLayerNormalization (or SimplifiedLayerNormalization) that only the matmul reads becomes
    the matmul's norm: its output is the matmul of rms_norm's rows (int4.h, the bits of `rms_norm` above),
    its sum the same as the norm's; a row's bits do not depend on the rows beside it; close to
    onnxruntime's own nodes. A norm whose output is used elsewhere, or with a bias, stays."""
    rng = np.random.default_rng(13)
    K, N, bs = 520, 96, 128  # K not a multiple of 8 x 8: the partial sums' tail
    B, s, z, _ = weights(rng, K, N, bs)
    gamma = rng.uniform(0.5, 2, K).astype(np.float32)
    A = (rng.standard_normal((1, 11, K)) * rng.uniform(0.1, 10, (1, 11, 1))).astype(np.float32)
    S = rng.standard_normal((1, 11, K)).astype(np.float32)
    for kind in ("skip", "simple", "used elsewhere", "bias"):
        path = _normed(tmp_path / f"{kind}.onnx", K, N, bs, B, s, z, gamma, kind)
        model, _ = int4.plan(path, "auto")
        ops = [n.op_type for n in model.graph.node]
        feeds = {"A": A} if kind == "simple" else {"A": A, "S": S}
        ours, _ = _session(path, "auto", threads=2)
        theirs, _ = _session(path, "off")
        got, want = _run_attention(ours, feeds), theirs.run(None, feeds)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-3 * np.abs(want[0]).max())
        if kind in ("used elsewhere", "bias"):
            assert ops[-1] == "Int4MatMul" and len(ops) == 2, ops
            continue
        assert ops == ["Int4MatMul"], ops
        total, x = rms_norm(A[0], None if kind == "simple" else S[0], gamma, 1e-6)
        np.testing.assert_array_equal(got[0][0], reference(B, s, z, None, K, N, bs, x))
        if kind == "skip":
            np.testing.assert_array_equal(got[1][0], total)
        order = rng.permutation(11)
        alone = ours.run(None, {k: v[:, order] for k, v in feeds.items()})[0]
        np.testing.assert_array_equal(alone[0], got[0][0][order])
        one = ours.run(None, {k: v[:, 4:5] for k, v in feeds.items()})[0]
        np.testing.assert_array_equal(one[0, 0], got[0][0, 4])
    lib = int4._lib()  # the library's own rms_norm: the same bits as the numpy one
    norm = lib.specrt_rms_norm
    norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 2
    y, out = np.empty((11, K), np.float32), np.empty((11, K), np.float32)
    norm(A.ctypes.data, S.ctypes.data, gamma.ctypes.data, 1e-6, 11, K, out.ctypes.data, y.ctypes.data)
    total, x = rms_norm(A[0], S[0], gamma, 1e-6)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(out, total)


@built
def test_threads_split_columns_not_bits(tmp_path):
    rng = np.random.default_rng(4)
    K, N, bs = 1536, 2048, 128
    path = _matmulnbits(tmp_path / "m.onnx", K, N, bs, *weights(rng, K, N, bs)[:3])
    one, _ = _session(path, "auto", threads=1)
    two, _ = _session(path, "auto", threads=2)
    A = rng.standard_normal((1, 20, K)).astype(np.float32)
    np.testing.assert_array_equal(one.run(None, {"A": A})[0], two.run(None, {"A": A})[0])


@built
def test_nodes_the_kernel_does_not_take_stay_onnxruntimes(tmp_path):
    rng = np.random.default_rng(5)
    K, N = 256, 40
    cases = {"accuracy level 0": dict(bs=128, level=0), "block size 16": dict(bs=16, level=4)}
    for why, c in cases.items():
        B, s, z, _ = weights(rng, K, N, c["bs"])
        path = _matmulnbits(tmp_path / f"{c['bs']}-{c['level']}.onnx", K, N, c["bs"], B, s, z, level=c["level"])
        sess, kernel = _session(path, "auto")
        assert kernel.swapped == 0 and kernel.total == 1 and why in kernel.why, kernel
        assert why in kernel.describe() and "onnxruntime MatMulNBits" in kernel.describe()
        assert sess.run(None, {"A": rng.standard_normal((1, 2, K)).astype(np.float32)})[0].shape == (1, 2, N)


@built
def test_a_path_that_cannot_run_here_is_refused(tmp_path):
    from specrt.errors import PairError

    rng = np.random.default_rng(6)
    path = _matmulnbits(tmp_path / "m.onnx", 128, 16, 128, *weights(rng, 128, 16, 128)[:3])
    missing = next(p for p in ("avx512vnni", "neon-dotprod", "avx2") if p not in int4.paths())
    with pytest.raises(PairError, match=f"SPECRT_INT4_KERNEL={missing}"):
        _session(path, missing)


def test_without_the_library_onnxruntime_runs_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(int4, "library", lambda: None)
    monkeypatch.setattr(int4, "HERE", tmp_path)
    (tmp_path / "_int4.build-error.txt").write_text("CompileError: command 'g++' failed\n")
    rng = np.random.default_rng(7)
    path = _matmulnbits(tmp_path / "m.onnx", 128, 16, 128, *weights(rng, 128, 16, 128)[:3])
    sess, kernel = _session(path, "auto")
    assert kernel.swapped == 0 and "not built (CompileError: command 'g++' failed)" in kernel.why
    assert "pip install" in kernel.why
    assert sess.run(None, {"A": np.ones((1, 1, 128), np.float32)})[0].shape == (1, 1, 16)


def test_the_build_without_a_compiler_installs_and_says_why(tmp_path):
    """setup.py's optional build: a compiler that fails leaves no library and a note, and the build succeeds."""
    env = {**os.environ, "CC": "false", "CXX": "false"}
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "int4 kernel library was not built" in r.stdout + r.stderr
    note = tmp_path / "lib" / "specrt" / "engines" / "_int4.build-error.txt"
    assert note.is_file() and note.read_text().strip()
    assert not list((tmp_path / "lib").rglob("_int4*.so"))


# ---------------------------------------------------------------- other compilers, other machines

KERNELS = ROOT / "specrt" / "engines" / "kernels"
BENCH_KERNELS = ROOT / "bench" / "kernels"
SOURCES = runpy.run_path(str(KERNELS / "sources.py"))
CXX, CLANG = shutil.which("g++"), shutil.which("clang++")
ARM_CXX, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
X86 = platform.machine() in ("x86_64", "AMD64")


def build_program(cxx: list[str], machine: str, main: Path, out: Path, link: list[str] = ()) -> Path:
    """`main` linked with the kernel's sources (all but the onnxruntime operator), each compiled by `cxx` with
    the flags setup.py gives it on `machine` (kernels/sources.py)."""
    objects = []
    for name in SOURCES["SOURCES"]:
        if name == "ort_op.cc":
            continue
        obj = out / f"{name}.o"
        r = subprocess.run([*cxx, *SOURCES["FLAGS"], *SOURCES["flags_for"](name, machine), "-c", str(KERNELS / name),
                            "-o", str(obj)], capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cxx)} {name}:\n{r.stderr[-3000:]}"
        objects.append(str(obj))
    exe = out / main.stem
    r = subprocess.run([*cxx, "-std=c++17", "-O2", f"-I{KERNELS}", *link, str(main), *objects, "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


@pytest.mark.skipif(not (CXX and X86), reason="needs g++ on x86-64")
def test_the_ceiling_tool_builds(tmp_path):
    """bench/kernels/ceiling.cc (docs/kernel.md's AVX2 ceiling) still builds against the kernel's sources as its
    header says; running it only times this machine, so it is not run here."""
    assert build_program([CXX], "x86_64", BENCH_KERNELS / "ceiling.cc", tmp_path).exists()


ARM_COMPILERS = [pytest.param(["aarch64-linux-gnu-g++"], id="gcc"),
                 pytest.param(["clang++", "--target=aarch64-linux-gnu"], id="clang",
                              marks=pytest.mark.skipif(not CLANG, reason="needs Debian's clang (apt-get install clang)"))]


@pytest.mark.skipif(not (ARM_CXX and QEMU), reason="needs Debian's g++-aarch64-linux-gnu and qemu-user "
                                                    "(apt-get install g++-aarch64-linux-gnu qemu-user)")
@pytest.mark.parametrize("cxx", ARM_COMPILERS)
@pytest.mark.parametrize("cpu,paths", [("max", "neon-i8mm,neon-dotprod,scalar"), ("cortex-a76", "neon-dotprod,scalar"),
                                       ("cortex-a72", "scalar")])
def test_the_arm_paths_under_qemu(tmp_path, cxx, cpu, paths):
    """Built as setup.py builds it on Arm, by GCC and by clang: each CPU gets the paths it has, every path the
    reference's bits."""
    exe = build_program(cxx, "aarch64", ROOT / "tests" / "native" / "int4_check.cc", tmp_path, ["-static"])
    r = subprocess.run([QEMU, "-cpu", cpu, str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    # a Cortex-A76 has the dot-product instructions but not i8mm, an A72 neither: only the reference
    assert f"paths: {paths}" in r.stdout
    if int4.library() is not None:  # the attention gives the same bits on Arm as here
        assert f"attention {_attention_hash():016x}" in r.stdout
        assert f"attention-big {_attention_hash(big=True):016x}" in r.stdout
        assert f"attention-tree {_attention_hash(big=2):016x}" in r.stdout


@built
@pytest.mark.skipif(not (CLANG and shutil.which("clang")), reason="needs Debian's clang (apt-get install clang)")
def test_clang_builds_the_library_that_gcc_builds(tmp_path):
    """setup.py with clang: the library builds, offers the same paths, and computes the same bits (matmul on
    every path, attention) as the installed build; onnxruntime loads its operators."""
    env = {**os.environ, "CC": "clang", "CXX": "clang++"}
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "not built" not in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    lib = next((tmp_path / "lib").rglob("_int4*.so"))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    got = subprocess.run([sys.executable, str(probe)], env={**os.environ, int4.LIBRARY_ENV: str(lib)},
                         capture_output=True, text=True, timeout=300)
    want = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and want.returncode == 0, got.stderr[-3000:] + want.stderr[-3000:]
    assert got.stdout == want.stdout and "paths " in got.stdout and "session ok" in got.stdout, (got.stdout, want.stdout)


@built
def test_a_wrong_index_into_onnxruntimes_api_is_refused_in_one_line(tmp_path):
    """ort_api.h names onnxruntime's functions by their index in its table: a library built with a wrong one
    (GetDimensionsCount at GetTensorShapeElementCount's index) refuses to load, saying so in one line."""
    env = {**os.environ, "SPECRT_CXXFLAGS": "-DSPECRT_ORT_DIMENSIONS_COUNT=64"}
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "not built" not in r.stdout + r.stderr, r.stderr[-3000:]
    lib = next((tmp_path / "lib").rglob("_int4*.so"))
    probe = tmp_path / "probe.py"
    probe.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import numpy as np
from pathlib import Path
from test_kernel import _matmulnbits, _session, weights
from specrt.errors import PairError
B, s, z, b = weights(np.random.default_rng(0), 128, 16, 128)
try:
    _session(_matmulnbits(Path({str(tmp_path)!r}) / "m.onnx", 128, 16, 128, B, s, z), "auto")
except PairError as e:
    print("refused:", e)
""")
    out = subprocess.run([sys.executable, str(probe)], env={**os.environ, int4.LIBRARY_ENV: str(lib)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip()
    assert line.startswith("refused: specrt's kernel library does not match onnxruntime") and "\n" not in line, line
    assert "GetDimensionsCount" in line and "SPECRT_INT4_KERNEL=off" in line


# What a build computes, printed for comparison with another build (SPECRT_INT4_LIBRARY names it).
PROBE = """
import hashlib, sys
import numpy as np
sys.path.insert(0, %r)
from test_kernel import Packed, _attention_hash, _matmulnbits, _session, weights
from specrt.engines import int4
print("paths", int4.paths())
rng = np.random.default_rng(11)
K, N, bs = 1000, 61, 64
B, s, z, b = weights(rng, K, N, bs, bias=True)
w, A = Packed(B, s, z, b, K, N, bs), rng.standard_normal((13, K)).astype(np.float32)
for path in int4.paths():
    print(path, hashlib.sha256(w(A, path).tobytes()).hexdigest())
print("attention", _attention_hash(), _attention_hash(big=True))
import tempfile, pathlib
d = pathlib.Path(tempfile.mkdtemp())
sess, kernel = _session(_matmulnbits(d / "m.onnx", K, N, bs, B, s, z, b), "auto")
y = sess.run(None, {"A": A[None]})[0]
print("session ok" if kernel.swapped == 1 else "session not swapped", hashlib.sha256(y.tobytes()).hexdigest())
""" % str(ROOT / "tests")


def _attention_hash(base: bool = False, big: int = 0) -> int:
    """The bits of specrt_attention_demo's problem (attention.cc): the small one, the big one (1) or the big
    one's rows as trees (2), through the best instructions this CPU has or the baseline's."""
    lib = int4._lib()
    out = np.empty(2 * 9 * 768 + 2 * 2 * 2 * 48 * 128 if big else 2 * 3 * 128 + 2 * 2 * 2 * 16 * 32, np.float32)
    n = lib.specrt_attention_demo(ctypes.c_void_p(out.ctypes.data), int(base), int(big))
    assert n == len(out)
    h = 1469598103934665603
    for bits in out[:n].view(np.uint32).tolist():
        h = ((h ^ bits) * 1099511628211) & (2**64 - 1)
    return h


# ---------------------------------------------------------------- attention


def _gqa_graph(path: Path, H: int, Hkv: int, D: int, C: int, cos, sin, scale: float):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inputs = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"] + [""] * 7 + ["qlens"]
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=Hkv, scale=scale, do_rotary=1,
                            rotary_interleaved=0)
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("qkv", f, ["b", "s", (H + 2 * Hkv) * D]),
         helper.make_tensor_value_info("past_key", f, ["b", Hkv, C, D]),
         helper.make_tensor_value_info("past_value", f, ["b", Hkv, C, D]),
         helper.make_tensor_value_info("seqlens_k", i32, ["b"]), helper.make_tensor_value_info("total", i32, [1]),
         helper.make_tensor_value_info("qlens", i32, ["b"])],
        [helper.make_tensor_value_info("out", f, ["b", "s", H * D]),
         helper.make_tensor_value_info("present_key", f, ["b", Hkv, C, D]),
         helper.make_tensor_value_info("present_value", f, ["b", Hkv, C, D])],
        [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]),
              str(path))
    return path


def _attention_case(rng, H=4, Hkv=2, D=32, C=48):
    pos = np.arange(C)[:, None] / (10000 ** (np.arange(D // 2) / (D // 2)))
    cos, sin = np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)
    return H, Hkv, D, C, cos, sin


def _run_attention(sess, feeds: dict) -> list:
    """A run of a _gqa_graph session; where specrt's attention took the node, the graph's tree input (int4.plan)
    gets a chain's parents (each token after the one before)."""
    if int4.TREE_INPUT in {i.name for i in sess.get_inputs()}:
        B, S = feeds["qkv"].shape[:2]
        feeds = {**feeds, int4.TREE_INPUT: np.tile(np.arange(-1, S - 1, dtype=np.int32), (B, 1))}
    return sess.run(None, feeds)


@built
def test_attention_computes_what_groupqueryattention_computes(tmp_path):
    rng = np.random.default_rng(8)
    H, Hkv, D, C, cos, sin = _attention_case(rng)
    path = _gqa_graph(tmp_path / "gqa.onnx", H, Hkv, D, C, cos, sin, 1 / np.sqrt(D))
    ours, kernel = _session(path, "auto")
    theirs, off = _session(path, "off")
    assert kernel.attention == kernel.attention_total == 1 and off.attention == 0
    B, S = 3, 5
    n = np.array([5, 2, 1], np.int32)  # new tokens per row (ragged), after pasts of 0, 17 and 30 entries
    past = np.array([0, 17, 30])
    cache_k = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    cache_v = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    feeds = {"qkv": rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float32), "past_key": cache_k,
             "past_value": cache_v, "seqlens_k": (past + n - 1).astype(np.int32), "total": np.array([C], np.int32),
             "qlens": n}
    got, want = _run_attention(ours, feeds), theirs.run(None, feeds)
    for b in range(B):
        np.testing.assert_allclose(got[0][b, :n[b]], want[0][b, :n[b]], rtol=1e-4, atol=2e-5)
        assert not got[0][b, n[b]:].any()  # padding positions: zeros
        end = past[b] + n[b]
        for o in (1, 2):  # the caches: the past kept, the new entries written (keys after the rotary embedding)
            np.testing.assert_allclose(got[o][b, :, :end], want[o][b, :, :end], rtol=1e-5, atol=1e-6)


@built
@pytest.mark.parametrize("big", [False, True])
def test_attention_gives_the_same_bits_with_and_without_avx2(big):
    assert _attention_hash(big=big) == _attention_hash(base=True, big=big)


@built
def test_attention_rows_ignore_the_pass(tmp_path):
    """A query row's output and the cache entries it writes are the same bits alone, in a wider pass, or
    beside other rows of a batch."""
    rng = np.random.default_rng(9)
    H, Hkv, D, C, cos, sin = _attention_case(rng, H=6, Hkv=2, D=64, C=80)
    path = _gqa_graph(tmp_path / "gqa.onnx", H, Hkv, D, C, cos, sin, 0.125)
    ours, _ = _session(path, "auto", threads=2)
    qkv = rng.standard_normal((1, 9, (H + 2 * Hkv) * D)).astype(np.float32)
    cache = [rng.standard_normal((1, Hkv, C, D)).astype(np.float32) for _ in range(2)]
    P = 40

    def run(first, width, batch_with=None, past=cache):
        q = qkv[:, first:first + width]
        feeds = {"qkv": q, "past_key": past[0], "past_value": past[1], "total": np.array([C], np.int32),
                 "seqlens_k": np.array([P + first + width - 1], np.int32), "qlens": np.array([width], np.int32)}
        if batch_with is not None:  # a second row before it, of another length
            other = rng.standard_normal((1, width, q.shape[2])).astype(np.float32)
            feeds.update(qkv=np.concatenate([other, q]), past_key=np.concatenate([past[0], past[0]]),
                         past_value=np.concatenate([past[1], past[1]]),
                         seqlens_k=np.array([10 + width - 1, P + first + width - 1], np.int32),
                         qlens=np.array([width, width], np.int32))
        out = _run_attention(ours, feeds)
        return [o[-1:] for o in out]

    wide = run(0, 9)
    past = cache
    for i in range(9):  # the same tokens one at a time, each pass's caches the next one's past
        step = run(i, 1, past=past)
        np.testing.assert_array_equal(step[0][0, 0], wide[0][0, i])
        past = step[1:]
    for o in (1, 2):
        np.testing.assert_array_equal(past[o - 1], wide[o])
    batched = run(0, 9, batch_with=True)
    for o in range(3):
        np.testing.assert_array_equal(batched[o], wide[o])


@pytest.mark.parametrize("which", ["int4_default_pair", "qwen_pair"])
def test_a_token_verified_in_a_wide_pass_has_its_logits_alone(request, which):
    """Through specrt's kernels a token's logits are the same bits decoded alone, verified in a pass of
    k + 1 tokens, at any position: int4 (every matmul and attention node specrt's) and fp32 (attention
    specrt's, onnxruntime's float matmuls rounding as they do)."""
    pair = request.getfixturevalue(which)
    e = pair.target
    if which == "qwen_pair" or not KERNELS_RUN:
        exact = False
    else:
        exact = e.kernel.invariant
        assert exact, e.kernel
    rng = np.random.default_rng(10)
    ids = rng.integers(3, pair.manifest.vocab_size, 80)
    with pair.exclusive():
        for P in (1, 17, 40, 63):
            e.truncate(0)
            e.forward(ids[None, :P], np.array([P - 1]))
            alone = [e.forward(ids[None, P + i:P + i + 1], np.array([0]))[0, 0].copy() for i in range(9)]
            for k in (2, 5, 9):
                e.truncate(P)
                wide = e.forward(ids[None, P:P + k], np.arange(k))[0]
                for i in range(k):
                    if exact:
                        np.testing.assert_array_equal(wide[i], alone[i], err_msg=f"P={P} k={k} row {i}")
                    else:
                        np.testing.assert_allclose(wide[i], alone[i], atol=1e-4)


# -------------------------------------------------------- the roofline tools (bench/kernels/roofline.py, profile.py)


@built
@pytest.mark.skipif(not (CXX or CLANG), reason="needs a C++ compiler")
def test_the_roofline_tools_measure_and_report(tmp_path, int4_default_dir):
    """They run on a pair (figures are this machine's; only their presence and consistency are checked)."""
    out = tmp_path / "roof.json"
    r = subprocess.run([sys.executable, str(BENCH_KERNELS / "roofline.py"), str(int4_default_dir), "--rows", "1,3",
                        "--repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["bandwidth_gbs"] > 0 and d["peak_gops"] > 0 and d["path"] == int4.paths()[0]
    assert {s["model"] for s in d["shapes"]} == {"target", "draft"}
    for s in d["shapes"]:
        for m, c in s["rows"].items():
            assert c["ms"] > 0 and c["stream_ms"] == pytest.approx(s["bytes"] / d["bandwidth_gbs"] / 1e6)
            assert c["fraction"] == pytest.approx(max(c["stream_ms"], c["arith_ms"]) / c["ms"])
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, str(BENCH_KERNELS / "profile.py"), str(int4_default_dir), "--widths", "1,3",
                        "--past", "8", "--repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    for w in ("1", "3"):
        ms = d["ms"][w]
        assert ms["pass"] > 0 and ms["layer matmuls"] > 0 and ms["attention"] > 0
        parts = sum(v for k, v in ms.items() if k != "pass")
        assert parts == pytest.approx(ms["pass"])  # every part of the pass accounted for, once
        roof = d["roofline"][w]
        assert roof["pass_ms"] == pytest.approx(roof["matmuls_ms"] + roof["rest_ms"])
        # the matmuls by shape are the same nodes as the layers' and the head's
        assert sum(v[w]["ms"] for v in d["by_shape"].values()) == pytest.approx(ms["layer matmuls"] + ms["head matmuls"])
    r = subprocess.run([sys.executable, str(BENCH_KERNELS / "profile.py"), str(int4_default_dir), "--model", "draft",
                        "--widths", "1,3", "--past", "8", "--repeats", "2", "--json", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert "# draft: specrt" in r.stdout and d["ms"]["3"]["pass"] > 0 and d["ms"]["3"]["layer matmuls"] > 0


def _plain_library(tmp_path: Path) -> Path:
    """The kernel library built by hand without its onnxruntime operators (what the bench tools load)."""
    lib = tmp_path / "a.so"
    r = subprocess.run([os.environ.get("CXX", "g++"), *SOURCES["FLAGS"], "-fPIC", "-shared", f"-I{KERNELS}", "-o",
                        str(lib), *[str(KERNELS / n) for n in SOURCES["SOURCES"] if n != "ort_op.cc"]],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return lib


@pytest.mark.skipif(not {"avx512f", "avx512bw"} <= cpu_flags(), reason="bench/kernels/stream_ab.cc reads with AVX-512")
def test_the_stream_tool_runs_the_kernel_beside_a_read(tmp_path):
    cxx, lib = os.environ.get("CXX", "g++"), _plain_library(tmp_path)
    exe = tmp_path / "stream_ab"
    r = subprocess.run([cxx, "-std=c++17", "-O2", "-mavx512f", f"-I{KERNELS}", str(BENCH_KERNELS / "stream_ab.cc"),
                        "-ldl", "-pthread", "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([str(exe), str(lib), "256", "64", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("K 256 N 64:") and "kernel/read time" in r.stdout
    assert subprocess.run([str(exe), str(lib)], capture_output=True, text=True).returncode == 2


def test_the_kernel_ab_tool_compares_two_builds(tmp_path):
    """bench/kernels/kernel_ab.cc: a library against itself runs at one speed within the noise and gives the same
    bits; bad arguments get a usage line and exit 2."""
    cxx, lib = os.environ.get("CXX", "g++"), _plain_library(tmp_path)
    exe = tmp_path / "kernel_ab"
    r = subprocess.run([cxx, "-std=c++17", "-O2", str(BENCH_KERNELS / "kernel_ab.cc"), "-ldl", "-pthread", "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([str(exe), str(lib), str(lib), "256", "64", "1", "1", "5"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["K=256 N=64 rows= 1", "K=256 N=64 rows= 5"]
    assert all(line.endswith("bits same") for line in lines)
    r = subprocess.run([str(exe), str(lib), str(lib), "100", "64", "1", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "multiple of 128" in r.stderr
