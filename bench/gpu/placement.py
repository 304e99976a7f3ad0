"""Where onnxruntime's CUDA provider places the nodes of the lean fp16 graph, and whether a session with
CUDA graph capture starts on it (capture needs every compute node on the GPU and no copy nodes). Exports
the tiny qwen2 pair's target (the node kinds are those of any size) and prints the placement lines of
onnxruntime's verbose log, then the capture session's outcome."""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

CREATE = """
import sys, onnxruntime as ort
ort.preload_dlls()
so = ort.SessionOptions(); so.log_severity_level = 0; so.log_verbosity_level = 0
ort.InferenceSession(sys.argv[1], so, providers=[("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"])
"""
CAPTURE = """
import sys, onnxruntime as ort
ort.preload_dlls()
opts = {"device_id": 0, "enable_cuda_graph": 1}
try:
    ort.InferenceSession(sys.argv[1], providers=[("CUDAExecutionProvider", opts), "CPUExecutionProvider"])
    print("capture session: started")
except Exception as e:
    print("capture session: refused:", str(e).splitlines()[0])
"""


def main() -> int:
    from specrt.export.pair import ExportConfig, export_pair
    from specrt.export.tiny import make_tiny_pair

    work = Path(tempfile.mkdtemp())
    target, draft = make_tiny_pair(work / "hf")
    export_pair(ExportConfig(target=str(target), draft=str(draft), out=work / "pair", precision="fp16", max_len=256),
                log=lambda s: None)
    graph = str(work / "pair/target/model.onnx")
    r = subprocess.run([sys.executable, "-c", CREATE, graph], capture_output=True, text=True)
    lines = (r.stdout + r.stderr).splitlines()
    print("placement lines:", *[ln for ln in lines if re.search(r"placed on \[|All nodes placed|Memcpy", ln)], sep="\n")
    c = subprocess.run([sys.executable, "-c", CAPTURE, graph], capture_output=True, text=True)
    said = [ln for ln in c.stdout.splitlines() if ln.startswith("capture session:")]  # stderr has warnings
    print(said[-1] if said else f"capture session: no answer (exit {c.returncode}): {c.stderr.strip()[-300:]}")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
