"""Resolve a checkpoint source (HF folder, GGUF file, known model name, hub id) and load it."""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import ExportError, first_line
from specrt.export import gguf_meta, weights
from specrt.export.fetch import KNOWN_MODELS, fetch_model


@dataclass(frozen=True)
class Source:
    spec: str  # what the user wrote
    kind: str  # "hf" | "gguf"
    folder: Path  # HF folder, or the folder holding the GGUF
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


# What a hub download fetches: config, weights, tokenizer (with a chat template kept in its own file,
# as newer transformers saves it), generation config.
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "chat_template.jinja")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(spec: str, progress: bool = True) -> Source:
    """Turn what the user wrote into a local source, fetching known names and hub ids if possible."""
    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ExportError(f"{p} is not a .gguf file; pass a GGUF file or a Hugging Face model folder")
        return Source(spec, "gguf", p.parent, p.name)
    if p.is_dir():
        if (p / "config.json").is_file():
            return Source(spec, "hf", p)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return Source(spec, "gguf", p, ggufs[0].name)
        raise ExportError(f"{p} has no config.json and {'several' if ggufs else 'no'} .gguf files: "
                          "pass a Hugging Face model folder or one GGUF file")
    if spec.lower() in KNOWN_MODELS:
        gguf = fetch_model(spec.lower(), progress=progress)
        return Source(spec, "gguf", gguf.parent, gguf.name)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return Source(spec, "hf", _download_from_hub(spec))
    raise ExportError(f"model source not found: {spec} (not a folder, a .gguf file, a known name "
                      f"({', '.join(KNOWN_MODELS)}) or a hub id)")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_FILES)))
    except Exception as e:
        raise ExportError(f"cannot download {repo_id} from the Hugging Face hub ({first_line(e, limit=200)}); "
                          "pass a local model folder or GGUF file instead") from None


def load_config(src: Source):
    """The model's transformers config: config.json of a Hugging Face folder, or a GGUF's metadata (read without
    torch, export/gguf_meta.py)."""
    try:
        if src.kind == "gguf":
            return gguf_meta.config(gguf_meta.read(src.folder / src.gguf_file), src.folder)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(src.folder)
    except Exception as e:
        raise ExportError(f"cannot read the model config of {src.spec}: {first_line(e, limit=300)}") from None


def save_tokenizer(src: Source, out: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json of `src` into `out`; return tokenizer.json."""
    out.mkdir(parents=True, exist_ok=True)
    if src.kind == "hf" and (src.folder / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (src.folder / name).is_file():
                shutil.copy2(src.folder / name, out / name)
    else:
        try:
            if src.kind == "gguf":
                gguf_meta.save_tokenizer(gguf_meta.read(src.folder / src.gguf_file, vocabulary=True), src.folder, out)
            else:  # a folder with a slow tokenizer only (tokenizer.model, vocab.json): transformers converts it
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(src.folder).save_pretrained(out)
        except Exception as e:
            raise ExportError(f"cannot load the tokenizer of {src.spec}: {first_line(e, limit=300)}") from None
    if not (out / "tokenizer.json").is_file():
        raise ExportError(f"the tokenizer of {src.spec} has no fast (tokenizer.json) form, which specrt needs")
    return out / "tokenizer.json"


def open_tensors(src: Source):
    """The checkpoint's tensors, read one at a time (export/weights.py)."""
    if src.kind == "gguf":
        return weights.open_gguf(src.folder / src.gguf_file)
    return weights.open_safetensors(src.folder)


def load_model(src: Source, dtype: str = "float32"):
    """The whole model through transformers and torch (the traced export, export/traced.py)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # The exporter's "loading" step reports this: transformers' own bar would break into that line, or
    # print where the export was asked to be quiet. (A GGUF's dequantization bar is plain tqdm: it stays.)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=getattr(torch, dtype), **src.kwargs())
    except Exception as e:
        raise ExportError(f"cannot load the model {src.spec}: {first_line(e, limit=300)}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval()


# Tokens that end a turn or a text in the tokenizers specrt meets (Qwen: <|im_end|> ends a chat turn,
# <|endoftext|> a document): a GGUF carries one EOS id in its metadata, and no generation config listing both.
END_TOKENS = ("<|endoftext|>", "<|im_end|>")


def eos_ids(src: Source, config, tokenizer_file: Path | None = None) -> list[int]:
    """EOS ids from generation_config.json (a list for chat models) and the model config; from a GGUF,
    also the ids of END_TOKENS in `tokenizer_file` (the pair's tokenizer.json) where it has them."""
    ids = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(src.folder, **src.kwargs())
        ids.append(gen.eos_token_id)
    except Exception:
        pass  # a checkpoint without generation_config.json: the model config's eos below
    ids.append(getattr(config, "eos_token_id", None))
    if src.kind == "gguf" and tokenizer_file is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        ids.extend(tok.token_to_id(t) for t in END_TOKENS)
    flat = []
    for i in ids:
        for j in i if isinstance(i, (list, tuple)) else [i]:
            if j is not None and j not in flat:
                flat.append(int(j))
    return flat

