"""A checkpoint's tensors read one at a time, for the graph builder (export/builder.py).

Each read takes only the rows asked for from the file, with plain reads (no memory map, whose pages would
count in the process's resident memory for as long as it lives), and returns float32: the builder holds
about one weight at a time whatever the checkpoint's size. Tensors are named as in Hugging Face checkpoints
(`model.layers.0.self_attn.q_proj.weight`) whatever the source.

- A Hugging Face folder: its safetensors files (one, or shards listed in `model.safetensors.index.json`).
  The format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
  byte range, then the data; rows are contiguous, so a row range is one read.
- A GGUF file: the `gguf` package reads the tensor table, and `gguf.quants.dequantize` turns each row range's
  blocks into floats (the same function transformers' GGUF loading calls, so the values are the same). For
  the llama architecture, llama.cpp stores q and k with the rows of each head interleaved for its rotary
  layout; they are put back in Hugging Face order as transformers does on load.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import ExportError
from specrt.export import gguf_meta

# The builder's reads that a missing tensor may leave out: a tied output matrix is the embedding table.
TIED_OUTPUT = ("lm_head.weight", "model.embed_tokens.weight")
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # BF16: widened on read


@dataclass(frozen=True)
class _Entry:
    path: Path
    offset: int  # absolute, in bytes
    shape: tuple[int, ...]
    dtype: object  # numpy dtype of the stored values (or of a GGUF tensor's raw rows)
    row_bytes: int
    qtype: object = None  # GGUF: the ggml type


class Tensors:
    """Row ranges of a checkpoint's tensors, as float32."""

    def __init__(self, entries: dict[str, _Entry], label: str):
        self._entries = entries
        self.label = label

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ExportError(f"{self.label} has no tensor {name}") from None

    def rows(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo:hi (the whole tensor by default) as float32."""
        e = self._entry(name)
        hi = e.shape[0] if hi is None else hi
        count = (hi - lo) * e.row_bytes
        with open(e.path, "rb") as f:
            f.seek(e.offset + lo * e.row_bytes)
            raw = f.read(count)
        if len(raw) != count:
            raise ExportError(f"{e.path} is shorter than its header says (tensor {name}); is it complete?")
        return self._decode(np.frombuffer(raw, e.dtype), e, hi - lo)

    def _decode(self, raw: np.ndarray, e: _Entry, n: int) -> np.ndarray:
        raise NotImplementedError


class SafetensorsTensors(Tensors):
    def _decode(self, raw, e, n):
        if e.dtype == np.uint16:  # bfloat16: the high half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape((n, *e.shape[1:]))
        return raw.astype(np.float32).reshape((n, *e.shape[1:]))


class GgufTensors(Tensors):
    def __init__(self, entries, label, permuted: dict[str, int]):
        super().__init__(entries, label)
        self._permuted = permuted  # name: heads, for llama's q and k

    def _decode(self, raw, e, n):
        import gguf

        return np.asarray(gguf.quants.dequantize(raw.reshape(n, -1), e.qtype), np.float32).reshape((n, *e.shape[1:]))

    def rows(self, name, lo=0, hi=None):
        if name not in self._permuted:
            return super().rows(name, lo, hi)
        # llama.cpp's order of q/k rows within a head is [d0, d_half, d1, d_half+1, ...]; undo it on the whole
        # tensor (a few heads' rows: small), then cut
        w = super().rows(name)
        heads = self._permuted[name]
        half = w.shape[0] // heads // 2
        w = w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return w[lo:hi]


def open_safetensors(folder: Path) -> SafetensorsTensors:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ExportError(f"cannot read {index}: {e}") from None
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{folder} has no safetensors weights, which the graph builder reads; "
                          "--trace loads other checkpoints through torch")
    entries = {}
    for name in files:
        entries.update(_safetensors_header(folder / name))
    return SafetensorsTensors(entries, str(folder))


def _safetensors_header(path: Path) -> dict[str, _Entry]:
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read the safetensors header of {path}: {e}") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ExportError(f"{path}: tensor {name} is {info['dtype']}; the graph builder reads F32, F16 and BF16")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = info["data_offsets"]
        row_bytes = (end - begin) // max(shape[0], 1) if shape else end - begin
        entries[name] = _Entry(path, 8 + size + begin, shape or (1,), np.dtype(dtype), row_bytes)
    return entries


# Hugging Face names of the decoder's tensors and their gguf names (the gguf package's own table).
def _gguf_names(layers: int) -> dict[str, str]:
    from gguf import MODEL_TENSOR as T
    from gguf import TENSOR_NAMES

    names = {"model.embed_tokens": T.TOKEN_EMBD, "lm_head": T.OUTPUT, "model.norm": T.OUTPUT_NORM}
    per_layer = {"input_layernorm": T.ATTN_NORM, "post_attention_layernorm": T.FFN_NORM,
                 "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K, "self_attn.v_proj": T.ATTN_V,
                 "self_attn.o_proj": T.ATTN_OUT, "self_attn.q_norm": T.ATTN_Q_NORM, "self_attn.k_norm": T.ATTN_K_NORM,
                 "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN}
    out = {}
    for hf, t in names.items():
        for kind in ("weight", "bias"):
            out[f"{TENSOR_NAMES[t]}.{kind}"] = f"{hf}.{kind}"
    for i in range(layers):
        for hf, t in per_layer.items():
            for kind in ("weight", "bias"):
                out[f"{TENSOR_NAMES[t].format(bid=i)}.{kind}"] = f"model.layers.{i}.{hf}.{kind}"
    return out


def open_gguf(path: Path) -> GgufTensors:
    meta = gguf_meta.read(path)  # the tensor table, read with the config and tokenizer (export/gguf_meta.py)
    arch = meta.arch
    layers, heads = int(meta.get(f"{arch}.block_count", 0)), meta.get(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    names = _gguf_names(layers)
    entries, permuted = {}, {}
    for t in meta.tensors:
        hf = names.get(t.name)
        if hf is None:
            continue
        # a row is a 2-D tensor's row, or a 1-D tensor's element (those are never block-quantized)
        entries[hf] = _Entry(path, t.offset, t.shape, t.dtype, t.n_bytes // t.shape[0], t.qtype)
        if arch == "llama" and heads is not None and (".q_proj." in hf or ".k_proj." in hf):
            permuted[hf] = int(heads if ".q_proj." in hf else kv_heads)
    return GgufTensors(entries, str(path), permuted)
