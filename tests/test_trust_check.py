"""`specrt check` and `specrt info` (specrt/cli/check.py, info.py; apps/check.py, info.py) and the statistics behind check."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats

from _helpers import copy_pair
from specrt.apps import check as chk
from specrt.cli.check import check
from specrt.cli.info import info


def run(cmd, *args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


def _edit_manifest(d, fn):
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------- statistics without scipy


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 5, 8, 17, 50, 101, 300])
def test_chi2_sf_matches_scipy(dof):
    xs = [1e-9, 0.1, 1.0] + [float(stats.chi2.ppf(q, dof)) for q in (1e-6, 0.01, 0.3, 0.5, 0.9, 0.999)]
    xs += [float(stats.chi2.isf(q, dof)) for q in (1e-5, 1e-10, 1e-30, 1e-100)]
    for x in xs:
        want = float(stats.chi2.sf(x, dof))
        assert chk.chi2_sf(x, dof) == pytest.approx(want, rel=1e-9, abs=1e-300), (x, dof)
    assert chk.chi2_sf(0.0, dof) == 1.0 and chk.chi2_sf(1e7, dof) == 0.0


def test_chi2_sf_rejects_bad_dof():
    for dof in (0, -1, 2.5):
        with pytest.raises(ValueError):
            chk.chi2_sf(1.0, dof)


def test_chi_square_matches_scipy_and_merges_small_bins():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(12, 20.0))  # every bin expects well over 5
    obs = rng.multinomial(2000, p)
    stat, dof, pv = chk.chi_square(obs, p)
    ref = stats.chisquare(obs, p * obs.sum())
    assert (stat, dof) == (pytest.approx(ref.statistic), 11) and pv == pytest.approx(ref.pvalue, rel=1e-9)
    # bins expecting < 5 are merged into one bin (here: 3 tiny bins -> 1)
    p2 = np.array([0.4, 0.3, 0.29, 0.004, 0.003, 0.003])
    stat, dof, pv = chk.chi_square([40, 30, 29, 1, 0, 0], p2)
    assert dof == 2 and pv > 0.5  # the rest bin (1 expected) joins the smallest kept bin
    stat, dof, pv = chk.chi_square([400, 300, 290, 4, 3, 3], p2)
    assert dof == 3  # now the rest bin expects 10
    # an outcome of probability 0 is an outright failure; a single bin is no test
    assert chk.chi_square([5, 1], [1.0, 0.0])[2] == 0.0
    assert chk.chi_square([10], [1.0]) == (0.0, 0, 1.0)


def test_noise_threshold_follows_the_quantization(qwen_pair):
    e = qwen_pair.manifest.target
    assert chk.noise_threshold(e)[0] == 0.05 and "fp32" in chk.noise_threshold(e)[1]
    q = {"method": "MatMulNBits", "bits": 4, "block_size": 32, "symmetric": True}
    for level, want in ((0, 0.05), (1, 0.05), (2, 0.5), (3, 0.5), (4, 1.0)):
        e4 = dataclasses.replace(e, precision="int4", quantization={**q, "accuracy_level": level})
        assert chk.noise_threshold(e4)[0] == want
    div = {"equal": False, "margin": 0.3}
    assert chk.classify(div, e) == "BUG"
    assert chk.classify(div, dataclasses.replace(e, precision="int4", quantization={**q, "accuracy_level": 4})) \
        == "numerical"
    assert chk.classify({"equal": False, "margin": -0.01}, e) == "numerical"
    assert chk.classify({"equal": True, "margin": None}, e) == "equal"
    # specrt's kernels on every matmul and attention node: a row's numbers do not depend on the pass, so
    # only an exact tie may part the two decodes
    from specrt.engines.int4 import Kernel

    e4 = dataclasses.replace(e, precision="int4", quantization={**q, "accuracy_level": 4})
    assert chk.noise_threshold(e4, Kernel("avx2", 17, 17, None, 4, 4))[0] == 1e-6
    assert chk.classify({"equal": False, "margin": 0.001}, e4, Kernel("avx2", 17, 17, None, 4, 4)) == "BUG"
    assert chk.noise_threshold(e4, Kernel("avx2", 17, 17, None, 0, 4, "x"))[0] == 1.0  # attention onnxruntime's
    assert chk.noise_threshold(e4, Kernel(None, 0, 17, "off", 0, 4, "off"))[0] == 1.0
    # kernels off (here: the library not built): the report says so, and what it means for the verdicts
    why = chk.noise_threshold(e4, Kernel(None, 0, 17, "specrt's int4 kernel library is not built (x)", 0, 4, "y"))[1]
    assert "specrt's kernels are off (specrt's int4 kernel library is not built (x))" in why and "near-ties" in why
    assert "kernels are off" not in chk.noise_threshold(e4, Kernel("avx2", 17, 17, None, 4, 4))[1]


def test_second_token_test_passes_on_correct_decoding(stat_pair):
    ids = stat_pair.encode("alpha beta gamma")
    res = chk.second_token_test(stat_pair, ids, samples=400)
    assert res["ok"] and res["dof"] >= 5 and res["mass_covered"] >= 0.99, res
    assert res["draft_len"] == 2 and res["drafter"] == "model"


def _accept_everything(monkeypatch):
    """A broken verifier: every draft token is accepted, whatever the target says."""
    from specrt.decoding import sampling

    def accept_all(d, p_draft, p_target, u):
        return len(d), sampling.draw(p_target[len(d)], u[len(d)])

    monkeypatch.setattr(sampling, "accept_sample", accept_all)
    monkeypatch.setattr(sampling, "accept_greedy", lambda d, logits: (len(d), int(logits[len(d)].argmax())))


def test_second_token_test_catches_a_broken_verifier(stat_pair, monkeypatch):
    _accept_everything(monkeypatch)
    res = chk.second_token_test(stat_pair, stat_pair.encode("alpha beta gamma"), samples=400)
    assert not res["ok"] and res["p_value"] < 1e-6, res


# ---------------------------------------------------------------- specrt check


def test_check_passes_on_a_good_pair(qwen_dir):
    r = run(check, qwen_dir, "--samples", 200)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("speculative (drafter model, draft_len 4, tree auto) vs target-only, 48 tokens, greedy and sampled "
                               "with coupling")
    assert [ln for ln in lines if ln.startswith("prompt ")] == [
        f"prompt {i}: greedy equal (48 tokens); sampled equal (48 tokens)" for i in range(1, 5)]
    assert "sampling: chi-square" in r.stdout and lines[-1] == "check passed"
    assert r.stderr == ""


def test_check_json_and_prompts_file(stat_dir, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "alpha beta", "chat": false}\n{"id": "b", "prompt": "gamma", "chat": false}\n')
    r = run(check, stat_dir, "--prompts", f, "--max-new-tokens", 20, "--draft-len", 3, "--samples", 100, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] and [p["id"] for p in d["prompts"]] == ["a", "b"]
    assert all(p["verdict"] == p["sampled"]["verdict"] == "equal" for p in d["prompts"])
    assert d["sampling"]["prompt"] == "a" and d["sampling"]["samples"] == 100 and d["sampling"]["ok"]
    assert (d["draft_len"], d["max_new_tokens"], d["threshold"]) == (3, 20, 0.05)


def test_check_reports_a_bug_and_exits_1(qwen_dir, monkeypatch):
    _accept_everything(monkeypatch)
    r = run(check, qwen_dir, "--samples", 0)
    assert r.exit_code == 1, r.output
    assert any(ln.startswith("prompt ") and "greedy differs at token" in ln and ": BUG;" in ln
               for ln in r.stdout.splitlines()), r.stdout
    assert r.stdout.splitlines()[-1].startswith("check FAILED: ")
    assert "sampling" not in r.stdout and "Traceback" not in r.output


def test_check_sampling_failure_exits_1(stat_dir, tmp_path, monkeypatch):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "alpha beta gamma", "chat": false}\n')
    from specrt.decoding import sampling

    def accept_all(d, p_draft, p_target, u):
        return len(d), sampling.draw(p_target[len(d)], u[len(d)])

    monkeypatch.setattr(sampling, "accept_sample", accept_all)  # greedy stays right: only sampling breaks
    r = run(check, stat_dir, "--prompts", f, "--max-new-tokens", 16)
    assert r.exit_code == 1, r.output
    assert "prompt 1: greedy equal" in r.stdout
    assert "FAILED (p < 0.0001)" in r.stdout and r.stdout.splitlines()[-1] == "check FAILED: the sampling test failed"


def test_check_compares_coupled_samples_exactly_and_reports_a_broken_verifier(qwen_dir, monkeypatch):
    """A coupled verifier that accepts every draft: greedy stays right, the sampled comparison is a BUG
    with the tokens' coupled scores far apart."""
    from specrt.decoding import sampling

    monkeypatch.setattr(sampling, "accept_coupled", lambda d, p, noise, pos: (len(d), noise.pick(p[len(d)], pos + len(d))))
    r = run(check, qwen_dir, "--samples", 0)
    assert r.exit_code == 1, r.output
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("prompt ")]
    assert all("greedy equal" in ln for ln in rows), r.stdout
    assert any("sampled differs at token" in ln and ln.endswith(": BUG") for ln in rows), r.stdout


