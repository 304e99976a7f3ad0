"""A catalogue of bad input across every command and the Python API.

Rules, for every CLI row: exit code 2 (bad input), no traceback, exactly one stderr line that
starts with "Error:" and it is the last one (commands without progress output print nothing
else on stderr), nothing on stdout. Every API row raises the documented SpecrtError subclass.
The tests after the tables check that nothing the user had is lost when a command fails.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import specrt
from _helpers import WORDS, copy_pair, export
from test_probe3 import chain_of_refs, chain_of_rules
from specrt.cli import main
from specrt.cli.check import check
from specrt.cli.info import info
from specrt.errors import ConfigError, ExportError, FetchError, PairError, SpecrtError
from specrt.manifest import sha256_file

COMMANDS = {"main": main, "info": info, "check": check}
MEM = "SPECRT_MEM_AVAILABLE_BYTES"


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _rehash(d: Path) -> None:
    """Make the manifest's sha256 entries match the graph files as they now are."""
    def fix(m):
        for role in ("target", "draft"):
            if m.get(role):
                m[role]["files"] = {f: sha256_file(d / f) for f in m[role]["files"]}
    _edit_manifest(d, fix)


@pytest.fixture(scope="module")
def bad(qwen_dir, tmp_path_factory) -> dict[str, Path]:
    """Pair folders with one defect each, and bad input files."""
    from specrt.export.tiny import make_word_tokenizer

    base = tmp_path_factory.mktemp("catalogue")
    out = {}

    def pair(name):
        out[name] = copy_pair(qwen_dir, base / name)
        return out[name]

    d = pair("corrupt_graph")  # garbage graph whose hash was "fixed": onnxruntime itself must refuse it
    (d / "target" / "model.onnx").write_bytes(os.urandom(4096))
    _rehash(d)
    d = pair("swapped")  # target and draft graphs swapped, hashes fixed: I/O does not match the manifest
    t, dr = d / "target" / "model.onnx", d / "draft" / "model.onnx"
    tmp = d / "swap.tmp"
    t.rename(tmp), dr.rename(t), tmp.rename(dr)
    _rehash(d)
    d = pair("corrupt_tokenizer")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    d = pair("replaced_tokenizer")  # a valid tokenizer of another vocabulary
    make_word_tokenizer(WORDS).save(str(d / "tokenizer.json"))
    d = pair("corrupt_tokenizer_config")
    (d / "tokenizer_config.json").write_bytes(b"\xff\xfe{")
    d = pair("missing_draft")
    (d / "draft" / "model.onnx").unlink()
    d = pair("version")
    _edit_manifest(d, lambda m: m.update(format_version=2))
    d = pair("binary_manifest")
    (d / "manifest.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    d = pair("tampered_draft")
    with open(d / "draft" / "model.onnx", "ab") as f:
        f.write(b"\0")
    d = pair("target_only")
    _edit_manifest(d, lambda m: m.update(draft=None))
    (base / "empty_dir").mkdir()
    out["empty_dir"] = base / "empty_dir"

    files = {
        "nonutf8": b'{"prompt": "caf\xe9"}\n',
        "empty": b"",
        "blank_lines": b"\n  \n",
        "notjson": b'{"prompt": "ok"}\n{"prompt": \n',
        "noprompt": b'{"id": 1, "text": "x"}\n',
        "emptyprompt": b'{"prompt": "", "chat": false}\n',
        "good": b'{"prompt": "def fib(n):", "chat": false}\n',
        "long": json.dumps({"prompt": "def x " * 300, "chat": False}).encode() + b"\n",
        "regular": b"just a file\n",
        "badgguf": b"not a gguf file at all " * 40,
        "truncgguf": b"GGUF\x03\x00\x00\x00" + b"\xff" * 60,
        "emptygguf": b"",
        "chainlark": chain_of_rules(3000).encode(),  # a chain of named rules: once a crash (issue 60)
        "refchain": chain_of_refs(1000).encode(),
        "nothing": b'{"$ref": "#"}',
    }
    for name, data in files.items():
        suffix = ".gguf" if "gguf" in name else ".jsonl"
        (base / f"{name}{suffix}").write_bytes(data)
        out[f"file.{name}"] = base / f"{name}{suffix}"
    out["file.missing"] = base / "no-such-prompts.jsonl"
    return out


def _fill(args, bad, hf, qwen_dir, tmp_path):
    subs = {"{qwen}": str(qwen_dir), "{tmp}": str(tmp_path), "{hf.target}": str(hf[0]), "{hf.draft}": str(hf[1])}
    subs |= {f"{{bad.{k}}}": str(v) for k, v in bad.items() if not k.startswith("file.")}
    subs |= {f"{{{k}}}": str(v) for k, v in bad.items() if k.startswith("file.")}
    filled = []
    for a in args:
        a = str(a)
        for k, v in subs.items():
            a = a.replace(k, v)
        filled.append(a)
    return filled


def _disk_full(path):
    return shutil._ntuple_diskusage(10 << 30, 10 << 30, 1024)  # 1 KB free


# (id, command, args, message, options). options: usage=True (click itself rejects the value: usage
# lines, then the Error line), progress=True (a progress label may precede the Error line),
# env={...}, patch=[(module, attribute, value)].
CLI = [
    # ---- fetch
    ("fetch-empty-name", "main", ["fetch", ""], "unknown model ''", {}),
    ("fetch-out-under-a-file", "main", ["fetch", "qwen2.5-coder-0.5b-instruct", "--out", "{file.regular}/sub"],
     "cannot create", {}),
    ("fetch-disk-full", "main", ["fetch", "qwen2.5-coder-0.5b-instruct", "--out", "{tmp}/models"],
     "not enough free disk space", {"patch": [("specrt.export.fetch.shutil", "disk_usage", _disk_full)]}),
    # ---- export
    ("export-corrupt-gguf", "main", ["export", "--target", "{file.badgguf}", "--out", "{tmp}/o"],
     "cannot read the model config", {}),
    ("export-truncated-gguf", "main", ["export", "--target", "{file.truncgguf}", "--out", "{tmp}/o"],
     "cannot read the model config", {}),
    ("export-empty-gguf", "main", ["export", "--target", "{file.emptygguf}", "--out", "{tmp}/o"],
     "cannot read the model config", {}),
    ("export-corrupt-gguf-draft", "main", ["export", "--target", "{hf.target}", "--draft", "{file.badgguf}",
                                           "--out", "{tmp}/o"], "cannot read the model config", {}),
    ("export-out-under-a-file", "main", ["export", "--target", "{hf.target}", "--draft", "{hf.draft}",
                                         "--out", "{file.regular}/sub/pair"], "cannot create", {}),
    ("export-disk-full-preflight", "main", ["export", "--target", "{hf.target}", "--draft", "{hf.draft}",
                                            "--out", "{tmp}/o"], "not enough disk",
     {"patch": [("specrt.export.pair.shutil", "disk_usage", _disk_full)]}),
    ("export-memory-preflight", "main", ["export", "--target", "{hf.target}", "--draft", "{hf.draft}",
                                         "--out", "{tmp}/o"], "not enough memory",
     {"patch": [("specrt.export.pair", "_mem_available", lambda: 1000)]}),
    ("export-unknown-precision", "main", ["export", "--target", "{hf.target}", "--out", "{tmp}/o", "--precision",
                                          "fp8"], "Invalid value for '--precision'", {"usage": True}),
    ("export-max-len-not-a-number", "main", ["export", "--target", "{hf.target}", "--out", "{tmp}/o", "--max-len",
                                             "lots"], "Invalid value for '--max-len'", {"usage": True}),
    # ---- generate
    # ---- generate: constraints (issue 60)
    ("generate-chain-of-rules", "main", ["generate", "{qwen}", "--prompt", "x", "--grammar", "{file.chainlark}"],
     "nest too deeply", {}),
    ("generate-chain-of-refs", "main", ["generate", "{qwen}", "--prompt", "x", "--json-schema", "{file.refchain}"],
     "nest too deeply", {}),
    ("generate-schema-matching-nothing", "main", ["generate", "{qwen}", "--prompt", "x", "--json-schema",
                                                  "{file.nothing}"], "no text matches it", {}),
    ("generate-schema-from-a-device", "main", ["generate", "{qwen}", "--prompt", "x", "--json-schema", "/dev/zero"],
     "not a regular file", {"usage": True}),
    ("generate-seed-past-int64", "main", ["generate", "{qwen}", "--prompt", "x", "--seed", str(2**64)],
     "2**63", {}),
    ("generate-corrupt-graph-hash-fixed", "main", ["generate", "{bad.corrupt_graph}", "--prompt", "x"],
     "cannot load", {}),
    ("generate-swapped-graphs", "main", ["generate", "{bad.swapped}", "--prompt", "x"],
     "does not match its manifest", {}),
    ("generate-corrupt-tokenizer", "main", ["generate", "{bad.corrupt_tokenizer}", "--prompt", "x"],
     "cannot load the tokenizer", {}),
    ("generate-replaced-tokenizer", "main", ["generate", "{bad.replaced_tokenizer}", "--prompt", "x"],
     "does not match the manifest", {}),
    ("generate-corrupt-tokenizer-config", "main", ["generate", "{bad.corrupt_tokenizer_config}", "--prompt", "x"],
     "tokenizer_config.json", {}),
    ("generate-missing-draft-graph", "main", ["generate", "{bad.missing_draft}", "--prompt", "x"],
     "missing graph file", {}),
    ("generate-binary-manifest", "main", ["generate", "{bad.binary_manifest}", "--prompt", "x"],
     "corrupt manifest", {}),
    ("generate-confidence-stop-high", "main", ["generate", "{qwen}", "--prompt", "x", "--confidence-stop", "1.5"],
     "confidence_stop must be in [0, 1)", {}),
    ("generate-confidence-stop-negative", "main", ["generate", "{qwen}", "--prompt", "x", "--confidence-stop",
                                                   "-0.1"], "confidence_stop must be in [0, 1)", {}),
    ("generate-ngram-max-zero", "main", ["generate", "{qwen}", "--prompt", "x", "--drafter", "ngram", "--ngram-max", "0"],
     "ngram_max must be in 1..16, got 0", {}),
    ("generate-ngram-max-high", "main", ["generate", "{qwen}", "--prompt", "x", "--ngram-max", "17"],
     "ngram_max must be in 1..16, got 17", {}),
    ("generate-unknown-drafter", "main", ["generate", "{qwen}", "--prompt", "x", "--drafter", "magic"],
     "Invalid value for '--drafter'", {"usage": True}),
    ("generate-model-drafter-without-draft", "main", ["generate", "{bad.target_only}", "--prompt", "x",
                                                      "--drafter", "model", "--draft-len", "2"],
     "has no draft model", {}),
    ("generate-auto-output-too-long", "main", ["generate", "{qwen}", "--prompt", "def", "--max-new-tokens", "250",
                                              "--draft-len", "auto"], "exceeds max_len 256", {}),
    ("generate-negative-seed", "main", ["generate", "{qwen}", "--prompt", "x", "--seed", "-1"], "seed", {}),
    ("generate-not-enough-memory", "main", ["generate", "{qwen}", "--prompt", "x"], "not enough memory",
     {"env": {MEM: str(1 << 20)}}),
    ("generate-bad-memory-override", "main", ["generate", "{qwen}", "--prompt", "x"], MEM, {"env": {MEM: "lots"}}),
    # ---- bench
    ("bench-non-utf8-prompts", "main", ["bench", "{qwen}", "--prompts", "{file.nonutf8}"], "is not UTF-8", {}),
    ("bench-missing-prompts", "main", ["bench", "{qwen}", "--prompts", "{file.missing}"],
     "cannot read prompts file", {}),
    ("bench-empty-prompts", "main", ["bench", "{qwen}", "--prompts", "{file.empty}"], "holds no prompts", {}),
    ("bench-blank-prompts", "main", ["bench", "{qwen}", "--prompts", "{file.blank_lines}"], "holds no prompts", {}),
    ("bench-prompt-line-not-json", "main", ["bench", "{qwen}", "--prompts", "{file.notjson}"], "notjson.jsonl:2: bad "
     "prompt line", {}),
    ("bench-prompt-line-without-prompt", "main", ["bench", "{qwen}", "--prompts", "{file.noprompt}"],
     'needs "prompt"', {}),
    ("bench-empty-prompt-line", "main", ["bench", "{qwen}", "--prompts", "{file.emptyprompt}"],
     "the prompt is empty", {}),
    ("bench-prompt-and-prompts", "main", ["bench", "{qwen}", "--prompts", "{file.emptyprompt}", "--prompt", "x"],
     "give exactly one", {}),
    ("bench-no-prompts", "main", ["bench", "{qwen}"], "give exactly one", {}),
    ("bench-unknown-drafter", "main", ["bench", "{qwen}", "--prompt", "x", "--drafters", "magic"],
     "unknown drafter 'magic'", {"progress": True}),
    ("bench-negative-temperature", "main", ["bench", "{qwen}", "--prompt", "x", "--temperature", "-1"],
     "temperature must be >= 0", {}),
    ("bench-draft-len-above-max", "main", ["bench", "{qwen}", "--prompt", "x", "--draft-lens", "0,9"],
     "max_draft_len 8", {"progress": True}),
    ("bench-repeats-zero", "main", ["bench", "{qwen}", "--prompt", "x", "--repeats", "0"], "--repeats", {}),
    ("bench-other-manifest-version", "main", ["bench", "{bad.version}", "--prompt", "x"], "format version 2", {}),
    ("bench-limit-zero", "main", ["bench", "{qwen}", "--prompts", "{file.long}", "--limit", "0"], "limit", {}),
    ("bench-json-unwritable", "main", ["bench", "{qwen}", "--prompt", "x", "--draft-lens", "0", "--repeats", "1",
                                       "--max-new-tokens", "2", "--json", "{file.regular}/out.json"], "out.json", {"progress": True}),
    # ---- tune
    ("tune-non-utf8-prompts", "main", ["tune", "{qwen}", "--prompts", "{file.nonutf8}"], "is not UTF-8", {}),
    ("tune-tampered-draft", "main", ["tune", "{bad.tampered_draft}", "--prompts", "{file.long}"], "sha256", {}),
    ("tune-empty-prompt-line", "main", ["tune", "{qwen}", "--prompts", "{file.emptyprompt}"],
     "the prompt is empty", {}),
    ("tune-draft-len-above-max", "main", ["tune", "{qwen}", "--prompts", "{file.good}", "--draft-lens", "0,9",
                                          "--dry-run"], "max_draft_len 8", {"progress": True}),
    ("tune-prompt-longer-than-max-len", "main", ["tune", "{qwen}", "--prompts", "{file.long}", "--dry-run"],
     "max_len is 256", {"progress": True}),
    ("tune-model-drafter-without-draft", "main", ["tune", "{bad.target_only}", "--prompts", "{file.good}",
                                                  "--drafters", "model", "--dry-run"], "has no draft model", {"progress": True}),
    ("tune-limit-zero", "main", ["tune", "{qwen}", "--prompts", "{file.long}", "--limit", "0", "--dry-run"], "limit", {}),
    # ---- check
    ("check-missing-pair", "check", ["{tmp}/nope"], "pair folder not found", {}),
    ("check-not-a-pair", "check", ["{bad.empty_dir}"], "not a specrt pair folder", {}),
    ("check-prompt-longer-than-max-len", "check", ["{qwen}", "--prompts", "{file.long}"],
     "prompt 1: the prompt has", {}),
    ("check-output-too-long", "check", ["{qwen}", "--max-new-tokens", "250"], "exceeds max_len 256", {}),
    ("check-draft-len-zero", "check", ["{qwen}", "--draft-len", "0"], "--draft-len must be >= 1", {}),
    ("check-draft-len-above-max", "check", ["{qwen}", "--draft-len", "9"], "max_draft_len 8", {}),
    ("check-max-new-tokens-zero", "check", ["{qwen}", "--max-new-tokens", "0"], "max_new_tokens must be >= 1", {}),
    ("check-negative-samples", "check", ["{qwen}", "--samples", "-1"], "--samples must be >= 0", {}),
    ("check-limit-zero", "check", ["{qwen}", "--limit", "0"], "--limit must be >= 1", {}),
    ("check-tampered-draft", "check", ["{bad.tampered_draft}"], "sha256", {}),
    ("check-non-utf8-prompts", "check", ["{qwen}", "--prompts", "{file.nonutf8}"], "is not UTF-8", {}),
    ("check-empty-prompt-line", "check", ["{qwen}", "--prompts", "{file.emptyprompt}"], "the prompt is empty", {}),
    ("check-draft-len-not-a-number", "check", ["{qwen}", "--draft-len", "many"], "Invalid value for '--draft-len'",
     {"usage": True}),
    ("check-swapped-graphs", "check", ["{bad.swapped}"], "does not match its manifest", {}),
    # ---- info
    ("info-missing-pair", "info", ["{tmp}/nope"], "pair folder not found", {}),
    ("info-not-a-pair", "info", ["{bad.empty_dir}"], "not a specrt pair folder", {}),
    ("info-binary-manifest", "info", ["{bad.binary_manifest}"], "corrupt manifest", {}),
    ("info-other-manifest-version", "info", ["{bad.version}", "--json"], "format version 2", {}),
    ("info-missing-graph", "info", ["{bad.missing_draft}"], "missing graph file", {}),
    ("info-bad-memory-override", "info", ["{qwen}"], MEM, {"env": {MEM: "-3"}}),
]


def _cli_param(row):
    rid, cmd, args, match, opts = row
    return pytest.param(cmd, args, match, opts, id=rid)


def assert_clean_error(r, match: str, usage: bool = False, progress: bool = False):
    assert isinstance(r.exception, SystemExit), f"unhandled {r.exception!r}\n{r.output}"
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("Error")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr
    assert lines[-1].startswith("Error: "), lines[-1]
    assert match in lines[-1], lines[-1]
    if usage:
        assert lines[0].startswith("Usage: ")
    elif not progress:
        assert len(lines) == 1, r.stderr
    assert r.stdout == "", r.stdout


@pytest.mark.parametrize("cmd,args,match,opts", [_cli_param(row) for row in CLI])
def test_cli(cmd, args, match, opts, bad, hf_tiny, qwen_dir, tmp_path, monkeypatch):
    for module, attr, value in opts.get("patch", ()):
        monkeypatch.setattr(f"{module}.{attr}", value)
    argv = _fill(args, bad, hf_tiny["qwen2"], qwen_dir, tmp_path)
    r = CliRunner().invoke(COMMANDS[cmd], argv, env=opts.get("env"))
    if cmd == "main" and argv[0] == "export":
        assert not (tmp_path / "o").exists()  # a failed export leaves no pair folder ...
        assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # ... and no temporary folder
        progress = True  # export logs its steps on stderr before it fails
    else:
        progress = opts.get("progress", False)
    assert_clean_error(r, match, usage=opts.get("usage", False), progress=progress)


# ---------------------------------------------------------------- the Python API


def _api_rows():
    def closed(pair_dir):
        p = specrt.load(pair_dir)
        p.close()
        return p.generate("x")

    def _with(pair_dir, fn):
        with specrt.load(pair_dir) as p:
            return fn(p)

    def incompatible_tokenizers(pair_dir, hf, tmp):
        from specrt.export.tiny import make_word_tokenizer

        other = tmp / "draft"
        shutil.copytree(hf[1], other)
        make_word_tokenizer(WORDS).save(str(other / "tokenizer.json"))
        try:
            export(hf[0], other, tmp / "out")
        finally:
            assert not (tmp / "out").exists()

    q = "qwen_pair"
    rows = [
        ("load-corrupt-draft-graph-unverified", PairError, "cannot load",
         lambda f: specrt.load(f["bad"]["corrupt_graph"], verify=False)),
        ("load-swapped-graphs", PairError, "does not match its manifest", lambda f: specrt.load(f["bad"]["swapped"])),
        ("load-replaced-tokenizer", PairError, "does not match the manifest",
         lambda f: specrt.load(f["bad"]["replaced_tokenizer"])),
        ("load-corrupt-tokenizer", PairError, "cannot load the tokenizer",
         lambda f: specrt.load(f["bad"]["corrupt_tokenizer"])),
        ("load-other-manifest-version", PairError, "format version 2", lambda f: specrt.load(f["bad"]["version"])),
        ("load-binary-manifest", PairError, "corrupt manifest", lambda f: specrt.load(f["bad"]["binary_manifest"])),
        ("load-tampered-draft", PairError, "sha256", lambda f: specrt.load(f["bad"]["tampered_draft"])),
        ("load-bad-threads", ConfigError, "threads", lambda f: specrt.load(f["qwen_dir"], threads=-2)),
        ("generate-after-close", PairError, "closed", lambda f: closed(f["qwen_dir"])),
        ("generate-prompt-none", ConfigError, "prompt must be a str", lambda f: f[q].generate(None)),
        ("generate-prompt-int", ConfigError, "prompt must be a str", lambda f: f[q].generate(42)),
        ("generate-prompt-bytes", ConfigError, "prompt must be a str", lambda f: f[q].generate(b"def")),
        ("generate-stop-not-strings", ConfigError, "stop must be", lambda f: f[q].generate("x", stop=[1])),
        ("generate-unknown-drafter", ConfigError, "unknown drafter", lambda f: f[q].generate("x", drafter="magic")),
        ("generate-draft-len-word", ConfigError, "draft_len", lambda f: f[q].generate("x", draft_len="fast")),
        ("generate-top-p-nan", ConfigError, "top_p", lambda f: f[q].generate("x", top_p=float("nan"))),
        ("generate-cancel-not-callable", ConfigError, "cancel must be", lambda f: f[q].generate("x", cancel=5)),
        ("generate-model-drafter-without-draft", ConfigError, "no draft model",
         lambda f: _with(f["bad"]["target_only"], lambda p: p.generate("x", draft_len=2, drafter="model"))),
        ("config-confidence-stop", ConfigError, "confidence_stop", lambda f: f[q].config(confidence_stop=1.0)),
        ("stream-prompt-too-long", ConfigError, "max_len", lambda f: f[q].stream("def x " * 300)),
        ("export-incompatible-tokenizers", ExportError, "tokenizers differ",
         lambda f: incompatible_tokenizers(f["qwen_dir"], f["hf"], f["tmp"])),
        ("export-config-precision", ExportError, "unknown precision",
         lambda f: __import__("specrt.export.pair", fromlist=["x"]).ExportConfig(target="a", draft=None,
                                                                                 out=Path("o"), precision="fp8")),
        ("fetch-unknown", FetchError, "unknown model", lambda f: __import__(
            "specrt.export.fetch", fromlist=["x"]).fetch_model("qwen-9000", out_dir=f["tmp"])),
        ("load-not-enough-memory", PairError, "re-export with --max-len 40",
         lambda f: (f["mp"].setenv(MEM, str(memory_for(f["qwen_dir"], 40))), specrt.load(f["qwen_dir"]))),
    ]
    params = [pytest.param(cls, match, fn, id=rid) for rid, cls, match, fn in rows]
    params += [
        pytest.param(ConfigError, "top_k", lambda f: f[q].generate("x", temperature=1.0, top_k=2.5), id="top-k-float"),
        pytest.param(ConfigError, "max_new_tokens", lambda f: f[q].generate("x", max_new_tokens=2.5),
                     id="max-new-tokens-float"),
        pytest.param(ConfigError, "draft_len", lambda f: f[q].generate("x", draft_len=True, max_new_tokens=3),
                     id="draft-len-bool"),
        pytest.param(ConfigError, "seed", lambda f: f[q].generate("x", temperature=1.0, seed=-1), id="seed-negative"),
    ]
    return params


def memory_for(pair_dir, positions):
    from specrt.manifest import read_manifest
    from specrt.api.memory import estimate

    est = estimate(pair_dir, read_manifest(pair_dir))
    return est.fixed() + positions * sum(est.kv_per_token.values())


@pytest.mark.parametrize("cls,match,fn", _api_rows())
def test_api(cls, match, fn, bad, qwen_dir, qwen_pair, hf_tiny, tmp_path, monkeypatch):
    monkeypatch.delenv(MEM, raising=False)
    f = {"bad": bad, "qwen_dir": qwen_dir, "qwen_pair": qwen_pair, "hf": hf_tiny["qwen2"], "tmp": tmp_path,
         "mp": monkeypatch}
    with pytest.raises(cls, match=match) as e:
        fn(f)
    assert isinstance(e.value, SpecrtError) and "\n" not in str(e.value)
    assert qwen_pair.generate("def", max_new_tokens=2).tokens  # the shared pair still works


def test_catalogue_size():
    assert len(CLI) + len(_api_rows()) >= 30
    commands = {row[2][0] if row[1] == "main" else row[1] for row in CLI}
    assert commands >= {"fetch", "export", "generate", "bench", "tune", "check", "info"}


# ---------------------------------------------------------------- nothing the user had is lost


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and not p.name.endswith(".verified")}


