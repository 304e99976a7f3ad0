"""Will this pair fit in memory? An estimate from the manifest, checked before anything is loaded.

The estimate models how the process holds the pair (measured on the Qwen2.5-Coder int4 and fp32 pairs
with onnxruntime 1.32's CPU provider, bench/RESULTS.md "Memory"):

- weights: the MatMul and MatMulNBits weights are prepacked, i.e. copied into memory when the
  session loads (their bytes on disk, a few percent more); the embedding tables stay in the
  memory-mapped file, and a pass touches only its tokens' rows (page cache, which the kernel can
  reclaim: an allowance, not the table); the rest (norms, biases, rotary tables) is small. Pairs
  exported before the manifest recorded this (`ModelEntry.weights`) are counted at their size on disk;
- KV caches: per model `layers x 2 (K and V) x tokens x batch x kv_heads x head_dim x itemsize`,
  allocated in full when the pair loads (docs/design.md, "The KV-cache contract") and resident as a
  sequence fills them: counted for `tokens` (max_len unless asked), so they are linear in it;
- logits buffers: the engines' output buffers (target: max_draft_len + 1 rows, draft: 1 row, each
  `logits_width` float32 values) twice over, for the copies the sampler makes;
- a workspace: Python, numpy and onnxruntime themselves, the loaded tokenizer (about 8.5 times its
  tokenizer.json), each onnxruntime session's own state, and the activations of the widest pass (a
  prompt is read in chunks of ``PREFILL_CHUNK`` tokens, so that is a chunk's).

It is compared with the memory the kernel says is available (`MemAvailable` in /proc/meminfo). On
a Jetson the CPU and the GPU share one memory, and this is the same number.

`SPECRT_MEM_AVAILABLE_BYTES` overrides the available memory (an integer number of bytes): a knob
for tests, and for a deployment that wants to reserve memory for other processes (set it to what
specrt may use). Where /proc/meminfo is missing (not Linux) and the variable is unset, the check
is skipped.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrt import host
from specrt.engines.cuda import libcuda as _libcuda
from specrt.engines.select import PREFILL_CHUNK
from specrt.errors import ConfigError, PairError
from specrt.manifest import Manifest, ModelEntry

ENV_AVAILABLE = host.ENV_AVAILABLE
ENV_GPU_AVAILABLE = "SPECRT_GPU_MEM_AVAILABLE_BYTES"  # the same knob for the GPU's free memory
MB = 1 << 20
# Measured (bench/RESULTS.md "Memory"): Python with numpy and onnxruntime imported, 47 MB; the Qwen2.5
# tokenizer (11.4 MB of JSON) loaded, +94 MB; per session beyond its weights (graph, kernels, the
# provider's libraries) ~25 MB; prepacked int4 weights against their bytes on disk, +0-7%.
RUNTIME_BYTES = 50 * MB
TOKENIZER_FACTOR = 8.5
SESSION_BYTES = 30 * MB
PACKED_FACTOR = 1.05
MAPPED_ALLOWANCE = 32 * MB  # page cache of an embedding table's touched rows, per model (measured 8-60 MB)
ACTIVATION_FACTOR = 2  # activations of a pass: this many gate/up outputs per token (measured at chunks of 128)
MIN_MAX_LEN = 16  # `specrt export --max-len` refuses less


def _itemsize(entry: ModelEntry) -> int:
    return np.dtype(entry.dtype).itemsize


def kv_bytes_per_token(entry: ModelEntry, batch: int = 1) -> int:
    """Bytes of K and V cache one sequence position takes in this model, over all layers."""
    return entry.num_layers * 2 * batch * entry.num_kv_heads * entry.head_dim * _itemsize(entry)


def graph_bytes(pair_dir: Path, entry: ModelEntry) -> int:
    """Size on disk of a model's graph files (a missing file counts 0; loading reports it)."""
    total = 0
    for name in entry.files:
        try:
            total += (Path(pair_dir) / name).stat().st_size
        except OSError:
            pass
    return total


def weights_held(pair_dir: Path, entry: ModelEntry, device: str = "cpu") -> int:
    """Bytes the process holds for a model's weights (see the module docstring). On a GPU every weight is
    copied to the device."""
    w = entry.weights
    if w is None:  # exported before the manifest said how: its size on disk
        return graph_bytes(pair_dir, entry)
    if device == "cuda":
        return w["packed"] + w["mapped"] + w["other"]
    return int(PACKED_FACTOR * w["packed"]) + w["other"] + min(w["mapped"], MAPPED_ALLOWANCE)


