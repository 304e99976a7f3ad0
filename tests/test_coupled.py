"""Coupled sampling end to end: a seeded request's tokens are the target-only sample of that seed, whatever
drafts it (drafter, draft length, auto, a batch, a job); rejection sampling only matches its own drafts."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrt.api.pair import generate_batch
from specrt.cli import main
from specrt.errors import ConfigError

PROMPTS = ["def quicksort(xs):", "The quick brown", "import numpy as np\n", "Once upon a time"]
SAMPLED = dict(temperature=0.9, top_p=0.95, max_new_tokens=24)
WAYS = [dict(draft_len=0), dict(draft_len=1, drafter="model"), dict(draft_len=4, drafter="model"),
        dict(draft_len=3, drafter="ngram"), dict(draft_len="auto", drafter="hybrid"),
        dict(draft_len="auto", drafter="model"), dict(draft_len=2, drafter="suffix")]


def test_a_coupled_seed_gives_the_target_only_sample_whatever_drafts_it(qwen_pair):
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        alone = qwen_pair.generate(prompt, seed=i, sampling="coupled", draft_len=0, **SAMPLED)
        for way in WAYS[1:]:
            res = qwen_pair.generate(prompt, seed=i, sampling="coupled", **way, **SAMPLED)
            assert res.tokens == alone.tokens, (prompt, way)
            accepted += res.stats["accepted"]
        # other seeds give other samples
        assert qwen_pair.generate(prompt, seed=i + 100, sampling="coupled", draft_len=0, **SAMPLED).tokens != alone.tokens
    assert accepted > 50  # drafts were verified and taken, not only rejected


def test_rejection_sampling_draws_follow_the_drafts(qwen_pair):
    """The contrast that makes coupling worth having: with rejection the same seed gives other samples
    under other drafts (at least one of these prompts and drafters)."""
    differ = 0
    for i, prompt in enumerate(PROMPTS):
        alone = qwen_pair.generate(prompt, seed=i, sampling="rejection", draft_len=0, **SAMPLED).tokens
        differ += any(qwen_pair.generate(prompt, seed=i, **way, **SAMPLED).tokens != alone for way in WAYS[1:4])
    assert differ > 0


def test_coupled_batch_rows_equal_the_request_alone(qwen_pair):
    alone = [qwen_pair.generate(p, seed=7, sampling="coupled", draft_len=0, **SAMPLED).tokens for p in PROMPTS]
    for draft_len in (0, 3):
        rows = generate_batch(qwen_pair, PROMPTS, batch_size=3, seed=7, sampling="coupled", draft_len=draft_len,
                              drafter="model", **SAMPLED)
        assert [r.tokens for r in rows] == alone, draft_len


def test_a_job_drafts_coupled_records_auto_and_each_is_its_target_only_sample(qwen_dir, qwen_pair, tmp_path):
    from specrt.apps.jobs import record_seed

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "temperature": 0.9, "top_p": 0.95,
                                       "sampling": "coupled"}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["batch", str(qwen_dir), "--input", str(inp), "--output", str(out),
                                  "--max-new-tokens", "24", "--batch-size", "3", "--no-progress"])
    assert r.exit_code == 0, r.output
    first = out.read_text().splitlines()
    # resumed: the output cut back to its first 3 records, the rest run again at another batch size
    out.write_text("\n".join(first[:3]) + "\n")
    r = CliRunner().invoke(main, ["batch", str(qwen_dir), "--input", str(inp), "--output", str(out),
                                  "--max-new-tokens", "24", "--batch-size", "2", "--no-progress"])
    assert r.exit_code == 0, r.output
    for lines in (first, out.read_text().splitlines()):
        recs = {json.loads(x)["id"]: json.loads(x) for x in lines}
        for i, p in enumerate(PROMPTS * 2):
            rec = recs[f"r{i}"]
            assert rec["stats"]["draft_len"] == "auto"
            want = qwen_pair.generate(p, seed=record_seed(0, json.dumps(f"r{i}")), sampling="coupled", draft_len=0,
                                      **SAMPLED)
            assert rec["tokens"] == want.tokens, i


def test_an_unknown_sampling_method_is_one_line(qwen_pair, qwen_dir):
    with pytest.raises(ConfigError, match="sampling must be one of rejection, coupled"):
        qwen_pair.generate("x", sampling="gumbel")
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x", "--sampling", "gumbel"])
    assert r.exit_code == 2 and "gumbel" in r.output
