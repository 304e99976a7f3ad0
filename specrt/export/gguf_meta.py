"""A GGUF's model config and tokenizer, read without torch.

A GGUF carries no config.json or tokenizer.json: its metadata holds both, under llama.cpp's key names.
transformers turns that metadata into a config and a tokenizer through modules that import torch (the config of
the families specrt exports through `modeling_gguf_pytorch_utils.load_gguf_checkpoint`, the tokenizer's metadata
through `integrations.gguf.reader`). So the export reads the metadata with the gguf package's GGUFReader, and
hands it to the parts of transformers that need no torch: the key tables (`GGUF_CONFIG_MAPPING`,
`GGUF_TOKENIZER_MAPPING`), the tokenizer converter (`convert_gguf_tokenizer`), the config classes and the
tokenizer class's own `from_pretrained` and `save_pretrained`. Only the glue between them is written here, step
for step as transformers' GGUF path does it, and tests/test_gguf_meta.py holds the result to that path's: the
same config, byte-equal tokenizer files, for the tiny GGUFs of every family and the real Qwen2.5-Coder files.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import ExportError, first_line
from specrt.export.builder import FAMILIES

# transformers, imported where torch is not, advises at import that its models are unavailable: the export uses
# none of them (its configs and tokenizers only), so the line would only puzzle
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# the special tokens a GGUF names by id, as transformers' get_gguf_tokenizer puts them in the tokenizer's arguments
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


@contextlib.contextmanager
def _transformers():
    """The transformers modules this file uses, or one line saying which transformers it needs (an older one
    lacks them, or holds them where they import torch)."""
    try:
        yield
    except ImportError as e:
        raise ExportError(f"reading a GGUF's config and tokenizer needs transformers 5.24 or later, without torch "
                          f"({first_line(e, limit=120)}): pip install -U 'specrt[export]'") from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # Hugging Face order (ggml lists the fastest-moving dimension first)
    offset: int  # absolute, in bytes
    n_bytes: int
    qtype: object  # the ggml type
    dtype: object  # numpy dtype of the stored rows (uint8 for quantized blocks)


@dataclass(frozen=True)
class Metadata:
    fields: dict  # key: value as gguf's `contents()` gives it (numbers, strings, lists)
    tensors: tuple[TensorInfo, ...]
    token_count: int | None  # the vocabulary's length, kept where its arrays are left out

    @property
    def arch(self) -> str:
        return str(self.fields["general.architecture"])

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


# The tokenizer's arrays (a real vocabulary: ~150k tokens and as many merges). Only the tokenizer reads them;
# held on, their strings would pin the memory of the reader's ~1M parsed fields (~180 MB resident per model,
# measured on the 1.5B) through the layers' export.
_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
               "tokenizer.ggml.token_type", "tokenizer.ggml.precompiled_charsmap")


def read(path: Path, vocabulary: bool = False) -> Metadata:
    """The metadata and tensor table of the GGUF at `path`. Without `vocabulary` (the config and the tensors)
    the tokenizer's arrays are left out and the read is kept per file version, as an export asks for each
    model's config and tensors more than once and GGUFReader takes seconds on a real vocabulary."""
    if vocabulary:
        return _parse(str(path), vocabulary=True)
    st = Path(path).stat()
    return _read(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)  # a draft and a target
def _read(path: str, _mtime: int, _size: int) -> Metadata:
    return _parse(path, vocabulary=False)


def _parse(path: str, vocabulary: bool) -> Metadata:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items() if vocabulary or k not in _VOCABULARY}
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        tensors = tuple(TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.data_offset),
                                   int(t.n_bytes), t.tensor_type, t.data.dtype) for t in reader.tensors)
    except Exception as e:  # a damaged or foreign file: gguf raises ValueError and others
        raise ExportError(f"not a GGUF file the gguf package reads ({first_line(e, limit=200)})") from None
    if "general.architecture" not in fields:
        raise ExportError("the GGUF file names no architecture (general.architecture)")
    return Metadata(fields, tensors, None if tokens is None else len(tokens.data))


def model_type(meta: Metadata) -> str:
    """transformers' name for the file's architecture. Its GGUF loader calls a llama file mistral only when
    general.name is exactly "mistral" (it tests membership in a one-item list); so does this, so that a pair
    records the model type the transformers path recorded."""
    return "mistral" if meta.arch == "llama" and meta.get("general.name") == "mistral" else meta.arch


def config_dict(meta: Metadata) -> dict:
    """The transformers config dict of the file, as `load_gguf_checkpoint` builds it: the keys its table maps,
    the output matrix tied when the file has none, the vocabulary's length where no size is given."""
    arch, mt = meta.arch, model_type(meta)
    # only the families both export paths write: transformers' loader gives some others (gemma3, t5, stablelm,
    # the MoE files, ...) fields of their own that this generic mapping does not, and neither path exports them
    if mt not in FAMILIES:
        raise ExportError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
    with _transformers():
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    d = {"tie_word_embeddings": all(t.name != "output.weight" for t in meta.tensors),
         **GGUF_CONFIG_DEFAULTS_MAPPING.get(mt, {})}
    for key, value in meta.fields.items():
        prefix, _, name = key.replace(arch, mt).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers unwraps one-item values
        if isinstance(value, str):
            value = value.replace(arch, mt)  # general.architecture becomes the model type
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name)
        if renamed not in (None, -1):
            d[renamed] = value
    if "vocab_size" not in d and meta.token_count is not None:
        d["vocab_size"] = meta.token_count
    return d


def config(meta: Metadata, folder: Path):
    """The transformers config of the file (found in `folder`, which it records as its origin, as
    `AutoConfig.from_pretrained` does)."""
    from transformers import AutoConfig

    c = AutoConfig.for_model(**config_dict(meta))
    c.name_or_path = str(folder)
    return c


def tokenizer_arguments(meta: Metadata) -> tuple[dict, dict]:
    """(the tokenizer dict `convert_gguf_tokenizer` takes, the tokenizer class's arguments), as transformers'
    get_gguf_tokenizer reads them from the metadata."""
    with _transformers():
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    groups = {group: {name: meta.fields[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in meta.fields}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, arguments = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tokenizer:  # a file without a vocabulary, or metadata read without it
        raise ExportError("the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
    if tokenizer.get("tokenizer_type") == "llama":
        arguments.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary by default
    for name, key in _SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        arguments[name] = tokenizer["tokens"][i] if i is not None else None
    return tokenizer, arguments


def tokenizer_class(config):
    """The class AutoTokenizer gives a GGUF of this config: the model type's, else the plain tokenizers backend
    (so too for Mistral's mistral-common backend, which reads Mistral's own files, not a GGUF)."""
    with _transformers():
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return TokenizersBackend if cls is None or cls.__name__ == "MistralCommonBackend" else cls


def save_tokenizer(meta: Metadata, folder: Path, out: Path) -> None:
    """Write the file's tokenizer into `out` (tokenizer.json, tokenizer_config.json, chat_template.jinja) as
    AutoTokenizer.from_pretrained(folder, gguf_file=...).save_pretrained(out) writes it: the same converter
    builds the backend, and the class's from_pretrained is handed it in place of reading the file with torch."""
    with _transformers():
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokenizer, arguments = tokenizer_arguments(meta)
    backend, _ = convert_gguf_tokenizer(meta.arch, tokenizer)
    cls = tokenizer_class(config(meta, folder))
    cls.from_pretrained(folder, tokenizer_object=backend, **arguments).save_pretrained(out)
