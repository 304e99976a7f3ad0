"""`specrt bench --report` and `specrt tune --report`: the files, the numbers they are drawn from, and the page
as a browser renders it."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import specrt
from specrt.apps.report import break_even
from specrt.cli import main
from specrt.decoding.policy import Controller, CostModel

from _helpers import copy_pair

import matplotlib  # noqa: E402,F401  (the plots extra)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "bench" / "prompts" / "prompts.jsonl"
PNG = b"\x89PNG\r\n\x1a\n"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], color=True)


@pytest.fixture(scope="module")
def bench_report(same_dir, tmp_path_factory):
    """A report of the pair whose draft is its target (every greedy draft accepted), with its --json."""
    out = tmp_path_factory.mktemp("report")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p, "chat": False, "class": c}) + "\n" for i, (p, c) in
                               enumerate([("def quicksort(xs):", "code"), ("import numpy as", "code"),
                                          ("The weather today", "chat")])))
    r = invoke("bench", same_dir, "--prompts", prompts, "--limit", 3, "--max-new-tokens", 12, "--repeats", 2,
               "--draft-lens", "0,1,3,auto", "--drafters", "model,ngram", "--json", out / "bench.json",
               "--report", out / "rep")
    assert r.exit_code == 0, r.output
    assert f"report: {out / 'rep' / 'index.html'}" in r.stdout
    return out


def test_report_files_and_their_data(bench_report, same_dir):
    rep = bench_report / "rep"
    for name in ("speed.png", "acceptance.png", "costs.png", "prompts.png"):
        assert (rep / name).read_bytes()[:8] == PNG, name
    assert not (rep / "batch.png").exists()  # no --batch-sizes
    data = json.loads((rep / "report.json").read_text())
    bench = json.loads((bench_report / "bench.json").read_text())
    assert data["bench"]["rows"] == bench["rows"]  # the report draws the run the table printed
    h = data["header"]
    assert h["pair"] == str(same_dir) and h["precision"] and h["kernel"] and h["command"].startswith("specrt bench")
    max_k = json.loads((same_dir / "manifest.json").read_text())["max_draft_len"]
    costs = data["costs"]
    assert sorted(int(w) for w in costs["target_s"]) == list(range(1, max_k + 2))
    assert costs["draft_s"] > 0
    # measured over the context these prompts decode at: their median length plus half the new tokens
    with specrt.load(same_dir) as pair:
        lengths = sorted(len(pair.encode(p)) for p in ("def quicksort(xs):", "import numpy as", "The weather today"))
    assert costs["past"] == lengths[1] + 12 // 2
    # break-even: a k-draft round costs k draft passes and a (k+1)-wide target pass, over one plain pass
    # (the policy never takes a width's cost above what a wider pass measured)
    t = {int(w): s for w, s in costs["target_s"].items()}
    c = {w: min(t[v] for v in t if v >= w) for w in t}
    assert [e["k"] for e in data["break_even"]] == list(range(1, max_k + 1))
    for e in data["break_even"]:
        k = e["k"]
        assert e["model"]["tokens"] == pytest.approx((k * costs["draft_s"] + c[k + 1]) / c[1])
        assert e["lookup"]["tokens"] == pytest.approx(c[k + 1] / c[1])
        for kind in ("model", "lookup"):
            a = e[kind]["acceptance"]
            if a is not None:  # the uniform acceptance that emits exactly the break-even tokens
                assert sum(a ** i for i in range(k + 1)) == pytest.approx(e[kind]["tokens"], rel=1e-9)
            else:
                assert e[kind]["tokens"] > k + 1
    # per prompt: every prompt of every drafting setting, its speedup recomputed from the runs
    rows = {(r["drafter"], r["draft_len"]): r for r in bench["rows"]}
    base = {(x["repeat"], x["prompt"]): x["new_tokens"] / x["wall_s"] for x in rows[("none", 0)]["runs"]}
    assert set(data["per_prompt"]) == {"model 1", "model 3", "model auto", "ngram 1", "ngram 3", "ngram auto"}
    for name, points in data["per_prompt"].items():
        assert len(points) == 3
    first = data["per_prompt"]["model 3"][0]
    runs = [x for x in rows[("model", 3)]["runs"] if x["prompt"] == first["prompt"]]
    ratios = sorted(x["new_tokens"] / x["wall_s"] / base[(x["repeat"], x["prompt"])] for x in runs)
    assert first["speedup"] == pytest.approx(sum(ratios) / 2)  # the median of two repeats
    # the model draft is the target: every greedy draft is accepted at every position
    assert rows[("model", 3)]["accepted_per_position"] == [1.0, 1.0, 1.0]
    # a round of 3 accepted drafts emits 4 tokens (but a last round cut short by max_new_tokens or an EOS)
    assert 2.5 < rows[("model", 3)]["tokens_per_round"] <= 4.0
    assert 0.9 < rows[("none", 0)]["tokens_per_round"] <= 1.0


def test_report_page_embeds_every_picture(bench_report):
    page = (bench_report / "rep" / "index.html").read_text()
    for name in ("speed.png", "acceptance.png", "costs.png", "prompts.png"):
        assert f"href='{name}'" in page
    assert page.count("src='data:image/png;base64,") == 4
    assert "http://" not in page and "https://" not in page  # nothing to fetch to view it
    assert "Fastest here:" in page and "Break-even by draft length" in page


def test_report_renders_in_headless_chromium(bench_report, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")
    # a copy in another folder: the page must not need the PNGs beside it
    probe = tmp_path / "index.html"
    probe.write_text((bench_report / "rep" / "index.html").read_text() + (
        "<script>addEventListener('load', () => { const i = [...document.images]; document.body.setAttribute("
        "'data-images', i.length + ':' + i.filter(x => x.complete && x.naturalWidth > 0).length); });</script>"))
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'data-images="4:4"' in r.stdout  # every image decoded
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == []


def test_batch_report_has_throughput_and_batch_pass_costs(qwen_dir, tmp_path):
    r = invoke("bench", qwen_dir, "--prompts", PROMPTS, "--limit", 3, "--max-new-tokens", 6, "--repeats", 1,
               "--draft-lens", "0,2", "--batch-sizes", "1,2", "--drafters", "model", "--report", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    rep = tmp_path / "rep"
    assert (rep / "batch.png").read_bytes()[:8] == PNG and (rep / "costs.png").read_bytes()[:8] == PNG
    assert not (rep / "speed.png").exists()
    data = json.loads((rep / "report.json").read_text())
    assert sorted(data["costs"]["batch_s"]) == ["1", "2"] and all(s > 0 for s in data["costs"]["batch_s"].values())
    assert {(x["draft_len"], x["batch_size"]) for x in data["batch"]["rows"]} == {(0, 1), (0, 2), (2, 1), (2, 2)}
    assert "Batched: fastest at batch size" in (rep / "index.html").read_text()


def test_tune_report_names_the_choice(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    r = invoke("tune", d, "--prompts", PROMPTS, "--limit", 2, "--max-new-tokens", 6, "--draft-lens", "0,2",
               "--drafters", "model", "--confidence-stops", "0", "--dry-run", "--report", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["chosen"].startswith("drafter ") and data["header"]["command"].startswith("specrt tune")
    assert [row["draft_len"] for row in data["bench"]["rows"]] == [0, 2]
    assert "Stored by tune: drafter" in (tmp_path / "rep" / "index.html").read_text()


def test_report_without_matplotlib_is_one_line_before_measuring(qwen_dir, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from specrt.cli import main\n"
            f"main(['bench', {str(qwen_dir)!r}, '--prompt', 'hi', '--report', {str(tmp_path / 'rep')!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip() == "Error: --report needs matplotlib: pip install 'specrt[plots]'"
    assert r.stdout == "" and not (tmp_path / "rep").exists()


def test_report_into_a_file_is_refused(qwen_dir, tmp_path):
    f = tmp_path / "taken"
    f.write_text("mine")
    r = invoke("bench", qwen_dir, "--prompt", "hi", "--report", f)
    assert r.exit_code != 0 and "exists and is not a folder" in r.stderr and "Traceback" not in r.output
    assert f.read_text() == "mine"


def test_break_even_follows_the_policys_cost_model():
    # a flat target cost: a lookup draft (free) pays with any acceptance, a model draft needs its passes back
    flat = break_even({"draft_s": 0.5, "target_s": {1: 1.0, 2: 1.0, 3: 1.0}}, 3)
    assert [e["lookup"]["tokens"] for e in flat] == [1.0, 1.0, 1.0]
    assert [e["lookup"]["acceptance"] for e in flat] == [pytest.approx(0.0, abs=1e-12)] * 3
    assert flat[0]["model"]["tokens"] == 1.5 and flat[0]["model"]["acceptance"] == pytest.approx(0.5)
    # k = 3 needs 2.5 tokens: a + a^2 + a^3 = 1.5
    a = flat[2]["model"]["acceptance"]
    assert a + a * a + a ** 3 == pytest.approx(1.5)
    # an unmeasured width is the policy's interpolation, and a round that cannot pay says so
    steep = break_even({"draft_s": None, "target_s": {1: 1.0, 3: 5.0}}, 2)
    ctl = Controller(1, CostModel(target_s={1: 1.0, 3: 5.0}), free_draft=True)
    assert steep[0]["lookup"]["tokens"] == pytest.approx(ctl.cost(1)) == pytest.approx(3.0)
    assert steep[1]["lookup"] == {"tokens": 5.0, "acceptance": None} and steep[0]["model"] is None
