"""The lean graph written directly with onnx's helpers, layer by layer, in about one layer's memory.

It is the graph `graph.LeanDecoder` traces (same inputs, outputs, ops and attributes; docs/design.md, "The
export"), built without torch: each weight is read from the checkpoint (export/weights.py) when its node is
written, cast to the graph's float type or quantized to int4 a chunk of rows at a time (export/quant.py), and
appended to the external-data file at once. What stays in memory is the graph's structure and the weight
being written, so a 7B exports where its fp32 copy would not fit.

Per decoder layer: one matmul for q/k/v (+ the bias Add where the model has one), GroupQueryAttention (rotary
and the cache write inside it), the output matmul, a fused residual + RMSNorm, one matmul for gate/up, Split,
Sigmoid and two Muls (SiLU times up), the down matmul and the next fused residual + RMSNorm; Qwen3 adds a
Split and the per-head norms of q and k between their Reshapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import ExportError
from specrt.export.progress import QUIET, Progress
from specrt.export.quant import SLICE_ROWS, matmul_4bits, quantize_blocks

FAMILIES = ("llama", "qwen2", "mistral", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
TRACE_HINT = "--trace exports it through torch instead"
CHUNK_BYTES = 64 << 20  # fp32 bytes of weight rows read (and quantized) at a time
INLINE_BYTES = 1024  # smaller tensors stay in the graph file, as onnx's external-data writer keeps them


@dataclass(frozen=True)
class Shape:
    """What the graph needs of a model's config."""
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    tied: bool
    rope: dict  # rope_type, rope_theta and the type's own parameters

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def of(cls, c) -> Shape:
        """From a transformers config; refuses (naming --trace) what the builder does not write."""
        if c.model_type not in FAMILIES:
            raise ExportError(f"model type {c.model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
        rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(c, "rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        why = None
        if rope["rope_type"] not in ROPE_TYPES:
            why = f"rope type {rope['rope_type']!r}"
        elif float(rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0) or 1.0)) != 1.0:
            why = "a partial rotary factor"
        elif getattr(c, "hidden_act", "silu") != "silu":
            why = f"activation {c.hidden_act!r}"
        elif getattr(c, "mlp_bias", False):
            why = "biases in the MLP"
        if why:
            raise ExportError(f"the graph builder does not write {why} ({c.model_type}); {TRACE_HINT}")
        heads = c.num_attention_heads
        return cls(c.model_type, c.num_hidden_layers, c.hidden_size, heads, getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads, c.intermediate_size, c.vocab_size,
                   float(c.rms_norm_eps), bool(getattr(c, "tie_word_embeddings", False)), rope)


