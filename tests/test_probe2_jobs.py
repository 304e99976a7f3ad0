"""Catalogue tests of the second hostile probe (issue 46) for batch jobs, request values and the export's
output folder: items 1 (batch part), 2, 8, 10 and 11."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _helpers import cli, copy_pair, one_line_error
from specrt.api import requests
from specrt.config import GenerationConfig, SamplingConfig
from specrt.errors import ConfigError, ExportError
from specrt.manifest import read_manifest


def batch(qwen_dir, inp, out, *extra):
    return cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 2, "--batch-size", 2,
               "--no-progress", *extra)


def write_lines(path: Path, lines) -> Path:
    """JSONL as given: str lines verbatim (JSON text a test spells itself), others through json.dumps."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines()]


def by_id(recs: list[dict]) -> dict:
    """Records with a real id, by id (each once); a malformed line's record has id null and its "line"."""
    real = [r for r in recs if r["id"] is not None]
    assert len(real) == len({json.dumps(r["id"]) for r in real}), "an id written twice"
    return {r["id"]: r for r in real}


def malformed(recs: list[dict]) -> dict[int, dict]:
    lines = [r for r in recs if r["id"] is None]
    assert all(set(r) == {"id", "line", "error"} and r["error"].startswith(f"line {r['line']}: ") for r in lines)
    assert len(lines) == len({r["line"] for r in lines}), "a malformed line written twice"
    return {r["line"]: r for r in lines}


# ---------------------------------------------------------------------------------------------- 1


def test_an_integer_past_the_digit_limit_is_an_error_record_and_the_job_goes_on(qwen_dir, tmp_path):
    huge = "1" + "0" * 5000  # Python's json raises a plain ValueError past 4,300 digits
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "x = 1"},
                                              '{"id": "a", "prompt": "x", "max_new_tokens": ' + huge + "}",
                                              '{"id": "t", "prompt": "x", "temperature": 1' + "0" * 400 + "}",
                                              {"id": "ok2", "prompt": "y = 2"}])
    out = tmp_path / "out.jsonl"
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0, r.output
    recs = records(out)
    ok = by_id(recs)
    assert "text" in ok["ok"] and "text" in ok["ok2"]
    assert "temperature" in ok["t"]["error"] and "finite" in ok["t"]["error"]  # too large for a float
    assert "4300 digits" in malformed(recs)[2]["error"]


# ---------------------------------------------------------------------------------------------- 2


def test_a_lone_surrogate_in_an_id_is_an_error_record_and_reruns_resume(qwen_dir, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [
        '{"id": "\\udc00", "prompt": "x"}',
        {"id": "ok", "prompt": "x = 1"},
        '{"id": "p", "prompt": "x\\udc00"}',
        '{"id": "s", "prompt": "x", "stop": ["a\\ud800"]}',
        '{"id": "c", "messages": [{"role": "user", "content": "h\\udc00"}]}',
        '{"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        '{"id": "r", "messages": [{"role": "\\udc00", "content": "h"}]}',
    ])
    out = tmp_path / "out.jsonl"
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0, r.output
    out.read_bytes().decode("utf-8")  # the output is valid UTF-8 text
    recs = records(out)
    assert '"id"' in malformed(recs)[1]["error"] and "not valid text" in malformed(recs)[1]["error"]
    ok = by_id(recs)
    assert "text" in ok["ok"] and len(recs) == 7
    for rid in ("p", "s", "c", "parts", "r"):
        assert "not valid text" in ok[rid]["error"], ok[rid]
    before = out.read_bytes()
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0 and "nothing to run" in r.stderr, r.output
    assert out.read_bytes() == before


# ---------------------------------------------------------------------------------------------- 10


def test_a_malformed_line_never_collides_with_a_real_id_and_resumes_once(qwen_dir, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", ["nonsense", {"id": "line:1", "prompt": "x"}, {"prompt": "no id"},
                                              {"id": "line 1", "prompt": "y"}, {"id": 1, "prompt": "z"}])
    out = tmp_path / "out.jsonl"
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0, r.output
    recs = records(out)
    bad, ok = malformed(recs), by_id(recs)
    assert sorted(bad) == [1, 3] and "not JSON" in bad[1]["error"] and 'no "id"' in bad[3]["error"]
    assert all("text" in ok[i] for i in ("line:1", "line 1", 1)) and len(recs) == 5
    # Killed after its first line (an error record): the rerun writes every other record, none twice.
    out.write_bytes(out.read_bytes().split(b"\n", 1)[0] + b"\n")
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0 and "resuming: 1 of 5" in r.stderr, r.output
    recs = records(out)
    assert sorted(malformed(recs)) == [1, 3] and sorted(map(str, by_id(recs))) == ["1", "line 1", "line:1"]
    before = out.read_bytes()
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0 and "nothing to run" in r.stderr and out.read_bytes() == before


# ---------------------------------------------------------------------------------------------- 11


