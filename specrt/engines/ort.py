"""onnxruntime backends: the lean graph over shared per-row caches, and the delta graph for TensorRT's kind.

`ort_engine(...)` opens the right one for a manifest entry:

- `LeanEngine` (`entry.graph == "lean"`, docs/design.md "The KV-cache contract"): per layer one K and one
  V buffer `[B, Hkv, C, D]`, allocated once on the device the model runs on, bound as both the past and
  the present of GroupQueryAttention, which reads each row's valid prefix and writes its new entries in
  place at that row's own length. Each row has its own length; a rollback is a shorter length next call.
  Every call has the same input and output addresses, so on a GPU each pass shape is captured once as a
  CUDA graph and replayed.
- `DeltaEngine` (the standard-op "portable" graph TensorRT builds from, and graphs exported before the
  lean one): sequence-major buffers `[C, B, Hkv, D]`; a call binds the valid prefix `[0:P]` as the past
  and the graph's new-K/V outputs at `[P:P+S]` (`kv_offset`), so onnxruntime writes the new entries
  straight into the cache. All rows share one length.

Per call only the token ids and lengths go to the device and only the requested logits rows come back.
"""
from __future__ import annotations

import itertools
import os
import warnings
import weakref
from pathlib import Path

import numpy as np

from specrt.engines import int4
from specrt.engines.cuda import cuda_device_count
from specrt.errors import PairError, first_line
from specrt.manifest import ModelEntry

_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
              "tensor(int32)": "int32"}
DEVICES = ("cpu", "cuda")


