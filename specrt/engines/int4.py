"""specrt's CPU kernels (specrt/engines/kernels, docs/kernel.md) as onnxruntime custom operators, put in
place of onnxruntime's when the CPU engine loads a lean graph: `specrt.Int4MatMul` for MatMulNBits and
`specrt.Attention` for GroupQueryAttention. Both compute each row the same way whatever the pass around it.

The library is built by `pip install` when a C++17 compiler is there. At load, `plan` reads the graph's
nodes (not its weights) and swaps every node the kernels take. MatMulNBits: 4 bits, a block size that is a
multiple of 32, accuracy level 4 (int8 activations, which is what the kernel computes), constant float
weights, no g_idx, on a CPU with one of the kernel's SIMD paths. GroupQueryAttention: float, rotary inside
(not interleaved), no softcap, local window, smooth softmax, position ids or bias, a head size that is a
multiple of 16. The others stay onnxruntime's, node by node. Then three folds into the swapped matmuls: an Add
of a constant bias after one becomes its bias (the same bits), a gated MLP's activation after one (Split
in halves, g * Sigmoid(g), times the other half) becomes its gated output (kernels/int4.h, Packed::glu), and
a root-mean-square norm before one becomes its `norm` (kernels/int4.h, rms_norm): a layer runs seven nodes
fewer. The graph file is never changed: the session is made from the edited graph in
memory, its weights read from the pair folder as before.

`SPECRT_INT4_KERNEL` chooses: "auto" (the default: the best matmul path this CPU runs), "off" (onnxruntime's
own kernels for every node), or a path name ("avx2", "neon-dotprod", ...: that path or an error).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import PairError, first_line

DOMAIN, OP, ATTENTION = "specrt", "Int4MatMul", "Attention"
# The graph input plan() adds when specrt's attention takes every attention node: int32 [batch, seq], each new
# token's parent among its row's new tokens (-1: the row's last cached entry); kernels/ort_op.cc
TREE_INPUT = "tree_parents"
ENV = "SPECRT_INT4_KERNEL"
LIBRARY_ENV = "SPECRT_INT4_LIBRARY"
HERE = Path(__file__).parent
BUILD_HINT = ("install a C++17 compiler (g++ or clang++) and run `pip install -e .` in the specrt checkout again "
              "(`pip install -v` shows the compiler's output)")


@dataclass(frozen=True)
class Kernel:
    """What computes a graph's int4 matmuls: `path` (the library's, e.g. "avx2") on `swapped` of its `total`
    MatMulNBits nodes, onnxruntime's MatMulNBits on the rest; `why` says why any node is onnxruntime's.
    Likewise specrt's attention on `attention` of its `attention_total` GroupQueryAttention nodes."""

    path: str | None
    swapped: int
    total: int
    why: str | None = None
    attention: int = 0
    attention_total: int = 0
    attention_why: str | None = None
    other_matmuls: int = 0  # float MatMul/Gemm nodes: onnxruntime's, whose rounding may follow the pass
    # whether the graph takes TREE_INPUT (every attention node specrt's), else why not
    trees: bool = False
    trees_why: str | None = None

    @property
    def invariant(self) -> bool:
        """Whether every row's numbers are independent of the pass around it: every matmul and attention
        node is specrt's."""
        return (self.total > 0 and self.swapped == self.total and self.attention_total > 0
                and self.attention == self.attention_total and not self.other_matmuls)

    def describe(self) -> str:
        if not self.total and not self.attention_total and self.why:
            return f"onnxruntime's own ({self.why})"
        if not self.total:
            mm = "no int4 matmuls"
        elif self.swapped == self.total:
            mm = f"specrt {self.path} ({self.total} MatMulNBits)"
        elif not self.swapped:
            mm = f"onnxruntime MatMulNBits ({self.why})"
        else:
            mm = f"specrt {self.path} on {self.swapped} of {self.total} MatMulNBits; onnxruntime's on the rest ({self.why})"
        return mm + "; " + self.describe_attention()

    def describe_attention(self) -> str:
        if not self.attention_total:
            return "no attention nodes"
        if self.attention == self.attention_total:
            return f"specrt attention ({self.attention} GroupQueryAttention)"
        if not self.attention:
            return f"onnxruntime GroupQueryAttention ({self.attention_why})"
        return (f"specrt attention on {self.attention} of {self.attention_total} GroupQueryAttention; onnxruntime's "
                f"on the rest ({self.attention_why})")


