"""The pair folder's schema: the manifest (what the runtime trusts about a pair folder: no model-type sniffing
at run time), reading and writing it, and checking its files."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from specrt.errors import PairError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "specrt-pair"
FORMAT_VERSION = 1
# The layouts of the caches (docs/design.md, "The KV-cache contract"): the delta graphs' past and new K/V,
# the lean graph's past/present.
KV_LAYOUT = "seq,batch,kv_heads,head_dim"
LEAN_KV_LAYOUT = "batch,kv_heads,seq,head_dim"


@dataclass(frozen=True)
class ModelEntry:
    """One exported graph of the pair, as the manifest describes it."""

    path: str  # graph file, relative to the pair folder
    files: dict[str, str]  # every file of the graph (the .onnx and its external data) -> sha256
    source: str
    model_type: str
    precision: str  # fp32 | int4 | fp16
    dtype: str  # numpy name of the KV/activation dtype, e.g. "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    logits_width: int  # rows of the model's output matrix (may exceed the shared vocabulary)
    inputs: dict[str, dict]
    outputs: dict[str, dict]
    quantization: dict | None = None
    # Quantized input embeddings (export/pair.quantize_embedding): {"op", "bits", "block_size", "symmetric"}
    embedding: dict | None = None
    # How onnxruntime holds the weights, in bytes (export/pair.weight_bytes; api/memory.py):
    # {"packed": copied into memory at load (MatMul and MatMulNBits weights, prepacked), "mapped": read
    # from the memory-mapped file where a pass touches them (embedding tables: only the rows of the tokens
    # seen), "row": one embedding row, "other": the rest (norms, biases, rotary tables)}; None: older export
    weights: dict | None = None
    hidden_size: int = 0  # the model's widths (api/memory.py's activations); 0: an older export
    intermediate_size: int = 0
    # Draft with a restricted output vocabulary: an .npy of the token ids its logits rows stand for
    # (sorted, relative to the pair folder, hashed in `files`); None = row i is token id i.
    output_ids: str | None = None
    # Which graph (export/graph.py): "lean" (fused onnxruntime ops over per-row caches [B, Hkv, C, D]; CPU
    # and CUDA), "portable" (standard ops, the delta contract over [C, B, Hkv, D]; what TensorRT builds
    # from) or "contrib" (the delta contract with onnxruntime CPU ops, exported by specrt before the lean graph).
    graph: str = "lean"

    @property
    def portable(self) -> bool:
        return self.graph == "portable"

    @property
    def kv_layout(self) -> str:
        return LEAN_KV_LAYOUT if self.graph == "lean" else KV_LAYOUT

    def kv_names(self, layer: int) -> tuple[str, str, str, str]:
        """(past key, past value, new or present key, new or present value) tensor names of one layer."""
        out = "present" if self.graph == "lean" else "new"
        return (f"past_key.{layer}", f"past_value.{layer}", f"{out}_key.{layer}", f"{out}_value.{layer}")


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs to know about a pair folder."""

    vocab_size: int  # ids the sampler may choose: shared by both models and the tokenizer
    eos_token_ids: tuple[int, ...]
    max_len: int
    max_draft_len: int
    target: ModelEntry
    draft: ModelEntry | None
    tokenizer_files: tuple[str, ...]
    kv_layout: str = KV_LAYOUT  # of the delta graphs; each entry's own: ModelEntry.kv_layout
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    created_by: str = ""
    # Written by `specrt tune`: {"drafter", "draft_len", "confidence_stop", "acceptance": [...],
    # "costs": {"draft_s", "target_s": {width: s}}, "graphs": {file: sha256}, "measured": {...}}
    tuned: dict | None = None
    # Written by `specrt export --engine tensorrt` (engines/trt.py): {"tensorrt_version",
    # "compute_capability", "target": {"plan", "sha256", "profiles": [...]}, "draft": {...}}
    engines: dict | None = None

    @property
    def portable(self) -> bool:
        """Every graph uses standard ops only (what TensorRT builds from)."""
        return all(e.portable for e in self.entries())

    @property
    def for_gpu(self) -> bool:
        """Every graph can run on onnxruntime's CUDA provider: fp16 lean graphs, or portable ones."""
        return all(e.portable or (e.graph == "lean" and e.dtype == "float16") for e in self.entries())

    def entries(self) -> list[ModelEntry]:
        return [e for e in (self.target, self.draft) if e is not None]

    def graph_hashes(self) -> dict[str, str]:
        return {f: h for e in (self.target, self.draft) if e is not None for f, h in e.files.items()}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        d = dict(d)
        _keys(cls, d, "the manifest")
        d["target"] = _entry(d["target"], "target")
        d["draft"] = _entry(d["draft"], "draft") if d.get("draft") else None
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["tokenizer_files"] = tuple(d["tokenizer_files"])
        m = cls(**d)
        for name in m.tokenizer_files:
            _inside(name, "tokenizer_files")
        for role in ("target", "draft"):
            plan = ((m.engines or {}).get(role) or {}).get("plan")
            if plan is not None:
                _inside(plan, f"engines.{role}.plan")
        return m


