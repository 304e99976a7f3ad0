"""A price table for bench/ab.py --table, measured as its Meter measures one (the target after two draft steps,
the draft after a 3-wide target pass, a past of 256) but in rounds, each between two probes of the read
bandwidth (bench/kernels/roofline.cc, 0.9 GB, 2 threads), so that rounds can be kept by the host's memory state:
the medians of the rounds whose two probes both read below --slow-below GB/s. Widths 1-16 measured; 32 and wider
(prompt chunks) from BASE.

    python bench/results/host_states/prices.py PAIR BASE_TABLE ROUNDS OUT [--slow-below 36]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
import roofline  # noqa: E402
import specrt  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("pair")
ap.add_argument("base", type=Path)
ap.add_argument("rounds", type=int)
ap.add_argument("out", type=Path)
ap.add_argument("--slow-below", type=float, default=36.0)
a = ap.parse_args()
exe = roofline.build_helper(Path(tempfile.mkdtemp()))
probe = lambda: float(subprocess.run([str(exe), "bandwidth", "900000000", "2"], capture_output=True, text=True).stdout)  # noqa: E731
pair = specrt.load(a.pair, threads=2)
base = json.loads(a.base.read_text())
W = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16]
t, d = pair.target, pair.draft
for e in (t, d):
    e.truncate(0)
    e.forward(np.zeros((1, 256), np.int64), np.array([255]))


def timed(engine, other, before, w):
    engine.truncate(256)
    other.truncate(256)
    for b in before:
        other.forward(np.zeros((1, b), np.int64), np.array([b - 1]))
    t0 = time.perf_counter()
    engine.forward(np.zeros((1, w), np.int64), np.array([w - 1]))
    return time.perf_counter() - t0


rows = []
for _ in range(a.rounds):
    rec = {"bw": probe(), "target": {}, "draft": {}}
    timed(t, d, [1, 1], 3), timed(d, t, [3], 1)  # the probe's process leaves the first pass after it slow: not kept
    for w in W:
        rec["target"][w] = timed(t, d, [1, 1], w)
        rec["draft"][w] = timed(d, t, [3], w)
    rec["bw2"] = probe()
    rows.append(rec)
    print(f"{rec['bw']:5.1f} -> {rec['bw2']:5.1f} GB/s  target 1 {rec['target'][1] * 1e3:5.1f} 5 "
          f"{rec['target'][5] * 1e3:5.1f}  draft 1 {rec['draft'][1] * 1e3:5.1f}", flush=True)
kept = [x for x in rows if max(x["bw"], x["bw2"]) < a.slow_below]
table = {"pattern": "drafting"}
for m in ("target", "draft"):
    table[m] = [statistics.median(x[m][w] for x in kept) for w in W] + base[m][len(W):]
a.out.write_text(json.dumps(table))
print(f"{len(kept)} of {len(rows)} rounds below {a.slow_below} GB/s;",
      {m: [round(v * 1e3, 1) for v in table[m][:len(W)]] for m in ("target", "draft")})