def kv_offset(length: int, batch: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Byte offset of cache slot `length` in a sequence-major [C, B, Hkv, D] buffer (the delta contract):
    where a call's new K/V are written, and the end of the past it binds (every prefix is contiguous)."""
    return length * batch * kv_heads * head_dim * itemsize


def cuda_available() -> str | None:
    """None when onnxruntime can run on a CUDA GPU here, else why not (one line)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"this onnxruntime ({ort.__version__}, {ort.get_device()}) has no CUDA provider; "
                "install onnxruntime-gpu (pip install 'specrt[gpu]')")
    if cuda_device_count() == 0:
        return "no CUDA device is visible (driver missing, or CUDA_VISIBLE_DEVICES hides them)"
    return None


def gqa_has_query_seqlens() -> bool:
    """Whether this onnxruntime's GroupQueryAttention takes `query_seqlens` (1.32+): several rows with
    several new tokens each in one call. Older versions refuse such calls; lean graphs exported for them
    lack that input, and the engine runs such calls row by row."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as C

        return any(s.name == "GroupQueryAttention" and any(i.name == "query_seqlens" for i in s.inputs)
                   for s in C.get_all_operator_schema())
    except (ImportError, AttributeError):
        return False


def _preload_cuda_libraries() -> None:
    """Load CUDA/cuDNN from the nvidia-* pip packages when they are installed (onnxruntime >= 1.21 looks
    for them there only when asked); system-wide CUDA installs need nothing."""
    import onnxruntime as ort

    try:
        ort.preload_dlls()
    except Exception:  # older onnxruntime, or no such packages: the dynamic loader's search applies
        pass


def _cuda_provider(device_id: int, dtype: str = "float16", cuda_graph: bool = False):
    """The CUDA provider's options: device memory grows in its own arena; the default stream is used
    for copies so a host read of the logits waits for the pass that wrote them. An fp32 graph runs in
    fp32: onnxruntime's default TF32 matmuls (10-bit mantissa) moved the tiny test model's fp32 logits
    ~0.3% from the CPU's on an H200 and flipped near-ties between one-token and verify passes."""
    opts = {"device_id": device_id, "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": True}
    if dtype == "float32":
        opts["use_tf32"] = 0
    if cuda_graph:
        opts["enable_cuda_graph"] = 1
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
    # spinning at all; spinning without the stop made alternating sessions 0.74x.
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


def load_session(path: Path, entry: ModelEntry, device: str, device_id: int = 0, threads: int | None = None,
                 spinning: bool = True, cuda_graph: bool = False):
    """(InferenceSession, note, kernel): the session of one graph on `device`. With `cuda_graph`, onnxruntime
    is asked to capture passes as CUDA graphs; when it refuses, the session runs without and `note` says why.
    `kernel` (engines/int4.Kernel; None off the CPU or for other graphs) says what computes the int4 matmuls
    and the attention: on the CPU, specrt's kernels wherever they take a node."""
    import onnxruntime as ort

    if device not in DEVICES:
        raise PairError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda":
        why = cuda_available()
        if why:
            raise PairError(f"cannot run on cuda: {why}")
        if entry.graph == "contrib":
            raise PairError(f"{path} was exported for the CPU (onnxruntime contrib ops of an older specrt); "
                            "re-export the pair with --precision fp16 for a GPU")
        if entry.graph == "lean" and entry.dtype == "float32":
            raise PairError(f"{path} is an fp32 graph: onnxruntime's GroupQueryAttention has no fp32 CUDA kernel; "
                            "export with --precision fp16 (or int4 --activations fp16) for a GPU")
        _preload_cuda_libraries()
    if "query_seqlens" in entry.inputs and not gqa_has_query_seqlens():
        raise PairError(f"{path} needs onnxruntime >= 1.32 (GroupQueryAttention's query_seqlens), this is "
                        f"{ort.__version__}; upgrade onnxruntime, or re-export the pair with --no-query-seqlens")
    note = kernel = None
    for capture in ((True, False) if cuda_graph and device == "cuda" else (False,)):
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            providers = [_cuda_provider(device_id, entry.dtype, capture), "CPUExecutionProvider"]
        so, source = session_options(threads, spinning), os.fspath(path)
        if device == "cpu" and entry.graph == "lean":
            source, kernel = int4.session_source(path, so)
        try:
            session = ort.InferenceSession(source, so, providers=providers)
            break
        except Exception as e:  # onnxruntime raises its own types with multi-line text
            if capture:
                note = f"CUDA graphs are off for {path.parent.name}: onnxruntime refused to capture ({first_line(e)})"
                continue
            raise PairError(f"cannot load {path}: {first_line(e)}") from None
    # onnxruntime falls back to the CPU when the CUDA provider fails to load (a missing cuDNN, say) with
    # only a log line: a silent 20x slowdown, so refuse instead.
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise PairError(f"onnxruntime could not start its CUDA provider for {path} (CUDA/cuDNN libraries "
                        "not found? see `python -c 'import onnxruntime; onnxruntime.preload_dlls()'`)")
    _check_io(session, entry, path, kernel)
    return session, note, kernel


def _check_io(session, entry: ModelEntry, path: Path, kernel=None) -> None:
    """The graph must have exactly the inputs and outputs its manifest entry lists (and the input for tokens
    with parent pointers, when the kernels added it: int4.plan)."""
    trees = {int4.TREE_INPUT: {"dtype": "int32"}} if kernel is not None and kernel.trees else {}
    for kind, actual, expected in (("input", session.get_inputs(), {**entry.inputs, **trees}),
                                   ("output", session.get_outputs(), entry.outputs)):
        got = {a.name: _ORT_TYPES.get(a.type, a.type) for a in actual}
        want = {n: spec["dtype"] for n, spec in expected.items()}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:3]
            raise PairError(f"{path} does not match its manifest ({kind}s differ: {diff}); re-export the pair")


def ort_engine(pair_dir, entry: ModelEntry, max_len: int, max_logits: int, batch: int = 1, **kw):
    """The onnxruntime engine for `entry`'s graph (see the module docstring); `kw` as LeanEngine takes."""
    cls = LeanEngine if entry.graph == "lean" else DeltaEngine
    return cls(pair_dir, entry, max_len, max_logits, batch=batch, **kw)