def _keys(cls, d, where: str) -> None:
    """PairError naming the first key `d` lacks (or has that `cls` does not know)."""
    if not isinstance(d, dict):
        raise PairError(f"{where} must be an object")
    known = {f.name for f in dataclasses.fields(cls)}
    needed = {f.name for f in dataclasses.fields(cls)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if missing := sorted(needed - d.keys()):
        raise PairError(f"{where} has no {missing[0]!r}")
    if unknown := sorted(d.keys() - known):
        raise PairError(f"{where} has an unknown key {unknown[0]!r} (written by a newer specrt?)")


def _inside(name, where: str) -> str:
    """`name`, a path the manifest gives relative to the pair folder, if it stays inside that folder."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise PairError(f"{where}: {name!r} is not a file name inside the pair folder")
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise PairError(f"{where}: {name!r} leaves the pair folder; a manifest names files inside it only")
    return name


def _entry(d: dict, role: str) -> ModelEntry:
    if not isinstance(d, dict):
        raise PairError(f"{role} must be an object")
    d = dict(d)
    if "graph" not in d:  # written before the lean graph: a delta graph, portable or with CPU contrib ops
        d["graph"] = "portable" if d.get("portable") else "contrib"
    d.pop("portable", None)
    _keys(ModelEntry, d, role)
    e = ModelEntry(**d)
    _inside(e.path, f"{role}.path")
    if not isinstance(e.files, dict):
        raise PairError(f"{role}.files must be an object of file names and sha256 digests")
    for name in e.files:
        _inside(name, f"{role}.files")
    if e.output_ids is not None:
        _inside(e.output_ids, f"{role}.output_ids")
    return e


def read_manifest(pair_dir: str | os.PathLike) -> Manifest:
    """Read and validate a pair folder's manifest; every failure is a one-line PairError."""
    pair = Path(pair_dir)
    if not pair.is_dir():
        raise PairError(f"pair folder not found: {pair}")
    path = pair / MANIFEST_NAME
    if not path.is_file():
        raise PairError(f"{pair} is not a specrt pair folder (no {MANIFEST_NAME}); create one with `specrt export`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PairError(f"corrupt manifest {path}: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise PairError(f"{path} is not a specrt manifest")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise PairError(
            f"{path} has manifest format version {version}, this specrt reads version {FORMAT_VERSION}; "
            "re-export the pair with this version of specrt"
        )
    try:
        return Manifest.from_dict(raw)
    except PairError as e:
        raise PairError(f"corrupt manifest {path}: {e}") from None
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise PairError(f"corrupt manifest {path}: {e}") from None


def write_manifest(pair_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Write a pair folder's manifest: the one writer (export, build-engines, tune). Atomic: a temporary
    file beside it, flushed to disk and renamed over it, so a reader sees the old manifest or the new one."""
    path = Path(pair_dir) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22, on_read=None) -> str:
    """`on_read(n)`, if given, hears of each block of n bytes as it is hashed (a progress bar)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if on_read is not None:
                on_read(len(block))
    return h.hexdigest()


def verify_files(pair_dir: Path, entry: ModelEntry) -> None:
    """Check each graph file against the manifest's sha256.

    Hashing gigabytes at every load would cost seconds, so a verified file leaves a small stamp
    (size and mtime) next to it; an unchanged file is not hashed again.
    """
    for name, digest in entry.files.items():
        f = pair_dir / name
        if not f.is_file():
            raise PairError(f"missing graph file {f} (listed in the manifest)")
        st = f.stat()
        stamp = f.parent / f".{f.name}.verified"
        key = f"{digest} {st.st_size} {st.st_mtime_ns}"
        try:
            if stamp.read_text() == key:
                continue
        except OSError:
            pass
        if sha256_file(f) != digest:
            raise PairError(f"{f} does not match the sha256 in the manifest (corrupt or replaced); re-export the pair")
        try:
            stamp.write_text(key)
        except OSError:
            pass  # a read-only pair folder is fine: it is just hashed again next time
