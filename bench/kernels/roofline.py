"""How close specrt's int4 matmul comes to this host's limits, shape by shape (docs/kernel.md, "Roofline").

Measures, on the machine it runs on: the read bandwidth over a buffer the size of the target's packed weights
(all --threads threads), and the int8 product rate of the instructions of the path `auto` picks (a loop of
independent dot instructions per thread; bench/kernels/roofline.cc, built here with -march=native). Then, for every
MatMulNBits shape of the pair's target and draft (or of Qwen2.5-Coder 1.5B / 0.5B without a pair) and each
row count, times specrt's kernel through onnxruntime with weights that do not fit in the caches (one session
running enough copies of the shape one after another; a call's time is the run's over the copies) and prints
it beside the roofline of that call:
    roofline = max(packed weight bytes / bandwidth, rows x K x N / peak)
and the fraction roofline / measured (1.0: at the limit).

    python bench/kernels/roofline.py [PAIR_DIR] [--threads 2] [--rows 1,2,3,5,9,16] [--repeats 15] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
QWEN = {  # role: {(K, N): nodes} for Qwen2.5-Coder 1.5B (target) and 0.5B (draft), block 128
    "target": {(1536, 2048): 28, (1536, 1536): 28, (1536, 17920): 28, (8960, 1536): 28},
    "draft": {(896, 1152): 24, (896, 896): 24, (896, 9728): 24, (4864, 896): 24},
}
CACHE_BYTES = 64 << 20  # more than this host kind's L3 (32 MB): copies of a shape add up to at least this,
MAX_COPIES = 64  # or to this many (the smallest real shape, 0.5 MB, needs 128: its figures flatter it)


def packed_bytes(K: int, N: int, bs: int) -> int:
    """What the kernel streams for one call: 16-column panels, per block bs*8 bytes of weights + 128 of scales."""
    return -(-N // 16) * -(-K // bs) * (bs * 8 + 128)


def shapes_of(pair: Path | None) -> dict[str, dict[tuple[int, int, int], int]]:
    """role -> {(K, N, block): number of nodes} from the pair's graphs (names read, weights not loaded)."""
    if pair is None:
        return {role: {(K, N, 128): n for (K, N), n in s.items()} for role, s in QWEN.items()}
    import onnx

    manifest = json.loads((pair / "manifest.json").read_text())
    out = {}
    for role in ("target", "draft"):
        if not manifest.get(role):
            continue
        model = onnx.load(os.fspath(pair / manifest[role]["path"]), load_external_data=False)
        shapes = Counter()
        for n in model.graph.node:
            if n.op_type == "MatMulNBits":
                a = {x.name: x.i for x in n.attribute}
                shapes[a["K"], a["N"], a["block_size"]] += 1
        out[role] = dict(shapes)
    return out


def build_helper(tmp: Path) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        sys.exit("bench/kernels/roofline.py needs a C++ compiler (g++ or clang++) to build bench/kernels/roofline.cc")
    exe = tmp / "roofline"
    subprocess.run([cxx, "-std=c++17", "-O3", "-march=native", "-pthread", str(HERE / "roofline.cc"), "-o", str(exe)],
                   check=True)
    return exe


def helper(exe: Path, *args, runs: int = 5) -> float:
    """The best of `runs` runs of bench/kernels/roofline.cc: a limit, which a busy neighbour on a shared host only
    ever lowers (one run in ten has read ~30% low here)."""
    best = 0.0
    for _ in range(runs):
        r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench/kernels/roofline.cc {' '.join(map(str, args))}: {r.stderr.strip()}")
        best = max(best, float(r.stdout))
    return best


