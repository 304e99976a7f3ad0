"""`specrt export`: a draft and a target checkpoint become one self-describing pair folder.

Everything is written into a temporary folder beside the destination and renamed at the end, so
a half-written pair folder never looks valid. An existing destination is replaced only if it is empty or
holds a pair (with `overwrite`); one holding anything else, and the current folder, are refused before any
work, so no file of the user's is ever deleted.
"""
from __future__ import annotations

import gc
import glob
import json
import os
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from specrt import host
from specrt.engines import trt
from specrt.engines.ort import gqa_has_query_seqlens
from specrt.errors import ExportError, first_line
from specrt.export import builder, load, traced, trt_build
from specrt.export import vocab as draft_vocab
from specrt.export.builder import FAMILIES as SUPPORTED_MODEL_TYPES
from specrt.export.progress import QUIET, Progress, hash_files
from specrt.export.quant import SLICE_ROWS
from specrt.manifest import FORMAT_NAME, MANIFEST_NAME, MAX_DRAFT_LEN, Manifest, ModelEntry, write_manifest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class ExportConfig:
    target: str
    draft: str | None
    out: Path
    precision: str = "fp32"  # weights: fp32 | int4 (MatMulNBits: CPU, edge) | fp16 (GPU)
    # the activations' and caches' dtype: fp16 for a GPU (fp16 weights, or int4 weights on an edge GPU);
    # "" = fp16 for fp16 weights, else fp32 (what the CPU runs fastest)
    activations: str = ""
    max_len: int = 2048
    max_draft_len: int = 8
    block_size: int = 128  # int4: weights per quantization block (128: ~23% faster steps than 32 here, docs/design.md)
    accuracy_level: int = 4  # int4: MatMulNBits compute (4 = int8 activations, fast; 0 = fp32, exact)
    # the input embeddings, weight-only (GatherBlockQuantized): 4 or 8 bits, 0 = kept as they are; None = 4 for
    # int4 pairs (the GGUF sources' embeddings are 4-bit already; a pass reads only its tokens' rows), else 0
    embedding_bits: int | None = None
    embedding_block_size: int = 32
    symmetric: bool = False  # int4: False = a 4-bit zero point per block too (closer to the weights, same speed)
    draft_vocab: int = 0  # > 0: keep only this many output ids in the draft (export/vocab.py)
    draft_vocab_texts: tuple[Path, ...] = ()  # calibration texts for draft_vocab (default: Python's stdlib)
    portable: bool = False  # the standard-op graph (graph.PortableDecoder; implied by tensorrt) instead of the lean one
    # the lean graph traced through torch (export/traced.py) instead of written by the graph builder: the whole
    # model in memory; the portable graph is always traced
    trace: bool = False
    # lean graphs: GroupQueryAttention's query_seqlens input (onnxruntime >= 1.32: several multi-token rows
    # in one call); None = whether the onnxruntime exporting has it
    query_seqlens: bool | None = None
    engine: str = "none"  # "tensorrt": also build TensorRT engines (engines/trt.py) next to the graphs
    prefill_chunk: int = 256  # tensorrt: the prefill profile's widest chunk; longer prompts run in chunks
    overwrite: bool = False

    @property
    def dtype(self) -> str:
        """numpy name of the activations' and caches' dtype."""
        return "float16" if self.precision == "fp16" or self.activations == "fp16" else "float32"

    @property
    def embedding(self) -> int:
        """Bits of the quantized input embeddings, 0 = none."""
        return (4 if self.precision == "int4" else 0) if self.embedding_bits is None else self.embedding_bits

    @property
    def graph(self) -> str:
        return "portable" if self.portable or self.engine == "tensorrt" else "lean"

    @property
    def traced(self) -> bool:
        """Whether the models go through torch (export/traced.py) rather than the graph builder."""
        return self.trace or self.graph == "portable"

    def __post_init__(self):
        if self.precision not in ("fp32", "fp16", "int4"):
            raise ExportError(f"unknown precision {self.precision!r}; choose fp32, fp16 or int4")
        if self.engine not in ("none", "tensorrt"):
            raise ExportError(f"unknown engine {self.engine!r}; choose none or tensorrt")
        if self.activations not in ("", "fp32", "fp16"):
            raise ExportError(f"unknown activations {self.activations!r}; choose fp32 or fp16")
        if (self.precision, self.activations) in (("fp32", "fp16"), ("fp16", "fp32")):
            raise ExportError(f"--activations {self.activations} does not go with --precision {self.precision} "
                              "(fp16 activations: --precision fp16, or int4 for an edge GPU)")
        if self.portable and self.precision == "int4":
            raise ExportError("int4 graphs use onnxruntime's MatMulNBits; a portable graph is fp32 or fp16")
        if self.engine == "tensorrt" and self.precision == "int4":
            raise ExportError("TensorRT engines are built from fp16 or fp32 graphs (int4 here is onnxruntime's "
                              "MatMulNBits); use --precision fp16")
        if self.prefill_chunk < 1:
            raise ExportError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_len < 16:
            raise ExportError(f"max_len must be >= 16, got {self.max_len}")
        if not 1 <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise ExportError(f"max_draft_len must be in 1..{MAX_DRAFT_LEN}, got {self.max_draft_len}")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise ExportError(f"block_size must be one of 16, 32, 64, 128, 256, got {self.block_size}")
        if self.embedding_bits not in (None, 0, 4, 8):
            raise ExportError(f"embedding_bits must be 0 (as they are), 4 or 8, got {self.embedding_bits}")
        if self.embedding_block_size not in (16, 32, 64, 128, 256):
            raise ExportError(f"embedding_block_size must be one of 16, 32, 64, 128, 256, got {self.embedding_block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ExportError(f"accuracy_level must be 0..4, got {self.accuracy_level}")
        if self.draft_vocab < 0 or self.draft_vocab == 1:
            raise ExportError(f"draft_vocab must be 0 (full vocabulary) or >= 2, got {self.draft_vocab}")
        if self.draft_vocab and not self.draft:
            raise ExportError("draft_vocab restricts the draft's output vocabulary, but no draft is given")
        if self.draft_vocab_texts and not self.draft_vocab:
            raise ExportError("draft_vocab_texts calibrate draft_vocab; give draft_vocab too")
        for t in self.draft_vocab_texts:
            if not Path(t).is_file():
                raise ExportError(f"calibration text not found: {t}")


def export_pair(cfg: ExportConfig, log=print, progress: Progress = QUIET) -> Manifest:
    """`log`: what the user should know (one line each); `progress`: the long steps as they run."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder; choose another --out")
    try:
        here = Path.cwd()
    except OSError:  # the current folder was removed: --out cannot be it
        here = None
    if here is not None and (out.resolve() == here or out.resolve() in here.parents):
        # renaming it fails at the very end (EBUSY), or leaves the shell in a deleted folder
        raise ExportError(f"--out {out} is the current folder or holds it; an export replaces its --out: "
                          "choose another folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create {out.parent}: {e.strerror}") from None
    try:
        recover(out, log)
    except OSError as e:
        raise ExportError(f"cannot tidy up after an earlier export to {out}: {e.strerror or e}") from None
    _check_out(out, cfg.overwrite)
    if cfg.traced:
        traced.require_torch()  # before a model is fetched or a file written
    tmp = _aside(out, "partial", os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        roles = {"target": cfg.target} | ({"draft": cfg.draft} if cfg.draft else {})
        sources = {r: load.resolve(s, progress=progress.on) for r, s in roles.items()}
        for role, src in sources.items():
            a, b = out.resolve(), src.folder.resolve()
            if a == b or a in b.parents or b in a.parents:
                raise ExportError(f"--out {out} overlaps the {role} source {src.folder}; choose a separate folder")
        configs = _configs(sources, cfg)
        toks = {r: load.save_tokenizer(s, tmp / f"tok-{r}") for r, s in sources.items()}
        preflight(configs, tmp, cfg)
        if cfg.engine == "tensorrt":
            trt.require_tensorrt()  # before minutes of export: fail now if the engines cannot be built here
        widths = {r: int(c.vocab_size) for r, c in configs.items()}
        vocab = check_tokenizers(toks, widths)
        for name in TOKENIZER_FILES:
            if (tmp / "tok-target" / name).is_file():
                shutil.copy2(tmp / "tok-target" / name, tmp / name)
        eos = load.eos_ids(sources["target"], configs["target"], tmp / "tokenizer.json")
        output_ids = {}
        if cfg.draft_vocab >= vocab:
            log(f"draft vocabulary: --draft-vocab {cfg.draft_vocab} >= the {vocab} ids of the pair, keeping them all")
        elif cfg.draft_vocab:
            output_ids["draft"] = draft_vocab_ids(cfg, tmp / "tokenizer.json", vocab, eos, log, progress)
        entries = {}
        for role, src in sources.items():
            log(f"exporting {role} ({src.spec}) ...")
            entries[role] = export_model(src, tmp / role, cfg, output_ids.get(role), progress.of(role))
            gc.collect()
        for role in roles:
            shutil.rmtree(tmp / f"tok-{role}")
        manifest = Manifest(
            vocab_size=vocab,
            eos_token_ids=tuple(i for i in eos if i < vocab),
            max_len=cfg.max_len,
            max_draft_len=cfg.max_draft_len,
            target=_relative(entries["target"], "target"),
            draft=_relative(entries["draft"], "draft") if "draft" in entries else None,
            tokenizer_files=tuple(n for n in TOKENIZER_FILES if (tmp / n).is_file()),
            kv_layout=entries["target"].kv_layout,
            created_by=f"specrt {_version()}",
        )
        if cfg.engine == "tensorrt":
            manifest = trt_build.build_pair_engines(tmp, manifest, min(cfg.prefill_chunk, cfg.max_len), log,
                                                    progress=progress)
        write_manifest(tmp, manifest)
        _check_out(out, cfg.overwrite)  # again: files may have been put there while the export ran
        _swap_in(tmp, out)
        return manifest
    except OSError as e:
        raise ExportError(f"export failed writing {e.filename or tmp}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse to replace a non-empty `out` unless it holds a pair and `overwrite` is given."""
    if not (out.exists() and any(out.iterdir())):
        return
    if not _holds_pair(out):
        raise ExportError(f"{out} is not empty and is not a specrt pair folder (no specrt {MANIFEST_NAME}); "
                          "--overwrite replaces only a pair or an empty folder: choose another --out")
    if not overwrite:
        raise ExportError(f"{out} exists and is not empty; choose another --out or pass --overwrite")


def _holds_pair(folder: Path) -> bool:
    """Whether `folder` has a specrt pair's manifest; read loosely, so that a damaged or older pair can
    still be replaced."""
    try:
        raw = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT_NAME


def _swap_in(new: Path, out: Path) -> None:
    """Replace `out` by `new`; an old pair is moved aside first and put back if the swap fails
    (after a crash between the two renames, the next export to `out` puts it back: `recover`)."""
    old = _aside(out, "old", os.getpid())
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:  # a full disk, or Ctrl-C between the two renames
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _aside(out: Path, kind: str, pid: int) -> Path:
    """Where an export keeps things beside `out`: the folder it writes (partial), the pair it replaces (old)."""
    return out.parent / f".{out.name}.{kind}-{pid}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours are left over from an earlier export in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's live process
        return True
    return True


def recover(out: Path, log=print) -> None:
    """Tidy up after an export to `out` that died before it finished (killed, power cut), so nothing is lost
    and nothing is left behind: its temporary folder is removed; the old pair it had moved aside (a crash
    between the two renames of `_swap_in`) is put back if `out` is missing, or removed if `out` is a complete
    pair. Exports still running (their process alive) are left alone."""
    for kind in ("partial", "old"):
        for p in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
            pid = p.name.rsplit("-", 1)[1]
            if not pid.isdigit() or _alive(int(pid)) or not p.is_dir():
                continue
            if kind == "partial":
                shutil.rmtree(p, ignore_errors=True)
            elif not out.exists():
                os.replace(p, out)
                log(f"restored {out} (an earlier export was interrupted while replacing it)")
            elif (out / MANIFEST_NAME).is_file():
                shutil.rmtree(p, ignore_errors=True)


def param_count(c) -> int:
    """Parameters of a Llama-family decoder, from its config alone (before loading anything)."""
    h, inter, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * (
        getattr(c, "head_dim", None) or h // c.num_attention_heads)
    embed = vocab * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return embed + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)


def estimate(configs: dict, cfg: ExportConfig) -> tuple[int, int]:
    """(peak memory, disk) the export needs, in bytes, from the models' configs alone.

    The graph builder holds the process's base and the weight it is writing (export/builder.py,
    `working_bytes`); the graphs take their weights' bytes on disk. The traced path, measured on the
    Qwen2.5-Coder pair: peak RSS ~1.6x the fp32 weights of the larger model (the GGUF loader's dequantization
    plus the exporter's copy); disk holds the fp32 graphs, and int4 needs room for the fp32 graph and its
    quantized copy at once.
    """
    fp32 = {r: 4 * param_count(c) for r, c in configs.items()}
    if cfg.traced:
        disk = sum(fp32.values()) * (1.0 if cfg.precision == "fp32" else 0.5) + max(fp32.values()) * 0.4
        return int(1.6 * max(fp32.values())), int(disk)
    per_weight = {"fp32": 1.0, "fp16": 0.5, "int4": 0.16}[cfg.precision]  # int4: 4 bits, scales and zero points
    work = max(builder.working_bytes(builder.Shape.of(c), cfg.dtype, cfg.precision == "int4") for c in configs.values())
    return builder.BASE_BYTES + work, int(sum(fp32.values()) * per_weight * 1.05)


def preflight(configs: dict, folder: Path, cfg: ExportConfig) -> None:
    """Refuse before hours of work when disk or memory cannot hold the export."""
    need_mem, need_disk = estimate(configs, cfg)
    free_disk = shutil.disk_usage(folder).free
    if need_disk > free_disk:
        raise ExportError(f"not enough disk in {folder.parent}: the export needs about {need_disk / 1e9:.1f} GB, "
                          f"{free_disk / 1e9:.1f} GB are free")
    avail = _mem_available()
    if avail is not None and need_mem > avail:
        hint = "" if cfg.traced else " (one layer at a time already)"
        raise ExportError(f"not enough memory: exporting needs about {need_mem / 1e9:.1f} GB{hint}, "
                          f"{avail / 1e9:.1f} GB are available; close other programs or use a machine with more memory")


def dry_run(cfg: ExportConfig, log=print, progress: Progress = QUIET) -> tuple[int, int]:
    """What `export_pair(cfg)` would need, said in lines to `log`, writing nothing: (peak memory, disk) in
    bytes. Known model names are fetched (their configs are in the files)."""
    roles = {"target": cfg.target} | ({"draft": cfg.draft} if cfg.draft else {})
    configs = _configs({r: load.resolve(s, progress=progress.on) for r, s in roles.items()}, cfg)
    for role, c in configs.items():
        log(f"{role}: {c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{param_count(c) / 1e9:.2f} B parameters")
    need_mem, need_disk = estimate(configs, cfg)
    where = Path(cfg.out).resolve()
    while not where.exists():  # the nearest folder that exists holds what --out will
        where = where.parent
    avail, free = _mem_available(), shutil.disk_usage(where).free
    how = "traced through torch" if cfg.traced else "written layer by layer"
    log(f"export ({how}, {cfg.precision}): peak memory about {need_mem / 1e9:.1f} GB"
        + (f" ({avail / 1e9:.1f} GB available)" if avail is not None else "")
        + f", disk about {need_disk / 1e9:.1f} GB ({free / 1e9:.1f} GB free)")
    return need_mem, need_disk


def _configs(sources: dict, cfg: ExportConfig) -> dict:
    """The models' configs, refused early where no export path writes them."""
    configs = {r: load.load_config(s) for r, s in sources.items()}
    for role, c in configs.items():
        if c.model_type not in SUPPORTED_MODEL_TYPES:
            raise ExportError(f"{role} model type {c.model_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if not cfg.traced:
            builder.Shape.of(c)  # what the builder does not write is refused now, naming --trace
    return configs


_mem_available = host.available_bytes  # bytes, None when unknown; $SPECRT_MEM_AVAILABLE_BYTES overrides it


def check_tokenizers(tok_files: dict[str, Path], widths: dict[str, int]) -> int:
    """Return the vocabulary the sampler may use, or refuse tokenizers that differ.

    Identical vocabularies pass. Output matrices of different widths (Qwen2.5: 151936 vs 152064
    rows) are fine as long as every tokenizer id fits in both; the rows past the tokenizer are
    padding and the runtime masks them by using only the first `vocab` logits.
    """
    from tokenizers import Tokenizer

    vocabs = {}
    for role, f in tok_files.items():
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:
            raise ExportError(f"cannot read the {role} tokenizer {f}: {first_line(e)}") from None
        vocabs[role] = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if "draft" in vocabs:
        t, d = vocabs["target"], vocabs["draft"]
        diff = [i for i in sorted(set(t) | set(d)) if t.get(i) != d.get(i)]
        if diff:
            shown = ", ".join(f"{i} ({t.get(i)!r} vs {d.get(i)!r})" for i in diff[:5])
            raise ExportError(f"draft and target tokenizers differ at {len(diff)} ids: {shown}; "
                              "speculative decoding needs the same tokenizer")
    vocab = max(max(v) for v in vocabs.values()) + 1
    for role, w in widths.items():
        if vocab > w:
            raise ExportError(f"the tokenizer has ids up to {vocab - 1} but the {role} model has only {w} output rows")
    return vocab


def draft_vocab_ids(cfg: ExportConfig, tokenizer_file: Path, vocab: int, always, log=print, progress=QUIET):
    """The draft's kept output ids, counted on the calibration texts (see export/vocab.py)."""
    from tokenizers import Tokenizer

    texts = list(cfg.draft_vocab_texts) or draft_vocab.default_corpus()
    with progress.of("draft vocabulary").step("counting calibration tokens"):
        counts = draft_vocab.calibration_counts(tokenizer_file, texts, vocab, strict=bool(cfg.draft_vocab_texts))
    if not counts.any():
        raise ExportError("the calibration texts hold no tokens; give --draft-vocab-text FILE")
    special = list(Tokenizer.from_file(str(tokenizer_file)).get_added_tokens_decoder())  # ids of added tokens
    ids = draft_vocab.select_ids(counts, cfg.draft_vocab, [*always, *special])
    seen = counts[ids].sum() / counts.sum()
    log(f"draft vocabulary: {len(ids)} of {vocab} ids, covering {seen:.1%} of {counts.sum()} calibration tokens "
        f"({int((counts > 0).sum())} distinct)")
    return ids


def export_model(src, folder: Path, cfg: ExportConfig, output_ids=None, progress: Progress = QUIET) -> ModelEntry:
    """Export one checkpoint to `folder/model.onnx` (+ external data), quantized if asked: written by the graph
    builder, or traced through torch (`cfg.traced`). `output_ids`: keep only these rows of the output matrix
    (a restricted draft vocabulary)."""
    import onnx

    folder.mkdir()
    path = folder / "model.onnx"
    if cfg.traced:
        spec, quant, embedding = traced.trace(src, path, cfg, output_ids, progress)
    else:
        spec, quant, embedding = _build(src, path, cfg, output_ids, progress)
    if output_ids is not None:
        np.save(folder / "output_ids.npy", np.asarray(output_ids, np.int64))
        spec["output_ids"] = "output_ids.npy"
    proto = onnx.load(str(path), load_external_data=False)
    for p in folder.iterdir():
        p.chmod(0o644)  # onnx writes external data owner-only; a pair folder is meant to be shared
    paths = sorted(folder.iterdir())
    files = {p.name: digest for p, digest in zip(paths, hash_files(paths, progress))}
    inputs, outputs = _io_spec(proto.graph.input), _io_spec(proto.graph.output)
    # The tracer leaves dims symbolic where shape inference stops (at contrib ops); the config fixes them.
    Hkv, D = spec["num_kv_heads"], spec["head_dim"]
    for io in (inputs, outputs):
        for name, v in io.items():
            if name.startswith(("past_", "present_")):
                v["shape"] = ["batch", Hkv, "capacity", D]
            elif name.startswith("new_"):
                v["shape"] = ["seq", "batch", Hkv, D]
            if cfg.graph == "portable" and name.startswith("past_"):
                v["shape"] = ["past", "batch", Hkv, D]
    outputs["logits"]["shape"] = (["n_logits", spec["logits_width"]] if cfg.graph == "lean"
                                  else ["batch", "n_logits", spec["logits_width"]])
    return ModelEntry(path=path.name, files=files, source=src.spec, precision=cfg.precision, dtype=cfg.dtype,
                      inputs=inputs, outputs=outputs, quantization=quant, embedding=embedding, graph=cfg.graph,
                      weights=weight_bytes(proto, path.parent), **spec)


def _build(src, path: Path, cfg: ExportConfig, output_ids, progress: Progress) -> tuple[dict, dict | None, dict | None]:
    """The lean graph written by export/builder.py: (the manifest's model fields, the weights' quantization,
    the embedding's)."""
    shape = builder.Shape.of(load.load_config(src))
    int4 = cfg.precision == "int4"
    opts = builder.Options(
        dtype=cfg.dtype, int4=int4, block_size=cfg.block_size, accuracy_level=cfg.accuracy_level,
        symmetric=cfg.symmetric, embedding_bits=cfg.embedding, embedding_block_size=cfg.embedding_block_size,
        query_seqlens=gqa_has_query_seqlens() if cfg.query_seqlens is None else cfg.query_seqlens,
        # rotary tables for every position a cache holds: batch caches have max_draft_len + 1 slots spare
        positions=cfg.max_len + cfg.max_draft_len + 1,
        slice_rows=SLICE_ROWS if int4 and cfg.dtype == "float32" else 0)  # a CPU graph (on a GPU: more launches)
    embedding = builder.build_lean(load.open_tensors(src), shape, path, opts, output_ids, progress)
    quant = ({"method": "MatMulNBits", "bits": 4, "block_size": cfg.block_size, "accuracy_level": cfg.accuracy_level,
              "symmetric": cfg.symmetric} if int4 else None)
    spec = dict(model_type=shape.model_type, num_layers=shape.layers, num_kv_heads=shape.kv_heads,
                head_dim=shape.head_dim, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                logits_width=shape.vocab if output_ids is None else len(output_ids))
    return spec, quant, embedding


def weight_bytes(proto, folder: Path) -> dict:
    """How onnxruntime's CPU provider holds this graph's weights (measured on the int4 and fp32 pairs:
    api/memory.py): MatMul/MatMulNBits weights are prepacked, i.e. copied into memory at load; the
    embedding tables stay in the memory-mapped file and a pass touches only its tokens' rows."""
    import onnx

    size = {t.name: int(np.prod(t.dims, dtype=np.int64)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
            for t in proto.graph.initializer}
    packed, mapped, row = set(), set(), 0
    for n in proto.graph.node:
        if n.op_type == "MatMulNBits" or (n.op_type == "MatMul" and n.input[1] in size):
            packed |= {i for i in n.input[1:] if i in size}
        elif n.op_type in ("Gather", "GatherBlockQuantized") and n.input[0] in size:
            tables = [n.input[0]] + ([i for i in n.input[2:] if i in size] if n.op_type == "GatherBlockQuantized" else [])
            mapped |= set(tables)
            rows = next(t.dims[0] for t in proto.graph.initializer if t.name == n.input[0])
            row += sum(size[t] for t in tables) // rows
    other = sum(v for k, v in size.items() if k not in packed | mapped)
    return {"packed": sum(size[k] for k in packed), "mapped": sum(size[k] for k in mapped), "row": row, "other": other}


def _io_spec(values) -> dict[str, dict]:
    import onnx

    spec = {}
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        spec[v.name] = {"dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}
    return spec


def _relative(entry: ModelEntry, sub: str) -> ModelEntry:
    d = {**entry.__dict__, "path": f"{sub}/{entry.path}", "files": {f"{sub}/{k}": v for k, v in entry.files.items()}}
    if entry.output_ids:
        d["output_ids"] = f"{sub}/{entry.output_ids}"
    return ModelEntry(**d)


def _version() -> str:
    try:
        return version("specrt")
    except PackageNotFoundError:
        return "dev"
