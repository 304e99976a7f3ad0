#!/usr/bin/env bash
# The GPU checks of the CUDA path (issue 7), one script, well inside 8 minutes on an H200:
#   1. tests/test_gpu.py: logits GPU vs CPU on the tiny pairs (fp32 portable, fp16), greedy speculative ==
#      greedy target-only on the GPU, and no KV tensor copied to the host (onnxruntime's profile);
#   2. bench/gpu/speed.py: target-only vs speculative round times on the real pair's shapes (random fp16
#      weights made here), next to transformers' assisted generation on the same GPU.
# Needs onnxruntime-gpu (CUDA provider), torch with CUDA and transformers (for the random models).
# Usage: bash bench/gpu/check.sh [OUT_DIR]      (TensorRT, where installed, is reported; see README)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-bench/gpu/out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
# CUDA/cuDNN from the nvidia-* pip packages (torch's), for onnxruntime's CUDA provider
NV=$($PY -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/**/lib*.so*', recursive=True)})))" 2>/dev/null)
[ -n "$NV" ] && export LD_LIBRARY_PATH="$NV${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
  $PY -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), '| torch', torch.__version__)"
  $PY -c "import tensorrt as t; print('tensorrt', t.__version__)" 2>/dev/null || echo "tensorrt: not installed (engines unverified here)"
  echo "== tests/test_gpu.py (each test in its own process: a crash names its test; full log in tests.log)"
  for t in $($PY -m pytest -q -p no:cacheprovider --collect-only tests/test_gpu.py 2>/dev/null | grep '::'); do
    timeout 60 $PY -m pytest -q -p no:cacheprovider -rs "$t" >> "$OUT/tests.log" 2>&1
    echo "exit $? $t"
  done
  echo "== nodes onnxruntime keeps on the CPU (bench/gpu/placement.py)"
  timeout 60 $PY bench/gpu/placement.py 2>&1 | grep -v "^\s*$" | head -80
  if [ -z "${SKIP_SPEED:-}" ]; then
    echo "== bench/gpu/speed.py"
    timeout 380 $PY bench/gpu/speed.py --out "$OUT" ${SPEED_ARGS:-}
  fi
  echo "== done $(date -u +%FT%TZ)"
} 2>&1 | tee "$OUT/check.log"
