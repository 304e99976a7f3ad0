"""Which nodes of the portable graph onnxruntime places on the CPU when the CUDA provider is asked for
(graph capture needs every node on the GPU). Exports the tiny qwen2 pair's target (the node kinds are
those of any size) and prints the placement block of onnxruntime's verbose log."""
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


def main() -> int:
    from specrt.export.pair import ExportConfig, export_pair
    from specrt.export.tiny import make_tiny_pair

    work = Path(tempfile.mkdtemp())
    target, draft = make_tiny_pair(work / "hf")
    export_pair(ExportConfig(target=str(target), draft=str(draft), out=work / "pair", portable=True, max_len=256),
                log=lambda s: None)
    r = subprocess.run([sys.executable, "-c", CREATE, str(work / "pair/target/model.onnx")], capture_output=True, text=True)
    log = r.stdout + r.stderr
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"placed on \[CPUExecutionProvider\]", line):
            block = [line]
            for nxt in lines[i + 1:i + 60]:
                if "placed on [" in nxt:
                    break
                block.append(nxt)
            print("\n".join(block))
    print("placement lines:", *[ln for ln in lines if "placed on [" in ln or "All nodes placed" in ln], sep="\n")
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
