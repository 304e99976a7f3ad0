"""Bad input: one clean line and a non-zero exit from the CLI, a SpecrtError subclass from the API."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import specrt
from _helpers import WORDS, copy_pair
from specrt.cli import main
from specrt.errors import ConfigError, ExportError, FetchError, PairError, SpecrtError


def invoke(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def assert_clean_error(r, match: str, usage: bool = False):
    """exit code 2, no traceback, stderr is exactly one line 'Error: ...' containing `match`.

    usage=True: a value click itself rejects; click prints its usage hint before the one Error line.
    """
    assert isinstance(r.exception, SystemExit), f"unhandled {r.exception!r}\n{r.output}"
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    if usage:
        assert lines[0].startswith("Usage: ") and [ln for ln in lines if ln.startswith("Error")] == lines[-1:]
        lines = lines[-1:]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: "), lines[0]
    assert match in lines[0], lines[0]
    assert r.stdout == ""


# ---------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def broken(qwen_dir, tmp_path_factory):
    """Copies of the Qwen2 pair with one defect each."""
    base = tmp_path_factory.mktemp("broken")
    out = {}
    d = out["corrupt"] = copy_pair(qwen_dir, base / "corrupt")
    (d / "manifest.json").write_text('{"format": "specrt-pair", "format_version": 1, ')
    d = out["version"] = copy_pair(qwen_dir, base / "version")
    m = json.loads((d / "manifest.json").read_text())
    m["format_version"] = 99
    (d / "manifest.json").write_text(json.dumps(m))
    d = out["tampered"] = copy_pair(qwen_dir, base / "tampered")
    with open(d / "target" / "model.onnx", "ab") as f:
        f.write(b"\0")
    d = out["nochat"] = copy_pair(qwen_dir, base / "nochat")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_generate_missing_pair_folder(tmp_path):
    assert_clean_error(invoke("generate", tmp_path / "nope", "--prompt", "x"), "pair folder not found")


def test_generate_folder_without_manifest(tmp_path):
    assert_clean_error(invoke("generate", tmp_path, "--prompt", "x"), "not a specrt pair folder")


def test_generate_corrupt_manifest(broken):
    assert_clean_error(invoke("generate", broken["corrupt"], "--prompt", "x"), "corrupt manifest")


def test_generate_other_format_version(broken):
    assert_clean_error(invoke("generate", broken["version"], "--prompt", "x"), "format version 99")


def test_generate_tampered_graph(broken):
    assert_clean_error(invoke("generate", broken["tampered"], "--prompt", "x"), "sha256")


def test_generate_chat_without_template(broken):
    assert_clean_error(invoke("generate", broken["nochat"], "--prompt", "x", "--chat"), "no chat template")


@pytest.mark.parametrize("args,match", [
    (["--prompt", "def x " * 200], "max_len is 256"),  # prompt alone longer than the cache
    (["--prompt", "def", "--max-new-tokens", 300], "exceeds max_len 256"),
    (["--prompt", "def", "--draft-len", 9], "max_draft_len 8"),
    (["--prompt", "def", "--temperature", -0.5], "temperature must be >= 0"),
    (["--prompt", "def", "--temperature", "nan"], "temperature must be >= 0"),
    (["--prompt", "def", "--top-p", 0], "top_p must be in (0, 1]"),
    (["--prompt", "def", "--top-p", 1.5], "top_p must be in (0, 1]"),
    (["--prompt", "def", "--top-k", -3], "top_k must be >= 0"),
    (["--prompt", "def", "--draft-window", -2], "draft_window must be an integer >= 0"),
    (["--prompt", "def", "--max-new-tokens", 0], "max_new_tokens must be >= 1"),
    (["--prompt", "def", "--stop", ""], "stop strings must not be empty"),
    (["--prompt", ""], "the prompt is empty"),
], ids=lambda a: str(a)[:40])
def test_generate_bad_settings(qwen_dir, args, match):
    assert_clean_error(invoke("generate", qwen_dir, *args), match)


@pytest.mark.parametrize("value", ["-1", "fast", "2.5"])
def test_generate_bad_draft_len(qwen_dir, value):
    r = invoke("generate", qwen_dir, "--prompt", "def", "--draft-len", value)
    assert_clean_error(r, "Invalid value for '--draft-len'", usage=True)


# ---------------------------------------------------------------- export and fetch


def test_export_incompatible_tokenizers(hf_tiny, tmp_path):
    from specrt.export.tiny import make_word_tokenizer

    target, draft = hf_tiny["qwen2"]
    other = tmp_path / "draft"
    shutil.copytree(draft, other)
    make_word_tokenizer(WORDS).save(str(other / "tokenizer.json"))
    r = invoke("export", "--target", target, "--draft", other, "--out", tmp_path / "out")
    assert_clean_error(r, "tokenizers differ at")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_export_source_not_found(hf_tiny, tmp_path):
    r = invoke("export", "--target", tmp_path / "missing", "--draft", hf_tiny["qwen2"][1], "--out", tmp_path / "o")
    assert_clean_error(r, "model source not found")


def test_export_out_not_empty(hf_tiny, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    r = invoke("export", "--target", hf_tiny["qwen2"][0], "--draft", hf_tiny["qwen2"][1], "--out", tmp_path / "out")
    assert_clean_error(r, "is not empty")


@pytest.mark.parametrize("args,match", [
    (["--max-len", 4], "max_len must be >= 16"),
    (["--max-draft-len", 0], "max_draft_len must be in 1..64"),
    (["--block-size", 33], "block_size"),
    (["--accuracy-level", 9], "accuracy_level"),
])
def test_export_bad_settings(hf_tiny, tmp_path, args, match):
    r = invoke("export", "--target", hf_tiny["qwen2"][0], "--draft", hf_tiny["qwen2"][1], "--out", tmp_path / "o",
               *args)
    assert_clean_error(r, match)


def test_export_out_is_a_file(hf_tiny, tmp_path):
    (tmp_path / "out").write_text("x")
    r = invoke("export", "--target", hf_tiny["qwen2"][0], "--draft", hf_tiny["qwen2"][1], "--out", tmp_path / "out")
    assert_clean_error(r, "out")


def test_fetch_unknown_name():
    assert_clean_error(invoke("fetch", "no-such-model"), "unknown model 'no-such-model'")


# ---------------------------------------------------------------- in a real process


def _specrt(*args, env=None, timeout=60):
    e = dict(os.environ, **(env or {}))
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "specrt.cli", *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=timeout)
    return p, time.monotonic() - t


def test_process_error_is_one_line(tmp_path):
    p, _ = _specrt("generate", tmp_path / "nope", "--prompt", "x")
    assert p.returncode == 2
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [f"Error: pair folder not found: {tmp_path / 'nope'}"]


def test_export_hub_id_without_network_fails_fast(hf_tiny, tmp_path):
    p, elapsed = _specrt("export", "--target", "someorg/somemodel", "--draft", hf_tiny["qwen2"][1],
                         "--out", tmp_path / "out", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot download someorg/somemodel"), p.stderr
    assert elapsed < 30
    assert not (tmp_path / "out").exists()
    assert not [q for q in tmp_path.iterdir() if ".partial-" in q.name]


# ---------------------------------------------------------------- the Python API


@pytest.mark.parametrize("prompt", [[-1], [320], [5, 6, 10_000], []])
def test_api_invalid_prompt_ids(qwen_pair, prompt):
    with pytest.raises(ConfigError):
        qwen_pair.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("prompt", [["a"], [3.7], [True]])
def test_api_non_integer_prompt_ids(qwen_pair, prompt):
    with pytest.raises(ConfigError):
        qwen_pair.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(draft_len=-1), "draft_len"),
    (dict(draft_len=9), "max_draft_len"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=2.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(draft_window=-1), "draft_window"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(max_new_tokens=300), "max_len"),
])
def test_api_bad_settings(qwen_pair, kw, match):
    with pytest.raises(ConfigError, match=match):
        qwen_pair.generate("def", **kw)


def test_api_prompt_too_long(qwen_pair):
    with pytest.raises(ConfigError, match="max_len"):
        qwen_pair.generate(list(range(3, 259)), max_new_tokens=1)  # 256 ids == max_len
    with pytest.raises(ConfigError, match="max_len"):
        qwen_pair.generate(list(range(3, 253)), max_new_tokens=8)  # 250 ids, fits alone, not with the output


def test_api_errors_are_specrt_errors():
    for cls in (ConfigError, ExportError, FetchError, PairError):
        assert issubclass(cls, SpecrtError) and cls is getattr(specrt, cls.__name__)


def test_api_ids_prompt_and_context_manager(qwen_dir, qwen_pair):
    ids = qwen_pair.encode("def fib(n):")
    assert ids == qwen_pair.codec.encode("def fib(n):")
    with specrt.load(qwen_dir) as pair:
        a = pair.generate(ids, max_new_tokens=16)
        assert a.tokens == pair.generate("def fib(n):", max_new_tokens=16).tokens
        import numpy as np

        assert pair.generate(np.array(ids), max_new_tokens=16).tokens == a.tokens
    assert pair.target.session is None and pair.draft.session is None  # released by the with block