def graph(K: int, N: int, bs: int, copies: int):
    """`copies` MatMulNBits nodes of one shape, each with its own random weights, all reading input A."""
    import onnx
    from onnx import TensorProto, helper as h, numpy_helper

    rng = np.random.default_rng(0)
    nblk = -(-K // bs)
    nodes, inits, outs = [], [], []
    for c in range(copies):
        B = rng.integers(0, 256, (N, nblk, bs // 2), dtype=np.uint8)
        scales = (rng.random((N, nblk), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
        zp = rng.integers(0, 256, (N, (nblk + 1) // 2), dtype=np.uint8)
        nodes.append(h.make_node("MatMulNBits", ["A", f"B{c}", f"scales{c}", f"zp{c}"], [f"Y{c}"],
                                 domain="com.microsoft", K=K, N=N, bits=4, block_size=bs, accuracy_level=4))
        inits += [numpy_helper.from_array(a, f"{n}{c}") for a, n in ((B, "B"), (scales, "scales"), (zp, "zp"))]
        outs.append(h.make_tensor_value_info(f"Y{c}", TensorProto.FLOAT, ["M", N]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])], outs, inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])


def kernel_session(K: int, N: int, bs: int, copies: int, threads: int, tmp: Path):
    """One session running `copies` matmuls of this shape (different weights) one after another, each on
    specrt's kernel: a call's time is a run's over `copies`, without the per-run cost of onnxruntime and
    Python (~13 us here, a fifth of a small matmul), as a node inside a pass has it."""
    import onnx
    import onnxruntime as ort

    from specrt.engines import int4
    from specrt.engines.ort import session_options

    path = tmp / f"m{K}x{N}.onnx"
    onnx.save(graph(K, N, bs, copies), os.fspath(path))
    so = session_options(threads)
    source, kernel = int4.session_source(path, so, "auto")
    if kernel.swapped != copies:
        sys.exit(f"specrt's kernel did not take the {K}x{N} matmuls here: {kernel.describe()}")
    session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    path.unlink()
    return session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", nargs="?", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,5,9,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    from specrt.engines import int4

    if int4.unavailable():
        sys.exit(int4.unavailable())
    path = int4.paths()[0]
    rows = [int(r) for r in args.rows.split(",")]
    shapes = shapes_of(args.pair)
    weights = sum(packed_bytes(*s) * n for s, n in shapes["target"].items())
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        exe = build_helper(tmp)
        bw = helper(exe, "bandwidth", weights, args.threads)  # GB/s
        peak = helper(exe, "peak", path, args.threads)  # G products/s
        print(f"# {' '.join(sys.argv)}")
        print(f"# host: {os.uname().machine}, {os.cpu_count()} cpus, path {path}, {args.threads} threads")
        print(f"# read bandwidth {bw:.1f} GB/s over {weights / 1e9:.2f} GB (the target's packed weights); "
              f"int8 peak of {path}: {peak:.1f} G products/s")
        print(f"# the target's weights stream in {weights / bw / 1e6:.1f} ms; a row of its arithmetic takes "
              f"{sum(K * N * n for (K, N, _), n in shapes['target'].items()) / peak / 1e6:.1f} ms")
        print(f"{'model':<7} {'K x N':>13} {'nodes':>5} {'MB':>6} | " + " | ".join(f"{m:>2} rows: ms  roof  frac"
                                                                           for m in rows))
        results = {"command": " ".join(sys.argv), "path": path, "threads": args.threads, "bandwidth_gbs": bw,
                   "peak_gops": peak, "shapes": []}
        for role, role_shapes in shapes.items():
            for (K, N, bs), nodes in sorted(role_shapes.items()):
                size = packed_bytes(K, N, bs)
                copies = min(MAX_COPIES, max(2, -(-CACHE_BYTES // size)))
                session = kernel_session(K, N, bs, copies, args.threads, tmp)
                rng = np.random.default_rng(1)
                feeds = {m: {"A": rng.standard_normal((m, K)).astype(np.float32)} for m in rows}
                for m in rows:  # warm-up: every width once
                    session.run(None, feeds[m])
                times = {m: [] for m in rows}
                for _ in range(args.repeats):
                    for m in rows:
                        t = time.perf_counter()
                        session.run(None, feeds[m])
                        times[m].append((time.perf_counter() - t) / copies)
                cells, row = [], {"model": role, "K": K, "N": N, "block": bs, "nodes": nodes, "bytes": size, "rows": {}}
                for m in rows:
                    ms = statistics.median(times[m]) * 1e3
                    stream, arith = size / bw / 1e6, m * K * N / peak / 1e6
                    roof = max(stream, arith)
                    row["rows"][m] = {"ms": ms, "stream_ms": stream, "arith_ms": arith, "fraction": roof / ms}
                    cells.append(f"{ms:7.3f} {roof:5.3f} {roof / ms:5.2f}")
                results["shapes"].append(row)
                print(f"{role:<7} {f'{K} x {N}':>13} {nodes:>5} {size / 1e6:6.1f} | " + " | ".join(cells), flush=True)
                del session
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
