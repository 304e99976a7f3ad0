"""Where a target pass spends its time, by width, and how far the pass is from its roofline (docs/kernel.md).

Loads the pair's target once with onnxruntime's profiler on (specrt's kernels as `specrt.load` picks them),
reads a past of --past tokens, then runs each width --repeats times (truncated back after each pass). From the
profile, per width, medians over the repeats: the pass as onnxruntime timed it (model_run), the int4 matmuls
of the layers, the output head (the widest matmuls), attention, every other op by type, and what is left of
the pass outside any node (the executor, the thread pool waking, binding). The pass's roofline is the sum of
its matmuls' rooflines, each max(packed bytes / bandwidth, width x K x N / peak) with this host's bandwidth
and int8 peak (bench/kernels/roofline.cc, as bench/kernels/roofline.py measures them), plus the measured time of everything
that is not a matmul. Then each matmul shape's time inside the pass (all its nodes) against its roofline.
`--model draft` profiles the draft model's pass instead.

    python bench/kernels/profile.py PAIR_DIR [--model draft] [--past 300] [--widths 1,5,9] [--repeats 10] [--threads 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402  (bench/kernels/roofline.py: the host's limits)

MATMULS = ("Int4MatMul", "MatMulNBits")
ATTENTION = ("Attention", "GroupQueryAttention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--past", type=int, default=300)
    ap.add_argument("--widths", default="1,5,9")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=("target", "draft"), default="target")
    ap.add_argument("--json")
    args = ap.parse_args()
    import specrt
    from specrt.engines import int4, ort as ort_engine

    widths = [int(w) for w in args.widths.split(",")]
    tmp = Path(tempfile.mkdtemp())
    plain = ort_engine.session_options

    def profiled(*a, **k):
        so = plain(*a, **k)
        so.enable_profiling = True
        so.profile_file_prefix = os.fspath(tmp / "pass")
        return so

    ort_engine.session_options = profiled
    pair = specrt.load(args.pair, draft_model=args.model == "draft", threads=args.threads)
    ort_engine.session_options = plain
    target = pair.target if args.model == "target" else pair.draft
    print(f"# {' '.join(sys.argv)}")
    print(f"# {args.model}: {target.kernel.describe() if target.kernel else 'no int4 kernel'}")
    V = pair.manifest.vocab_size
    rng = np.random.default_rng(0)
    target.forward(rng.integers(0, V, (1, args.past)), np.array([args.past - 1]))
    toks = rng.integers(0, V, (1, max(widths)))
    order = []
    for _ in range(args.repeats + 1):  # the first round: a warm-up
        for w in widths:
            target.truncate(args.past)
            # a target pass verifies: logits at every row; a draft pass (a catch-up) needs its last row's
            target.forward(toks[:, :w], np.arange(w) if args.model == "target" else np.array([w - 1]))
            order.append(w)
    events = json.loads(Path(target.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-len(order):]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                   key=lambda e: e["ts"])

    shapes = roofline.shapes_of(args.pair)[args.model]
    layer_shapes = {(K, N) for (K, N, _), n in shapes.items() if n == max(shapes.values())}
    import onnx

    graph = onnx.load(os.fspath(args.pair / getattr(pair.manifest, args.model).path), load_external_data=False).graph
    node_shape = {n.name: (a["K"], a["N"]) for n in graph.node if n.op_type == "MatMulNBits"
                  for a in [{x.name: x.i for x in n.attribute}]}
    # each node event belongs to the run whose span holds it
    parts = {w: defaultdict(list) for w in widths}
    by_shape = {w: defaultdict(list) for w in widths}  # (K, N): ms a pass spends in matmuls of that shape
    j = 0
    for i, (run, w) in enumerate(zip(runs, order)):
        start, end = run["ts"], run["ts"] + run["dur"]
        split, shape_ms = defaultdict(float), defaultdict(float)
        while j < len(nodes) and nodes[j]["ts"] < start:
            j += 1
        while j < len(nodes) and nodes[j]["ts"] < end:
            e = nodes[j]
            op = e["args"].get("op_name", "?")
            if op in MATMULS:  # a shape every layer has is a layer's; the others are the output head's
                k, n = node_shape[e["name"][: -len("_kernel_time")]]  # a gated one outputs N / 2 columns
                split["layer matmuls" if (k, n) in layer_shapes else "head matmuls"] += e["dur"] / 1e3
                shape_ms[k, n] += e["dur"] / 1e3
            elif op in ATTENTION:
                split["attention"] += e["dur"] / 1e3
            else:
                split[op] += e["dur"] / 1e3
            j += 1
        split["outside nodes"] = run["dur"] / 1e3 - sum(split.values())
        split["pass"] = run["dur"] / 1e3
        if i >= len(widths):  # past the warm-up round
            for k, v in split.items():
                parts[w][k].append(v)
            for k, v in shape_ms.items():
                by_shape[w][k].append(v)

    weights = sum(roofline.packed_bytes(*s) * n for s, n in shapes.items())
    exe = roofline.build_helper(tmp)
    bw = roofline.helper(exe, "bandwidth", weights, args.threads)
    path = int4.paths()[0] if int4.paths() else "avx2"
    peak = roofline.helper(exe, "peak", path, args.threads)
    print(f"# host limits: read bandwidth {bw:.1f} GB/s over {weights / 1e9:.2f} GB, int8 peak ({path}) {peak:.1f} "
          f"G products/s, {args.threads} threads")
    keys = ["pass", "layer matmuls", "head matmuls", "attention"]
    others = sorted({k for w in widths for k in parts[w]} - set(keys) - {"outside nodes"},
                    key=lambda k: -statistics.median(parts[widths[-1]].get(k, [0])))
    keys += others + ["outside nodes"]
    med = {w: {k: statistics.median(parts[w][k]) if parts[w].get(k) else 0.0 for k in keys} for w in widths}
    print(f"{'ms (median)':<26}" + "".join(f"{f'width {w}':>10}" for w in widths))
    for k in keys:
        print(f"{k:<26}" + "".join(f"{med[w][k]:10.2f}" for w in widths))
    out = {"command": " ".join(sys.argv), "bandwidth_gbs": bw, "peak_gops": peak, "path": path, "ms": med,
           "roofline": {}}
    print("roofline:")
    for w in widths:
        mm = sum(n * max(roofline.packed_bytes(K, N, bs) / bw / 1e6, w * K * N / peak / 1e6)
                 for (K, N, bs), n in shapes.items())
        rest = med[w]["pass"] - med[w]["layer matmuls"] - med[w]["head matmuls"]
        roof = mm + rest
        out["roofline"][w] = {"matmuls_ms": mm, "rest_ms": rest, "pass_ms": roof, "fraction": roof / med[w]["pass"]}
        print(f"  width {w}: matmuls {med[w]['layer matmuls'] + med[w]['head matmuls']:.2f} ms measured, "
              f"{mm:.2f} at their roofline; the rest {rest:.2f} ms; pass {med[w]['pass']:.2f} ms against a roofline "
              f"of {roof:.2f} ms ({roof / med[w]['pass']:.2f} of it)")
    print("matmuls inside the pass, by shape: ms a pass (all nodes of the shape), fraction of their roofline")
    out["by_shape"] = {}
    for (K, N, bs), n in sorted(shapes.items()):
        cells = []
        for w in widths:
            ms = statistics.median(by_shape[w][K, N]) if by_shape[w].get((K, N)) else float("nan")
            roof = n * max(roofline.packed_bytes(K, N, bs) / bw / 1e6, w * K * N / peak / 1e6)
            out["by_shape"].setdefault(f"{K}x{N}", {})[w] = {"ms": ms, "roofline_ms": roof}
            cells.append(f"{ms:8.2f} {roof / ms:5.2f}")
        print(f"  {f'{K} x {N}':>13} x{n:<3}" + "".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
