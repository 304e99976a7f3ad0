"""TensorRT: a runtime engine over the engines built from a pair's portable fp16 graphs (the build:
export/trt_build.py), and what both sides share (profiles, alignment, the engines' metadata).

UNVERIFIED ON HARDWARE. No machine this code was written on had TensorRT (the GPU machine used for
the CUDA checks has none, and its wheels are several GB). The pure parts (profile shapes from the
manifest, profile choice, prompt chunking, engine metadata checks, cache offsets) are unit-tested;
the calls into TensorRT follow its 10.x/11.x Python API (strongly typed networks, name-based
`set_tensor_address` + `execute_async_v3`) and are exercised only against a stand-in module in the
tests. Run bench/gpu/check.sh on a machine with TensorRT before relying on it.

Build (`specrt export --engine tensorrt`, or `specrt build-engines PAIR` for an existing fp16 pair):
one engine per model from its graph, strongly typed (precision lives in the ONNX), with one shape
profile per kind of call (`profiles`):
  target  prefill  S in 1..C (opt C)           verify  S in 1..max_draft_len+1 (opt that)
  draft   prefill  S in 1..C (opt C)           step    S in 1..2 (opt 1; 2 = the catch-up step)
Past length P spans 0..max_len-1 in every profile. The plans, the timing cache, and the TensorRT
version and GPU compute capability they were built for go into the pair folder and the manifest
("engines"); an engine built elsewhere is refused at load with how to rebuild.

Run (`--device tensorrt`): the same KV contract as onnxruntime (engines/ort.py): per layer one K and
one V buffer [max_len, 1, Hkv, D] in GPU memory; the past binds at the buffer's start, the new K/V
output at `kv_offset(P)`, so the engine writes into the cache and a rollback moves an offset. One
execution context per profile (a profile belongs to one context). A prompt longer than the prefill
profile runs in chunks, never fails.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from specrt.engines.ort import kv_offset
from specrt.errors import ExportError, PairError
from specrt.manifest import Manifest, ModelEntry

ALIGN = 256  # bytes: TensorRT's alignment for the addresses given to set_tensor_address

INSTALL_HINT = ("install TensorRT for this machine (x86_64: pip install tensorrt cuda-python; Jetson: the TensorRT "
                "of your JetPack, see docs/gpu.md)")


def check_alignment(entry: ModelEntry, role: str, error=PairError) -> None:
    """New K/V are bound at slot offsets (`kv_offset`), which TensorRT needs 256-byte aligned: every slot
    size must be a multiple of 256 bytes (Qwen2.5's 0.5B and 1.5B: 2 x 64 x 2 and 2 x 128 x 2). Refuse others."""
    slot = entry.num_kv_heads * entry.head_dim * np.dtype(entry.dtype).itemsize
    if slot % ALIGN:
        raise error(f"the {role} model's KV slot is {slot} bytes ({entry.num_kv_heads} KV heads x head_dim "
                    f"{entry.head_dim} x {np.dtype(entry.dtype).itemsize}), not a multiple of the {ALIGN} bytes "
                    "TensorRT needs for its tensor addresses; run this pair with --device cuda")


def require_tensorrt(error=ExportError):
    """The tensorrt module, or `error` saying how to get it."""
    try:
        import tensorrt
    except ImportError:
        raise error(f"TensorRT is not installed here; {INSTALL_HINT}") from None
    return tensorrt


def _dims(entry: ModelEntry, name: str, batch: int, seq: int, past: int, n_logits: int) -> tuple[int, ...]:
    """The concrete shape of input `name` for a call with these sizes (the graph contract, graph.py)."""
    if name in ("input_ids", "position_ids"):
        return (batch, seq)
    if name == "attention_mask":
        return (batch, past + seq)
    if name == "logit_positions":
        return (n_logits,)
    if name.startswith("past_"):
        return (past, batch, entry.num_kv_heads, entry.head_dim)
    raise PairError(f"the graph has an input {name!r} this engine does not know; re-export the pair")


def profiles(entry: ModelEntry, role: str, max_len: int, max_draft_len: int, prefill_chunk: int) -> list[dict]:
    """The shape profiles of one model: [{"name", "seq": [min, opt, max], "shapes": {input: [min, opt, max]}}].

    Each call picks the first profile whose seq range holds its S (`pick_profile`); S beyond every
    profile is chunked by the caller. P (the past) spans 0..max_len-1 everywhere, opt at a mid-length past.
    """
    if role == "target":
        kinds = [("verify", 1, max_draft_len + 1, max_draft_len + 1), ("prefill", 1, prefill_chunk, prefill_chunk)]
    else:
        kinds = [("step", 1, 1, 2), ("prefill", 1, prefill_chunk, prefill_chunk)]
    out = []
    for name, s_min, s_opt, s_max in kinds:
        p_opt = min(max_len // 2, max_len - s_max)
        shapes = {}
        for inp in entry.inputs:
            lo = _dims(entry, inp, 1, s_min, 0, 1)
            opt = _dims(entry, inp, 1, s_opt, p_opt, 1 if name in ("prefill", "step") else s_opt)
            # a one-token call may come at any past up to max_len - 1; P + S never exceeds max_len
            hi = _dims(entry, inp, 1, s_max, max_len - 1, s_max)
            if inp == "attention_mask":
                hi = (1, max_len)
            shapes[inp] = [list(lo), list(opt), list(hi)]
        out.append({"name": name, "seq": [s_min, s_opt, s_max], "shapes": shapes})
    return out


def pick_profile(profs: list[dict], seq: int) -> int:
    """Index of the first profile whose seq range holds `seq`; -1 if none (the call must be chunked)."""
    for i, p in enumerate(profs):
        if p["seq"][0] <= seq <= p["seq"][2]:
            return i
    return -1


def plan_chunks(seq: int, logit_positions: np.ndarray, widest: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Split a call of `seq` tokens into chunks of at most `widest`: [(start, end, local logit positions,
    indices of those rows in the call's logits)]. Every requested position lands in exactly one chunk."""
    pos = np.asarray(logit_positions, np.int64)
    if len(pos) and (pos.min() < 0 or pos.max() >= seq):
        raise ValueError(f"logit positions must be in 0..{seq - 1}")
    chunks = []
    for start in range(0, seq, widest):
        end = min(start + widest, seq)
        rows = np.flatnonzero((pos >= start) & (pos < end))
        chunks.append((start, end, pos[rows] - start, rows))
    return chunks


def gpu_identity(device_id: int = 0) -> tuple[str, str]:
    """(compute capability "major.minor", device name) of a CUDA device, through cuda-python."""
    cudart = _cudart()
    err, props = cudart.cudaGetDeviceProperties(device_id)
    _ok(err, "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return f"{props.major}.{props.minor}", name


def check_engine_meta(meta: dict | None, trt_version: str, capability: str, pair_dir) -> None:
    """Refuse engines built for another TensorRT or another GPU generation, saying how to rebuild."""
    rebuild = f"rebuild them here with `specrt build-engines {pair_dir}`"
    if not meta:
        raise PairError(f"{pair_dir} has no TensorRT engines; build them with `specrt build-engines {pair_dir}` "
                        "(needs an fp16 pair: `specrt export --precision fp16 --engine tensorrt`)")
    built_v, built_cc = meta.get("tensorrt_version"), meta.get("compute_capability")
    if built_v != trt_version:
        raise PairError(f"the TensorRT engines in {pair_dir} were built with TensorRT {built_v}, this machine has "
                        f"{trt_version} (engines do not load across versions); {rebuild}")
    if built_cc != capability:
        raise PairError(f"the TensorRT engines in {pair_dir} were built for a GPU of compute capability {built_cc}, "
                        f"this GPU is {capability}; {rebuild}")


def _cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.8
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise PairError(f"cuda-python is not installed; {INSTALL_HINT}") from None
    return cudart


def _ok(result, what: str):
    """cuda-python returns (error, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise PairError(f"CUDA {what} failed: {err}")
    return values[0] if len(values) == 1 else values


class TrtEngine:
    """One model's TensorRT engine. Implements engines.base.Engine (batch 1)."""

    prefill_chunk = None  # its prompt passes follow the engine's profiles, not a fixed chunk: no prefix reuse

    def __init__(self, pair_dir, entry: ModelEntry, role: str, manifest: Manifest, max_logits: int, device_id: int = 0):
        trt = require_tensorrt(PairError)
        cudart = self._rt = _cudart()
        pair_dir = Path(pair_dir)
        meta = manifest.engines or {}
        _ok(cudart.cudaSetDevice(device_id), "cudaSetDevice")
        check_engine_meta(meta or None, trt.__version__, gpu_identity(device_id)[0], pair_dir)
        info = meta.get(role)
        if not info:
            raise PairError(f"{pair_dir} has no TensorRT engine for the {role}; rebuild with `specrt build-engines {pair_dir}`")
        plan = pair_dir / info["plan"]
        try:
            blob = plan.read_bytes()
        except OSError as e:
            raise PairError(f"cannot read {plan}: {e.strerror}") from None
        if hashlib.sha256(blob).hexdigest() != info["sha256"]:
            raise PairError(f"{plan} does not match its hash in the manifest; rebuild with `specrt build-engines {pair_dir}`")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise PairError(f"TensorRT could not load {plan}; rebuild with `specrt build-engines {pair_dir}`")
        check_alignment(entry, role)
        self.entry, self.profiles = entry, info["profiles"]
        self.max_len, self.batch, self.length = manifest.max_len, 1, 0
        self.dtype = np.dtype(entry.dtype)
        self.stream = int(_ok(cudart.cudaStreamCreate(), "cudaStreamCreate"))  # TensorRT takes the handle as an int
        self.contexts = []
        for i in range(len(self.profiles)):  # a profile belongs to one context: one context each
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(i, self.stream)
            self.contexts.append(ctx)
        self.widest = max(p["seq"][2] for p in self.profiles)
        self._bufs = []
        alloc = lambda n: self._bufs.append(_ok(cudart.cudaMalloc(max(int(n), 1)), "cudaMalloc")) or self._bufs[-1]  # noqa: E731
        kv_bytes = kv_offset(self.max_len, 1, entry.num_kv_heads, entry.head_dim, self.dtype.itemsize)
        self.keys = [alloc(kv_bytes) for _ in range(entry.num_layers)]
        self.values = [alloc(kv_bytes) for _ in range(entry.num_layers)]
        self._in = {n: alloc(8 * (self.max_len if n == "attention_mask" else self.widest))
                    for n in ("input_ids", "position_ids", "attention_mask", "logit_positions")}
        self._logits_dev = alloc(4 * max(max_logits, self.widest) * entry.logits_width)
        self._logits = np.empty((max(max_logits, self.widest), entry.logits_width), np.float32)
        self._max_logits = max_logits
        self._staged: list[np.ndarray] = []

    def _copy_in(self, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, np.int64)
        self._staged.append(arr)  # alive until the stream is synchronized
        _ok(self._rt.cudaMemcpyAsync(self._in[name], arr.ctypes.data, arr.nbytes,
                                     self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream), "copy to device")

    def _run(self, tokens, positions, mask, logit_positions) -> np.ndarray:
        S, N, P, e = tokens.shape[1], len(logit_positions), self.length, self.entry
        i = pick_profile(self.profiles, S)
        ctx = self.contexts[i]
        for name, arr in (("input_ids", tokens), ("position_ids", positions), ("attention_mask", mask),
                          ("logit_positions", logit_positions)):
            self._copy_in(name, arr)
            _set(ctx.set_input_shape(name, arr.shape), "set_input_shape", name, arr.shape)
            _set(ctx.set_tensor_address(name, self._in[name]), "set_tensor_address", name)
        at = kv_offset(P, 1, e.num_kv_heads, e.head_dim, self.dtype.itemsize)
        for layer in range(e.num_layers):
            pk, pv, nk, nv = e.kv_names(layer)
            for past, new, buf in ((pk, nk, self.keys[layer]), (pv, nv, self.values[layer])):
                _set(ctx.set_input_shape(past, (P, 1, e.num_kv_heads, e.head_dim)), "set_input_shape", past, P)
                _set(ctx.set_tensor_address(past, buf), "set_tensor_address", past)
                # the engine writes the new entries into the cache (aligned: check_alignment)
                _set(ctx.set_tensor_address(new, buf + at), "set_tensor_address", new)
        _set(ctx.set_tensor_address("logits", self._logits_dev), "set_tensor_address", "logits")
        if not ctx.execute_async_v3(self.stream):
            raise PairError("TensorRT execution failed (see its log above)")
        out = self._logits[:N]
        _ok(self._rt.cudaMemcpyAsync(out.ctypes.data, self._logits_dev, out.nbytes,
                                     self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream), "copy to host")
        _ok(self._rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self._staged.clear()
        self.length = P + S
        return out

    def forward(self, tokens: np.ndarray, logit_positions: np.ndarray, positions: np.ndarray | None = None,
                mask: np.ndarray | None = None) -> np.ndarray:
        """Engine protocol (see engines.base); S beyond every profile runs in chunks."""
        B, S = tokens.shape
        P, N = self.length, len(logit_positions)
        if B != 1:
            raise ValueError("TensorRT engines run one sequence (batch 1)")
        if P + S > self.max_len:
            raise ValueError(f"KV cache overflow: {P}+{S} > max_len {self.max_len}")
        if N > self._max_logits:
            raise ValueError(f"{N} logit rows requested, at most {self._max_logits}")
        positions = np.arange(P, P + S, dtype=np.int64)[None] if positions is None else positions
        mask = np.ones((1, P + S), np.int64) if mask is None else mask
        chunks = [(0, S, np.asarray(logit_positions, np.int64), np.arange(N))] if pick_profile(self.profiles, S) >= 0 \
            else plan_chunks(S, logit_positions, max(p["seq"][2] for p in self.profiles if p["name"] == "prefill"))
        result = np.empty((1, N, self.entry.logits_width), np.float32)
        for start, end, local, rows in chunks:
            # a chunk without requested rows still needs one logits row (N >= 1 in every profile)
            want = local if len(local) else np.array([end - start - 1], np.int64)
            out = self._run(tokens[:, start:end], positions[:, start:end], mask[:, : P + end], want)
            if len(local):
                result[0, rows] = out[: len(local)]
        return result

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} to {length}")
        self.length = length

    def close(self) -> None:
        for b in getattr(self, "_bufs", []):
            self._rt.cudaFree(b)
        self._bufs, self.contexts, self.engine = [], [], None
        if getattr(self, "stream", None) is not None:
            self._rt.cudaStreamDestroy(self.stream)
            self.stream = None


def _set(ok, what: str, name: str, detail=None) -> None:
    """TensorRT's setters return False (and log why) instead of raising: an unchecked one leaves the
    context with a stale shape or address."""
    if not ok:
        raise PairError(f"TensorRT {what}({name}{'' if detail is None else f', {detail}'}) was refused (see its log above)")
