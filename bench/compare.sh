#!/usr/bin/env bash
# specrt against its peers, side by side in one sitting, on the real Qwen2.5-Coder pair.
# Runs one thing at a time (2 cores: anything else running skews every number) and writes
# bench/results/*.json; bench/render_results.py turns them into bench/RESULTS.md tables.
#   bash bench/compare.sh            (needs: scripts/demo.sh run once, the fp32 pair exported, peers installed)
#   SKIP_FP32=1 SKIP_TRANSFORMERS=1 SKIP_BATCH=1 bash bench/compare.sh    (without the slowest runs: ~35 min less)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results
P=bench/prompts/prompts.jsonl
INT4=pairs/qwen2.5-coder-0.5b-1.5b-int4
FP32=pairs/qwen2.5-coder-0.5b-1.5b-fp32
LIMIT=${LIMIT:-3}   # the three code-generation prompts for the peer comparison
run() { echo "== $* ($(date +%T))"; timeout 2400 "$@" || echo "!! failed: $*"; }
date -u +%FT%TZ > $OUT/when.txt
run specrt bench $INT4 --prompts $P --draft-lens 0,2,3,4,auto --drafters model --repeats 3 --max-new-tokens 128 \
    --limit $LIMIT --json $OUT/specrt_int4_code.json
[ -n "${SKIP_FP32:-}" ] || run specrt bench $FP32 --prompts $P --draft-lens 0,3,4,auto --repeats 3 --max-new-tokens 128 \
    --limit $LIMIT --json $OUT/specrt_fp32_code.json
run python bench/peers/ortgenai_peer.py --k 3,4 --repeats 3 --limit $LIMIT --json $OUT/peer_ortgenai.json
# the builder's int4 at specrt's default block size too (its own default is 32)
run python bench/peers/ortgenai_peer.py --k 3,4 --repeats 3 --limit $LIMIT --block-size 128 \
    --json $OUT/peer_ortgenai_b128.json
run python bench/peers/llamacpp_peer.py --pld 2,10 --repeats 3 --limit $LIMIT --json $OUT/peer_llamacpp.json
[ -n "${SKIP_TRANSFORMERS:-}" ] || run python bench/peers/transformers_peer.py --settings target,assisted-k4 --repeats 1 --limit $LIMIT \
    --json $OUT/peer_transformers.json
# all prompt classes (code, edit, chat) for specrt's drafters
run specrt bench $INT4 --prompts $P --draft-lens 0,2,3,auto --drafters model,ngram,hybrid --repeats 2 \
    --max-new-tokens 128 --json $OUT/specrt_int4_classes.json
# the break-even guard: the same pair with a draft that is always wrong (bench/policy/make_mismatched.py)
python bench/policy/make_mismatched.py $INT4 pairs/mismatched-int4
run specrt bench pairs/mismatched-int4 --prompts $P --draft-lens 0,2,auto --drafters model,hybrid --repeats 2 \
    --max-new-tokens 128 --json $OUT/specrt_int4_mismatched.json
# batched decoding: aggregate tokens/s per batch size (32 short requests)
[ -n "${SKIP_BATCH:-}" ] || run specrt bench $INT4 --prompts bench/prompts/batch.jsonl --batch-sizes 1,2,4,8 --draft-lens 0,2 \
    --max-new-tokens 64 --repeats 1 --json $OUT/specrt_int4_batch.json
python bench/render_results.py $OUT > $OUT/tables.md && echo "wrote $OUT/tables.md"
