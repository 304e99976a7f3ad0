"""A pair exported for wide passes (`--max-draft-len 16`): every front end drafts up to 16 tokens a round and
stays target-only's text; `specrt tune` measures every width up to 17; `auto` drafts long where wide passes
cost about one token's (a host whose arithmetic hides under the weight stream) and short where they do not."""
from __future__ import annotations

import json

import pytest

import specrt
from _helpers import KERNELS_RUN, FrozenCosts, cli, copy_pair, export
from specrt.api.pair import generate_batch
from specrt.decoding.controller import Controller, PolicyConfig

PROMPTS = ["def add(a, b):", "for i in range(10):", "import numpy as np"]


@pytest.fixture(scope="module")
def wide_dir(work, hf_tiny):
    d = work / "pair-int4-wide"
    if not (d / "manifest.json").exists():
        export(*hf_tiny["qwen2"], d, precision="int4", max_draft_len=16)
    return d


def test_a_wide_pair_drafts_16_tokens_a_round_and_stays_target_only(wide_dir):
    r = cli("info", wide_dir)
    assert r.exit_code == 0 and "max_draft_len: 16" in r.output
    with specrt.load(wide_dir, threads=1) as pair:
        assert pair.manifest.max_draft_len == 16 and pair.target.trees == KERNELS_RUN  # specrt's kernels where they run
        for prompt in PROMPTS:
            alone = pair.generate(prompt, max_new_tokens=40, draft_len=0)
            for kw in (dict(draft_len=16, drafter="model"), dict(draft_len=16, drafter="ngram"),
                       dict(draft_len="auto", drafter="hybrid")):
                got = pair.generate(prompt, max_new_tokens=40, **kw)
                assert got.tokens == alone.tokens, kw
            wide = pair.generate(prompt, max_new_tokens=40, draft_len=16, drafter="model").stats
            assert max(int(k) for k in wide["draft_len_hist"]) == 16  # 17-token verify passes ran
            sampled = dict(max_new_tokens=32, temperature=0.9, seed=3)
            assert (pair.generate(prompt, draft_len=16, drafter="model", **sampled).tokens
                    == pair.generate(prompt, draft_len=0, **sampled).tokens)
        rows = generate_batch(pair, PROMPTS, batch_size=2, max_new_tokens=40, draft_len=16, drafter="model")
        for prompt, row in zip(PROMPTS, rows):
            assert row.tokens == pair.generate(prompt, max_new_tokens=40, draft_len=0).tokens


def test_tune_measures_every_width_of_a_wide_pair(wide_dir, tmp_path):
    d = copy_pair(wide_dir, tmp_path / "p")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "class": "code", "chat": False, "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    r = cli("tune", d, "--prompts", prompts, "--limit", 2, "--max-new-tokens", 8, "--draft-lens", "0,16,auto",
            "--drafters", "model")
    assert r.exit_code == 0, r.output
    tuned = json.loads((d / "manifest.json").read_text())["tuned"]
    assert set(tuned["costs"]["target_s"]) == {str(w) for w in range(1, 18)}


@pytest.mark.parametrize("flat_to, draft_s, k", [(17, 0.0005, 16), (17, 0.002, 12), (6, 0.0005, 5), (6, 0.002, 5)])
def test_auto_drafts_long_where_wide_passes_are_cheap(flat_to, draft_s, k):
    """A 16-wide pair's controller at acceptance 0.9: where a pass costs one token's up to 17 wide (the stream hides
    the arithmetic: the AMX host) it drafts as far as the draft's own steps pay, up to 16; where passes cost more
    past 6 (Zen 4) it stops there."""
    target = {w: 0.030 if w <= flat_to else 0.030 + 0.004 * (w - flat_to) for w in range(1, 18)}
    assert Controller(16, FrozenCosts(draft_s=draft_s, target_s=target), PolicyConfig(prior=0.9)).choose(16) == k

