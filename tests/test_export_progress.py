"""Export progress: each long step shows on a terminal, nothing elsewhere, with --quiet, or from the library."""
from __future__ import annotations

import hashlib
import io
import re
from types import SimpleNamespace

import onnx
import pytest
from click.testing import CliRunner

from _helpers import export
from specrt.cli import main
from specrt.errors import ExportError
from specrt.export.pair import ExportConfig, export_pair
from specrt.export.progress import Progress


def _timed(role: str, step: str) -> str:
    """A finished line step: the line again from its start, with its duration."""
    return rf"\r{role}: {step} \.\.\. \d+\.\d s\n"


@pytest.mark.parametrize("trace", [False, True])
def test_every_step_of_an_int4_export_is_reported(hf_tiny, tmp_path, trace):
    stream, logged = io.StringIO(), []
    target, draft = hf_tiny["qwen2"]
    out = tmp_path / "pair"
    export_pair(ExportConfig(target=str(target), draft=str(draft), out=out, max_len=64, precision="int4", trace=trace),
                log=logged.append, progress=Progress(stream))
    text = stream.getvalue()
    for role, layers in (("target", 4), ("draft", 2)):
        nodes = onnx.load(str(out / role / "model.onnx"), load_external_data=False).graph.node
        matmuls = sum(n.op_type == "MatMulNBits" for n in nodes)
        assert matmuls > 0
        if trace:
            found = [re.search(_timed(role, "loading"), text), re.search(_timed(role, "tracing"), text),
                     re.search(rf"{role}: quantizing: 100%\|[^|]*\| {matmuls}/{matmuls} ", text),  # a bar over the nodes
                     re.search(_timed(role, "writing"), text),
                     re.search(_timed(role, "quantizing the embeddings"), text)]
        else:  # a bar over the embedding, each layer and the output matrix
            found = [re.search(rf"{role}: writing the graph: 100%\|[^|]*\| {layers + 2}/{layers + 2} ", text)]
        found.append(re.search(rf"{role}: hashing: 100%\|", text))
        assert all(found), (role, found, text)
        starts = [m.start() for m in found]
        assert starts == sorted(starts)  # in the order they run
    assert text.index("target: hashing") < text.index("draft: " + ("loading" if trace else "writing the graph"))
    assert logged == [f"exporting target ({target}) ...", f"exporting draft ({draft}) ..."]  # steps go to progress


def test_the_library_is_quiet_by_default(hf_tiny, tmp_path, capsys):
    export(*hf_tiny["qwen2"], tmp_path / "pair", precision="int4")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # transformers' own loading bar included


def test_a_failed_step_ends_its_line():
    stream = io.StringIO()
    with pytest.raises(ExportError):
        with Progress(stream).of("target").step("tracing"):
            raise ExportError("no")
    assert stream.getvalue() == "target: tracing ...\n"  # the error's message starts a line of its own


@pytest.mark.parametrize("terminal,quiet", [(False, False), (True, True), (True, False)])
def test_cli_shows_progress_only_on_a_terminal_without_quiet(hf_tiny, tmp_path, monkeypatch, terminal, quiet):
    # CliRunner's stderr is not a terminal; this makes it say it is
    monkeypatch.setattr("click.testing._NamedTextIOWrapper.isatty", lambda self: terminal)
    target, draft = hf_tiny["qwen2"]
    out = tmp_path / "pair"
    args = ["export", "--target", target, "--draft", draft, "--out", out, "--max-len", 64]
    r = CliRunner().invoke(main, [str(a) for a in args + (["--quiet"] if quiet else [])])
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert f"wrote {out}" in r.stderr  # the messages stay in every case
    if terminal and not quiet:
        for role in ("target", "draft"):
            assert f"{role}: writing the graph: 100%" in r.stderr and f"{role}: hashing: 100%" in r.stderr
    else:
        lines = r.stderr.splitlines()  # the messages alone: no step, nor transformers' loading bar
        assert len(lines) == 4, lines
        assert all(line.startswith(("exporting ", "draft vocabulary: ", "wrote ")) for line in lines), lines


def test_engine_builds_are_steps(tmp_path, monkeypatch):
    """With a stand-in TensorRT: each engine's build is a timed step and its plan is hashed under a bar."""
    from specrt.engines import trt
    from specrt.export import trt_build
    from specrt.export.tiny import make_model, make_tokenizer

    # 2 KV heads x head_dim 64 in fp16: the 256-byte KV slots TensorRT's tensor addresses need
    make_model(tmp_path / "hf", make_tokenizer(), "qwen2", layers=1, hidden=128, heads=2, kv_heads=2, vocab_size=384)
    monkeypatch.setattr(trt, "require_tensorrt", lambda error=ExportError: SimpleNamespace(__version__="10.99.0"))
    monkeypatch.setattr(trt, "gpu_identity", lambda device_id=0: ("8.7", "stand-in"))
    monkeypatch.setattr(trt_build, "build_engine", lambda trt_, onnx_path, profs, plan, *a, **kw: plan.write_bytes(b"plan"))
    stream = io.StringIO()
    m = export_pair(ExportConfig(target=str(tmp_path / "hf"), draft=None, out=tmp_path / "pair", precision="fp16",
                                 engine="tensorrt", max_len=64), log=lambda s: None, progress=Progress(stream))
    text = stream.getvalue()
    assert re.search(_timed("target", "building the engine"), text), text
    assert len(re.findall(r"target: hashing: +0%", text)) == 2, text  # the graph's files, then the plan
    assert m.engines["target"]["sha256"] == hashlib.sha256(b"plan").hexdigest()
