"""Will this pair fit in memory? An estimate from the manifest, checked before anything is loaded.

The estimate adds up what a loaded `Pair` holds:

- weights: the size on disk of every graph file of both models (onnxruntime keeps the initializers
  in memory; an int4 graph is counted at its int4 size, which is what it loads as);
- KV caches: per model `layers x 2 (K and V) x max_len x batch x kv_heads x head_dim x itemsize`,
  allocated in full when the pair loads (DESIGN §3), so they are linear in `max_len`;
- logits buffers: the engines' output buffers (target: max_draft_len + 1 rows, draft: 1 row, each
  `logits_width` float32 values) twice over, for the copies the sampler makes;
- a workspace margin for onnxruntime's arenas and intermediate activations: 15% of the weights
  plus 64 MB.

It is compared with the memory the kernel says is available (`MemAvailable` in /proc/meminfo). On
a Jetson the CPU and the GPU share one memory, and this is the same number.

`SPECRT_MEM_AVAILABLE_BYTES` overrides the available memory (an integer number of bytes): a knob
for tests, and for a deployment that wants to reserve memory for other processes (set it to what
specrt may use). Where /proc/meminfo is missing (not Linux) and the variable is unset, the check
is skipped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from specrt.config import Manifest, ModelEntry
from specrt.errors import ConfigError, PairError

ENV_AVAILABLE = "SPECRT_MEM_AVAILABLE_BYTES"
ENV_GPU_AVAILABLE = "SPECRT_GPU_MEM_AVAILABLE_BYTES"  # the same knob for the GPU's free memory
WORKSPACE_FRACTION = 0.15  # of the weights
WORKSPACE_FIXED = 64 << 20  # bytes
MIN_MAX_LEN = 16  # `specrt export --max-len` refuses less
MB = 1 << 20


def _itemsize(entry: ModelEntry) -> int:
    import numpy as np

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
                "kv_bytes_per_token": dict(self.kv_per_token)}


def estimate(pair_dir, manifest: Manifest, batch: int = 1) -> MemoryEstimate:
    """What loading this pair (with `batch` sequences per cache) takes, from the manifest and file sizes."""
    entries = {"target": manifest.target} | ({"draft": manifest.draft} if manifest.draft is not None else {})
    rows = {"target": manifest.max_draft_len + 1, "draft": 1}
    weights = {r: graph_bytes(pair_dir, e) for r, e in entries.items()}
    per = {r: kv_bytes_per_token(e, batch) for r, e in entries.items()}
    return MemoryEstimate(
        weights=weights,
        kv_cache={r: per[r] * manifest.max_len for r in entries},
        logits={r: 2 * batch * rows[r] * e.logits_width * 4 for r, e in entries.items()},
        workspace=int(WORKSPACE_FRACTION * sum(weights.values())) + WORKSPACE_FIXED,
        max_len=manifest.max_len, batch=batch, kv_per_token=per)


def _env_bytes(name: str) -> int | None:
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name} must be a number of bytes (an integer >= 0), got {env!r}")
    return value


def _libcuda():
    """The CUDA driver library through ctypes (no toolkit or cuda-python needed), initialised; or None."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def cuda_device_count() -> int:
    """CUDA devices the driver shows this process (0 without a driver)."""
    import ctypes

    lib = _libcuda()
    n = ctypes.c_int(0)
    return n.value if lib is not None and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def gpu_free_bytes(device_id: int = 0) -> int | None:
    """Free memory of CUDA device `device_id`: $SPECRT_GPU_MEM_AVAILABLE_BYTES, else the driver's
    cuMemGetInfo in the device's primary context (the one onnxruntime uses too), else None."""
    env = _env_bytes(ENV_GPU_AVAILABLE)
    if env is not None:
        return env
    import ctypes

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


def available_bytes() -> int | None:
    """Memory available to a new allocation: $SPECRT_MEM_AVAILABLE_BYTES, else MemAvailable, else None."""
    env = _env_bytes(ENV_AVAILABLE)
    if env is not None:
        return env
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fmt(n: int) -> str:
    """Bytes for people: MB below 10 GB-ish, GB above."""
    return f"{n / (1 << 30):.2f} GB" if n >= 1 << 30 else f"{n / MB:.1f} MB"


def check_memory(pair_dir, manifest: Manifest, batch: int = 1, available: int | None = None,
                 device: str = "cpu", device_id: int = 0) -> MemoryEstimate:
    """Refuse (PairError) a pair whose estimate exceeds the available memory; return the estimate.
    `device` "cuda": the weights, caches and workspace must fit in the GPU's free memory."""
    est = estimate(pair_dir, manifest, batch)
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
    where = f"GPU memory on cuda:{device_id}" if device == "cuda" else "memory"
    raise PairError(f"not enough {where} to load {pair_dir}: it needs about {fmt(est.total)} ({parts}), "
                    f"{fmt(avail)} are available; {fix}")
