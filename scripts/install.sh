#!/usr/bin/env bash
# Install specrt with its export, trace, test, ray, serve and plots extras into the current Python (a virtual
# environment's, when one is active). torch (the trace extra's, pinned to 2.13.0) is installed first, on its own,
# so that pip picks the CPU build that lies on this machine kind's disk and never pulls a multi-GB CUDA build.
# `pip install 'specrt[export]'` alone (Hugging Face folders and GGUF files, no torch) needs none of this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[export,trace,test,ray,serve,plots]"
# pip shows no build output unless asked: say here when specrt's kernels are off, and why
$PY -c "from specrt.engines import int4; why = int4.unavailable(); why and print('warning: ' + why + ' (without them: slower wide passes, and greedy speculation equals target-only only up to near-ties)')"