@pytest.fixture
def existing(qwen_dir, tmp_path):
    """A valid pair folder the user already has, and what it holds."""
    d = copy_pair(qwen_dir, tmp_path / "pair")
    return d, _snapshot(d)


def _export_cli(hf, out, *extra):
    return CliRunner().invoke(main, ["export", "--target", str(hf[0]), "--draft", str(hf[1]), "--out", str(out),
                                     "--max-len", "64", *extra])


def _intact(d: Path, snap: dict) -> None:
    assert _snapshot(d) == snap
    with specrt.load(d) as pair:
        assert len(pair.generate("def", max_new_tokens=3).tokens) == 3
    assert not [p for p in d.parent.iterdir() if ".partial-" in p.name]


def test_failed_reexport_without_overwrite_keeps_the_pair(existing, hf_tiny):
    d, snap = existing
    r = _export_cli(hf_tiny["qwen2"], d)
    assert_clean_error(r, "is not empty; choose another --out or pass --overwrite")
    _intact(d, snap)


def _enospc_on_final_rename(monkeypatch):
    real = os.replace

    def replace(src, dst, *a, **kw):
        if ".partial-" in os.path.basename(os.fspath(src)):  # the pair folder's rename, not its manifest's
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(dst))
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)


def test_disk_full_at_the_end_of_an_export_leaves_nothing(hf_tiny, tmp_path, monkeypatch):
    _enospc_on_final_rename(monkeypatch)
    r = _export_cli(hf_tiny["qwen2"], tmp_path / "out")
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines()[-1].startswith("Error: export failed writing")
    assert "No space left on device" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no pair, no temporary folder


