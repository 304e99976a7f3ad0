"""A pair loaded without its draft model (`load(draft_model=False)`, `generate --drafter ngram|suffix`,
`serve --no-draft-model`, a batch job that drafts by prompt lookup): the footprint of the target alone."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import specrt
from specrt.api import memory
from specrt.cli import main
from specrt.errors import ConfigError
from specrt.manifest import read_manifest

ENV = memory.ENV_AVAILABLE


def _between(d) -> int:
    """Memory available that fits the target alone but not the pair."""
    m = read_manifest(d)
    lean, full = memory.estimate(d, m, draft=False).total, memory.estimate(d, m).total
    assert lean < full
    return (lean + full) // 2


def test_estimate_without_the_draft_leaves_out_exactly_its_parts(qwen_dir):
    m = read_manifest(qwen_dir)
    full, lean = memory.estimate(qwen_dir, m), memory.estimate(qwen_dir, m, draft=False)
    assert set(lean.weights) == set(lean.kv_cache) == set(lean.logits) == {"target"}
    for part in ("weights", "kv_cache", "logits"):
        assert getattr(lean, part)["target"] == getattr(full, part)["target"]
    draft_ws = memory.SESSION_BYTES + memory.activation_bytes(m.draft, memory.PREFILL_CHUNK["cpu"])
    assert lean.workspace == full.workspace - draft_ws
    assert full.total - lean.total == (full.weights["draft"] + full.kv_cache["draft"] + full.logits["draft"]
                                       + draft_ws)


def test_a_pair_without_its_draft_drafts_by_prompt_lookup_as_the_whole_pair_does(qwen_dir, qwen_pair):
    prompt = "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return"
    with specrt.load(qwen_dir, draft_model=False) as lone:
        assert lone.draft is None and lone.draft_left_out and qwen_pair.draft is not None
        assert "draft" not in lone.memory.weights and lone.memory.total < qwen_pair.memory.total
        assert lone.default_drafter == "ngram"
        for drafter in ("ngram", "suffix"):
            for kw in ({}, {"temperature": 0.8, "seed": 3}):
                qwen_pair.forget_caches()
                qwen_pair.state.history.clear()
                lone.state.history.clear()
                a = lone.generate(prompt, max_new_tokens=24, drafter=drafter, draft_len=4, **kw)
                b = qwen_pair.generate(prompt, max_new_tokens=24, drafter=drafter, draft_len=4, **kw)
                assert a.tokens == b.tokens and a.stats["target_passes"] == b.stats["target_passes"]
        for drafter in ("model", "hybrid"):
            with pytest.raises(ConfigError, match=f"loaded without its draft model, which drafter '{drafter}' needs"):
                lone.generate(prompt, max_new_tokens=4, drafter=drafter, draft_len=2)
        assert lone.generate(prompt, max_new_tokens=4, draft_len=0).tokens  # target only still runs


def test_a_tuned_model_drafter_gives_way_to_prompt_lookup(qwen_dir):
    with specrt.load(qwen_dir, draft_model=False) as lone:
        lone.tuned = {"drafter": "hybrid", "draft_len": "auto"}
        assert lone.default_drafter == "ngram"
        assert lone.generate("x = 1", max_new_tokens=3).tokens
        lone.tuned = {"drafter": "suffix"}
        assert lone.default_drafter == "suffix"


def test_memory_between_the_two_refuses_the_pair_with_the_way_out_and_loads_the_target(qwen_dir, monkeypatch):
    avail = _between(qwen_dir)
    monkeypatch.setenv(ENV, str(avail))
    lean = memory.estimate(qwen_dir, read_manifest(qwen_dir), draft=False).total
    with pytest.raises(specrt.PairError) as e:
        specrt.load(qwen_dir)
    msg = str(e.value)
    assert "\n" not in msg and f"leave the draft model out (about {memory.fmt(lean)}" in msg
    specrt.load(qwen_dir, draft_model=False).close()
    # the command line: prompt lookup loads only the target; the default (hybrid) needs both
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x = 1", "--max-new-tokens", "3",
                                  "--drafter", "suffix"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x = 1", "--max-new-tokens", "3"])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "leave the draft model out" in r.stderr
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x = 1", "--max-new-tokens", "3",
                                  "--draft-len", "0"])
    assert r.exit_code == 0, r.output


def test_generate_follows_a_tuned_lookup_drafter(qwen_dir, tmp_path, monkeypatch):
    """A pair `specrt tune` set to prompt lookup: a plain `generate` loads the target alone."""
    import dataclasses

    from _helpers import copy_pair
    from specrt.manifest import write_manifest

    d = copy_pair(qwen_dir, tmp_path / "tuned")
    m = read_manifest(d)
    write_manifest(d, dataclasses.replace(m, tuned={"drafter": "suffix", "draft_len": "auto", "confidence_stop": 0.0,
                                                    "graphs": m.graph_hashes()}))
    monkeypatch.setenv(ENV, str(_between(d)))
    r = CliRunner().invoke(main, ["generate", str(d), "--prompt", "x = 1", "--max-new-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["generate", str(d), "--prompt", "x = 1", "--max-new-tokens", "3", "--drafter", "model"])
    assert r.exit_code == 2 and "leave the draft model out" in r.stderr


def test_info_shows_the_footprint_without_the_draft(qwen_dir):
    m = read_manifest(qwen_dir)
    lean = memory.estimate(qwen_dir, m, draft=False).total
    r = CliRunner().invoke(main, ["info", str(qwen_dir)])
    assert r.exit_code == 0 and f"without the draft model: about {memory.fmt(lean)}" in r.stdout
    room = _between(qwen_dir)
    r = CliRunner().invoke(main, ["info", str(qwen_dir), "--budget", str(room), "--json"])
    b = json.loads(r.stdout)["budget"]
    assert b["fits"] is False and b["fits_without_draft"] is True
    r = CliRunner().invoke(main, ["info", str(qwen_dir), "--budget", str(room)])
    assert "DOES NOT FIT" in r.stdout and "fits without the draft model (drafters ngram and suffix)" in r.stdout
    r = CliRunner().invoke(main, ["info", str(qwen_dir), "--budget", str(lean - 1), "--json"])
    assert json.loads(r.stdout)["budget"]["fits_without_draft"] is False


def test_a_prompt_lookup_batch_job_runs_where_the_pair_would_not_fit(qwen_dir, tmp_path, monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"y = {i} + {i} +"}) + "\n" for i in range(4)))
    monkeypatch.setenv(ENV, str(_between(qwen_dir)))
    args = ["batch", str(qwen_dir), "--input", str(inp), "--max-new-tokens", "5", "--draft-len", "3",
            "--batch-size", "1", "--no-progress"]
    r = CliRunner().invoke(main, args + ["--output", str(tmp_path / "a.jsonl"), "--drafter", "suffix"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row.get("tokens") for row in rows)
    r = CliRunner().invoke(main, args + ["--output", str(tmp_path / "b.jsonl"), "--drafter", "model"])
    assert r.exit_code != 0 and "leave the draft model out" in r.output
    assert not (tmp_path / "b.jsonl").exists() or (tmp_path / "b.jsonl").read_bytes() == b""


def test_serve_no_draft_model_refuses_a_model_drafter(qwen_dir):
    r = CliRunner().invoke(main, ["serve", str(qwen_dir), "--no-draft-model", "--drafter", "hybrid", "--port", "0"])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "--no-draft-model" in r.stderr


def test_info_measures_the_target_alone(qwen_dir):
    r = CliRunner().invoke(main, ["info", str(qwen_dir), "--measure", "--no-draft-model", "--json"])
    assert r.exit_code == 0, r.output
    meas = json.loads(r.stdout)["measured"]
    assert meas["draft_model"] is False and meas["peak_rss"] > 0
    est = memory.estimate(qwen_dir, read_manifest(qwen_dir), tokens=meas["tokens"], draft=False)
    assert meas["estimate"] == est.total
    r = CliRunner().invoke(main, ["info", str(qwen_dir), "--no-draft-model"])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "applies to --measure" in r.stderr
