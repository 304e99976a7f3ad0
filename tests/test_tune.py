"""`specrt tune` and `specrt bench`: measured settings land in the manifest and become the defaults."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import specrt
from specrt.cli import main
from specrt.errors import PairError

from _helpers import copy_pair

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "bench" / "prompts" / "prompts.jsonl"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], color=True)


def _tune(pair_dir, *extra):
    return invoke("tune", pair_dir, "--prompts", PROMPTS, "--limit", 2, "--max-new-tokens", 8,
                  "--draft-lens", "0,2,auto", "--confidence-stops", "0,0.5", *extra)


def test_tune_writes_settings_that_become_defaults(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    r = _tune(d, "--drafters", "model,ngram")
    assert r.exit_code == 0, r.output
    assert "chose drafter" in r.stdout and "measured pass costs" in r.stdout
    tuned = json.loads((d / "manifest.json").read_text())["tuned"]
    # a swept drafter when drafting won; the pair's own default when target-only (draft_len 0) won
    assert tuned["drafter"] in (("model", "ngram") if tuned["draft_len"] else ("hybrid",))
    assert tuned["draft_len"] in (0, 2, "auto") and tuned["confidence_stop"] in (0.0, 0.5)
    assert set(tuned["costs"]["target_s"]) == {str(w) for w in range(1, 10)}
    assert tuned["costs"]["draft_s"] > 0 and tuned["costs"]["draft_read_s"] >= 0
    with specrt.load(d) as pair:
        assert pair.tuned["graphs"] == pair.manifest.graph_hashes()
        cfg = pair.config(max_new_tokens=4)
        assert (cfg.draft_len, cfg.drafter, cfg.confidence_stop) == (
            tuned["draft_len"], tuned["drafter"] if tuned["draft_len"] else pair.default_drafter, tuned["confidence_stop"])
        assert pair.state.costs.target_s[1] == pytest.approx(tuned["costs"]["target_s"]["1"])  # loaded as measured
        assert pair.state.costs.draft_read_s == pytest.approx(tuned["costs"]["draft_read_s"])
        res = pair.generate("def f(x):", max_new_tokens=8)
        assert res.stats["draft_len"] == tuned["draft_len"]
        # explicit arguments still win over the tuned defaults
        assert pair.generate("def f(x):", max_new_tokens=8, draft_len=1).stats["draft_len"] == 1


def test_tune_dry_run_leaves_manifest_alone(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    before = (d / "manifest.json").read_text()
    r = _tune(d, "--drafters", "ngram", "--dry-run")
    assert r.exit_code == 0, r.output
    assert (d / "manifest.json").read_text() == before


def test_tuned_settings_for_other_graphs_are_refused(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    assert _tune(d, "--drafters", "model").exit_code == 0
    raw = json.loads((d / "manifest.json").read_text())
    raw["tuned"]["graphs"] = {k: "0" * 64 for k in raw["tuned"]["graphs"]}
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(PairError, match="tuned settings"):
        specrt.load(d)
    r = invoke("generate", d, "--prompt", "x")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines()[-1].startswith("Error: ") and "specrt tune" in r.stderr
    # tune itself can still run on it, and repairs it
    assert _tune(d, "--drafters", "model").exit_code == 0
    specrt.load(d).close()


@pytest.mark.parametrize("args, message", [
    (("--drafters", "bogus"), "unknown drafter"),
    (("--confidence-stops", "x"), "--confidence-stops"),
    (("--confidence-stops", "1.5"), "confidence_stop"),
    (("--repeats", "0"), "--repeats"),
    (("--draft-lens", "0,-2"), "draft"),
])
def test_tune_bad_input(qwen_dir, args, message):
    r = _tune(qwen_dir, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_tune_needs_prompts_file(qwen_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{not json\n')
    r = invoke("tune", qwen_dir, "--prompts", bad)
    assert r.exit_code == 2 and f"{bad}:2" in r.output


def test_bench_json_and_table(qwen_dir, tmp_path):
    out = tmp_path / "b.json"
    r = invoke("bench", qwen_dir, "--prompts", PROMPTS, "--limit", 3, "--draft-lens", "0,2", "--drafters",
               "model,hybrid", "--max-new-tokens", 8, "--repeats", 2, "--json", out)
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert [(row["drafter"], row["draft_len"]) for row in res["rows"]] == [("none", 0), ("model", 2), ("hybrid", 2)]
    base = res["rows"][0]
    assert base["speedup"] == 1.0
    for row in res["rows"]:
        for key in ("tokens_per_s", "acceptance_rate", "accepted_per_position", "tokens_per_target_pass",
                    "ttft_ms", "itl_ms", "tokens_per_s_by_class"):
            assert key in row
    assert set(base["tokens_per_s_by_class"]) == {"code"}  # the first three prompts are code generation
    assert res["peak_rss_mb"] > 0 and "best:" in r.stdout


def test_bench_batch_sizes(qwen_dir, tmp_path):
    out, prompts = tmp_path / "b.json", tmp_path / "short.jsonl"
    # prompts within the draft's catch-up window: the tiny random draft agrees with its target only on those
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "class": "code", "chat": False, "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "for i in range(10):", "import numpy as np"])))
    r = invoke("bench", qwen_dir, "--prompts", prompts, "--limit", 3, "--batch-sizes", "1,2,4", "--draft-lens",
               "0,3,auto", "--max-new-tokens", 8, "--repeats", 2, "--json", out)
    assert r.exit_code == 0, r.output
    table = r.stdout.splitlines()
    assert table[0].split()[:4] == ["draft_len", "tree", "batch", "tok/s"] and len(table) == 2 + 9
    res = json.loads(out.read_text())
    assert [(row["draft_len"], row["batch_size"]) for row in res["rows"]] == [(k, b) for k in (0, 3, "auto")
                                                                              for b in (1, 2, 4)]
    assert [row["tree"] for row in res["rows"]] == ["off"] * 3 + ["auto"] * 6
    assert all(row["tokens_per_s"] > 0 and row["tokens_per_target_pass"] > 0 for row in res["rows"])
    assert res["rows"][0]["speedup"] == 1.0 and res["rows"][0]["speculation_gain"] is None
    assert 0 < res["rows"][4]["acceptance_rate"] <= 1 and res["rows"][4]["speculation_gain"] > 0
    assert res["best_batch_size"] in (1, 2, 4) and "best: drafter model" in r.stdout


def test_bench_batch_sizes_compare_trees(qwen_dir, tmp_path):
    out = tmp_path / "b.json"
    r = invoke("bench", qwen_dir, "--prompt", "def add(a, b):", "--batch-sizes", "1,2", "--draft-lens", "0,auto",
               "--trees", "off,auto", "--max-new-tokens", 8, "--repeats", 1, "--json", out)
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [(row["draft_len"], row["tree"], row["batch_size"]) for row in rows] == [
        (0, "off", 1), (0, "off", 2), ("auto", "off", 1), ("auto", "off", 2), ("auto", "auto", 1), ("auto", "auto", 2)]
    assert all(row["tree_nodes"] >= 0 for row in rows) and "tree" in r.stdout.splitlines()[0]


@pytest.mark.parametrize("args, message", [
    (["--batch-sizes", "0,2"], "expected comma-separated integers >= 1"),
    (["--batch-sizes", "two"], "expected comma-separated integers >= 1"),
    (["--batch-sizes", "2", "--drafters", "model,ngram"], "one in --drafters"),
])
def test_bench_batch_sizes_bad_input(qwen_dir, args, message):
    r = invoke("bench", qwen_dir, "--prompt", "x", *args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_bench_reads_several_prompt_files(qwen_dir, tmp_path):
    """`--prompts` repeats: the prompts of every file, in order."""
    other = tmp_path / "more.jsonl"
    other.write_text(json.dumps({"id": "extra", "class": "edit", "prompt": "def f(x):"}) + "\n")
    out = tmp_path / "b.json"
    first = tmp_path / "first.jsonl"
    first.write_text(PROMPTS.read_text().splitlines()[0] + "\n")
    r = invoke("bench", qwen_dir, "--prompts", first, "--prompts", other, "--draft-lens", "0", "--repeats", 1,
               "--max-new-tokens", 4, "--json", out)
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["prompts"] == 2 and [run["prompt"] for run in res["rows"][0]["runs"]] == ["gen-palindrome", "extra"]


def test_shipped_prompt_files_read_together(qwen_dir):
    """bench/prompts' prompts, edits and more files, as the RESULTS commands pass them to one run: every line reads, ids are
    unique across the files (results are keyed by id), and every class the tables report is there."""
    from specrt.apps.bench import read_prompts

    pair = specrt.load(qwen_dir, check_memory=False)
    files = [ROOT / "bench" / "prompts" / f for f in ("prompts.jsonl", "edits.jsonl", "more.jsonl")]
    plist = read_prompts(files, pair)
    ids = [p.id for p in plist]
    assert len(ids) == len(set(ids)) == 27
    assert {c: sum(p.kind == c for p in plist) for c in ("chat", "code", "edit")} == {"chat": 9, "code": 9, "edit": 9}
    assert all(len(p.ids) > 10 for p in plist)