def test_non_finite_numbers_and_bad_messages_are_refused_everywhere(qwen_dir, qwen_pair, tmp_path):
    from specrt.apps.serve.http import APIError, generation_config

    inf = float("inf")
    for bad in ({"temperature": inf}, {"temperature": float("nan")}, {"top_p": inf}, {"top_p": float("nan")},
                {"temperature": 10 ** 400}):
        name = next(iter(bad))
        with pytest.raises(ConfigError, match=name) as e:  # Python API, CLI, jobs: api/requests.parse
            requests.parse(bad)
        assert e.value.param == name
        with pytest.raises(ConfigError, match=name):
            qwen_pair.generate("x", max_new_tokens=2, **bad)
        with pytest.raises(APIError, match=name) as e:  # the server, through the same parse
            generation_config(qwen_pair, {"prompt": "x", **bad}, [1, 2])
        assert e.value.status == 400 and e.value.param == name
    for bad in ({"temperature": inf}, {"top_p": -inf}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingConfig(**bad)
    for v in (inf, float("nan")):
        with pytest.raises(ConfigError, match="confidence_stop"):
            GenerationConfig(confidence_stop=v)
    msg = one_line_error(cli("generate", qwen_dir, "--prompt", "x", "--max-new-tokens", 2, "--temperature", "inf"))
    assert "temperature must be >= 0 and finite, got inf" in msg
    msg = one_line_error(cli("generate", qwen_dir, "--prompt", "x", "--max-new-tokens", 2, "--confidence-stop", "inf"))
    assert "confidence_stop" in msg
    inp = write_lines(tmp_path / "in.jsonl", [
        '{"id": "inf", "prompt": "x", "temperature": Infinity}',
        '{"id": "nan", "prompt": "x", "top_p": NaN}',
        {"id": "role", "messages": [{"role": 5, "content": "hi"}]},
        {"id": "content", "messages": [{"role": "user", "content": 5}]},
        {"id": "ok", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ])
    out = tmp_path / "out.jsonl"
    r = batch(qwen_dir, inp, out)
    assert r.exit_code == 0, r.output
    recs = by_id(records(out))
    assert "temperature must be >= 0 and finite, got inf" in recs["inf"]["error"]
    assert "top_p" in recs["nan"]["error"]
    assert "'role'" in recs["role"]["error"] and "'content'" in recs["content"]["error"]
    assert "text" in recs["ok"]
    msg = one_line_error(batch(qwen_dir, inp, tmp_path / "out2.jsonl", "--temperature", "inf"))
    assert "temperature" in msg and not (tmp_path / "out2.jsonl").exists()


# ---------------------------------------------------------------------------------------------- 8


def _export(hf, out, *extra):
    return cli("export", "--target", hf[0], "--draft", hf[1], "--out", out, "--max-len", 64, *extra)


@pytest.fixture
def no_work(monkeypatch):
    """Any export that gets as far as reading its sources fails the test: the refusals come first."""
    def resolve(*a, **kw):
        raise AssertionError("the export started work")

    monkeypatch.setattr("specrt.export.load.resolve", resolve)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_export_overwrite_refuses_a_folder_that_is_not_a_pair(hf_tiny, tmp_path, no_work):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "thesis.txt").write_text("four years")
    (out / "sub" / "photo.jpg").write_bytes(b"\xff\xd8\xff")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"format": "not-specrt"}')  # not a pair's manifest
    for d in (out, tmp_path / "other"):
        before = _tree(d)
        for extra in ((), ("--overwrite",)):
            msg = one_line_error(_export(hf_tiny["qwen2"], d, *extra))
            assert str(d) in msg and "is not empty" in msg and "not a specrt pair" in msg, msg
            assert _tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "other"]  # no temporary folder


def test_export_to_the_current_folder_is_refused_at_once(hf_tiny, tmp_path, monkeypatch, no_work):
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    for out in (".", here, here / "sub" / ".."):
        for extra in ((), ("--overwrite",)):
            msg = one_line_error(_export(hf_tiny["qwen2"], out, *extra))
            assert "current folder" in msg, msg
    (here / "notes.txt").unlink()
    msg = one_line_error(_export(hf_tiny["qwen2"], "."))  # empty: still the folder the shell stands in
    assert "current folder" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]


def test_export_overwrite_still_replaces_a_pair_or_an_empty_folder(qwen_dir, hf_tiny, tmp_path):
    from _helpers import export

    pair = copy_pair(qwen_dir, tmp_path / "pair")
    assert read_manifest(pair).max_len != 64
    r = _export(hf_tiny["qwen2"], pair, "--overwrite")
    assert r.exit_code == 0, r.output
    assert read_manifest(pair).max_len == 64
    empty = tmp_path / "empty"
    empty.mkdir()
    export(*hf_tiny["qwen2"], empty, max_len=64, overwrite=True)
    assert read_manifest(empty).max_len == 64
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a specrt pair"):  # the Python API refuses it the same way
        export(*hf_tiny["qwen2"], tmp_path / "x", max_len=64, overwrite=True)
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p or ".old-" in p]