def activation_bytes(entry: ModelEntry, tokens: int, batch: int = 1) -> int:
    """Activations of a pass of `tokens` tokens a row (onnxruntime's arena keeps its peak)."""
    width = entry.intermediate_size or 4 * entry.num_kv_heads * entry.head_dim  # older manifests: a guess
    return ACTIVATION_FACTOR * 2 * width * _itemsize(entry) * tokens * batch


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a loaded pair needs, by part. `roles` are "target" and, if present, "draft"."""

    weights: dict[str, int]
    kv_cache: dict[str, int]
    logits: dict[str, int]
    workspace: int
    max_len: int
    batch: int = 1
    kv_per_token: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # cache positions counted (max_len unless the estimate is for a shorter sequence)

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + sum(self.kv_cache.values()) + sum(self.logits.values()) + self.workspace

    def fixed(self) -> int:
        """Everything except the KV caches (which scale with max_len)."""
        return self.total - sum(self.kv_cache.values())

    def max_len_that_fits(self, available: int) -> int:
        """The largest max_len whose estimate fits in `available` bytes (rounded down to a multiple of 64
        above 64); 0 if even the weights do not fit with a minimal cache."""
        per = sum(self.kv_per_token.values())
        room = available - self.fixed()
        n = room // per if per else 0
        if n >= 128:
            n -= n % 64
        return int(n) if n >= MIN_MAX_LEN else 0

    def as_dict(self) -> dict:
        return {"weights": dict(self.weights), "kv_cache": dict(self.kv_cache), "logits": dict(self.logits),
                "workspace": self.workspace, "total": self.total, "max_len": self.max_len, "batch": self.batch,
                "tokens": self.tokens, "kv_bytes_per_token": dict(self.kv_per_token)}


def estimate(pair_dir, manifest: Manifest, batch: int = 1, tokens: int | None = None,
             device: str = "cpu", draft: bool = True) -> MemoryEstimate:
    """What loading this pair (with `batch` sequences per cache) and running it takes: its caches filled to
    `tokens` positions (default max_len, the most a request can use), from the manifest and file sizes.
    `draft=False`: the pair loaded without its draft model (`load(draft_model=False)`)."""

    tokens = manifest.max_len if tokens is None else min(tokens, manifest.max_len)
    with_draft = draft and manifest.draft is not None
    entries = {"target": manifest.target} | ({"draft": manifest.draft} if with_draft else {})
    rows = {"target": manifest.max_draft_len + 1, "draft": 1}
    per = {r: kv_bytes_per_token(e, batch) for r, e in entries.items()}
    widest = min(PREFILL_CHUNK.get(device, PREFILL_CHUNK["cpu"]), max(tokens, 1))
    try:
        tok = int(TOKENIZER_FACTOR * (Path(pair_dir) / "tokenizer.json").stat().st_size)
    except OSError:
        tok = 0
    workspace = (RUNTIME_BYTES + tok + len(entries) * SESSION_BYTES
                 + sum(activation_bytes(e, widest, batch) for e in entries.values()))
    return MemoryEstimate(
        weights={r: weights_held(pair_dir, e, device) for r, e in entries.items()},
        kv_cache={r: per[r] * tokens for r in entries},
        logits={r: 2 * batch * rows[r] * e.logits_width * 4 for r, e in entries.items()},
        workspace=workspace, max_len=manifest.max_len, batch=batch, kv_per_token=per, tokens=tokens)


GB = 1 << 30
# Boards by name: total memory (CPU and GPU share it), and what is assumed taken before specrt starts.
# JetPack 6 headless at idle keeps about 1 GB (a desktop session ~0.6 GB more); the CUDA context of a
# process that uses the GPU takes ~0.5 GB more. Assumptions from NVIDIA's figures, not measured here.
BOARDS = {"orin-nano-8gb": 8 * GB, "orin-nx-16gb": 16 * GB, "agx-orin-64gb": 64 * GB}
OS_RESERVE = 1 * GB
CUDA_CONTEXT = GB // 2


def parse_budget(text: str) -> tuple[str, int, int]:
    """(name, total bytes, bytes assumed taken by the OS) of a board name or a byte count (all of it for
    specrt). One-line ConfigError for anything else."""
    t = str(text).strip().lower()
    if t in BOARDS:
        return t, BOARDS[t], OS_RESERVE
    try:
        n = int(t)
    except ValueError:
        raise ConfigError(f"unknown budget {text!r}: a board ({', '.join(BOARDS)}) or a number of bytes") from None
    if n <= 0:
        raise ConfigError(f"a budget in bytes must be a positive integer, got {text!r}")
    return f"{n} bytes", n, 0


def gpu_free_bytes(device_id: int = 0) -> int | None:
    """Free memory of CUDA device `device_id`: $SPECRT_GPU_MEM_AVAILABLE_BYTES, else the driver's
    cuMemGetInfo in the device's primary context (the one onnxruntime uses too), else None."""
    env = host.env_bytes(ENV_GPU_AVAILABLE)
    if env is not None:
        return env

    lib = _libcuda()
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if (lib is None or lib.cuDeviceGet(ctypes.byref(dev), device_id) != 0
            or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0):
        return None
    try:
        ok = lib.cuCtxPushCurrent_v2(ctx) == 0
        if ok:
            ok = lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)
    return free.value if ok else None


