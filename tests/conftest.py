"""Shared fixtures: tiny pairs exported once per test run.

Every pair here is built from random-weight checkpoints made by `specrt.export.tiny`, exported with
`export_pair`, and loaded with `specrt.load`. Building one takes about a second; each is built once per
session in a `tmp_path_factory` folder. Tests that need to change a pair folder copy it first
(`copy_pair`), so the session fixtures stay pristine.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# 2 shared cores: one thread each for torch (export, reference forwards) and the subprocesses we start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from _helpers import WORDS, export


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("specrt")


@pytest.fixture(scope="session")
def hf_tiny(work) -> dict[str, tuple[Path, Path]]:
    """{"qwen2": (target_dir, draft_dir), "llama": (...)}: Hugging Face folders of the tiny pairs."""
    import torch

    from specrt.export.tiny import make_tiny_pair

    torch.set_num_threads(1)
    return {mt: make_tiny_pair(work / f"hf-{mt}", model_type=mt) for mt in ("qwen2", "llama")}


@pytest.fixture(scope="session")
def hf_families(hf_tiny, work) -> dict[str, tuple[Path, Path]]:
    """hf_tiny and the tiny Qwen3 and Mistral pairs: every family the graph builder writes."""
    from specrt.export.tiny import make_tiny_pair

    return {**hf_tiny, **{mt: make_tiny_pair(work / f"hf-{mt}", model_type=mt) for mt in ("qwen3", "mistral")}}


@pytest.fixture(scope="session")
def torch_models(hf_tiny) -> dict:
    """{(model_type, role): transformers model} of the tiny HF folders, for reference forwards."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return {(mt, role): AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            for mt, folders in hf_tiny.items() for role, folder in zip(("target", "draft"), folders)}


@pytest.fixture(scope="session")
def qwen_dir(work, hf_tiny) -> Path:
    export(*hf_tiny["qwen2"], work / "pair-qwen2")
    return work / "pair-qwen2"


@pytest.fixture(scope="session")
def long_qwen_dir(work, hf_tiny) -> Path:
    """The tiny Qwen2 pair with room for tools in its prompts (its byte-level tokens spell them long)."""
    export(*hf_tiny["qwen2"], work / "pair-qwen2-long", max_len=2048)
    return work / "pair-qwen2-long"


@pytest.fixture(scope="session")
def llama_dir(work, hf_tiny) -> Path:
    export(*hf_tiny["llama"], work / "pair-llama")
    return work / "pair-llama"


@pytest.fixture(scope="session")
def same_dir(work, hf_tiny) -> Path:
    """The tiny Qwen2 target as both draft and target: greedy acceptance must be exactly 1."""
    target = hf_tiny["qwen2"][0]
    export(target, target, work / "pair-same")
    return work / "pair-same"


@pytest.fixture(scope="session")
def stat_dir(work) -> Path:
    """An 11-id word-vocabulary pair whose draft is an unrelated model (partial acceptance)."""
    from specrt.export.tiny import make_model, make_word_tokenizer

    tok = make_word_tokenizer(WORDS)
    make_model(work / "hf-stat" / "target", tok, "qwen2", layers=2, init=0.3, seed=0)
    make_model(work / "hf-stat" / "draft", tok, "qwen2", layers=1, init=0.3, seed=1)
    export(work / "hf-stat" / "target", work / "hf-stat" / "draft", work / "pair-stat", max_len=64, max_draft_len=4)
    return work / "pair-stat"


@pytest.fixture(scope="session")
def int4_dir(work, hf_tiny) -> Path:
    """The tiny Qwen2 pair, int4 weight-only (MatMulNBits) at accuracy_level 0 (fp32 activations)."""
    import logging

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # one INFO line per node otherwise
    export(*hf_tiny["qwen2"], work / "pair-int4", precision="int4", accuracy_level=0)
    return work / "pair-int4"


@pytest.fixture(scope="session")
def int4_default_dir(work, hf_tiny) -> Path:
    """The tiny Qwen2 pair, int4 with the default accuracy level (4: int8 activations)."""
    import logging

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    export(*hf_tiny["qwen2"], work / "pair-int4-default", precision="int4")
    return work / "pair-int4-default"


def _load(d, int4_kernel: str | None = None):
    import specrt
    from specrt.engines.int4 import ENV

    before = os.environ.get(ENV)
    if int4_kernel is not None:
        os.environ[ENV] = int4_kernel
    try:
        pair = specrt.load(d, threads=1)
    finally:
        if int4_kernel is not None:
            os.environ.pop(ENV) if before is None else os.environ.__setitem__(ENV, before)
    yield pair
    pair.close()


@pytest.fixture(scope="session")
def qwen_pair(qwen_dir):
    yield from _load(qwen_dir)


@pytest.fixture(scope="session")
def llama_pair(llama_dir):
    yield from _load(llama_dir)


@pytest.fixture(scope="session")
def same_pair(same_dir):
    yield from _load(same_dir)


@pytest.fixture(scope="session")
def stat_pair(stat_dir):
    yield from _load(stat_dir)


@pytest.fixture(scope="session")
def int4_pair(int4_dir):
    yield from _load(int4_dir)


@pytest.fixture(scope="session")
def int4_default_pair(int4_default_dir):
    yield from _load(int4_default_dir)


@pytest.fixture(scope="session")
def noq_pair(noq_dir):
    yield from _load(noq_dir)


@pytest.fixture(scope="session")
def pairs(qwen_pair, llama_pair) -> dict:
    return {"qwen2": qwen_pair, "llama": llama_pair}


@pytest.fixture(scope="session")
def noq_dir(work, hf_tiny) -> Path:
    """The qwen2 tiny pair as exported for onnxruntime < 1.32 (no GroupQueryAttention query_seqlens)."""
    export(*hf_tiny["qwen2"], work / "pair-noq", query_seqlens=False)
    return work / "pair-noq"


@pytest.fixture(scope="session")
def portable_dir(work, hf_tiny) -> Path:
    """The qwen2 tiny pair as the portable graph (standard ops, fp32): what TensorRT builds from."""
    export(*hf_tiny["qwen2"], work / "pair-portable", portable=True)
    return work / "pair-portable"


@pytest.fixture(scope="session")
def fp16_dir(work, hf_tiny) -> Path:
    """The qwen2 tiny pair in fp16 (the lean graph: onnxruntime's CUDA provider)."""
    export(*hf_tiny["qwen2"], work / "pair-fp16", precision="fp16")
    return work / "pair-fp16"


@pytest.fixture(scope="session")
def fp16_portable_dir(work, hf_tiny) -> Path:
    """The qwen2 tiny pair as fp16 portable graphs (what TensorRT builds from); its KV slots are 64 bytes."""
    export(*hf_tiny["qwen2"], work / "pair-fp16-portable", precision="fp16", portable=True)
    return work / "pair-fp16-portable"


@pytest.fixture(scope="session")
def trt_dir(work) -> Path:
    """fp16 portable graphs of a tiny pair with 256-byte KV slots (2 KV heads x head_dim 64 x 2 bytes), the
    alignment TensorRT's tensor addresses need."""
    from specrt.export.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    src = work / "hf-trt"
    target = make_model(src / "target", tok, "qwen2", layers=2, hidden=128, heads=2, kv_heads=2, vocab_size=384)
    make_model(src / "draft", tok, "qwen2", layers=1, hidden=128, heads=2, kv_heads=2, vocab_size=384, seed=1,
               donor=target)
    export(src / "target", src / "draft", work / "pair-trt", precision="fp16", portable=True, max_len=128)
    return work / "pair-trt"