def test_disk_full_at_the_end_of_an_overwrite_keeps_the_old_pair(existing, hf_tiny, monkeypatch):
    d, snap = existing
    _enospc_on_final_rename(monkeypatch)
    r = _export_cli(hf_tiny["qwen2"], d, "--overwrite")
    assert r.exit_code == 2 and "No space left on device" in r.stderr
    monkeypatch.undo()
    _intact(d, snap)


def _interrupt_export(monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("specrt.export.pair.export_model", interrupted)


def test_interrupted_export_leaves_nothing(hf_tiny, tmp_path, monkeypatch):
    _interrupt_export(monkeypatch)
    r = _export_cli(hf_tiny["qwen2"], tmp_path / "out")
    assert r.exit_code == 130 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines()[-1] == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_the_old_pair(existing, hf_tiny, monkeypatch):
    d, snap = existing
    _interrupt_export(monkeypatch)
    r = _export_cli(hf_tiny["qwen2"], d, "--overwrite")
    assert r.exit_code == 130 and r.stderr.strip().splitlines()[-1] == "interrupted"
    monkeypatch.undo()
    _intact(d, snap)


def test_export_over_its_own_source_is_refused(hf_tiny, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(hf_tiny["qwen2"][0], target)
    snap = _snapshot(target)
    r = CliRunner().invoke(main, ["export", "--target", str(target), "--draft", str(hf_tiny["qwen2"][1]),
                                  "--out", str(target), "--max-len", "64", "--overwrite"])
    assert r.exit_code == 2, r.output
    assert _snapshot(target) == snap


def test_failed_or_interrupted_tune_leaves_the_manifest_alone(existing, bad, monkeypatch):
    d, snap = existing
    r = CliRunner().invoke(main, ["tune", str(d), "--prompts", str(bad["file.long"])])
    assert_clean_error(r, "max_len is 256", progress=True)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("specrt.apps.tune.tune", interrupted)
    r = CliRunner().invoke(main, ["tune", str(d), "--prompts", str(bad["file.good"])])
    assert r.exit_code == 130 and r.stderr.strip().splitlines()[-1] == "interrupted"
    monkeypatch.undo()
    _intact(d, snap)


def test_fetch_disk_full_leaves_no_partial_file(tmp_path, monkeypatch):
    from specrt.export import fetch

    monkeypatch.setattr(fetch.shutil, "disk_usage", _disk_full)
    with pytest.raises(FetchError, match="not enough free disk space"):
        fetch.fetch_model("qwen2.5-coder-0.5b-instruct", out_dir=tmp_path, progress=False,
                          downloader=lambda *a: pytest.fail("must not download"))
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".gguf", ".partial")]


def test_a_busy_pair_is_refused_not_corrupted(qwen_pair):
    """Two threads on one Pair: the second is refused, the first's output is unharmed."""
    want = qwen_pair.generate("def fib(n):", max_new_tokens=12, draft_len=2).tokens
    gate, go = threading.Event(), threading.Event()
    out = {}

    def first():
        out["tokens"] = qwen_pair.generate("def fib(n):", max_new_tokens=12, draft_len=2,
                                           on_text=lambda _: (gate.set(), go.wait(5))).tokens

    t = threading.Thread(target=first)
    t.start()
    assert gate.wait(5)
    with pytest.raises(ConfigError, match="one Pair per thread"):
        qwen_pair.generate("class A:", max_new_tokens=4)
    go.set()
    t.join()
    assert out["tokens"] == want
