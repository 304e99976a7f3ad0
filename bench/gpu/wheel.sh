#!/usr/bin/env bash
# Download onnxruntime-gpu for the GPU machine (Python 3.12, x86-64) and cut it into .whl/part-* pieces a
# device call can carry beside the working tree (64 MiB a call in all). The wheel is unpacked without its
# TensorRT provider (no TensorRT there) and recompressed with xz: 255 MB become ~200 MB, four calls.
# check.sh there unpacks the pieces into a folder that goes first on PYTHONPATH. Run here, in the
# repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${1:-1.31.1}
PART=${PART:-56m}  # one piece and the working tree (~5 MB) must fit in one call
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/dl .whl/tree
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .whl/dl "onnxruntime-gpu==$VERSION"
W=$(ls .whl/dl/*.whl)
python3 -m zipfile -e "$W" .whl/tree
rm -f .whl/tree/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
tar cf - -C .whl/tree . | xz -T0 -9 | split -b "$PART" - .whl/part-
rm -rf .whl/dl .whl/tree
ls -la .whl
