"""A mismatched draft at the same cost, for the break-even guard: a copy of a pair (hard links) whose
restricted draft vocabulary is shifted by one id, so each draft row stands for the wrong token and the
draft almost never agrees with the target. `auto` must then fall back to plain decoding.

    python bench/policy/make_mismatched.py pairs/qwen2.5-coder-0.5b-1.5b-int4 pairs/mismatched-int4
(the source pair must have been exported with --draft-vocab)
"""
import json
import os
import shutil
import sys

import numpy as np

from specrt.manifest import sha256_file


def main(src: str, dst: str) -> None:
    if not os.path.isfile(f"{src}/manifest.json"):
        sys.exit(f"{src}: not a pair folder (no manifest.json)")
    m = json.load(open(f"{src}/manifest.json"))
    if not (m.get("draft") or {}).get("output_ids"):
        sys.exit(f"{src}: the draft has no restricted vocabulary (export with --draft-vocab)")
    ids = np.load(f"{src}/draft/output_ids.npy") + 1
    if ids[-1] >= m["vocab_size"]:
        sys.exit(f"{src}: the draft keeps the last id; cannot shift")
    shutil.rmtree(dst, ignore_errors=True)
    for root, _, files in os.walk(src):
        rel = os.path.relpath(root, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for f in files:
            if f not in ("manifest.json", "output_ids.npy") and not f.startswith("."):
                os.link(os.path.join(root, f), os.path.join(dst, rel, f))
    np.save(f"{dst}/draft/output_ids.npy", ids)
    m["draft"]["files"]["draft/output_ids.npy"] = sha256_file(f"{dst}/draft/output_ids.npy")
    m.pop("tuned", None)
    with open(f"{dst}/manifest.json", "w") as f:
        json.dump(m, f, indent=2)
    print(f"wrote {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
