"""The pair-folder defects of the second hostile probe (issue 46), one test each: a manifest integer past
Python's digit limit, bit rot under an unchanged size and mtime, manifest values out of range, a kernel
library that cannot load, a graph replaced by a link to a copy outside the pair folder."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import specrt
from _helpers import cli, copy_pair, one_line_error
from specrt.errors import PairError
from specrt.manifest import read_manifest, verify_files


def problems(d) -> list[str]:
    """The `problem:` lines of `specrt info` on a pair it finds damaged (exit code 1, no traceback)."""
    r = cli("info", d)
    assert isinstance(r.exception, SystemExit), f"unhandled {r.exception!r}\n{r.output}"
    assert r.exit_code == 1 and "Traceback" not in r.output and r.stderr == "", (r.exit_code, r.output)
    return [ln for ln in r.stdout.splitlines() if ln.startswith("problem: ")]


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _refused_everywhere(d: Path, *words: str) -> None:
    """`generate` and `load` refuse the pair in one line that holds `words`."""
    msg = one_line_error(cli("generate", d, "--prompt", "x", "--max-new-tokens", 1))
    assert all(w in msg for w in words), msg
    with pytest.raises(PairError) as e:
        specrt.load(d)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------- item 1


def test_a_manifest_integer_past_pythons_digit_limit_is_a_problem_not_a_traceback(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    text = (d / "manifest.json").read_text()
    assert '"max_len": 256' in text
    (d / "manifest.json").write_text(text.replace('"max_len": 256', '"max_len": 1' + "0" * 5000))
    found = problems(d)
    assert len(found) == 1 and "max_len" in found[0] and "5001 digits" in found[0], found
    r = cli("info", d, "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["problems"] == [found[0].removeprefix("problem: ")], r.output
    _refused_everywhere(d, "max_len", "5001 digits")


def test_a_long_integer_anywhere_in_the_manifest_is_named(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    _edit_manifest(d, lambda m: m.update(tuned={"costs": {"draft_s": "LONG"}}))
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text.replace('"LONG"', "-" + "9" * 4400))
    found = problems(d)
    assert len(found) == 1 and "tuned.costs.draft_s" in found[0] and "4400 digits" in found[0], found
    _refused_everywhere(d, "tuned.costs.draft_s")


# ---------------------------------------------------------------------------------------------- item 6


def test_info_hashes_every_graph_even_when_size_and_mtime_are_unchanged(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    m = read_manifest(d)
    verify_files(d, m.target)  # leaves the stamp that lets `load` skip an unchanged file
    f = d / m.target.path
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot: one byte flipped, size and mtime as they were
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    found = problems(d)
    assert any("does not match the sha256" in p and str(f) in p for p in found), found


# ---------------------------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("field,value", [
    ("max_len", -5), ("max_len", 0), ("vocab_size", 0), ("max_draft_len", 1000000), ("max_draft_len", 0),
    ("max_len", "256"), ("max_len", 2.5), ("max_len", True), ("eos_token_ids", [-1]), ("eos_token_ids", [10 ** 9]),
    ("target.num_layers", 0), ("target.num_kv_heads", -2), ("draft.head_dim", 0), ("target.logits_width", 0),
    ("draft.hidden_size", -1), ("target.dtype", "float8"), ("draft.graph", "magic"), ("target.weights", {"packed": -1}),
    ("tuned", [1, 2]), ("target.embedding", {"bits": 3, "block_size": 32}),
])
def test_a_manifest_value_out_of_range_is_a_problem_and_refused(qwen_dir, tmp_path, field, value):
    d = copy_pair(qwen_dir, tmp_path / "p")

    def edit(m):
        *path, key = field.split(".")
        for k in path:
            m = m[k]
        m[key] = value

    _edit_manifest(d, edit)
    found = problems(d)
    assert len(found) == 1 and field in found[0] and "manifest.json" in found[0], found
    _refused_everywhere(d, field)


def test_every_manifest_value_out_of_range_is_reported(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    _edit_manifest(d, lambda m: m.update(max_len=-5, vocab_size=0, max_draft_len=1000000))
    found = problems(d)
    assert len(found) == 3, found
    for field, value in (("max_len", "-5"), ("vocab_size", "0"), ("max_draft_len", "1000000")):
        assert any(f"{field} must be" in p and p.endswith(f"got {value}") for p in found), found
    msg = one_line_error(cli("generate", d, "--prompt", "x"))
    assert "vocab_size must be" in msg and "got 0" in msg and "2 more" in msg, msg


@pytest.mark.parametrize("depth", [100_000, 100])
def test_a_manifest_nested_too_deep_is_a_problem_not_a_recursion_error(qwen_dir, tmp_path, depth):
    d = copy_pair(qwen_dir, tmp_path / "p")
    _edit_manifest(d, lambda m: m.update(tuned="DEEP"))
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text.replace('"DEEP"', "[" * depth + "]" * depth))
    found = problems(d)
    assert len(found) == 1 and "nested more than" in found[0], found
    _refused_everywhere(d, "nested more than")


def test_the_exported_manifests_are_in_range(qwen_dir, int4_dir):
    for d in (qwen_dir, int4_dir):
        r = cli("info", d)
        assert r.exit_code == 0 and "problem:" not in r.output, r.output


# ---------------------------------------------------------------------------------------------- item 12


@pytest.mark.parametrize("name", ["/etc/passwd", "no-such-library.so"])
def test_an_int4_library_that_cannot_load_is_one_line(qwen_dir, tmp_path, name):
    lib = name if name.startswith("/") else str(tmp_path / name)
    msg = one_line_error(cli("generate", qwen_dir, "--prompt", "x", "--max-new-tokens", 1,
                             env={"SPECRT_INT4_LIBRARY": lib}))
    assert f"SPECRT_INT4_LIBRARY={lib}" in msg and "cannot load" in msg, msg


# ---------------------------------------------------------------------------------------------- item 13


@pytest.mark.parametrize("what", ["graph", "tokenizer", "folder"])
def test_a_file_linked_from_outside_the_pair_is_refused(qwen_dir, tmp_path, what):
    d = copy_pair(qwen_dir, tmp_path / "p")
    outside = tmp_path / "outside"
    outside.mkdir()
    m = read_manifest(d)
    name = {"graph": m.target.path, "tokenizer": "tokenizer.json", "folder": Path(m.draft.path).parent}[what]
    (d / name).rename(outside / Path(name).name)  # an identical copy, outside the folder
    (d / name).symlink_to(outside / Path(name).name)
    found = problems(d)
    assert found and all("leaves the pair folder" in p for p in found), found
    assert any(str(outside) in p for p in found), found
    _refused_everywhere(d, "leaves the pair folder")


def test_a_loop_of_links_is_a_problem_not_a_traceback(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    f = d / read_manifest(d).target.path
    f.unlink()
    f.symlink_to(f.name)  # a link to itself
    found = problems(d)
    assert any("cannot be resolved" in p and str(f) in p for p in found), found
    _refused_everywhere(d, "cannot be resolved")


def test_links_that_stay_inside_the_pair_are_allowed(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    f = d / read_manifest(d).target.path
    f.rename(f.with_name("real.onnx"))
    f.symlink_to("real.onnx")  # a link inside the folder, to a file inside it
    (tmp_path / "alias").symlink_to(d)  # and the pair folder reached through a link
    r = cli("info", tmp_path / "alias")
    assert r.exit_code == 0 and "problem:" not in r.output, r.output
    specrt.load(tmp_path / "alias", threads=1).close()