def inverse_frequencies(shape: Shape) -> np.ndarray:
    """The rotary inverse frequencies [D/2], float32, as transformers computes them for each rope type (the
    power in float64, rounded: it agrees with torch's float32 power to the bit)."""
    r, D = shape.rope, shape.head_dim
    exponents = np.arange(0, D, 2, dtype=np.float32) / np.float32(D)
    inv = np.float32(1.0) / (float(r["rope_theta"]) ** exponents.astype(np.float64)).astype(np.float32)
    if r["rope_type"] == "linear":
        inv = inv / np.float32(r["factor"])
    elif r["rope_type"] == "llama3":
        factor, low, high = (np.float32(r[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        context = np.float32(r["original_max_position_embeddings"])
        # a number over a tensor is, in torch, the number times the tensor's reciprocal: the same bits here
        wavelen = np.float32(2 * math.pi) * (np.float32(1) / inv)
        scaled = np.where(wavelen > context / low, inv / factor, inv)
        smooth = (context * (np.float32(1) / wavelen) - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < context / high) & ~(wavelen > context / low)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rotary_tables(shape: Shape, positions: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, D/2] of GroupQueryAttention: the angles in float32 as transformers forms them,
    their cosines and sines rounded from float64 (within one float32 step of torch's)."""
    angles = np.arange(positions, dtype=np.float32)[:, None] * inverse_frequencies(shape)[None]
    wide = angles.astype(np.float64)
    # through float32 as torch's tables go, so an fp16 graph's tables are float32's rounded once more
    return np.cos(wide).astype(np.float32).astype(dtype), np.sin(wide).astype(np.float32).astype(dtype)


@dataclass(frozen=True)
class Options:
    dtype: str  # the activations' and caches' numpy type
    int4: bool
    block_size: int = 128
    accuracy_level: int = 4
    symmetric: bool = False
    embedding_bits: int = 0
    embedding_block_size: int = 32
    query_seqlens: bool = True
    positions: int = 4096  # rotary table length
    slice_rows: int = 0  # int4: cut MatMulNBits wider than this into slices (0: never)


class _Writer:
    """The graph being written: nodes, initializers, and the external-data file their bytes go to."""

    def __init__(self, path: Path):
        self.location = path.name + ".data"
        self.data = open(path.with_name(self.location), "wb")
        self.nodes, self.inits, self.at = [], [], 0

    def close(self):
        self.data.close()

    def node(self, op: str, inputs: list[str], name: str, outputs: int | list[str] = 1, domain: str = "", **attrs):
        from onnx import helper

        outs = [f"{name}/out{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def const(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        if array.nbytes < INLINE_BYTES:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
            return name
        return self.stream(name, array.dtype, array.shape, [array])

    def stream(self, name: str, dtype, dims, chunks) -> str:
        """An initializer whose bytes are the concatenated `chunks` (arrays of `dtype`), written as they come."""
        from onnx import TensorProto, helper

        pad = -self.at % 64  # each tensor on a 64-byte boundary
        self.data.write(b"\0" * pad)
        start = self.at = self.at + pad
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk, dtype)
            self.data.write(chunk.data)
            self.at += chunk.nbytes
        want = int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize
        if self.at - start != want:
            raise ExportError(f"internal: {name} got {self.at - start} bytes, its shape needs {want}")
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(dims))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", start), ("length", want)):
            t.external_data.add(key=key, value=str(value))
        self.inits.append(t)
        return name


class _Matrix:
    """A linear layer's weight [N, K] (output rows) as the graph's matmul computes it: checkpoint tensors
    stacked along N (q, k and v; gate and up), or the rows `ids` of one (a restricted output vocabulary)."""

    def __init__(self, tensors, names: list[str], dtype, ids=None):
        self.tensors, self.names, self.dtype, self.ids = tensors, names, np.dtype(dtype), ids
        self.sizes = [tensors.shape(n)[0] for n in names] if ids is None else [len(ids)]
        self.K = tensors.shape(names[0])[1]
        self.N = sum(self.sizes)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Rows lo:hi, in the graph's float type."""
        if self.ids is not None:
            ids = self.ids[lo:hi]
            return self.tensors.rows(self.names[0], int(ids[0]), int(ids[-1]) + 1)[ids - ids[0]].astype(self.dtype)
        parts, start = [], 0
        for name, n in zip(self.names, self.sizes):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                parts.append(self.tensors.rows(name, a - start, b - start))
            start += n
        return np.concatenate(parts).astype(self.dtype) if len(parts) > 1 else parts[0].astype(self.dtype)

    def chunks(self, lo: int, hi: int):
        step = max(64, CHUNK_BYTES // (4 * self.K) // 64 * 64)
        for a in range(lo, hi, step):
            yield self.read(a, min(a + step, hi))


def _linear(w: _Writer, x: str, m: _Matrix, name: str, opts: Options, bias: np.ndarray | None = None,
            out: str | None = None) -> str:
    """x @ m.T (+ bias), written to `out` if given: MatMul over the transposed weight, or MatMulNBits (in
    slices when it is wider than opts.slice_rows, joined by a Concat)."""
    last = [out] if out and bias is None else 1  # the outputs of the node before the bias
    if not opts.int4:
        weight = np.concatenate([c.T for c in m.chunks(0, m.N)], axis=1)
        y = w.node("MatMul", [x, w.const(f"{name}.weight", weight)], name, last)
    else:
        cut = opts.slice_rows if opts.slice_rows and m.N > opts.slice_rows else m.N
        if cut == m.N:
            y = _int4(w, x, m, 0, m.N, name, opts, last)
        else:
            parts = [_int4(w, x, m, lo, min(lo + cut, m.N), f"{name}_rows{lo}", opts) for lo in range(0, m.N, cut)]
            y = w.node("Concat", parts, f"{name}/concat", last, axis=-1)
    if bias is not None:
        y = w.node("Add", [w.const(f"{name}.bias", bias.astype(m.dtype)), y], f"{name}/bias", [out] if out else 1)
    return y


def _int4(w: _Writer, x: str, m: _Matrix, lo: int, hi: int, name: str, opts: Options, outputs=1) -> str:
    k_blocks = -(-m.K // opts.block_size)
    scales, zeros = [], []

    def packed():
        for rows in m.chunks(lo, hi):
            q, s, z = matmul_4bits(rows, opts.block_size, opts.symmetric)
            scales.append(s)
            zeros.append(z)
            yield q

    inputs = [x, w.stream(f"{name}.weight_Q4", np.uint8, [hi - lo, k_blocks, opts.block_size // 2], packed()),
              w.const(f"{name}.weight_scales", np.concatenate(scales))]
    if not opts.symmetric:
        inputs.append(w.const(f"{name}.weight_zero_points", np.concatenate(zeros)))
    level = {"accuracy_level": opts.accuracy_level} if opts.accuracy_level else {}  # as the quantizer omits 0
    return w.node("MatMulNBits", inputs, name, outputs, domain="com.microsoft", K=m.K, N=hi - lo, bits=4,
                  block_size=opts.block_size, **level)


def _embedding(w: _Writer, tensors, shape: Shape, opts: Options) -> tuple[str, dict | None]:
    """The input embedding: a Gather of the table, or GatherBlockQuantized of its blocks."""
    table = _Matrix(tensors, ["model.embed_tokens.weight"], opts.dtype)
    bits, block = opts.embedding_bits, opts.embedding_block_size
    if not bits:
        name = w.stream("embed_tokens.weight", table.dtype, [table.N, table.K], table.chunks(0, table.N))
        return w.node("Gather", [name, "input_ids"], "embed_tokens"), None
    if table.K % block:
        raise ExportError(f"embedding width {table.K} is not a multiple of the block size {block}")
    scales, zeros = [], []

    def data():
        for rows in table.chunks(0, table.N):
            q, s, z = quantize_blocks(rows, bits, block)
            scales.append(s)
            zeros.append(z)
            yield q

    q = w.stream("embed_tokens.weight_q", np.uint8, [table.N, table.K * bits // 8], data())
    inputs = [q, "input_ids", w.const("embed_tokens.weight_scales", np.concatenate(scales)),
              w.const("embed_tokens.weight_zero_points", np.concatenate(zeros))]
    out = w.node("GatherBlockQuantized", inputs, "embed_tokens", domain="com.microsoft", gather_axis=0,
                 quantize_axis=1, block_size=block, bits=bits)
    return out, {"op": "GatherBlockQuantized", "bits": bits, "block_size": block, "symmetric": False}


def _norm(w: _Writer, tensors, x: str, weight: str, name: str, shape: Shape, opts: Options) -> str:
    gamma = w.const(f"{name}.weight", tensors.rows(weight).astype(opts.dtype))
    return w.node("SimplifiedLayerNormalization", [x, gamma], name, axis=-1, epsilon=shape.eps, stash_type=1)


def _skip_norm(w: _Writer, tensors, x: str, skip: str, weight: str, name: str, shape: Shape, opts: Options,
               last: bool = False) -> tuple[str, str]:
    """(RMSNorm(x + skip), x + skip) in one SkipSimplifiedLayerNormalization; after the last layer only the
    norm is used."""
    gamma = w.const(f"{name}.weight", tensors.rows(weight).astype(opts.dtype))
    outs = [f"{name}/out0", "", "", "" if last else f"{name}/out3"]
    w.node("SkipSimplifiedLayerNormalization", [x, skip, gamma], name, outs, domain="com.microsoft",
           epsilon=shape.eps)
    return outs[0], outs[3]


def _bias(tensors, names: list[str]) -> np.ndarray | None:
    """The stacked biases of `names` (weights), zeros for those without one; None when none has one."""
    if not any(n.replace(".weight", ".bias") in tensors for n in names):
        return None
    return np.concatenate([tensors.rows(n.replace(".weight", ".bias")) if n.replace(".weight", ".bias") in tensors
                           else np.zeros(tensors.shape(n)[0], np.float32) for n in names])


def _attention(w: _Writer, tensors, x: str, i: int, shape: Shape, opts: Options, cos: str, sin: str) -> str:
    """q/k/v projection, GroupQueryAttention over layer i's cache; returns the attention's output [B, S, H*D]."""
    p = f"model.layers.{i}.self_attn"
    names = [f"{p}.{n}_proj.weight" for n in "qkv"]
    qkv = _linear(w, x, _Matrix(tensors, names, opts.dtype), f"layers.{i}.qkv", opts, _bias(tensors, names))
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    if shape.qk_norm:  # qwen3: per-head RMSNorm of q and k before rotary
        sizes = w.const(f"layers.{i}.qkv_sizes", np.array([H * D, Hkv * D, Hkv * D], np.int64))
        q, k, v = w.node("Split", [qkv, sizes], f"layers.{i}.qkv_split", 3, axis=-1)
        heads = []
        for t, n, which in ((q, H, "q"), (k, Hkv, "k")):
            split = w.node("Reshape", [t, w.const(f"layers.{i}.{which}_heads", np.array([0, -1, n, D], np.int64))],
                           f"layers.{i}.{which}_heads")
            normed = _norm(w, tensors, split, f"{p}.{which}_norm.weight", f"layers.{i}.{which}_norm", shape, opts)
            heads.append(w.node("Reshape", [normed, w.const(f"layers.{i}.{which}_flat",
                                                            np.array([0, -1, n * D], np.int64))], f"layers.{i}.{which}_flat"))
        qkv_in = [heads[0], heads[1], v]
    else:
        qkv_in = [qkv, "", ""]
    inputs = [*qkv_in, f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length", cos, sin]
    if opts.query_seqlens:  # GroupQueryAttention's input 16
        inputs += [""] * 7 + ["query_seqlens"]
    out, _, _ = w.node("GroupQueryAttention", inputs, f"layers.{i}.attn",
                       [f"layers.{i}.attn/out0", f"present_key.{i}", f"present_value.{i}"], domain="com.microsoft",
                       num_heads=H, kv_num_heads=Hkv, scale=D ** -0.5, do_rotary=1, rotary_interleaved=0)
    o = f"{p}.o_proj.weight"
    return _linear(w, out, _Matrix(tensors, [o], opts.dtype), f"layers.{i}.o_proj", opts, _bias(tensors, [o]))


def _layer(w: _Writer, tensors, x: str, h: str, i: int, shape: Shape, opts: Options, cos: str, sin: str):
    """Decoder layer i on the normed input x and the residual stream h; returns the next layer's (x, h)."""
    attn = _attention(w, tensors, x, i, shape, opts, cos, sin)
    p = f"model.layers.{i}"
    x, h = _skip_norm(w, tensors, attn, h, f"{p}.post_attention_layernorm.weight", f"layers.{i}.post_norm", shape, opts)
    gate_up = _Matrix(tensors, [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"], opts.dtype)
    gu = _linear(w, x, gate_up, f"layers.{i}.gate_up", opts)
    sizes = w.const(f"layers.{i}.gate_up_sizes", np.array([shape.intermediate] * 2, np.int64))
    g, u = w.node("Split", [gu, sizes], f"layers.{i}.gate_up_split", 2, axis=-1)
    act = w.node("Mul", [g, w.node("Sigmoid", [g], f"layers.{i}.sigmoid")], f"layers.{i}.silu")
    down = _linear(w, w.node("Mul", [act, u], f"layers.{i}.glu"), _Matrix(tensors, [f"{p}.mlp.down_proj.weight"], opts.dtype),
                   f"layers.{i}.down_proj", opts)
    last = i + 1 == shape.layers
    norm = "model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
    return _skip_norm(w, tensors, down, h, norm, "final_norm" if last else f"layers.{i + 1}.input_norm", shape, opts,
                      last)


def io_values(shape: Shape, opts: Options, logits_width: int):
    """The graph's inputs and outputs (graph.lean_io_names' names), typed and shaped."""
    from onnx import TensorProto, helper

    f = helper.np_dtype_to_tensor_dtype(np.dtype(opts.dtype))
    cache = ["batch", shape.kv_heads, "capacity", shape.head_dim]
    value = helper.make_tensor_value_info
    inputs = [value("input_ids", TensorProto.INT64, ["batch", "seq"]), value("seqlens_k", TensorProto.INT32, ["batch"]),
              value("total_sequence_length", TensorProto.INT32, [1]),
              value("logit_index", TensorProto.INT64, ["n_logits"])]
    if opts.query_seqlens:
        inputs.append(value("query_seqlens", TensorProto.INT32, ["batch"]))
    outputs = [value("logits", TensorProto.FLOAT, ["n_logits", logits_width])]
    for i in range(shape.layers):
        inputs += [value(f"past_key.{i}", f, cache), value(f"past_value.{i}", f, cache)]
        outputs += [value(f"present_key.{i}", f, cache), value(f"present_value.{i}", f, cache)]
    return inputs, outputs


def build_lean(tensors, shape: Shape, path: Path, opts: Options, output_ids=None,
               progress: Progress = QUIET) -> dict | None:
    """Write the lean graph of the checkpoint `tensors` to `path` and its weights to `path`.data; returns
    the embedding's quantization (None: kept as it is). `output_ids`: logits only for these token ids."""
    import onnx
    from onnx import helper

    w = _Writer(path)
    try:
        with progress.step("writing the graph", total=shape.layers + 2, unit="part") as advance:
            h, embedding = _embedding(w, tensors, shape, opts)
            advance(1)
            cos, sin = (w.const(n, t) for n, t in zip(("rotary.cos", "rotary.sin"),
                                                      rotary_tables(shape, opts.positions, opts.dtype)))
            x = _norm(w, tensors, h, "model.layers.0.input_layernorm.weight", "layers.0.input_norm", shape, opts)
            for i in range(shape.layers):
                x, h = _layer(w, tensors, x, h, i, shape, opts, cos, sin)
                advance(1)
            _head(w, tensors, x, shape, opts, output_ids)
            advance(1)
    finally:
        w.close()
    width = shape.vocab if output_ids is None else len(output_ids)
    inputs, outputs = io_values(shape, opts, width)
    graph = helper.make_graph(w.nodes, "specrt_lean", inputs, outputs, w.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8, producer_name="specrt")
    onnx.save_model(model, str(path))
    return embedding


def _head(w: _Writer, tensors, x: str, shape: Shape, opts: Options, output_ids) -> None:
    """Logits for the rows `logit_index` picks: x [B, S, hidden] flattened, gathered, times the output matrix
    (the embedding table where the model ties them)."""
    flat = w.node("Reshape", [x, w.const("hidden_rows", np.array([-1, shape.hidden], np.int64))], "flatten")
    picked = w.node("Gather", [flat, "logit_index"], "pick_rows", axis=0)
    ids = None if output_ids is None else np.asarray(output_ids, np.int64)
    head = _Matrix(tensors, ["model.embed_tokens.weight" if shape.tied else "lm_head.weight"], opts.dtype, ids)
    if opts.dtype == "float32":
        _linear(w, picked, head, "lm_head", opts, out="logits")
    else:  # the logits are float32 whatever the activations
        w.node("Cast", [_linear(w, picked, head, "lm_head", opts)], "logits_float", ["logits"], to=1)


# The process beside the weight being written: Python, numpy, onnx, onnxruntime, transformers reading a GGUF's
# tokenizer, the draft vocabulary's calibration. Measured (bench/RESULTS.md, "Export memory"): the int4 demo
# pair from its GGUFs peaks at 1.32 GB, a 7B-shaped safetensors checkpoint at 0.72 GB.
BASE_BYTES = 800 << 20


def working_bytes(shape: Shape, dtype: str, int4: bool) -> int:
    """The builder's peak above the process's base: the weight it is writing. int4: a chunk of rows in
    float32, its cast, transposed and padded copies, and a restricted vocabulary's read spanning a few
    chunks; float graphs: the widest matrix whole, in its chunks and concatenated."""
    if int4:
        return 8 * CHUNK_BYTES
    widest = max(2 * shape.intermediate, shape.vocab, shape.hidden + 2 * shape.kv_heads * shape.head_dim)
    return 2 * widest * shape.hidden * np.dtype(dtype).itemsize + 2 * CHUNK_BYTES
