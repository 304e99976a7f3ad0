#!/usr/bin/env bash
# Download onnxruntime-gpu for the GPU machine (Python 3.12, x86-64) and split it into .whl/part-* pieces a
# device call can carry (check.sh reassembles them there). Run here, in the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${1:-1.31.1}
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/dl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .whl/dl "onnxruntime-gpu==$VERSION"
W=$(ls .whl/dl/*.whl)
basename "$W" > .whl/name
split -b 60m "$W" .whl/part-
rm -rf .whl/dl
ls -la .whl