def library() -> Path | None:
    """The built library, or None. SPECRT_INT4_LIBRARY names another build of it (to compare builds)."""
    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = HERE / f"_int4{suffix}"
        if p.is_file():
            return p
    return None


def _lib():
    """The library, loaded (PairError, in one line, when it cannot be)."""
    return _open(library())


@functools.cache  # per path: SPECRT_INT4_LIBRARY may name another build later in the process
def _open(path: Path):
    try:
        lib = ctypes.CDLL(os.fspath(path))
        lib.specrt_int4_paths.restype = ctypes.c_char_p
        lib.specrt_int4_notes.restype = ctypes.c_char_p
        lib.specrt_int4_pack.restype = ctypes.c_void_p
        lib.specrt_int4_pack.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
        lib.specrt_int4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.specrt_int4_pack_gated.restype = ctypes.c_void_p
        lib.specrt_int4_pack_gated.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
        lib.specrt_int4_free.argtypes = [ctypes.c_void_p]
        lib.specrt_int4_reference.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int,
                                                                                         ctypes.c_void_p]
    except (OSError, AttributeError) as e:  # not a shared library of this machine, or one without specrt's functions
        what, fix = ((f"{LIBRARY_ENV}={path}", f"unset {LIBRARY_ENV} to use the build pip installed")
                     if os.environ.get(LIBRARY_ENV) else (os.fspath(path), BUILD_HINT))
        raise PairError(f"{what}: cannot load it as specrt's int4 kernel library ({first_line(e)}); {fix}") from None
    return lib


def paths() -> list[str]:
    """The library's paths this CPU runs, best first ("scalar", which defines the arithmetic, last); [] when
    the library is not built."""
    if library() is None:
        return []
    return _lib().specrt_int4_paths().decode().split(",")


def unavailable() -> str | None:
    """None when the library can take nodes here, else why not (one line that says what to do)."""
    if library() is None:
        note = HERE / "_int4.build-error.txt"
        why = note.read_text().strip() if note.is_file() else "it was not built"
        return f"specrt's int4 kernel library is not built ({why}); {BUILD_HINT}"
    notes = _lib().specrt_int4_notes().decode()
    if not [p for p in paths() if p != "scalar"]:
        return ("this CPU has none of the kernel's SIMD paths (AVX2, AVX-512, NEON dotprod)"
                + (f"; {notes}" if notes else ""))
    return None


def setting() -> str:
    return os.environ.get(ENV, "auto").strip() or "auto"


def chosen_path(choice: str) -> str:
    """The path `choice` ("auto" or a name) runs on here; PairError when it cannot."""
    usable = paths()
    if choice == "auto":
        return next(p for p in usable if p != "scalar")
    if choice not in usable:
        raise PairError(f"{ENV}={choice}: this CPU or build has no such kernel path; here: "
                        f"{', '.join(usable) or 'none'} (or auto, off)")
    return choice


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _swap(nodes, refusal, inits, make) -> tuple[int, dict[str, int]]:
    """Replace, in place, each node `refusal` finds nothing against by `make(node, attributes)`; count the
    others by reason."""
    swapped, refused = 0, {}
    for node in nodes:
        reason = refusal(node, inits)
        if reason:
            refused[reason] = refused.get(reason, 0) + 1
        else:
            node.CopyFrom(make(node, _attrs(node)))
            swapped += 1
    return swapped, refused


def _reasons(refused: dict[str, int]) -> str | None:
    return "; ".join(f"{n} with {r}" for r, n in refused.items()) or None


def _refusal(node, inits: dict) -> str | None:
    """Why the kernel does not take this MatMulNBits node (None: it does)."""
    from onnx import TensorProto

    a = _attrs(node)
    ins = list(node.input) + [""] * (6 - len(node.input))
    if a.get("bits", 4) != 4:
        return f"{a['bits']}-bit weights"
    bs = a.get("block_size", 0)
    if bs < 32 or bs % 32:
        return f"block size {bs}"
    if a.get("accuracy_level", 0) != 4:
        return f"accuracy level {a.get('accuracy_level', 0)} (float activations asked for)"
    if ins[4]:
        return "a g_idx input"
    kinds = {1: TensorProto.UINT8, 2: TensorProto.FLOAT, 3: TensorProto.UINT8, 5: TensorProto.FLOAT}
    for i, kind in kinds.items():
        if not ins[i] and i in (3, 5):
            continue
        if ins[i] not in inits:
            return "weights computed at run time"
        if inits[ins[i]].data_type != kind:
            return "float16 scales or float zero points" if i in (2, 3) else "float16 weights"
    return None


