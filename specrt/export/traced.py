"""The older export path: the whole model loaded through transformers (torch), its lean or portable graph
traced by torch's ONNX exporter (export/graph.py), then quantized by onnxruntime's MatMulNBits quantizer.

It holds the whole model in fp32 and a copy, about 4x the fp32 weights at its peak. The graph builder
(export/builder.py) writes the lean graph without it; this path stays for the portable (TensorRT) graph, and
behind `--trace` for what the builder does not write, and as the reference the builder is tested against.
"""
from __future__ import annotations

import gc
import importlib.util
import logging
from pathlib import Path

import numpy as np

from specrt.errors import ExportError
from specrt.export import load
from specrt.export.progress import QUIET, Progress
from specrt.export.quant import SLICE_ROWS, quantize_blocks


def require_torch() -> None:
    """Refuse a traced export (--trace, --portable, --engine tensorrt) where torch cannot be imported: the graph
    builder and every source's config and tokenizer need no torch, this path does."""
    if importlib.util.find_spec("torch") is None:
        raise ExportError("this export traces the model with torch, which is not installed (--trace, --portable "
                          "and --engine tensorrt do): pip install 'specrt[trace]'")


def trace(src, path: Path, cfg, output_ids=None, progress: Progress = QUIET) -> tuple[dict, dict | None, dict | None]:
    """Export one checkpoint to `path` (+ external data) through torch, quantized as `cfg` (an ExportConfig)
    asks: (the manifest's model fields, the weights' quantization, the embedding's), None where not quantized.
    `output_ids`: keep only these rows of the output matrix (a restricted draft vocabulary)."""
    import onnx

    require_torch()
    from specrt.export import graph  # torch (the trace extra): imported when a model is traced

    with progress.step("loading"):
        model = load.load_model(src, cfg.dtype)
    with progress.step("tracing"):
        if cfg.graph == "lean":
            q_lens = graph.gqa_has_query_seqlens() if cfg.query_seqlens is None else cfg.query_seqlens
            # rotary tables for every position a cache holds: batch caches have max_draft_len + 1 slots spare
            wrapper = graph.export_lean(model, path, cfg.max_len + cfg.max_draft_len + 1, output_ids, q_lens)
        else:
            wrapper = graph.export_portable(model, path, cfg.max_len, output_ids)
    spec = dict(model_type=model.config.model_type, num_layers=wrapper.num_layers,
                num_kv_heads=wrapper.num_kv_heads, head_dim=wrapper.head_dim, hidden_size=int(model.config.hidden_size),
                intermediate_size=int(model.config.intermediate_size),
                logits_width=int(model.config.vocab_size) if output_ids is None else len(output_ids))
    del model, wrapper
    gc.collect()
    _consolidate(path, progress)
    quant = embedding = None
    if cfg.precision == "int4":
        quant = quantize_int4(path, cfg.block_size, cfg.accuracy_level, cfg.symmetric, progress)
    sliced = cfg.precision == "int4" and cfg.dtype == "float32"  # a CPU graph (on a GPU: more launches a pass)
    if sliced or cfg.embedding:  # both edits in memory, one write
        with progress.step("quantizing the embeddings" if cfg.embedding else "slicing the output matrix"):
            proto = onnx.load(str(path))
            if sliced:
                slice_wide_matmuls(proto)
            if cfg.embedding:
                embedding = quantize_embedding(proto, path, cfg.embedding, cfg.embedding_block_size)
        with progress.step("writing"):
            _save(proto, path)
        del proto
    return spec, quant, embedding


def _consolidate(path: Path, progress: Progress = QUIET) -> None:
    """One external-data file per graph (the exporter may scatter one file per tensor)."""
    import onnx

    if any(p != path for p in path.parent.iterdir()):
        with progress.step("writing"):
            _save(onnx.load(str(path)), path)


