"""onnxruntime backend with I/O binding over a static, sequence-major KV cache (DESIGN §3).

Per layer one K and one V buffer `[max_len, B, Hkv, D]` is allocated once, on the device the model
runs on (numpy arrays on the CPU; onnxruntime OrtValues in GPU memory with the CUDA provider). A
call binds the valid prefix `[0:P]` as the past (by pointer, no copy) and binds the graph's new-K/V
outputs to `[P:P+S]` (`kv_offset`), so onnxruntime writes the new entries straight into the cache.
Rolling back rejected tokens is `truncate(n)`: the next call binds a shorter past. Per call only the
token ids, positions and mask go to the device and only the requested logits rows come back.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from specrt.config import ModelEntry
from specrt.errors import PairError

_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}
DEVICES = ("cpu", "cuda")


def kv_offset(length: int, batch: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Byte offset of cache slot `length` in a sequence-major [max_len, B, Hkv, D] buffer: where a
    call's new K/V are written, and the end of the past it binds (every prefix is contiguous)."""
    return length * batch * kv_heads * head_dim * itemsize


def cuda_available() -> str | None:
    """None when onnxruntime can run on a CUDA GPU here, else why not (one line)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"this onnxruntime ({ort.__version__}, {ort.get_device()}) has no CUDA provider; "
                "install onnxruntime-gpu (pip install 'specrt[gpu]')")
    from specrt.runtime.memory import cuda_device_count

    n = cuda_device_count()
    if n == 0:
        return "no CUDA device is visible (driver missing, or CUDA_VISIBLE_DEVICES hides them)"
    return None


def _preload_cuda_libraries() -> None:
    """Load CUDA/cuDNN from the nvidia-* pip packages when they are installed (onnxruntime >= 1.21 looks
    for them there only when asked); system-wide CUDA installs need nothing."""
    import onnxruntime as ort

    try:
        ort.preload_dlls()
    except Exception:  # older onnxruntime, or no such packages: the dynamic loader's search applies
        pass


def _cuda_provider(device_id: int, dtype: str = "float16"):
    """The CUDA provider's options: device memory grows in its own arena; the default stream is used
    for copies so a host read of the logits waits for the pass that wrote them. An fp32 graph runs in
    fp32: onnxruntime's default TF32 matmuls (10-bit mantissa) moved the tiny test model's fp32 logits
    ~0.3% from the CPU's on an H200 and flipped near-ties between one-token and verify passes."""
    opts = {"device_id": device_id, "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": True}
    if dtype == "float32":
        opts["use_tf32"] = 0
    return ("CUDAExecutionProvider", opts)


