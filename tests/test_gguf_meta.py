"""A GGUF's config and tokenizer read without torch (export/gguf_meta.py), held to transformers' own GGUF path (which
imports torch): the same config, byte-equal tokenizer files, the same encodings, decodings and chat prompts; and a
GGUF pair exported where torch cannot be imported, file for file the pair the transformers path exports.

The tiny GGUFs are written as llama.cpp writes them (tests/_gguf.py): Qwen2 and Qwen3 with Qwen's byte-level
tokenizer, Llama with Llama 3's (llama-bpe), Mistral as a llama file named "mistral" with a sentencepiece
vocabulary, as Mistral 7B's GGUFs hold. The real Qwen2.5-Coder files: `pytest -m real -k export`."""
from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _gguf import write_gguf
from _helpers import export
from specrt.errors import ExportError
from specrt.export import load
from specrt.manifest import read_manifest

FAMILIES = ("qwen2", "llama", "qwen3", "mistral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEXTS = [
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade naïve; 日本語のテキスト, 中文, 한국어, Ελληνικά.",
    "emoji 🙂🚀 and combining e\u0301, tabs\tand  double  spaces,\n\n\nnewlines\r\n and trailing   ",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F, urls https://example.com/a?b=c&d=e#f",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><s></s><unk>[INST] x [/INST]",
    "    indented\n\tcode {\"json\": [1, 2, {\"k\": null}]} // comment /* block */ 'quotes' \"double\"",
    "",
    " ",
]
MESSAGES = [{"role": "user", "content": "Write a quicksort in Python."},
            {"role": "assistant", "content": "def qs(xs): return xs"}, {"role": "user", "content": "Thanks! 🙂"}]


@pytest.fixture(scope="module")
def ggufs(hf_families, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each family's tiny target and draft as GGUF files, the token list padded to the draft's rows."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ggufs")
    files = {}
    for family in FAMILIES:
        arch = "llama" if family == "mistral" else family
        (out / family).mkdir()
        for role, folder in zip(("target", "draft"), hf_families[family]):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            write_gguf(out / family / f"{role}.gguf", arch, model, tokenizer=folder, spm=family == "mistral",
                       name=family if family == "mistral" else f"tiny {family}", tokens=352)
        files[family] = (out / family / "target.gguf", out / family / "draft.gguf")
    return files


def _transformers_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _transformers_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)


def _same_tokenizer(ours: Path, theirs: Path, texts: list[str]) -> None:
    """Byte-equal files, and (what the runtime does with them) equal ids, texts and chat prompts."""
    from specrt.api.text import TextCodec

    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(ours / name, theirs / name, shallow=False), name
    a, b = TextCodec(ours), TextCodec(theirs)
    specials = "".join(t.content for t in a.tokenizer.get_added_tokens_decoder().values())
    for text in [*texts, specials]:
        ids = a.tokenizer.encode(text).ids  # with the post-processor's BOS where the tokenizer adds one
        assert ids == b.tokenizer.encode(text).ids and a.encode(text) == b.encode(text)
        assert a.decode(ids) == b.decode(ids)
    assert a.apply_chat_template(MESSAGES) == b.apply_chat_template(MESSAGES)
    prompt = a.apply_chat_template(MESSAGES)
    assert a.encode(prompt) == b.encode(prompt)


def _same_as_transformers(path: Path, tmp: Path, texts: list[str]) -> None:
    src = load.resolve(str(path))
    assert load.load_config(src).to_dict() == _transformers_config(path).to_dict()
    load.save_tokenizer(src, tmp / "ours")
    _transformers_tokenizer(path, tmp / "theirs")
    _same_tokenizer(tmp / "ours", tmp / "theirs", texts)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_and_tokenizer_are_transformers(ggufs, tmp_path, family):
    for path in ggufs[family]:
        _same_as_transformers(path, tmp_path / path.stem, TEXTS)
    if family == "mistral":  # transformers' rename of a llama file named "mistral", and the sentencepiece vocabulary
        src = load.resolve(str(ggufs[family][0]))
        assert load.load_config(src).model_type == "mistral"
        assert (tmp_path / "target" / "ours" / "tokenizer.json").read_text().count('"type": "Metaspace"') > 0