class _Base:
    """Session, device and cache buffers of one model; the two contracts differ in how a call binds them."""

    shape: tuple  # of one layer's K (or V) buffer

    def __init__(self, pair_dir, entry: ModelEntry, max_len: int, max_logits: int, batch: int = 1,
                 threads: int | None = None, spinning: bool = True, session=None, device: str = "cpu",
                 device_id: int = 0, cuda_graph: bool = True, capture_width: int = 16,
                 prefill_chunk: int | None = None, buffers: tuple[list, list, list, list] | None = None,
                 kernel=None):
        """`max_len`: slots per row. `max_logits`: logits rows per row a call may ask for.
        `session`: an already loaded InferenceSession of this graph (another engine's), so that engines of
        other batch sizes, each with its own KV buffers, share one copy of the weights.
        `device`: "cpu", or "cuda" (onnxruntime's CUDA provider; caches stay in GPU memory).
        `cuda_graph`: on "cuda", replay each pass shape from a captured CUDA graph (lean graphs), for passes
        of at most `capture_width` tokens a row (wider ones, prefills, run uncaptured).
        `prefill_chunk` (lean graphs): a wider call runs in passes of this many tokens a row from its first
        token: the activations' memory, which onnxruntime's arena keeps, is that of a chunk, and a prompt is
        always read in the same passes (what lets its prefix be reused exactly, decoding/prefix.py).
        `buffers`: (keys, values, key pointers, value pointers) of another engine of this graph to work in
        instead of caches of its own (a row view). `kernel`: with `session`, what computes its int4 matmuls."""
        self.note = None  # why CUDA graphs are off, when they were asked for and refused
        self.kernel = kernel  # engines/int4.Kernel: what computes the int4 matmuls on the CPU
        # whether the session captures CUDA graphs (a shared session: whether the one it came from does)
        self.captures = cuda_graph and device == "cuda" and entry.graph == "lean"
        if session is None:
            session, self.note, self.kernel = load_session(Path(pair_dir) / entry.path, entry, device, device_id,
                                                           threads, spinning, self.captures)
            self.captures = self.captures and self.note is None
        elif device not in DEVICES:
            raise PairError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
        self.session, self.entry = session, entry
        self.device, self.device_id = device, device_id
        self.max_len, self.batch = max_len, batch
        self.dtype = np.dtype(entry.dtype)
        self._max_logits = max_logits
        if buffers is not None:
            self.keys, self.values, self._key_ptrs, self._value_ptrs = buffers
        elif device == "cpu":
            self.keys = [np.zeros(self.shape, self.dtype) for _ in range(entry.num_layers)]
            self.values = [np.zeros(self.shape, self.dtype) for _ in range(entry.num_layers)]
            self._key_ptrs = [k.ctypes.data for k in self.keys]
            self._value_ptrs = [v.ctypes.data for v in self.values]
        else:  # allocated once in GPU memory; never copied to the host
            import onnxruntime as ort

            alloc = lambda: ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), self.dtype, device, device_id)  # noqa: E731
            self.keys = [alloc() for _ in range(entry.num_layers)]
            self.values = [alloc() for _ in range(entry.num_layers)]
            self._key_ptrs = [k.data_ptr() for k in self.keys]
            self._value_ptrs = [v.data_ptr() for v in self.values]
        self._logits = np.empty(batch * max_logits * entry.logits_width, np.float32)
        self._io = self.session.io_binding()
        self.capture_width, self.prefill_chunk = capture_width, prefill_chunk

    @property
    def row_exact(self) -> bool:
        """Whether a row's numbers never depend on the pass around it (its width, where it starts, the other
        rows): every matmul and attention node is specrt's (engines/int4.Kernel.invariant)."""
        return self.kernel is not None and self.kernel.invariant

    def _check(self, P: int, S: int, N: int) -> None:
        if P + S > self.max_len:
            raise ValueError(f"KV cache overflow: {P}+{S} > max_len {self.max_len}")
        if N > self._max_logits * self.batch:
            raise ValueError(f"{N} logit rows requested, at most {self._max_logits * self.batch}")

    def close(self) -> None:
        self._io = None
        self.session = None
        self.keys = self.values = self._key_ptrs = self._value_ptrs = []