def session_options(threads: int | None = None, spinning: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    # Worker threads spin between the ops of one run (waking a sleeping worker per op costs more than
    # a small int4 op) and stop spinning when the run ends (force_spinning_stop), so the draft's idle
    # pool never steals the cores of the target's pass that follows, nor the other way round. Measured
    # on 2 cores, real pair, int4: draft step 12.0 -> 9.8 ms, target step 32.7 -> 29.4 ms, against no
    # spinning at all; spinning without the stop made alternating sessions 0.74x (measured-here.md).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


class OrtEngine:
    """One model on onnxruntime's CPU or CUDA provider. Implements engines.base.Engine."""

    def __init__(self, pair_dir: Path, entry: ModelEntry, max_len: int, max_logits: int, batch: int = 1,
                 threads: int | None = None, spinning: bool = True, session=None, device: str = "cpu",
                 device_id: int = 0):
        """`session`: an already loaded InferenceSession of this graph (another engine's), so that engines
        of other batch sizes, each with its own KV buffers, share one copy of the weights.
        `device`: "cpu", or "cuda" (onnxruntime's CUDA provider; caches stay in GPU memory)."""
        import onnxruntime as ort

        if device not in DEVICES:
            raise PairError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
        path = Path(pair_dir) / entry.path
        if session is None:
            providers = ["CPUExecutionProvider"]
            if device == "cuda":
                why = cuda_available()
                if why:
                    raise PairError(f"cannot run on cuda: {why}")
                if not entry.portable:
                    raise PairError(f"{path} uses onnxruntime's CPU-only contrib ops; export the pair with "
                                    "--precision fp16 for a GPU")
                _preload_cuda_libraries()
                providers = [_cuda_provider(device_id, entry.dtype), "CPUExecutionProvider"]
            try:
                session = ort.InferenceSession(os.fspath(path), session_options(threads, spinning),
                                               providers=providers)
            except Exception as e:  # onnxruntime raises its own types with multi-line text
                raise PairError(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            # onnxruntime falls back to the CPU when the CUDA provider fails to load (a missing cuDNN,
            # say) with only a log line: a silent 20x slowdown, so refuse instead.
            if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
                raise PairError(f"onnxruntime could not start its CUDA provider for {path} (CUDA/cuDNN libraries "
                                "not found? see `python -c 'import onnxruntime; onnxruntime.preload_dlls()'`)")
            _check_io(session, entry, path)
        self.session = session
        self.entry = entry
        self.device, self.device_id = device, device_id
        self.max_len, self.batch, self.length = max_len, batch, 0
        self.dtype = np.dtype(entry.dtype)
        shape = (max_len, batch, entry.num_kv_heads, entry.head_dim)
        if device == "cpu":
            self.keys = [np.zeros(shape, self.dtype) for _ in range(entry.num_layers)]
            self.values = [np.zeros(shape, self.dtype) for _ in range(entry.num_layers)]
            self._key_ptrs = [k.ctypes.data for k in self.keys]
            self._value_ptrs = [v.ctypes.data for v in self.values]
        else:  # allocated once in GPU memory; never copied to the host
            alloc = lambda: ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype, device, device_id)  # noqa: E731
            self.keys = [alloc() for _ in range(entry.num_layers)]
            self.values = [alloc() for _ in range(entry.num_layers)]
            self._key_ptrs = [k.data_ptr() for k in self.keys]
            self._value_ptrs = [v.data_ptr() for v in self.values]
        self._logits = np.empty(batch * max_logits * entry.logits_width, np.float32)
        self._max_logits = max_logits
        self._io = self.session.io_binding()

    def forward(self, tokens: np.ndarray, logit_positions: np.ndarray, positions: np.ndarray | None = None,
                mask: np.ndarray | None = None) -> np.ndarray:
        """Append `tokens` [B, S] to the cache; return logits [B, N, V] (a view, valid until the next call).

        `positions` [B, S] and `mask` [B, P+S] default to a dense batch: positions P..P+S-1, all slots valid.
        """
        B, S = tokens.shape
        P, N = self.length, len(logit_positions)
        if P + S > self.max_len:
            raise ValueError(f"KV cache overflow: {P}+{S} > max_len {self.max_len}")
        if N > self._max_logits:
            raise ValueError(f"{N} logit rows requested, at most {self._max_logits}")
        if positions is None:
            positions = np.broadcast_to(np.arange(P, P + S, dtype=np.int64), (B, S))
        if mask is None:
            mask = np.ones((B, P + S), np.int64)
        io, e = self._io, self.entry
        io.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, np.int64))
        io.bind_cpu_input("position_ids", np.ascontiguousarray(positions, np.int64))
        io.bind_cpu_input("attention_mask", np.ascontiguousarray(mask, np.int64))
        io.bind_cpu_input("logit_positions", np.ascontiguousarray(logit_positions, np.int64))
        kv_shape = [P, B, e.num_kv_heads, e.head_dim]
        new_shape = [S, B, e.num_kv_heads, e.head_dim]
        at = kv_offset(P, B, e.num_kv_heads, e.head_dim, self.dtype.itemsize)
        dev, did = self.device, self.device_id
        for i in range(e.num_layers):
            pk, pv, nk, nv = e.kv_names(i)
            k, v = self._key_ptrs[i], self._value_ptrs[i]
            io.bind_input(pk, dev, did, self.dtype, kv_shape, k)
            io.bind_input(pv, dev, did, self.dtype, kv_shape, v)
            io.bind_output(nk, dev, did, self.dtype, new_shape, k + at)  # writes in place
            io.bind_output(nv, dev, did, self.dtype, new_shape, v + at)
        io.bind_output("logits", "cpu", 0, np.float32, [B, N, e.logits_width], self._logits.ctypes.data)
        self.session.run_with_iobinding(io)
        self.length = P + S
        return self._logits[: B * N * e.logits_width].reshape(B, N, e.logits_width)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} to {length}")
        self.length = length

    def close(self) -> None:
        self._io = None
        self.session = None
        self.keys = self.values = self._key_ptrs = self._value_ptrs = []


def _check_io(session, entry: ModelEntry, path: Path) -> None:
    """The graph must have exactly the inputs and outputs its manifest entry lists."""
    for kind, actual, expected in (("input", session.get_inputs(), entry.inputs),
                                   ("output", session.get_outputs(), entry.outputs)):
        got = {a.name: _ORT_TYPES.get(a.type, a.type) for a in actual}
        want = {n: spec["dtype"] for n, spec in expected.items()}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:3]
            raise PairError(f"{path} does not match its manifest ({kind}s differ: {diff}); re-export the pair")