def _uses(graph) -> tuple[dict[str, list], set[str]]:
    """Each tensor's consuming nodes, and the graph's output names."""
    uses: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            uses.setdefault(name, []).append(node)
    return uses, {o.name for o in graph.output}


def _unbiased_matmuls(graph) -> list:
    """The graph's Int4MatMul nodes without a bias input: what a fold may extend."""
    return [n for n in graph.node if n.op_type == OP and n.domain == DOMAIN and not (len(n.input) > 4 and n.input[4])]


def _fold_bias(graph, inits: dict) -> int:
    """Each Add of a float constant of N values to an Int4MatMul's output, where that Add is the output's only
    use, becomes the matmul's bias: the kernel adds it to each output value as the Add did (one float
    addition, the same bits), and the pass runs one node fewer a layer. Returns how many were folded."""
    from onnx import TensorProto

    uses, outputs = _uses(graph)
    drop = []
    for node in _unbiased_matmuls(graph):
        out = node.output[0]
        add = uses.get(out, [])
        if out in outputs or len(add) != 1 or add[0].op_type != "Add" or add[0].domain not in ("", "ai.onnx"):
            continue
        add = add[0]
        other = add.input[1] if add.input[0] == out else add.input[0]
        bias = inits.get(other)
        N = _attrs(node)["N"]
        if other == out or bias is None or bias.data_type != TensorProto.FLOAT or list(bias.dims) != [N]:
            continue
        while len(node.input) < 5:
            node.input.append("")
        node.input[4] = other
        node.output[0] = add.output[0]
        drop.append(add)
    for add in drop:
        graph.node.remove(add)
    return len(drop)


def _constant(graph, inits: dict, name: str, folder: Path):
    """The value of `name` when it is an initializer (its data maybe in a file of `folder`) or a Constant
    node's output, else None."""
    from onnx import numpy_helper

    if name in inits:
        return numpy_helper.to_array(inits[name], os.fspath(folder))
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
    return None


