#!/usr/bin/env bash
# The GPU check, one script: on an H200 the tests take ~70 s, the placement ~20 s, the speed step up to
# SPEED_TIMEOUT (420 s: it makes and exports each model first, ~100-175 s each; its times are kept as they come):
#   1. tests/test_gpu.py, each test in its own process: GPU vs CPU logits (lean fp16, lean int4 with fp16
#      activations, portable fp32), captured CUDA graphs == uncaptured passes, greedy speculative == greedy
#      target-only on the GPU, batched decoding on the GPU, no cache-sized host copy per pass (profile);
#   2. bench/gpu/placement.py: where onnxruntime places the lean fp16 graph's nodes, and whether a session
#      with CUDA graph capture starts;
#   3. bench/gpu/speed.py: ms per pass at widths 1..5, captured and not, c and the projected speculative
#      tokens/s on the 0.5B->1.5B and 0.5B->7B shapes (random fp16 weights made there) -> OUT/summary.json.
# onnxruntime-gpu is not in the GPU machine's image and its wheel (255 MB) is bigger than one call carries:
# here, `bash bench/gpu/wheel.sh` downloads it and cuts it into .whl/part-* (git-ignored); carry .whl/part-aa,
# part-ab, ... in consecutive calls while the machine stays warm (carried paths persist), then this script
# unpacks them into a folder that goes first on PYTHONPATH (the image's CPU onnxruntime stays installed).
# specrt's int4 library (the CPU reference of the int4 tests) is built for this machine's Python: a build
# for another CPython on x86-64 is the same C library (loaded with ctypes), used through SPECRT_INT4_LIBRARY.
# Needs torch and transformers there (both in its image).
# Usage: bash bench/gpu/check.sh [OUT_DIR]; PARTS=tests,placement,speed (the default) chooses the parts,
# TESTS_K a pytest -k expression for the tests (a rerun of some).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-bench/gpu/out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
ORT_DIR=${ORT_DIR:-/tmp/ort-gpu}
if ls .whl/part-* >/dev/null 2>&1 && [ ! -d "$ORT_DIR/onnxruntime" ]; then
  mkdir -p "$ORT_DIR" && cat .whl/part-* | xz -d -T0 | tar x -C "$ORT_DIR" || echo "onnxruntime-gpu: the pieces did not unpack"
fi
[ -d "$ORT_DIR/onnxruntime" ] && PYTHONPATH="$ORT_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${SPECRT_INT4_LIBRARY:-}" ] && ! $PY -c "import sys; from specrt.engines.int4 import library; sys.exit(library() is None)" 2>/dev/null; then
  LIB=$(ls specrt/engines/_int4*.so 2>/dev/null | head -1)
  [ -n "$LIB" ] && export SPECRT_INT4_LIBRARY="$PWD/$LIB"
fi
# CUDA/cuDNN from the nvidia-* pip packages (torch's), for onnxruntime's CUDA provider
NV=$($PY -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + '/**/lib*.so*', recursive=True)})))" 2>/dev/null)
[ -n "$NV" ] && export LD_LIBRARY_PATH="$NV${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
  $PY -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), '| torch', torch.__version__)"
  $PY -c "from specrt.engines.ort import gqa_has_query_seqlens as q; print('GroupQueryAttention query_seqlens:', q())"
  $PY -c "import tensorrt as t; print('tensorrt', t.__version__)" 2>/dev/null || echo "tensorrt: not installed (engines unverified here)"
  PARTS=",${PARTS:-tests,placement,speed},"
  [[ $PARTS == *,tests,* ]] && {
  echo "== tests/test_gpu.py (each test in its own process, ${JOBS:-8} at a time: a crash names its test; logs in tests.log)"
  mkdir -p /tmp/gpu-tests
  $PY -m pytest -q -p no:cacheprovider --collect-only tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>/dev/null | grep '::' > /tmp/gpu-tests/ids
  # shellcheck disable=SC2016
  xargs -P "${JOBS:-8}" -I{} sh -c 'f=/tmp/gpu-tests/$(echo "$1" | tr -c "A-Za-z0-9_\n" _); timeout 150 '"$PY"' -m pytest -q -p no:cacheprovider -rs "$1" > "$f.log" 2>&1; echo "exit $? $1" > "$f.rc"' _ {} < /tmp/gpu-tests/ids
  while read -r t; do f=/tmp/gpu-tests/$(echo "$t" | tr -c "A-Za-z0-9_\n" _); cat "$f.rc"; cat "$f.log" >> "$OUT/tests.log"; done < /tmp/gpu-tests/ids
  }
  [[ $PARTS == *,placement,* ]] && {
  echo "== node placement of the lean fp16 graph (bench/gpu/placement.py)"
  timeout 90 $PY bench/gpu/placement.py 2>&1 | grep -v "^\s*$" | head -60
  }
  if [[ $PARTS == *,speed,* ]]; then
    echo "== bench/gpu/speed.py"
    timeout ${SPEED_TIMEOUT:-420} $PY bench/gpu/speed.py --out "$OUT" ${SPEED_ARGS:-}
  fi
  echo "== done $(date -u +%FT%TZ)"
} 2>&1 | tee "$OUT/check.log"
