"""Real-model checks on the Qwen2.5-Coder 0.5B -> 1.5B pair (`pytest -m real`).

Needs exported pair folders; they are not part of CI's default run. Make them with
    specrt export --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --out pairs/qwen2.5-coder-0.5b-1.5b-fp32
    specrt export ... --precision int4 --out pairs/qwen2.5-coder-0.5b-1.5b-int4
or point SPECRT_REAL_FP32 / SPECRT_REAL_INT4 at them.
"""
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FP32 = Path(os.environ.get("SPECRT_REAL_FP32", ROOT / "pairs/qwen2.5-coder-0.5b-1.5b-fp32"))
INT4 = Path(os.environ.get("SPECRT_REAL_INT4", ROOT / "pairs/qwen2.5-coder-0.5b-1.5b-int4"))
PROMPTS = [json.loads(line) for line in (ROOT / "bench/prompts/prompts.jsonl").read_text().splitlines() if line.strip()]

pytestmark = pytest.mark.real


def _pair(path):
    if not (path / "manifest.json").is_file():
        pytest.skip(f"no exported real pair at {path} (see this file's docstring)")
    import specrt

    return specrt.load(path)


@pytest.fixture(scope="module")
def fp32_pair():
    with _pair(FP32) as p:
        yield p


@pytest.fixture(scope="module")
def int4_pair():
    with _pair(INT4) as p:
        yield p


@pytest.mark.parametrize("rec", PROMPTS, ids=[r["id"] for r in PROMPTS])
def test_fp32_greedy_speculative_equals_target_only(fp32_pair, rec):
    from specrt.apps.check import first_divergence

    ids = fp32_pair.encode(rec["prompt"], chat=True)
    for k in (2, 4):
        res = first_divergence(fp32_pair, ids, 64, k)
        assert res["equal"], f"k={k}: first difference at token {res['index']}, target logit margin {res['margin']}"


@pytest.mark.parametrize("rec", PROMPTS, ids=[r["id"] for r in PROMPTS])
def test_fp32_greedy_auto_equals_target_only_for_the_lookup_drafters(fp32_pair, rec):
    """n-gram and hybrid at draft_len auto (hybrid's draft model skipping what copies emitted, on the CPU)."""
    from specrt.apps.check import first_divergence

    ids = fp32_pair.encode(rec["prompt"], chat=True)
    for drafter in ("ngram", "hybrid"):
        res = first_divergence(fp32_pair, ids, 64, "auto", drafter)
        assert res["equal"], f"{drafter}: first difference at token {res['index']}, target logit margin {res['margin']}"


@pytest.mark.parametrize("rec", PROMPTS, ids=[r["id"] for r in PROMPTS])
def test_int4_greedy_divergence_is_numerical(int4_pair, rec):
    """Through specrt's kernels (a row's numbers independent of the pass) int4 greedy speculative decoding is
    target-only decoding token for token; through onnxruntime's own it may part at a near-tie: report where,
    and fail only if the margin is not small."""
    from specrt.apps.check import first_divergence

    ids = int4_pair.encode(rec["prompt"], chat=True)
    res = first_divergence(int4_pair, ids, 64, 3)
    level = int4_pair.manifest.target.quantization["accuracy_level"]
    kernel = int4_pair.target.kernel
    if kernel is not None and kernel.invariant:
        assert res["equal"], f"first difference at token {res['index']}, margin {res['margin']} ({kernel.describe()})"
    elif not res["equal"]:
        print(f"{rec['id']}: int4 (accuracy level {level}) diverges at token {res['index']}, margin {res['margin']:.4f}")
        assert abs(res["margin"]) < (0.05 if level == 0 else 1.0)


STRUCTURED = [json.loads(line) for line in (ROOT / "bench/prompts/structured.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("rec", STRUCTURED, ids=[r["id"] for r in STRUCTURED])
def test_int4_structured_output_equals_constrained_target_only_and_parses(int4_pair, rec):
    from specrt.api import requests
    from specrt.apps.serve.tools import parse, tools_of

    tools = tools_of(rec, int4_pair.codec)
    ids = requests.prompt_ids(int4_pair.codec, int4_pair.manifest.vocab_size, messages=rec["messages"],
                              tools=tools.render if tools else None)
    g = tools.grammar if tools else requests.parse(rec)["grammar"]
    alone = int4_pair.run(ids, int4_pair.config(max_new_tokens=128, draft_len=0, grammar=g))
    spec = int4_pair.run(ids, int4_pair.config(max_new_tokens=128, draft_len="auto", drafter="hybrid", grammar=g))
    assert spec.tokens == alone.tokens and alone.finish_reason == "eos" and alone.stats["grammar_complete"]
    if tools:
        content, calls = parse(alone.text, tools)
        assert content is None and len(calls) == 1 and isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
    elif "json_schema" in rec and rec["json_schema"].get("type") == "object":
        assert set(json.loads(alone.text)) == set(rec["json_schema"]["required"])
