"""The int4 matmul alone: onnxruntime's MatMulNBits against specrt's kernel (specrt.Int4MatMul) on the
weight shapes of the Qwen2.5-Coder 1.5B target and 0.5B draft, for several row counts, in one process.

Each shape is one graph with random 4-bit weights (block 128, zero points, accuracy level 4); both sessions
use the same thread count; widths and kernels are interleaved within each repeat, medians reported.

    python bench/kernels/kernel.py [--threads 2] [--repeats 15] [--rows 1,2,3,4,5,7,9,16,64] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

SHAPES = {  # name: (K, N)
    "1.5B qkv": (1536, 2048), "1.5B o": (1536, 1536), "1.5B gate/up": (1536, 17920), "1.5B down": (8960, 1536),
    "1.5B lm slice": (1536, 32768), "0.5B gate/up": (896, 9728), "0.5B down": (4864, 896),
}


def graph(K: int, N: int, bs: int = 128, seed: int = 0):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nblk = (K + bs - 1) // bs
    B = rng.integers(0, 256, (N, nblk, bs // 2), dtype=np.uint8)
    scales = (rng.random((N, nblk), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    zp = rng.integers(0, 256, (N, (nblk + 1) // 2), dtype=np.uint8)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zp"], ["Y"], domain="com.microsoft",
                            K=K, N=N, bits=4, block_size=bs, accuracy_level=4)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])],
                          [numpy_helper.from_array(a, n) for a, n in ((B, "B"), (scales, "scales"), (zp, "zp"))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


def sessions(model, threads: int):
    import onnx
    import onnxruntime as ort

    from specrt.engines import int4
    from specrt.engines.ort import session_options

    out = {}
    for choice in ("off", "auto"):
        path = "/tmp/specrt-kernel-bench.onnx"
        onnx.save(model, path)
        so = session_options(threads)
        source, kernel = int4.session_source(__import__("pathlib").Path(path), so, choice)
        out[kernel.describe().split(" (")[0]] = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,4,5,7,9,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from: " + ", ".join(SHAPES))
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    print(f"# {' '.join(sys.argv)}")
    print(f"{'shape':<14} {'kernel':<28} " + " ".join(f"{m:>8}" for m in rows) + "   (ms; then x of M=1)")
    for name in args.shapes.split(","):
        K, N = SHAPES[name]
        sess = sessions(graph(K, N), args.threads)
        rng = np.random.default_rng(1)
        feeds = {m: {"A": rng.standard_normal((m, K)).astype(np.float32)} for m in rows}
        times = {(k, m): [] for k in sess for m in rows}
        for s in sess.values():  # warm-up
            for m in rows:
                s.run(None, feeds[m])
        for _ in range(args.repeats):
            for m in rows:
                for k, s in sess.items():
                    t = time.perf_counter()
                    s.run(None, feeds[m])
                    times[k, m].append(time.perf_counter() - t)
        for k in sess:
            med = [statistics.median(times[k, m]) * 1e3 for m in rows]
            results[f"{name} | {k}"] = dict(zip(map(str, rows), med))
            print(f"{name:<14} {k:<28} " + " ".join(f"{v:8.3f}" for v in med) + "   "
                  + " ".join(f"{v / med[0]:.2f}" for v in med))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
