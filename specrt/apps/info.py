"""What a pair folder holds and what it needs here, as data (`specrt info`): models, sizes, the memory
estimate against this machine or a board, tuned settings, the engines that can run it. Reads the manifest
and file sizes; `measure` also loads the pair and generates once.
"""
from __future__ import annotations

import resource
from pathlib import Path

from specrt.api import memory, requests
from specrt.api.pair import load
from specrt.api.text import TextCodec
from specrt.engines import int4
from specrt.engines import ort as ort_engines
from specrt.errors import PairError, SpecrtError
from specrt.manifest import ManifestProblems, read_manifest, verify_files
from specrt.config import MAX_NEW_TOKENS


def pair_info(pair_dir: Path, budget: str | None = None) -> dict:
    """Everything `specrt info` shows, as a JSON-able dict. Reads the manifest and file sizes only.
    `budget`: a board name or a number of bytes (api/memory.parse_budget) to check the pair against.
    A manifest that reads but cannot be trusted (manifest.ManifestProblems) gives its problems alone:
    nothing is sized by its values, and no file it names is opened."""
    try:
        m = read_manifest(pair_dir)
    except ManifestProblems as e:
        return {"problems": e.problems, "pair": str(pair_dir)}
    for e in (m.target, m.draft):
        for name in e.files if e is not None else ():
            if not (Path(pair_dir) / name).is_file():
                raise PairError(f"missing graph file {Path(pair_dir) / name} (listed in the manifest)")
    est = memory.estimate(pair_dir, m)
    # the footprint of `load(draft_model=False)` (drafters ngram and suffix), for a board the pair misses
    lean = memory.estimate(pair_dir, m, draft=False).total if m.draft is not None else None
    avail = memory.available_bytes()
    models = {}
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            continue
        models[role] = {
            "source": e.source, "model_type": e.model_type, "precision": e.precision, "dtype": e.dtype,
            "quantization": e.quantization, "layers": e.num_layers, "kv_heads": e.num_kv_heads,
            "head_dim": e.head_dim, "logits_width": e.logits_width, "size_bytes": memory.graph_bytes(pair_dir, e),
            "files": sorted(e.files), "graph": e.graph, "kv_layout": e.kv_layout, "embedding": e.embedding,
            "int4_kernel": _int4_kernel(Path(pair_dir) / e.path, e),
        }
    tuned = None
    if m.tuned:
        t = m.tuned
        tuned = {k: t.get(k) for k in ("drafter", "draft_len", "confidence_stop", "acceptance", "costs", "measured")}
        tuned["stale"] = t.get("graphs") != m.graph_hashes()
    # what a request that names no drafter or draft length gets (a stale "tuned" entry is refused at load)
    drafter, draft_len, _ = requests.defaults(m, m.tuned if tuned and not tuned["stale"] else None, m.draft is not None)
    try:
        import onnxruntime as ort

        ort_version = ort.__version__
    except ImportError:  # pragma: no cover - a runtime dependency
        ort_version = None
    fits = None if avail is None else est.total <= avail
    board = None
    if budget is not None:
        name, total, reserve = memory.parse_budget(budget)
        cuda = memory.CUDA_CONTEXT if (m.for_gpu and reserve) else 0
        room = total - reserve - cuda
        board = {"name": name, "total": total, "os_reserve": reserve, "cuda_context": cuda, "for_specrt": room,
                 "needs": est.total, "fits": est.total <= room,
                 "fits_without_draft": None if lean is None else lean <= room,
                 "max_len_that_fits": est.max_len_that_fits(room) if est.total > room else None}
    return {
        "problems": problems(Path(pair_dir), m),
        "pair": str(pair_dir), "format": m.format, "format_version": m.format_version, "created_by": m.created_by,
        "vocab_size": m.vocab_size, "eos_token_ids": list(m.eos_token_ids), "max_len": m.max_len,
        "max_draft_len": m.max_draft_len, "kv_layout": m.kv_layout, "tokenizer_files": list(m.tokenizer_files),
        "models": models,
        "memory": {**est.as_dict(), "without_draft": lean, "available": avail, "fits": fits,
                   "max_len_that_fits": est.max_len_that_fits(avail) if fits is False else None},
        "budget": board,
        "tuned": tuned,
        "defaults": {"drafter": drafter, "draft_len": draft_len},
        "engines": _engines(m, ort_version),
    }