class DeltaEngine(_Base):
    """The delta contract (module docstring): one shared length. Implements engines.base.Engine."""

    def __init__(self, pair_dir, entry: ModelEntry, max_len: int, max_logits: int, batch: int = 1, **kw):
        self.shape = (max_len, batch, entry.num_kv_heads, entry.head_dim)
        super().__init__(pair_dir, entry, max_len, max_logits, batch, **kw)
        self.length = 0
        self.prefill_chunk = None  # a wide call is one pass

    def forward(self, tokens: np.ndarray, logit_positions: np.ndarray) -> np.ndarray:
        """Append `tokens` [B, S] to the cache; return logits [B, N, V] (a view, valid until the next call)."""
        B, S = tokens.shape
        P, N = self.length, len(logit_positions)
        self._check(P, S, N * B)
        io, e = self._io, self.entry
        io.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, np.int64))
        io.bind_cpu_input("position_ids", np.ascontiguousarray(np.broadcast_to(np.arange(P, P + S), (B, S)), np.int64))
        io.bind_cpu_input("attention_mask", np.ones((B, P + S), np.int64))
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


class LeanEngine(_Base):
    """The lean graph over per-row caches (module docstring). Implements engines.base.Engine (`length`
    and `truncate` act on every row; batch 1 is the usual case) plus ragged calls for batched decoding:
    `forward_ragged` appends a different number of tokens to each row, `lengths[r]` is row r's length,
    and `row(r)` is a batch-1 engine over row r's part of the buffers (a prefill writes there directly)."""

    def __init__(self, pair_dir, entry: ModelEntry, max_len: int, max_logits: int, batch: int = 1, **kw):
        self.shape = (batch, entry.num_kv_heads, max_len, entry.head_dim)
        super().__init__(pair_dir, entry, max_len, max_logits, batch, **kw)
        self.lengths = np.zeros(batch, np.int64)
        # per row, the lowest slot a pass has written since someone set it (max_len: none): what lets a
        # caller keeping slots across requests (decoding/prefix.py) see that other code wrote over them
        self.lowest_write = np.zeros(batch, np.int64)
        # onnxruntime < 1.32 has no query_seqlens: one call cannot give several rows several tokens each
        self.ragged = "query_seqlens" in entry.inputs
        self._row_bytes = entry.num_kv_heads * max_len * entry.head_dim * self.dtype.itemsize
        self._offset = 0  # byte offset of row 0 within the buffers (a row view's row)
        self._total = np.array([max_len], np.int32)  # slots per row: every length's upper bound
        self._caches_bound = False  # in self._io (bound at the first uncaptured call, where _offset is final)
        self._graphs = _CudaGraphs(self) if self.captures else None
        self._rows: dict[tuple[int, int], LeanEngine] = {}  # views of rows lo .. hi - 1
        # Whether a call takes tokens with parent pointers (forward_ragged's `parents`): the session has the
        # input for them, which only specrt's attention on the CPU takes (int4.plan adds it); every call
        # then feeds it, a chain's where the caller gives none (made once per width: _chains).
        self.trees = self.device == "cpu" and any(i.name == int4.TREE_INPUT for i in self.session.get_inputs())
        self._chains: dict[int, np.ndarray] = {}

    @property
    def length(self) -> int:
        """Row 0's length (batch 1: the cache's)."""
        return int(self.lengths[0])

    def truncate(self, length: int) -> None:
        if length < 0 or (length > self.lengths).any():
            raise ValueError(f"cannot truncate a cache of {self.length} to {length}")
        self.lengths[:] = length

    def reclaim(self, length: int) -> None:
        """Every row's first `length` slots count again, after a truncate below them: for a caller that knows
        nothing has written them since (a prompt prefix kept across requests, decoding/prefix.py)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot reclaim {length} slots of {self.max_len}")
        self.lengths[:] = np.maximum(self.lengths, length)

    def set_length(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` slots (a shorter length: a rollback; 0: the row is free)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of {self.lengths[row]} slots to {length}")
        self.lengths[row] = length

    def forward(self, tokens: np.ndarray, logit_positions: np.ndarray) -> np.ndarray:
        """Append `tokens` [B, S] to every row; return logits [B, N, V] for positions `logit_positions` [N]
        of every row (a view, valid until the next call)."""
        B, S = tokens.shape
        pos = np.asarray(logit_positions, np.int64)
        index = (np.arange(B)[:, None] * S + pos[None]).reshape(-1)  # [B*N]
        out = self.forward_ragged(tokens, np.full(B, S, np.int64), index)
        return out.reshape(B, len(pos), self.entry.logits_width)

    def forward_ragged(self, tokens: np.ndarray, counts: np.ndarray, logit_index: np.ndarray,
                       parents: np.ndarray | None = None) -> np.ndarray:
        """Row r appends tokens[r, :counts[r]] ([B, S], right-padded; count 0: the row sits out). Returns
        logits [N, V] for the flat positions `logit_index` [N] (row * S + position), a view valid until the
        next call.

        `parents` [B, S] int (engines with `trees`; a call of one pass, not cut in prefill chunks): tokens
        with parent pointers. parents[r, i] for i < counts[r] is -1 (token i follows the row's cached
        tokens) or the index of the earlier token of the call it follows; a token is still written at slot
        lengths[r] + i, but it reads as the continuation of its cached tokens and its ancestors only, at the
        position that chain gives it, so its logits and cache entries are those of that chain (the same bits
        where the kernels are row-exact). None: each token follows the one before it."""
        B, S = tokens.shape
        counts = np.asarray(counts, np.int64)
        if B != self.batch:
            raise ValueError(f"{B} rows for an engine of batch {self.batch}")
        self._check(int(self.lengths.max()), S, len(logit_index))  # every row has room for the padded pass
        chunked = bool(self.prefill_chunk and S > self.prefill_chunk)
        if parents is not None:
            parents = self._parents(parents, tokens.shape, counts)
            if chunked:
                raise ValueError(f"tokens with parent pointers go in one pass: {S} are more than the engine's "
                                 f"prefill chunk of {self.prefill_chunk}")
        np.minimum(self.lowest_write, np.where(counts > 0, self.lengths, self.max_len), out=self.lowest_write)
        if chunked:
            return self._chunked(tokens, counts, logit_index)
        if not self.ragged and B > 1 and S > 1:  # GroupQueryAttention without query_seqlens refuses these
            return self._row_by_row(tokens, counts, logit_index, parents)
        if self._graphs is not None:  # CUDA: never parents (no trees there)
            out = self._graphs.run(tokens, counts, logit_index)
            if out is not None:
                self.lengths += counts
                return out
        return self._run(tokens, counts, logit_index, parents)

    def _parents(self, parents, shape: tuple[int, int], counts: np.ndarray) -> np.ndarray:
        """`parents` as the int32 [B, S] array the graph takes; ValueError when this engine takes none or
        one of them is not -1 or an earlier token of its row."""
        if not self.trees:
            why = self.kernel.trees_why if self.kernel is not None else f"onnxruntime's attention on {self.device}"
            raise ValueError(f"this engine takes no parent pointers ({why or 'its graph has no input for them'})")
        p = np.asarray(parents)
        if p.shape != shape or p.dtype.kind not in "iu":
            raise ValueError(f"parents must be integers of the tokens' shape {shape}, not {p.dtype} {p.shape}")
        i = np.arange(shape[1])
        # a graph without query_seqlens reads all S tokens of every row in a pass of its own (_run), a row's
        # count only where rows run one by one (_row_by_row)
        fed = counts[:, None] if self.ragged or min(shape) > 1 else shape[1]
        bad = ((p < -1) | (p >= i)) & (i < fed)
        if bad.any():
            r, j = np.argwhere(bad)[0]
            raise ValueError(f"row {r}, token {j}: parent {p[r, j]} is neither -1 (the row's cached tokens) nor an "
                             f"earlier token of the call (0 .. {j - 1})")
        return np.ascontiguousarray(p, np.int32)

    def _chain(self, S: int) -> np.ndarray:
        """The parents of a call whose tokens each follow the one before: [-1, 0, .., S - 2] in every row."""
        if S not in self._chains:
            self._chains[S] = np.ascontiguousarray(np.broadcast_to(np.arange(-1, S - 1, dtype=np.int32), (self.batch, S)))
        return self._chains[S]

    def move(self, r: int, src, dst) -> None:
        """Slot moves: in row r's caches (every layer's keys and values) slot dst[i] gets what slot src[i]
        holds. Every source is read before any destination is written, so the two may overlap; no
        destination twice. Lengths stay as they are (set_length says which slots count). CPU caches only."""
        if self.device != "cpu":
            raise ValueError(f"slot moves take caches in CPU memory, not on {self.device}")
        if not 0 <= r < self.batch:
            raise ValueError(f"no row {r} in an engine of batch {self.batch}")
        src, dst = np.asarray(src, np.int64).reshape(-1), np.asarray(dst, np.int64).reshape(-1)
        if src.shape != dst.shape:
            raise ValueError(f"{len(src)} source slots for {len(dst)} destinations")
        if len(src) and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= self.max_len):
            raise ValueError(f"slots must be in 0 .. {self.max_len - 1}")
        if len(np.unique(dst)) != len(dst):
            raise ValueError("a destination slot named twice")
        moved = src != dst
        src, dst = src[moved], dst[moved]
        if not len(src):
            return
        row = self._offset // self._row_bytes + r  # a row view's row of the batch's buffers
        for buf in (*self.keys, *self.values):
            cache = buf[row]  # [Hkv, C, D]
            cache[:, dst] = cache[:, src]  # the fancy index gathers a copy first
        self.lowest_write[r] = min(int(self.lowest_write[r]), int(dst.min()))

    def _inputs(self, tokens, counts, parents=None) -> dict[str, np.ndarray]:
        seqlens = self.lengths + (counts if self.ragged else tokens.shape[1]) - 1
        feeds = {"input_ids": np.ascontiguousarray(tokens, np.int64),
                 "seqlens_k": np.maximum(seqlens, 0).astype(np.int32),  # an idle empty row: one slot, unused
                 "total_sequence_length": self._total}
        if self.ragged:
            feeds["query_seqlens"] = counts.astype(np.int32)
        if self.trees:
            feeds[int4.TREE_INPUT] = self._chain(tokens.shape[1]) if parents is None else parents
        return feeds

    def _bind_caches(self, io) -> None:
        e, dev, did = self.entry, ("cpu" if self.device == "cpu" else "cuda"), self.device_id
        for i in range(e.num_layers):
            pk, pv, nk, nv = e.kv_names(i)
            for past, present, ptr in ((pk, nk, self._key_ptrs[i]), (pv, nv, self._value_ptrs[i])):
                io.bind_input(past, dev, did, self.dtype, list(self.shape), ptr + self._offset)
                io.bind_output(present, dev, did, self.dtype, list(self.shape), ptr + self._offset)  # in place

    def _run(self, tokens, counts, logit_index, parents=None) -> np.ndarray:
        io, N, W = self._io, len(logit_index), self.entry.logits_width
        for name, value in self._inputs(tokens, counts, parents).items():
            io.bind_cpu_input(name, value)
        io.bind_cpu_input("logit_index", np.ascontiguousarray(logit_index, np.int64))
        if not self._caches_bound:  # a binding holds between runs; the caches' addresses and shapes never change
            self._bind_caches(io)
            self._caches_bound = True
        io.bind_output("logits", "cpu", 0, np.float32, [N, W], self._logits.ctypes.data)
        self.session.run_with_iobinding(io, _run_options(-1) if self.captures else None)
        self.lengths += counts
        return self._logits[: N * W].reshape(N, W)

    def _chunked(self, tokens, counts, logit_index) -> np.ndarray:
        """A pass wider than `prefill_chunk`, chunk by chunk. Measured on the int4
        1.5B target, a 1024-token prompt: 8.2 s either way, +445 MB at once and +54 MB in chunks of 128."""
        S, W, c = tokens.shape[1], self.entry.logits_width, self.prefill_chunk
        index = np.asarray(logit_index, np.int64)
        rows, pos = index // S, index % S
        out = np.empty((len(index), W), np.float32)
        for start in range(0, S, c):
            end = min(start + c, S)
            n = np.clip(counts - start, 0, end - start)
            if not n.any():
                break
            mine = np.flatnonzero((pos >= start) & (pos < end))
            out[mine] = self.forward_ragged(tokens[:, start:end], n, rows[mine] * (end - start) + pos[mine] - start)
        return out

    def _row_by_row(self, tokens, counts, logit_index, parents=None) -> np.ndarray:
        """An onnxruntime without query_seqlens: each fed row in its own batch-1 call."""
        S, W = tokens.shape[1], self.entry.logits_width
        logit_index = np.asarray(logit_index, np.int64)
        out = np.empty((len(logit_index), W), np.float32)
        for r in np.flatnonzero(counts):
            mine = np.flatnonzero(logit_index // S == r)
            pos = logit_index[mine] % S
            mine_parents = None if parents is None else parents[r:r + 1, :counts[r]]
            got = self.row(r).forward_ragged(tokens[r:r + 1, :counts[r]], counts[r:r + 1], pos, mine_parents)
            out[mine] = got
        return out

    def row(self, r: int) -> LeanEngine:
        """A batch-1 engine over row r of these buffers (same session; its length is `lengths[r]`)."""
        return self._view(r, r + 1)

    def rows(self, lo: int, hi: int) -> LeanEngine:
        """An engine of batch hi - lo over rows lo .. hi - 1 of these buffers (same session; its lengths are
        `lengths[lo:hi]`): a pass that leaves the other rows out computes only these (all rows: self)."""
        return self if (lo, hi) == (0, self.batch) else self._view(lo, hi)

    def _view(self, lo: int, hi: int) -> LeanEngine:
        if not 0 <= lo < hi <= self.batch:
            raise ValueError(f"no rows {lo} .. {hi - 1} in an engine of batch {self.batch}")
        if (lo, hi) not in self._rows:
            self._rows[lo, hi] = _RowView(self, lo, hi)
        return self._rows[lo, hi]

    def close(self) -> None:
        self._rows.clear()  # the row views hold the buffers too
        self._graphs = None
        super().close()



class _RowView(LeanEngine):
    """Rows lo .. hi - 1 of a batched LeanEngine as an engine of batch hi - lo: the same session and buffers
    (its rows are contiguous in them: caches [B, Hkv, C, D]), its lengths a view of the batch's `lengths[lo:hi]`
    (they move in both), its writes at row lo's offset; uncaptured (a CUDA
    graph holds the batch's addresses), but on a session that captures, so its calls must say so: a call
    without a graph id would capture graph 0 and then replay it with another call's inputs."""

    def __init__(self, batch: LeanEngine, lo: int, hi: int):
        super().__init__(None, batch.entry, batch.max_len, batch._max_logits, hi - lo, session=batch.session,
                         device=batch.device, device_id=batch.device_id, cuda_graph=batch.captures,
                         capture_width=batch.capture_width, prefill_chunk=batch.prefill_chunk,
                         buffers=(batch.keys, batch.values, batch._key_ptrs, batch._value_ptrs), kernel=batch.kernel)
        self.lengths = batch.lengths[lo:hi]
        self.lowest_write = batch.lowest_write[lo:hi]
        self._offset = batch._offset + lo * batch._row_bytes
        if hi - lo > 1:  # a span's logits, read within its caller's round, go in the batch's buffer
            self._logits = batch._logits
        self._graphs = None


