"""The pair folder's schema: the manifest (what the runtime trusts about a pair folder: no model-type sniffing
at run time), reading and writing it, and checking its files."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import reprlib
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
# The ranges a manifest's numbers are read in: what export writes lies far inside them, so a value outside is
# damage, refused before anything is sized or allocated by it.
MAX_LEN = 1 << 24  # cache positions
MAX_DRAFT_LEN = 64  # the most export writes (export/pair.ExportConfig checks against it)
MAX_VOCAB = 1 << 24  # token ids, and a model's logits rows
MAX_COUNT = 1 << 16  # layers, KV heads, head_dim
MAX_WIDTH = 1 << 20  # hidden and intermediate sizes
MAX_BYTES = 1 << 50  # the weight bytes of a graph
MAX_DEPTH = 32  # a manifest nests about 5 levels deep


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


class ManifestProblems(PairError):
    """A manifest that reads as one but cannot be trusted: values out of their ranges, or files it names that lie
    outside the pair folder. `problems` has one line each (`specrt info` reports them all); the message is the
    first."""

    def __init__(self, problems: list[str]):
        more = f" (and {len(problems) - 1} more; `specrt info` lists them)" if len(problems) > 1 else ""
        super().__init__(problems[0] + more)
        self.problems = problems


class _Long:
    """A JSON integer longer than Python's int() reads (sys.get_int_max_str_digits), kept to be named."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(text: str):
    try:
        return int(text)
    except ValueError:
        return _Long(text)


def _show(v) -> str:
    """A value for a one-line message: long strings and containers cut short."""
    return reprlib.repr(v)