def _fuse_glu(graph, inits: dict, folder: Path) -> int:
    """A gated MLP's activation after an Int4MatMul (Split in two halves on the last axis, g * Sigmoid(g),
    times the other half), each intermediate used only there, becomes the matmul's `glu` output
    (kernels/int4.h, Packed::glu): four nodes and a [rows, N] tensor fewer a layer. The activation's bits
    are specrt's own (attention.h, silu_mul), the same for a row whatever the pass. Returns how many."""
    from onnx import helper

    uses, outputs = _uses(graph)

    def only(name: str, op: str):  # the one node that uses `name`, if it is an `op`
        u = uses.get(name, [])
        return u[0] if len(u) == 1 and u[0].op_type == op and u[0].domain in ("", "ai.onnx") and name not in outputs else None

    def other(node, name: str) -> str:
        return node.input[1] if node.input[0] == name else node.input[0]

    drop = []
    for mm in _unbiased_matmuls(graph):
        N = _attrs(mm)["N"]
        split = only(mm.output[0], "Split")
        if split is None or N % 32 or len(split.output) != 2 or _attrs(split).get("axis") != -1:
            continue
        # the sizes: an input (opset 13+), an attribute (older opsets), or neither (equal parts)
        sizes = _constant(graph, inits, split.input[1], folder) if len(split.input) > 1 and split.input[1] else None
        sizes = _attrs(split).get("split") if sizes is None else sizes
        if sizes is not None and [int(x) for x in np.asarray(sizes).reshape(-1)] != [N // 2, N // 2]:
            continue
        g, u = split.output
        g_uses = uses.get(g, [])
        sig = next((n for n in g_uses if n.op_type == "Sigmoid"), None)
        if len(g_uses) != 2 or sig is None or g in outputs or u in outputs:
            continue
        mul = only(sig.output[0], "Mul")
        if mul is None or other(mul, sig.output[0]) != g:
            continue
        gate = only(mul.output[0], "Mul")
        if gate is None or other(gate, mul.output[0]) != u or only(u, "Mul") is not gate:
            continue
        mm.output[0] = gate.output[0]
        mm.attribute.append(helper.make_attribute("glu", 1))
        drop += [split, sig, mul, gate]
    for node in drop:
        graph.node.remove(node)
    return len(drop) // 4


def _fold_norm(graph, inits: dict) -> int:
    """A root-mean-square norm whose output only Int4MatMuls read (onnxruntime's
    SkipSimplifiedLayerNormalization without a bias, or SimplifiedLayerNormalization over the last axis; a
    constant float gamma of K values) becomes their `norm` (kernels/int4.h, rms_norm): each normalizes the
    rows it quantizes anyway (the slices of a matmul export cut in parts each do it again: a row's norm costs
    little beside its matmul), and a skip norm's sum (the residual stream) becomes the first one's second
    output, which the others normalize. A layer runs two nodes fewer. The norm's bits are specrt's own, the
    same for a row whatever the pass. Returns how many norms were folded."""
    from onnx import TensorProto, helper

    uses, outputs = _uses(graph)
    drop = []
    for norm in list(graph.node):
        skip = norm.op_type == "SkipSimplifiedLayerNormalization" and norm.domain == "com.microsoft"
        simple = norm.op_type == "SimplifiedLayerNormalization" and norm.domain in ("", "ai.onnx")
        if not (skip or simple):
            continue
        ins, outs, na = list(norm.input), list(norm.output), _attrs(norm)
        if skip:  # input, skip, gamma[, bias]; outputs: y, mean, inv_std_var, input + skip
            x, residual, gamma = ins[0], ins[1], ins[2] if len(ins) > 2 else ""
            if len(ins) > 3 and ins[3] or len(outs) < 4 or not outs[3]:
                continue
        elif na.get("axis", -1) == -1:
            x, residual, gamma = ins[0], "", ins[1] if len(ins) > 1 else ""
        else:
            continue
        y, g = outs[0], inits.get(gamma)
        readers = uses.get(y, [])
        unused = not any(o and (uses.get(o) or o in outputs) for o in outs[1:3])
        if (not readers or y in outputs or not unused or g is None or g.data_type != TensorProto.FLOAT
                or "epsilon" not in na):
            continue
        if not all(mm.op_type == OP and mm.domain == DOMAIN and mm.input[0] == y and list(mm.input).count(y) == 1
                   and "norm" not in _attrs(mm) and list(g.dims) == [_attrs(mm)["K"]] for mm in readers):
            continue
        for i, mm in enumerate(readers):
            inputs = list(mm.input) + [""] * (5 - len(mm.input))
            del mm.input[:]
            # the first computes the sum; the others normalize it (norm(a + skip) == norm(the sum): the same bits)
            first = i == 0 or not skip
            mm.input.extend([x if first else outs[3], *inputs[1:5], residual if first else "", gamma])
            if skip and i == 0:
                mm.output.append(outs[3])
            mm.attribute.extend([helper.make_attribute("norm", 1), helper.make_attribute("epsilon", float(na["epsilon"]))])
        drop.append(norm)
    for node in drop:
        graph.node.remove(node)
    return len(drop)


def _attention_refusal(node, inits: dict) -> str | None:
    """Why specrt's attention does not take this GroupQueryAttention node (None: it does)."""
    from onnx import TensorProto

    a = _attrs(node)
    ins = list(node.input) + [""] * (17 - len(node.input))
    if not a.get("do_rotary") or a.get("rotary_interleaved", 0):
        return "no rotary or interleaved rotary"
    if a.get("softcap", 0.0) or a.get("local_window_size", -1) != -1 or a.get("smooth_softmax", 0):
        return "softcap, local window or smooth softmax"
    if any(ins[9:16]) or len(node.input) > 17:
        return "position ids, an attention bias or other extra inputs"
    cos = inits.get(ins[7])
    if cos is None or cos.data_type != TensorProto.FLOAT or len(cos.dims) != 2 or (2 * cos.dims[1]) % 16:
        return "rotary tables that are not float constants of a head size that is a multiple of 16"
    return None


def _add_tree_input(graph, attention: list) -> str | None:
    """Adds TREE_INPUT to the graph and as input 9 of every specrt.Attention node in `attention`; None, or why
    not. Its dimensions are input_ids' (the same symbols), else the first node's query's batch and sequence."""
    from onnx import TensorProto, helper

    if not attention:
        return "no attention nodes"
    if any(i.name == TREE_INPUT for i in graph.input):
        return f"the graph already has an input named {TREE_INPUT}"
    shapes = {v.name: v.type.tensor_type.shape for v in graph.input}
    dims = []
    for name in ("input_ids", attention[0].input[0]):
        shape = shapes.get(name)
        if shape is not None and len(shape.dim) >= 2:
            dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in shape.dim[:2]]
            break
    graph.input.append(helper.make_tensor_value_info(TREE_INPUT, TensorProto.INT32, dims or ["batch", "seq"]))
    for node in attention:
        node.input.append(TREE_INPUT)  # after query_seqlens (input 8, maybe "")
    return None