def problems(pair_dir: Path, m) -> list[str]:
    """What is wrong with the pair's files, one line each (empty: nothing found): every graph file against its
    sha256 (always hashed: this is the check a user runs when in doubt, and bit rot keeps a file's size and
    mtime), each graph's structure and inputs and outputs against the manifest, the tokenizer."""
    found = []
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            continue
        try:
            verify_files(pair_dir, e, cached=False)
        except SpecrtError as ex:
            found.append(f"{role}: {ex}")
            continue
        why = _graph_problem(pair_dir / e.path, e)
        if why:
            found.append(f"{role}: {pair_dir / e.path} {why}")
        if e.output_ids is not None and not (pair_dir / e.output_ids).is_file():
            found.append(f"{role}: missing {pair_dir / e.output_ids} (listed in the manifest)")
    for name in m.tokenizer_files:
        if not (pair_dir / name).is_file():
            found.append(f"tokenizer: missing {pair_dir / name} (listed in the manifest)")
    if not any(f.startswith("tokenizer:") for f in found):
        try:
            TextCodec(pair_dir)
        except SpecrtError as ex:
            found.append(f"tokenizer: {ex}")
    return found


def _graph_problem(path: Path, e) -> str | None:
    """Why the graph at `path` cannot be what its manifest entry says (None: it can), from its structure."""
    try:
        import onnx
    except ImportError:  # checked by loading instead
        return None
    try:
        g = onnx.load(str(path), load_external_data=False).graph
    except Exception as ex:  # onnx and protobuf raise their own types for a damaged file
        return f"is not an ONNX model ({str(ex).strip().splitlines()[0] if str(ex).strip() else type(ex).__name__})"
    if not g.node:
        return "has no nodes"
    inits = {t.name for t in g.initializer}
    names = {i.name for i in g.input if i.name not in inits}, {o.name for o in g.output}
    for kind, have, want in (("inputs", names[0], set(e.inputs)), ("outputs", names[1], set(e.outputs))):
        if have != want:
            diff = sorted(have ^ want)[:3]
            return f"has other {kind} than the manifest lists ({', '.join(diff)})"
    return None


def _int4_kernel(path: Path, e) -> dict | None:
    """What computes the graph's matmuls and attention on the CPU (engines/int4.py), as the CPU engine would
    load it; None for a graph the CPU engine does not run (not a lean graph, or fp16 activations)."""
    if e.graph != "lean" or e.dtype != "float32":
        return None
    try:
        _, k = int4.plan(path)
    except PairError as ex:
        return {"path": None, "swapped": 0, "total": None, "why": str(ex), "describe": f"refused: {ex}"}
    return {"path": k.path, "swapped": k.swapped, "total": k.total, "why": k.why, "attention": k.attention,
            "attention_total": k.attention_total, "attention_why": k.attention_why, "invariant": k.invariant,
            "trees": k.trees, "trees_why": k.trees_why, "describe": k.describe()}


def _engines(m, ort_version) -> list[dict]:
    """What can run this pair here: onnxruntime CPU always, CUDA for a pair with fp16 activations, TensorRT engines."""
    why = ort_engines.cuda_available() if ort_version else "onnxruntime is not installed"
    gpu = "" if m.for_gpu else ("; this pair's graphs run on the CPU only (fp32 activations, or an older specrt's "
                                "CPU ops): export with --precision fp16 (or int4 --activations fp16) for a GPU")
    out = [{"name": "onnxruntime", "version": ort_version, "provider": "CPUExecutionProvider",
            "note": "runs every pair (--device cpu)"},
           {"name": "onnxruntime", "version": ort_version, "provider": "CUDAExecutionProvider",
            "note": (why or "available") + gpu}]
    try:
        import tensorrt

        trt_version = tensorrt.__version__
    except ImportError:
        trt_version = None
    if m.engines:
        built = f"engines built for TensorRT {m.engines.get('tensorrt_version')} on compute capability " \
                f"{m.engines.get('compute_capability')} (unverified on hardware)"
    else:
        built = "no engines in this pair (specrt build-engines)"
    out.append({"name": "tensorrt", "version": trt_version, "provider": "native", "note": built})
    return out


def measure(pair_dir: Path, max_new_tokens: int = MAX_NEW_TOKENS, draft_model: bool = True) -> dict:
    """Load the pair on the CPU and run one greedy generation of a built-in chat prompt: this process's peak
    resident memory afterwards, beside the estimate for the same number of cache positions.
    `draft_model=False`: the target alone, drafting by prompt lookup."""
    with load(pair_dir, device="cpu", draft_model=draft_model) as pair:
        res = pair.generate("Write a Python function is_palindrome(s) that ignores case, spaces and punctuation, "
                            "with a short docstring.", chat=True, max_new_tokens=max_new_tokens, draft_len=2,
                            drafter=None if pair.draft is not None else "ngram")
        tokens = res.stats["prompt_tokens"] + res.stats["new_tokens"] + pair.manifest.max_draft_len + 1
        est = memory.estimate(pair_dir, pair.manifest, tokens=tokens, draft=pair.draft is not None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"peak_rss": peak, "estimate": est.total, "tokens": tokens, "new_tokens": res.stats["new_tokens"],
            "ratio": est.total / peak, "draft_model": pair.draft is not None}
