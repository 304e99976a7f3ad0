#!/usr/bin/env bash
# The GPU check of issue 21, one script, well inside 8 minutes on an H200 once onnxruntime-gpu is there:
#   1. tests/test_gpu.py, each test in its own process: GPU vs CPU logits (lean fp16, lean int4 with fp16
#      activations, portable fp32), captured CUDA graphs == uncaptured passes, greedy speculative == greedy
#      target-only on the GPU, batched decoding on the GPU, no cache-sized host copy per pass (profile);
#   2. bench/gpu/placement.py: where onnxruntime places the lean fp16 graph's nodes, and whether a session
#      with CUDA graph capture starts;
#   3. bench/gpu/speed.py: ms per pass at widths 1..5, captured and not, c and the projected speculative
#      tokens/s on the 0.5B->1.5B and 0.5B->7B shapes (random fp16 weights made there) -> OUT/summary.json.
# onnxruntime-gpu is not in the GPU machine's image and its wheel (255 MB) is bigger than one call carries:
# here, `bash bench/gpu/wheel.sh` downloads and splits it into .whl/ (git-ignored); carry .whl/part-aa,
# part-ab, ... in consecutive calls while the machine stays warm (carried paths persist), then this script
# reassembles and installs it. Needs torch and transformers there (both in its image).
# Usage: bash bench/gpu/check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-bench/gpu/out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if ls .whl/part-* >/dev/null 2>&1 && ! $PY -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; then
  NAME=$(cat .whl/name)
  cat .whl/part-* > "/tmp/$NAME"  # the CPU wheel provides the same module: it goes first
  $PY -m pip uninstall -q -y onnxruntime 2>/dev/null; $PY -m pip install -q --no-deps "/tmp/$NAME" 2>&1 | tail -2
fi
# CUDA/cuDNN from the nvidia-* pip packages (torch's), for onnxruntime's CUDA provider
NV=$($PY -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/**/lib*.so*', recursive=True)})))" 2>/dev/null)
[ -n "$NV" ] && export LD_LIBRARY_PATH="$NV${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
  $PY -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), '| torch', torch.__version__)"
  $PY -c "from specrt.engines.ort import gqa_has_query_seqlens as q; print('GroupQueryAttention query_seqlens:', q())"
  $PY -c "import tensorrt as t; print('tensorrt', t.__version__)" 2>/dev/null || echo "tensorrt: not installed (engines unverified here)"
  echo "== tests/test_gpu.py (each test in its own process: a crash names its test; full log in tests.log)"
  for t in $($PY -m pytest -q -p no:cacheprovider --collect-only tests/test_gpu.py 2>/dev/null | grep '::'); do
    timeout 90 $PY -m pytest -q -p no:cacheprovider -rs "$t" >> "$OUT/tests.log" 2>&1
    echo "exit $? $t"
  done
  echo "== node placement of the lean fp16 graph (bench/gpu/placement.py)"
  timeout 90 $PY bench/gpu/placement.py 2>&1 | grep -v "^\s*$" | head -60
  if [ -z "${SKIP_SPEED:-}" ]; then
    echo "== bench/gpu/speed.py"
    timeout 330 $PY bench/gpu/speed.py --out "$OUT" ${SPEED_ARGS:-}
  fi
  echo "== done $(date -u +%FT%TZ)"
} 2>&1 | tee "$OUT/check.log"