def plan(model_path: Path, choice: str | None = None):
    """(graph, Kernel): the graph of `model_path` (weights left in their files) with every MatMulNBits and
    GroupQueryAttention the kernels take swapped for specrt's, or None when none is (then onnxruntime loads
    the file as is). When specrt's attention takes every attention node the graph gets the input TREE_INPUT
    (Kernel.trees), which every call must then feed: each new token's parent, [-1, 0, 1, ...] for a chain."""
    choice = setting() if choice is None else choice
    try:
        import onnx
        from onnx import helper
    except ImportError:  # a runtime without onnx still runs, on onnxruntime's own kernels
        why = "the onnx package, which swaps specrt's kernels into the graph, is not installed (pip install onnx)"
        return None, Kernel(None, 0, 0, why, 0, 0, why, trees_why=why)
    try:
        model = onnx.load(os.fspath(model_path), load_external_data=False)
    except Exception as e:  # onnx and protobuf raise their own types for a damaged file
        raise PairError(f"cannot load {model_path}: {first_line(e)}") from None
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    attn = [n for n in model.graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not nodes and not attn:
        return None, Kernel(None, 0, 0, trees_why="no attention nodes")
    off = f"{ENV}=off" if choice == "off" else None
    built = None if library() is not None else unavailable()
    if off or built:
        why = off or built
        return None, Kernel(None, 0, len(nodes), why if nodes else None, 0, len(attn), why if attn else None,
                            trees_why=why)
    inits = {t.name: t for t in model.graph.initializer}
    path, swapped, refused = None, 0, {}
    simd = unavailable()  # a CPU without any of the matmul's SIMD paths: onnxruntime's MatMulNBits
    if nodes and not simd:
        path = chosen_path(choice)

        def matmul(node, a):
            ins = list(node.input) + [""] * (6 - len(node.input))
            return helper.make_node(OP, [ins[0], ins[1], ins[2], ins[3], ins[5]], list(node.output), name=node.name,
                                    domain=DOMAIN, K=a["K"], N=a["N"], bits=4, block_size=a["block_size"], path=path)

        swapped, refused = _swap(nodes, _refusal, inits, matmul)
        _fold_bias(model.graph, inits)
        _fuse_glu(model.graph, inits, Path(model_path).parent)
        _fold_norm(model.graph, inits)
    why = (simd if nodes else None) or _reasons(refused)

    def attention(node, a):
        ins = list(node.input) + [""] * (17 - len(node.input))
        return helper.make_node(ATTENTION, [*ins[0:6], ins[7], ins[8], ins[16]], list(node.output), name=node.name,
                                domain=DOMAIN, num_heads=a["num_heads"], kv_num_heads=a["kv_num_heads"],
                                scale=float(a.get("scale", 0.0)))

    a_swapped, a_refused = _swap(attn, _attention_refusal, inits, attention)  # portable C++: every CPU takes it
    a_why = _reasons(a_refused)
    other = sum(n.op_type in ("MatMul", "Gemm") and n.domain in ("", "ai.onnx") and n.input[1] in inits
                for n in model.graph.node)
    trees_why = _add_tree_input(model.graph, attn) if a_swapped == len(attn) else \
        f"onnxruntime's GroupQueryAttention on {len(attn) - a_swapped} of {len(attn)} attention nodes ({a_why})"
    kernel = Kernel(path if swapped else None, swapped, len(nodes), why, a_swapped, len(attn), a_why, other,
                    trees_why is None, trees_why)
    if not swapped and not a_swapped:
        return None, kernel
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model, kernel


def session_source(model_path: Path, so, choice: str | None = None):
    """(what to give InferenceSession, Kernel): the graph's bytes with the library registered on `so` (and the
    pair folder as where its weights are), or the file's path when no node is swapped."""
    model, kernel = plan(model_path, choice)
    if model is None:
        return os.fspath(model_path), kernel
    try:
        so.register_custom_ops_library(os.fspath(library()))
    except Exception as e:  # onnxruntime raises its own error types; the library says why in one line
        why = first_line(e, last=True)
        why = why.split(" : FAIL : ", 1)[-1]  # onnxruntime's "[ONNXRuntimeError] : 1 : FAIL : " before the library's
        raise PairError(f"{why}; rebuild specrt (pip install -e .) or set {ENV}=off for onnxruntime's own "
                        "kernels") from None
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(model_path.parent))
    return model.SerializeToString(), kernel