def _json_problems(raw) -> list[str]:
    """Where the parsed manifest holds an integer too long to read or nests deeper than MAX_DEPTH."""
    found, todo = [], [(raw, "", 0)]
    while todo:
        v, where, depth = todo.pop()
        name = where if len(where) <= 60 else where[:57] + "..."
        if isinstance(v, _Long):
            found.append(f"{name} is {v!r}")
        elif isinstance(v, (dict, list)) and depth >= MAX_DEPTH:
            found.append(f"{name} is nested more than {MAX_DEPTH} levels deep")
        elif isinstance(v, dict):
            todo += [(x, f"{where}.{k}" if where else k, depth + 1) for k, x in v.items()]
        elif isinstance(v, list):
            todo += [(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    return sorted(found)


def _int_problem(where: str, v, lo: int, hi: int) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return f"{where} must be an integer in {lo}..{hi}, got {_show(v)}"
    return None


def _one_of(where: str, v, allowed: tuple) -> str | None:
    if v not in allowed:
        return f"{where} must be one of {', '.join(map(str, allowed))}, got {_show(v)}"
    return None


def _object(where: str, v, optional: bool = True) -> str | None:
    if not isinstance(v, dict) and not (optional and v is None):
        return f"{where} must be an object{' or null' if optional else ''}, got {_show(v)}"
    return None


def _value_problems(m: Manifest) -> list[str]:
    """Every value of `m` outside its type and range, one line each naming the field and the value."""
    found = [_int_problem("vocab_size", m.vocab_size, 1, MAX_VOCAB),
             _int_problem("max_len", m.max_len, 1, MAX_LEN),
             _int_problem("max_draft_len", m.max_draft_len, 1, MAX_DRAFT_LEN),
             _object("tuned", m.tuned), _object("engines", m.engines)]
    vocab = MAX_VOCAB if found[0] else m.vocab_size  # a bad vocab_size is reported once, not per EOS id
    found += [_int_problem(f"eos_token_ids[{i}]", t, 0, vocab - 1) for i, t in enumerate(m.eos_token_ids)]
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            continue
        found += [_int_problem(f"{role}.num_layers", e.num_layers, 1, MAX_COUNT),
                  _int_problem(f"{role}.num_kv_heads", e.num_kv_heads, 1, MAX_COUNT),
                  _int_problem(f"{role}.head_dim", e.head_dim, 1, MAX_COUNT),
                  _int_problem(f"{role}.logits_width", e.logits_width, 1, MAX_VOCAB),
                  _int_problem(f"{role}.hidden_size", e.hidden_size, 0, MAX_WIDTH),  # 0: an older export
                  _int_problem(f"{role}.intermediate_size", e.intermediate_size, 0, MAX_WIDTH),
                  _one_of(f"{role}.precision", e.precision, ("fp32", "int4", "fp16")),
                  _one_of(f"{role}.dtype", e.dtype, ("float32", "float16")),
                  _one_of(f"{role}.graph", e.graph, ("lean", "portable", "contrib")),
                  _object(f"{role}.inputs", e.inputs, optional=False),
                  _object(f"{role}.outputs", e.outputs, optional=False),
                  _object(f"{role}.quantization", e.quantization)]
        # the memory estimate adds these up (api/memory.py)
        if (w := e.weights) is not None:
            if not isinstance(w, dict) or sorted(w) != ["mapped", "other", "packed", "row"]:
                found.append(f"{role}.weights must be null or an object of the byte counts packed, mapped, row and "
                             f"other, got {_show(w)}")
            else:
                found += [_int_problem(f"{role}.weights.{k}", v, 0, MAX_BYTES) for k, v in w.items()]
        if (emb := e.embedding) is not None:
            if not isinstance(emb, dict):
                found.append(_object(f"{role}.embedding", emb))
            else:
                found += [_one_of(f"{role}.embedding.bits", emb.get("bits"), (4, 8)),
                          _int_problem(f"{role}.embedding.block_size", emb.get("block_size"), 1, MAX_COUNT)]
    return [f for f in found if f]


def _escapes(pair: Path, m: Manifest) -> list[str]:
    """The files `m` names that lie outside the pair folder once links are followed (a link inside the folder
    to a file inside it is fine), one line each."""
    names = {}  # file name -> where the manifest names it
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is not None:
            names.setdefault(e.path, f"{role}.path")
            names.update({f: f"{role}.files" for f in e.files if f not in names})
            names.setdefault(e.output_ids, f"{role}.output_ids")
        names.setdefault(((m.engines or {}).get(role) or {}).get("plan"), f"engines.{role}.plan")
    names.update({f: "tokenizer_files" for f in m.tokenizer_files if f not in names})
    names.pop(None, None)
    root, found = pair.resolve(), []
    for name, where in names.items():
        try:
            real = (pair / name).resolve()
        except (OSError, RuntimeError) as e:  # a loop of links
            found.append(f"{where}: {pair / name} cannot be resolved ({e})")
            continue
        if not real.is_relative_to(root):
            found.append(f"{where}: {pair / name} leaves the pair folder (a link to {real}); "
                         "a pair's files must lie inside it")
    return found


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
    """Read and validate a pair folder's manifest; every failure is a one-line PairError. A manifest that reads
    as one but holds values out of their types and ranges, or names files that lie outside the folder, raises
    ManifestProblems, which lists each."""
    pair = Path(pair_dir)
    if not pair.is_dir():
        raise PairError(f"pair folder not found: {pair}")
    path = pair / MANIFEST_NAME
    if not path.is_file():
        raise PairError(f"{pair} is not a specrt pair folder (no {MANIFEST_NAME}); create one with `specrt export`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PairError(f"corrupt manifest {path}: {e}") from None
    except RecursionError:
        raise ManifestProblems([f"corrupt manifest {path}: the manifest is nested more than {MAX_DEPTH} levels "
                                "deep"]) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise PairError(f"{path} is not a specrt manifest")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise PairError(
            f"{path} has manifest format version {version}, this specrt reads version {FORMAT_VERSION}; "
            "re-export the pair with this version of specrt"
        )
    if found := _json_problems(raw):
        raise ManifestProblems([f"corrupt manifest {path}: {f}" for f in found])
    try:
        m = Manifest.from_dict(raw)
    except PairError as e:
        raise PairError(f"corrupt manifest {path}: {e}") from None
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise PairError(f"corrupt manifest {path}: {e}") from None
    if found := _value_problems(m):
        raise ManifestProblems([f"corrupt manifest {path}: {f}" for f in found])
    if found := _escapes(pair, m):
        raise ManifestProblems(found)
    return m


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


def verify_files(pair_dir: Path, entry: ModelEntry, cached: bool = True) -> None:
    """Check each graph file against the manifest's sha256.

    Hashing gigabytes at every load would cost seconds, so a verified file leaves a small stamp
    (size and mtime) next to it; an unchanged file is not hashed again. A byte that rots under an
    unchanged size and mtime passes that, so `cached=False` hashes every file (`specrt info`).
    """
    for name, digest in entry.files.items():
        f = pair_dir / name
        if not f.is_file():
            raise PairError(f"missing graph file {f} (listed in the manifest)")
        st = f.stat()
        stamp = f.parent / f".{f.name}.verified"
        key = f"{digest} {st.st_size} {st.st_mtime_ns}"
        try:
            if cached and stamp.read_text() == key:
                continue
        except OSError:
            pass
        if sha256_file(f) != digest:
            raise PairError(f"{f} does not match the sha256 in the manifest (corrupt or replaced); re-export the pair")
        try:
            stamp.write_text(key)
        except OSError:
            pass  # a read-only pair folder is fine: it is just hashed again next time