_NO_TORCH_EXPORT = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError, as where the export extra alone is installed
from pathlib import Path
from specrt.cli import main
for family, target, draft, out in zip(*[iter(sys.argv[1:])] * 4):
    try:
        main(["export", "--target", target, "--draft", draft, "--out", out, "--precision", "int4", "--max-len", "256",
              "--draft-vocab", "200", "--quiet"])
    except SystemExit as e:
        assert e.code in (0, None), (family, e.code)
"""


def _with_transformers_path(monkeypatch) -> None:
    """load's GGUF config and tokenizer through transformers' own GGUF reader (torch), as the export did before."""
    def config(src):
        return _transformers_config(src.folder / src.gguf_file)

    def tokenizer(src, out):
        _transformers_tokenizer(src.folder / src.gguf_file, out)
        return out / "tokenizer.json"

    monkeypatch.setattr(load, "load_config", config)
    monkeypatch.setattr(load, "save_tokenizer", tokenizer)


def test_gguf_pairs_export_without_torch_as_through_transformers(ggufs, tmp_path, monkeypatch):
    """Every family's GGUF pair exported by the CLI where torch cannot be imported: the manifest and every file of
    the pair (graphs, weights, tokenizer) equal to the pair exported through transformers' GGUF path."""
    args = [str(a) for f in FAMILIES for a in (f, *ggufs[f], tmp_path / f"{f}-no-torch")]
    r = subprocess.run([sys.executable, "-c", _NO_TORCH_EXPORT, *args], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "PyTorch was not found" not in r.stderr  # transformers' advice at import, about models it never loads
    _with_transformers_path(monkeypatch)
    for family in FAMILIES:
        ours, theirs = tmp_path / f"{family}-no-torch", tmp_path / family
        export(*ggufs[family], theirs, precision="int4", draft_vocab=200)
        assert read_manifest(ours) == read_manifest(theirs), family
        files = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
        for f in files:
            assert filecmp.cmp(ours / f, theirs / f, shallow=False), (family, f)


def test_traced_export_without_torch_is_one_error_line_naming_the_extra(ggufs, tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from specrt.cli import main\n"
            "main(sys.argv[1:])\n")
    target = str(ggufs["qwen2"][0])
    for flag in ("--trace", "--portable"):
        r = subprocess.run([sys.executable, "-c", code, "export", "--target", target, "--out", str(tmp_path / "o"),
                            flag], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("Error: this export traces the model with torch, which is not installed")
        assert "pip install 'specrt[trace]'" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "o").exists()



def test_a_gguf_of_another_architecture_is_refused_in_one_line(tmp_path):
    """A family neither export path writes (transformers' GGUF loader reads gemma3's config its own way) is
    refused before anything is written, naming the families that are."""
    import gguf

    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ExportError) as e:
        export(path, None, tmp_path / "pair", precision="int4")
    msg = str(e.value)
    assert "GGUF architecture 'gemma3' is not supported; supported: llama, qwen2, mistral, qwen3" in msg
    assert len(msg.splitlines()) == 1
    assert not (tmp_path / "pair").exists()


def test_the_export_extra_pulls_no_torch_and_torch_is_pinned():
    """pyproject.toml: `pip install 'specrt[export]'` brings no torch (nor a package that needs it to read a
    GGUF: accelerate); torch, wherever it is named, is the tested release."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs):
        return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in reqs}

    assert not names(project["dependencies"] + extras["export"]) & {"torch", "accelerate", "torchvision"}
    assert names(extras["export"]) >= {"transformers", "onnx", "gguf"}
    torch_reqs = [r for reqs in [project["dependencies"], *extras.values()] for r in reqs
                  if names([r]) == {"torch"}]
    assert torch_reqs == ["torch==2.13.0"]  # the trace extra's, and nowhere else
    assert "torch==2.13.0" in extras["trace"]


# ---------------------------------------------------------------- the real Qwen2.5-Coder files (pytest -m real)

REAL = Path.home() / ".cache" / "specrt" / "models"


def _real_texts() -> list[str]:
    """Text of many kinds: Python sources of the standard library (code, comments, docstrings; ~1 MB), and TEXTS."""
    from specrt.export.vocab import default_corpus

    texts, size = list(TEXTS), 0
    for path in default_corpus()[::7]:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size > 1 << 20:
            break
    return texts


@pytest.mark.real
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_real_gguf_export_config_and_tokenizer_are_transformers(tmp_path, name):
    path = REAL / f"{name}-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is not cached (specrt fetch {name})")
    _same_as_transformers(path, tmp_path, _real_texts())
