"""Engine selection: which device a pair runs on, and the engine of each model there (a batch of rows
included)."""
from __future__ import annotations

from specrt.engines import ort, trt
from specrt.errors import ConfigError, PairError

# Prompts are read in chunks of this many tokens from position 0, which is also the unit in which a prompt's
# prefix is kept across requests (decoding/prefix.py). CPU: 64 reads a prompt ~3% slower than 128 (int4 pair,
# 15 prompts of 46-1642 tokens) and keeps a job's shared instruction (bench/prompts/repetitive.jsonl shares
# 89 tokens: 64 kept, none at 128); a 1024-token prompt in one pass would take 16x a chunk's activations.
# On a GPU wider passes are cheaper per token: not measured, a larger chunk.
PREFILL_CHUNK = {"cpu": 64, "cuda": 512}


DEVICES = ("auto", "cpu", "cuda", "tensorrt")


def resolve_device(requested: str, m, pair_dir) -> tuple[str, str | None]:
    """The device a pair runs on, and a note when "auto" stays on the CPU although the pair is made for a GPU.

    auto: TensorRT when the pair has engines and TensorRT loads, else onnxruntime's CUDA provider when the
    graphs can run there (fp16 activations) and a CUDA device is visible, else the CPU. An explicit device
    that cannot work is a ConfigError/PairError with the reason, never a silent fallback."""
    if requested not in DEVICES:
        raise ConfigError(f"unknown device {requested!r}; choose one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu", None
    if requested == "tensorrt":
        if not m.engines:
            raise PairError(f"{pair_dir} has no TensorRT engines; build them with `specrt build-engines {pair_dir}` "
                            "(an fp16 pair: `specrt export --precision fp16 --engine tensorrt`)")
        return "tensorrt", None
    if requested == "auto" and not m.for_gpu and not m.engines:
        return "cpu", None  # a CPU pair: nothing to look for, nothing to note
    why = ort.cuda_available()
    if requested == "cuda":
        if why:
            raise PairError(f"cannot run on cuda: {why}")
        if not m.for_gpu:
            old = any(e.graph == "contrib" for e in m.entries())
            raise PairError(f"{pair_dir} was exported for the CPU ("
                            + ("onnxruntime CPU ops of an older specrt" if old else
                               "fp32 activations, and GroupQueryAttention has no fp32 CUDA kernel")
                            + "); export it with --precision fp16, or --precision int4 --activations fp16, for a GPU")
        return "cuda", None
    if m.engines and not why:
        try:
            import tensorrt  # noqa: F401 - optional (NVIDIA's): does it load here
            return "tensorrt", None
        except ImportError:
            pass
    if m.for_gpu and not why:
        return "cuda", None
    return "cpu", f"running on the CPU: this pair is made for a GPU, but {why or 'TensorRT is not installed'}"


def open_engine(pair_dir, m, role: str, max_logits: int, threads, device: str):
    """The engine of model `role` ("target" or "draft") of a pair on a resolved `device`."""
    entry = getattr(m, role)
    if device == "tensorrt":
        return trt.TrtEngine(pair_dir, entry, role, m, max_logits)
    # a pass of up to max_draft_len + 1 tokens is decoding (verify widths, draft steps and catch-ups): captured
    return ort.ort_engine(pair_dir, entry, m.max_len, max_logits, threads=threads, device=device,
                          capture_width=m.max_draft_len + 1, prefill_chunk=PREFILL_CHUNK[device])


def batch_engine(pair_dir, base, cache_len: int, max_logits: int, batch: int):
    """A lean engine of batch `batch` with its own caches over the loaded session of engine `base`."""
    if not isinstance(base, ort.LeanEngine):
        kind = {"portable": "standard-op (TensorRT) graphs", "contrib": "graphs of an older specrt"}.get(
            base.entry.graph, f"{base.entry.graph} graphs")
        where = "TensorRT engines run one sequence" if getattr(base, "device", "") == "tensorrt" else f"this pair has {kind}"
        raise ConfigError(f"batched decoding runs on the lean onnxruntime graph, and {where}; "
                          "re-export the pair with this specrt (without --engine tensorrt), or use --batch-size 1")
    return ort.LeanEngine(pair_dir, base.entry, cache_len, max_logits, batch=batch, session=base.session,
                          device=base.device, device_id=base.device_id, cuda_graph=base.captures,
                          capture_width=base.capture_width, prefill_chunk=base.prefill_chunk, kernel=base.kernel)