def _save(proto, path: Path) -> None:
    """Write a graph (in memory) with its tensors in one external-data file, replacing what its folder held."""
    import onnx

    for p in path.parent.iterdir():
        p.unlink()
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def quantize_int4(path: Path, block_size: int, accuracy_level: int, symmetric: bool = True,
                  progress: Progress = QUIET) -> dict:
    """Weight-only int4 (onnxruntime's MatMulNBits) for every MatMul with a constant weight."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(str(path))
    algo = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level)
    q = MatMulNBitsQuantizer(model, block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level,
                             algo_config=algo)
    matmuls = sum(n.op_type in algo.op_types_to_quantize for n in model.graph.node)
    with progress.step("quantizing", total=matmuls, unit="node") as advance:
        quantize = q.node_quantizer.quantize  # the quantizer offers no progress hook: count the nodes it is given

        def counted(node, graph_stack):
            nodes = quantize(node, graph_stack)
            advance(1)
            return nodes

        q.node_quantizer.quantize = counted
        q.process()
    del model
    with progress.step("writing"):
        for p in path.parent.iterdir():
            p.unlink()
        q.model.save_model_to_file(str(path), use_external_data_format=True)
        _consolidate(path)
    return {"method": "MatMulNBits", "bits": 4, "block_size": block_size, "accuracy_level": accuracy_level,
            "symmetric": symmetric}


def slice_wide_matmuls(model, rows: int = SLICE_ROWS) -> int:
    """Split every MatMulNBits of `model` (a ModelProto, edited in place) with more than `rows` output columns
    into slices of `rows` joined by a Concat on the last axis; returns how many were split."""
    from onnx import helper, numpy_helper

    if rows % 64:
        raise ValueError(f"slices of {rows} rows would not start on the kernels' column tiles: use a multiple of 64")
    inits = {t.name: t for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    wide = [n for n in model.graph.node if n.op_type == "MatMulNBits" and len(n.input) <= 4
            and helper.get_attribute_value(next(a for a in n.attribute if a.name == "N")) > rows
            and all(i in inits and uses[i] == 1 for i in n.input[1:] if i)]  # weights of this op alone
    for node in wide:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        N = attrs["N"]
        parts = [numpy_helper.to_array(inits[i]) if i else None for i in node.input[1:]]
        parts = [None if a is None else a.reshape(N, -1) for a in parts]  # per output row: B, scales, zero points
        outs, at = [], list(model.graph.node).index(node)
        for j, lo in enumerate(range(0, N, rows)):
            hi = min(lo + rows, N)
            names = [node.input[0]]
            for i, a in zip(node.input[1:], parts):
                if a is None:
                    names.append("")
                    continue
                init = inits[i]
                shape = [hi - lo] + list(init.dims[1:]) if len(init.dims) > 1 else [(hi - lo) * a.shape[1]]
                names.append(f"{i}_rows{lo}")
                model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(a[lo:hi]).reshape(shape), names[-1]))
            out = f"{node.output[0]}_rows{lo}"
            model.graph.node.insert(at + j, helper.make_node("MatMulNBits", names, [out], name=f"{node.name}_rows{lo}",
                                                             domain=node.domain, **{**attrs, "N": hi - lo}))
            outs.append(out)
        model.graph.node.insert(at + len(outs), helper.make_node("Concat", outs, list(node.output), axis=-1,
                                                                 name=f"{node.name}_concat"))
        model.graph.node.remove(node)
        for i in node.input[1:]:
            if i and i in inits:
                model.graph.initializer.remove(inits.pop(i))
    return len(wide)


def quantize_embedding(model, path: Path, bits: int, block_size: int) -> dict:
    """The input embedding (the Gather of a constant [V, H] table) of `model` (a ModelProto, edited in place;
    read from `path`) as com.microsoft GatherBlockQuantized: weight-only, per block of `block_size` along H;
    a pass reads only the rows of its tokens."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
             and len(inits[n.input[0]].dims) == 2]
    if len(nodes) != 1:
        raise ExportError(f"{path} has {len(nodes)} constant embedding tables, expected one")
    node = nodes[0]
    table = numpy_helper.to_array(inits[node.input[0]])
    if table.shape[1] % block_size:
        raise ExportError(f"embedding width {table.shape[1]} is not a multiple of the block size {block_size}")
    data, scales, zero = quantize_blocks(table, bits, block_size)
    name = node.input[0]
    model.graph.initializer.remove(inits[name])
    model.graph.initializer.extend([numpy_helper.from_array(data, name + "_q"),
                                    numpy_helper.from_array(scales, name + "_scales"),
                                    numpy_helper.from_array(zero, name + "_zero_points")])
    quantized = helper.make_node("GatherBlockQuantized", [name + "_q", node.input[1], name + "_scales", name + "_zero_points"],
                                 list(node.output), name=node.name + "_q", domain="com.microsoft", gather_axis=0,
                                 quantize_axis=1, block_size=block_size, bits=bits)
    at = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    model.graph.node.insert(at, quantized)
    return {"op": "GatherBlockQuantized", "bits": bits, "block_size": block_size, "symmetric": False}