def _run_options(graph_id: int):
    import onnxruntime as ort

    ro = ort.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", str(graph_id))  # -1: run without capturing or replaying
    return ro


class _CudaGraphs:
    """Captured passes of a LeanEngine on CUDA: one CUDA graph per call shape (rows, width, logits rows),
    each with its own device input and logits buffers at fixed addresses (what replaying needs; the caches'
    addresses never change). Passes wider than the engine's `capture_width` (prefills) run uncaptured."""

    most = 64  # graphs kept per engine (each holds its own activations)
    # graph ids are the session's: engines of other batch sizes sharing it must not reuse each other's
    # (from 1: -1 is "no graph", and 0 is what onnxruntime captures a call that names no graph as)
    _next_id: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, engine: LeanEngine):
        import onnxruntime as ort

        self.e, self._ort = engine, ort
        self._ids = self._next_id.setdefault(engine.session, itertools.count(1))
        self.ids: dict[tuple[int, int, int], int] = {}
        self.bufs: dict[tuple[int, int, int], dict] = {}

    def run(self, tokens, counts, logit_index) -> np.ndarray | None:
        """Logits [N, V] from the captured graph of this shape, or None: run it uncaptured."""
        e = self.e
        B, S = tokens.shape
        key = (B, S, len(logit_index))
        if S > e.capture_width or (key not in self.ids and len(self.ids) >= self.most):
            return None
        ort, dev, did = self._ort, "cuda", e.device_id
        if key not in self.ids:
            self.ids[key] = next(self._ids)
            feeds = e._inputs(tokens, counts)
            # attention reads the bound on the host: kept there, it needs no copy node (which capture forbids)
            bufs = {n: ort.OrtValue.ortvalue_from_numpy(v, *(("cpu", 0) if n == "total_sequence_length" else (dev, did)))
                    for n, v in feeds.items()}
            bufs["logit_index"] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(logit_index, np.int64), dev, did)
            bufs["logits"] = ort.OrtValue.ortvalue_from_shape_and_type([key[2], e.entry.logits_width], np.float32, dev, did)
            io = e.session.io_binding()
            for n, v in bufs.items():
                (io.bind_ortvalue_output if n == "logits" else io.bind_ortvalue_input)(n, v)
            e._bind_caches(io)
            bufs["io"] = io
            self.bufs[key] = bufs
        else:
            bufs = self.bufs[key]
            for n, v in e._inputs(tokens, counts).items():
                if n != "total_sequence_length":
                    bufs[n].update_inplace(v)
            bufs["logit_index"].update_inplace(np.ascontiguousarray(logit_index, np.int64))
        try:
            e.session.run_with_iobinding(bufs["io"], _run_options(self.ids[key]))
        except Exception as ex:  # noqa: BLE001 - capture refused at run time: run uncaptured from now on
            e.note = f"CUDA graphs are off for {e.entry.path}: onnxruntime could not capture a pass ({first_line(ex)})"
            warnings.warn(e.note, RuntimeWarning, stacklevel=3)
            e._graphs = None
            return None
        return bufs["logits"].numpy()