def test_check_near_tie_is_numerical(qwen_dir, monkeypatch):
    real = chk.first_divergence

    def near_tie(pair, ids, n, k, drafter=None, sampling=None, seed=0, tree="auto"):
        d = real(pair, ids, n, k, drafter, sampling, seed, tree)
        return {**d, "equal": False, "index": 7, "margin": 0.004}

    monkeypatch.setattr(chk, "first_divergence", near_tie)
    r = run(check, qwen_dir, "--samples", 0, "--limit", 2)
    assert r.exit_code == 0, r.output
    assert ("prompt 1: greedy differs at token 7, target logit margin 0.004: numerical; sampled differs at token 7, "
            "target logit margin 0.004: numerical") in r.stdout
    assert r.stdout.splitlines()[-1] == "check passed"


def test_check_target_only_pair_uses_the_ngram_drafter(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    _edit_manifest(d, lambda m: m.update(draft=None))
    r = run(check, d, "--samples", 50, "--limit", 1)
    assert r.exit_code == 0, r.output
    assert "drafter ngram" in r.stdout


def test_first_divergence_where_one_run_ends_early(qwen_pair, monkeypatch):
    """A length difference (one decode chose EOS) is a divergence with a margin against the EOS logit."""
    ids = qwen_pair.encode("def fib(n):")
    import specrt.apps.check as mod

    real_run = qwen_pair.run

    def run_cut(prompt, cfg, *a, **kw):  # the speculative run "chooses EOS" after 5 tokens
        res = real_run(prompt, cfg, *a, **kw)
        return dataclasses.replace(res, tokens=res.tokens[:5]) if cfg.draft_len else res

    monkeypatch.setattr(qwen_pair, "run", run_cut)
    d = mod.first_divergence(qwen_pair, ids, 12, 3)
    monkeypatch.undo()
    assert d["equal"] is False and d["index"] == 5
    qwen_pair.target.truncate(0)
    prefix = ids + d["target_only"][:5]
    logits = qwen_pair.target.forward(np.array([prefix]), np.array([len(prefix) - 1]))[0, 0, :320]
    assert d["margin"] == pytest.approx(float(logits[d["target_only"][5]] - logits[2]))
    assert math.isfinite(d["margin"])


# ---------------------------------------------------------------- specrt info


def test_info_text(qwen_dir):
    r = run(info, qwen_dir)
    assert r.exit_code == 0, r.output
    out = r.stdout
    for want in ("vocab:     320 ids, EOS [2]", "max_len:   256 tokens", "max_draft_len: 8",
                 "target:    qwen2 from ", "draft:     qwen2 from ", "precision fp32", "quantization none",
                 "4 layers, 2 KV heads x head_dim 16", "2 layers, 2 KV heads x head_dim 16", "on disk",
                 "memory:    about ", "KV cache", "workspace", "available: ", "tuned:     no",
                 "engines:   onnxruntime ", "CPUExecutionProvider", "CUDAExecutionProvider",
                 "this pair's graphs run on the CPU only", "engines:   tensorrt", "no engines in this pair"):
        assert want in out, (want, out)
    assert r.stderr == ""


def test_info_untuned_line_says_what_a_request_gets(qwen_dir, qwen_pair, tmp_path):
    """The defaults come from the rule that decides them (api/requests.defaults), with a draft model and without."""
    import specrt

    line = "tuned:     no (a request gets: drafter {}, draft_len auto); run `specrt tune` on this machine"
    cfg = qwen_pair.config()
    assert (cfg.drafter, cfg.draft_len) == ("hybrid", "auto")
    assert line.format("hybrid") in run(info, qwen_dir).stdout
    assert json.loads(run(info, qwen_dir, "--json").stdout)["defaults"] == {"drafter": "hybrid", "draft_len": "auto"}
    d = copy_pair(qwen_dir, tmp_path / "solo")
    _edit_manifest(d, lambda m: m.update(draft=None))
    r = run(info, d)
    assert r.exit_code == 0, r.output
    assert line.format("ngram") in r.stdout
    with specrt.load(d) as solo:
        assert (solo.config().drafter, solo.config().draft_len) == ("ngram", "auto")


def test_info_json(qwen_dir):
    from specrt.api.memory import estimate
    from specrt.manifest import read_manifest

    r = run(info, qwen_dir, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    est = estimate(qwen_dir, read_manifest(qwen_dir))
    assert d["memory"]["total"] == est.total and d["memory"]["weights"] == est.weights
    t = d["models"]["target"]
    assert (t["model_type"], t["precision"], t["quantization"], t["layers"], t["kv_heads"], t["head_dim"]) == \
        ("qwen2", "fp32", None, 4, 2, 16)
    assert t["size_bytes"] == sum((qwen_dir / f).stat().st_size for f in t["files"])
    assert (d["vocab_size"], d["max_len"], d["max_draft_len"], d["tuned"]) == (320, 256, 8, None)
    assert d["engines"][0]["name"] == "onnxruntime" and d["engines"][0]["provider"] == "CPUExecutionProvider"


def test_info_tuned_int4_and_target_only(qwen_dir, tmp_path):
    from specrt.manifest import read_manifest

    d = copy_pair(qwen_dir, tmp_path / "p")
    hashes = {f: h for f, h in read_manifest(d).graph_hashes().items() if f.startswith("target/")}
    tuned = {"drafter": "hybrid", "draft_len": 3, "confidence_stop": 0.4, "acceptance": [0.8], "graphs": hashes,
             "costs": {"draft_s": 0.001, "target_s": {"1": 0.002}},
             "measured": {"tokens_per_s": 123.4, "speedup": 1.7, "date": "2025-01-02", "machine": "aarch64, 6 cpus"}}
    q = {"method": "MatMulNBits", "bits": 4, "block_size": 32, "accuracy_level": 4, "symmetric": True}

    def edit(m):
        m["tuned"] = tuned
        m["target"]["precision"], m["target"]["quantization"] = "int4", q
        m["draft"] = None

    _edit_manifest(d, edit)
    out = run(info, d).stdout
    assert "tuned:     drafter hybrid, draft_len 3, confidence_stop 0.4: 123.4 tok/s, 1.70x target-only " \
           "(measured 2025-01-02, aarch64, 6 cpus)" in out
    assert "quantization MatMulNBits 4-bit, block 32, accuracy level 4, symmetric" in out
    assert "draft:     none" in out and "STALE" not in out
    _edit_manifest(d, lambda m: m["tuned"].update(graphs={"target/model.onnx": "0" * 64}))
    r = run(info, d, "--json")
    assert json.loads(r.stdout)["tuned"]["stale"] is True
    assert "STALE" in run(info, d).stdout


# ---------------------------------------------------------------- on the `specrt` command


def test_registered_on_the_specrt_command(tmp_path):
    import subprocess
    import sys

    from specrt.cli import main

    assert main.commands["info"] is info and main.commands["check"] is check
    p = subprocess.run([sys.executable, "-m", "specrt.cli", "info", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"Error: pair folder not found: {tmp_path / 'nope'}"]
