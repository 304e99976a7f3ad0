"""Whether a wide pass's cost relative to one token follows the memory bandwidth of the moment, in one process:
rounds of (the read bandwidth, bench/kernels/roofline.cc over 0.9 GB with 2 threads, best of its 7 passes; then
the target's passes at widths 1, 3, 5 and 9 after a past of 300, the median of 5 each).

    python bench/results/host_states/widths.py PAIR ROUNDS
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
import roofline  # noqa: E402  (bench/kernels/roofline.py: builds the helper)
import specrt  # noqa: E402

exe = roofline.build_helper(Path(tempfile.mkdtemp()))
pair = specrt.load(sys.argv[1], threads=2, draft_model=False)
e = pair.target
rng = np.random.default_rng(0)
past, toks = rng.integers(0, 49152, (1, 300)), rng.integers(0, 49152, (1, 9))
e.truncate(0)
e.forward(past, np.array([299]))
rows = []
for _ in range(int(sys.argv[2])):
    bw = float(subprocess.run([str(exe), "bandwidth", "900000000", "2"], capture_output=True, text=True).stdout)
    t = {w: [] for w in (1, 3, 5, 9)}
    for _ in range(5):
        for w in t:
            e.truncate(300)
            t0 = time.perf_counter()
            e.forward(toks[:, :w], np.arange(w))
            t[w].append(time.perf_counter() - t0)
    m = {w: statistics.median(x) * 1e3 for w, x in t.items()}
    rows.append((bw, m))
    print(f"stream {bw:5.1f} GB/s | ms: 1 {m[1]:5.1f}  3 {m[3]:5.1f}  5 {m[5]:5.1f}  9 {m[9]:5.1f} | x one token: "
          f"3 {m[3] / m[1]:.2f}  5 {m[5] / m[1]:.2f}  9 {m[9] / m[1]:.2f}", flush=True)
bws = np.array([r[0] for r in rows])
print(f"correlation of the read bandwidth with the 5-token ratio {np.corrcoef(bws, [r[1][5] / r[1][1] for r in rows])[0, 1]:.2f}, "
      f"with the one-token time {np.corrcoef(bws, [r[1][1] for r in rows])[0, 1]:.2f}")
