"""Building TensorRT engines from a pair's portable graphs (`specrt export --engine tensorrt`,
`specrt build-engines`): what TensorRT's ONNX parser takes, one engine per model with the shape profiles
of engines/trt.py, the plans' hashes into the manifest. UNVERIFIED ON HARDWARE (see engines/trt.py)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specrt.engines import trt as engines_trt
from specrt.errors import ExportError
from specrt.export.progress import QUIET, Progress, hash_files
from specrt.manifest import Manifest

# TensorRT's ONNX parser: the operators it takes and the types of their data input, from onnx-tensorrt's
# docs/operators.md (the TensorRT 8.5 matrix: newer releases accept more, so a graph passing this check
# parses on the TensorRT of JetPack 6 and later). INT64 tensors count as INT32: the parser casts them down.
# Only the operators a traced Llama-family graph can contain are listed; anything else is reported.
_F, _I, _B = ("FP32", "FP16"), ("INT32",), ("BOOL",)
PARSER_TYPES = {
    "Add": _F + _I, "And": _B, "Cast": _F + _I + ("INT8",) + _B, "Concat": _F + _I + ("INT8",) + _B,
    "Constant": _F + _I + ("INT8",) + _B, "ConstantOfShape": ("FP32",), "Cos": _F, "CumSum": _F, "Div": _F + _I,
    "Equal": _F + _I, "Expand": _F + _I + _B, "Gather": _F + ("INT8",) + _I + _B, "Greater": _F + _I,
    "GreaterOrEqual": _F + _I, "Identity": _F + _I + ("INT8",) + _B, "Less": _F + _I, "LessOrEqual": _F + _I,
    "MatMul": _F, "Max": _F + _I, "Min": _F + _I, "Mul": _F + _I, "Neg": _F + _I, "Not": _B, "Or": _B, "Pow": _F,
    "Range": _F + _I, "Reciprocal": _F, "ReduceMax": _F, "ReduceMean": _F, "ReduceSum": _F, "Reshape": _F + _I + ("INT8",) + _B,
    "Shape": _F + _I + ("INT8",) + _B, "Sigmoid": _F + ("INT8",), "Sin": _F, "Slice": _F + _I + ("INT8",) + _B,
    "Softmax": _F, "Split": _F + _I + _B, "Sqrt": _F, "Squeeze": _F + _I + ("INT8",) + _B, "Sub": _F + _I,
    "Tanh": _F + ("INT8",), "Tile": _F + _I + _B, "Transpose": _F + _I + ("INT8",) + _B, "Trilu": _F + _I + ("INT8",) + _B,
    "Unsqueeze": _F + _I + ("INT8",) + _B, "Where": _F + _I + _B,
}


def check_parser_support(onnx_path) -> list[str]:
    """What in this graph TensorRT's ONNX parser refuses (PARSER_TYPES): one line per problem, [] if none.
    Checked statically, with onnx's type inference, since no machine here has TensorRT."""
    import onnx

    proto = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_path), load_external_data=False))
    g = proto.graph
    names = {0: "UNDEFINED", 1: "FP32", 10: "FP16", 16: "BF16", 6: "INT32", 7: "INT32", 3: "INT8", 2: "UINT8", 9: "BOOL",
             11: "DOUBLE"}
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    problems = []
    for n in g.node:
        if n.domain not in ("", "ai.onnx"):
            problems.append(f"{n.op_type} ({n.domain}) is not an ONNX operator")
            continue
        if n.op_type not in PARSER_TYPES:
            problems.append(f"{n.op_type} is not in the parser's operator table")
            continue
        # the tensor whose type the table gives: Where's branches, what ConstantOfShape/Constant make, else input 0
        data = {"Where": n.input[1:2], "ConstantOfShape": n.output[:1], "Constant": n.output[:1]}.get(
            n.op_type, n.input[:1])
        data = data[0] if data else n.output[0]
        t = names.get(types.get(data, 0), "UNDEFINED")
        if t not in PARSER_TYPES[n.op_type]:
            problems.append(f"{n.op_type} on {t} ({n.name or data}): the parser takes {', '.join(PARSER_TYPES[n.op_type])}")
    return problems


def build_pair_engines(pair_dir, manifest: Manifest, prefill_chunk: int = 256, log=print,
                       workspace: int = 2 << 30, progress: Progress = QUIET) -> Manifest:
    """Build one engine per model of a portable pair into its folder; return the manifest with "engines"."""
    trt = engines_trt.require_tensorrt()
    pair_dir = Path(pair_dir)
    entries = {"target": manifest.target} | ({"draft": manifest.draft} if manifest.draft else {})
    for role, e in entries.items():
        if not e.portable:
            raise ExportError(f"the {role} graph uses onnxruntime contrib ops, which TensorRT cannot parse; "
                              "export with --precision fp16 --engine tensorrt")
        engines_trt.check_alignment(e, role, ExportError)
        problems = check_parser_support(pair_dir / e.path)
        if problems:
            raise ExportError(f"TensorRT's ONNX parser would refuse the {role} graph: {'; '.join(problems[:3])}")
    capability, device = engines_trt.gpu_identity()
    cache_path = pair_dir / "timing.cache"
    meta = {"tensorrt_version": trt.__version__, "compute_capability": capability, "device_name": device,
            "prefill_chunk": prefill_chunk}
    for role, e in entries.items():
        profs = engines_trt.profiles(e, role, manifest.max_len, manifest.max_draft_len, prefill_chunk)
        plan = pair_dir / role / "model.plan"
        log(f"building the {role} TensorRT engine ({', '.join(p['name'] for p in profs)} profiles) ...")
        with progress.of(role).step("building the engine"):
            build_engine(trt, pair_dir / e.path, profs, plan, cache_path, workspace, tf32=e.dtype != "float32")
        digest, = hash_files([plan], progress.of(role))
        meta[role] = {"plan": f"{role}/model.plan", "sha256": digest, "profiles": profs}
    return replace(manifest, engines=meta)


def build_engine(trt, onnx_path: Path, profs: list[dict], plan_path: Path, cache_path: Path, workspace: int,
                 tf32: bool = True) -> None:
    """ONNX -> serialized engine: strongly typed (fp16 comes from the graph), one optimization profile
    per entry of `profs`, a timing cache shared by the pair's builds. `tf32=False` (fp32 graphs): fp32
    matmuls stay fp32, as the CUDA path keeps them (engines/ort._cuda_provider)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads the external weights beside the graph
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT cannot parse {onnx_path}: {errs[:500]}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    if not tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    for p in profs:
        missing = names - set(p["shapes"])
        if missing:
            raise ExportError(f"profile {p['name']} lacks shapes for {sorted(missing)}")
        prof = builder.create_optimization_profile()
        for name in sorted(names):
            lo, opt, hi = (tuple(s) for s in p["shapes"][name])
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build an engine from {onnx_path} (see its log above)")
    plan_path.write_bytes(bytes(serialized))
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