available_bytes = host.available_bytes  # $SPECRT_MEM_AVAILABLE_BYTES, else MemAvailable, else None


def fmt(n: int) -> str:
    """Bytes for people: MB below 10 GB-ish, GB above."""
    return f"{n / (1 << 30):.2f} GB" if n >= 1 << 30 else f"{n / MB:.1f} MB"


def check_memory(pair_dir, manifest: Manifest, batch: int = 1, available: int | None = None,
                 device: str = "cpu", device_id: int = 0, draft: bool = True) -> MemoryEstimate:
    """Refuse (PairError) a pair whose estimate exceeds the available memory; return the estimate.
    `device` "cuda": the weights, caches and workspace must fit in the GPU's free memory.
    `draft=False`: the pair loaded without its draft model."""
    est = estimate(pair_dir, manifest, batch, device=device, draft=draft)
    if available is None:
        available = gpu_free_bytes(device_id) if device == "cuda" else available_bytes()
    avail = available
    if avail is None or est.total <= avail:
        return est
    parts = (f"weights {fmt(sum(est.weights.values()))} + KV caches {fmt(sum(est.kv_cache.values()))} "
             f"at max_len {est.max_len} + logits {fmt(sum(est.logits.values()))} + workspace {fmt(est.workspace)}")
    fits = est.max_len_that_fits(avail)
    if fits:
        fix = (f"max_len is fixed at export: re-export with --max-len {fits} (KV caches "
               f"{fmt(sum(est.kv_per_token.values()) * fits)}), or free memory")
    else:
        fix = ("the weights alone do not fit: use smaller models, --precision int4, a target-only pair, "
               "or free memory")
    if "draft" in est.weights:
        lean = estimate(pair_dir, manifest, batch, device=device, draft=False)
        if lean.total <= avail:
            fix += (f"; or leave the draft model out (about {fmt(lean.total)}: drafter ngram or suffix, "
                    "which `specrt generate --drafter suffix` and `load(draft_model=False)` do)")
    where = f"GPU memory on cuda:{device_id}" if device == "cuda" else "memory"
    raise PairError(f"not enough {where} to load {pair_dir}: it needs about {fmt(est.total)} ({parts}), "
                    f"{fmt(avail)} are available; {fix}")


def kv_bytes(m, batch: int, cache_len: int, draft: bool = True) -> int:
    """Bytes of the batch KV caches of both models (allocated in full when a batch runner is made, api/runner.py);
    `draft=False`: of the target's alone (a pair loaded without its draft model)."""
    return sum(e.num_layers * 2 * cache_len * batch * e.num_kv_heads * e.head_dim * np.dtype(e.dtype).itemsize
               for e in (m.target, m.draft if draft else None) if e is not None)


def check_batch(m, batch: int, cache_len: int, device: str = "cpu", draft: bool = True) -> None:
    """Refuse a batch whose KV caches do not fit in the memory available now (when that is known)."""
    avail = gpu_free_bytes() if device == "cuda" else available_bytes()
    need = kv_bytes(m, batch, cache_len, draft)
    if avail is not None and need > avail:
        fits = max(0, batch * avail // need)
        where = "GPU memory" if device == "cuda" else "memory"
        raise ConfigError(f"a batch of {batch} needs {fmt(need)} of KV cache (max_len {m.max_len}), "
                          f"{fmt(avail)} of {where} are available; "
                          + (f"use a batch size <= {fits}" if fits else "use a smaller batch or a shorter --max-len"))
