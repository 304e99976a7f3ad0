"""`specrt export`: a draft and a target checkpoint become one ONNX pair folder (export/pair.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from specrt.cli.common import errors, log

DEFAULT_DRAFT_VOCAB = 49152  # --draft-vocab for a pair with a draft (README: faster draft steps, same output)


@click.command()
@click.option("--target", required=True, help="Target model: Hugging Face folder, .gguf file, known name or hub id.")
@click.option("--draft", default=None,
              help="Draft model: same kinds of source as --target, same tokenizer (omit for an n-gram-only pair).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Pair folder to create.")
@click.option("--precision", type=click.Choice(["fp32", "int4", "fp16"]), default="fp32", show_default=True,
              help="Weights: fp32; int4 weight-only (MatMulNBits) for CPUs and edge boards; fp16 for GPUs.")
@click.option("--activations", type=click.Choice(["fp32", "fp16"]), default=None,
              help="Activations and KV caches (default: fp16 for --precision fp16, else fp32). fp16 runs on "
                   "onnxruntime's CUDA provider; --precision int4 --activations fp16 is int4 for an edge GPU.")
@click.option("--portable", is_flag=True,
              help="The standard-op graph TensorRT builds from (implied by --engine tensorrt) instead of the "
                   "lean onnxruntime graph. It is traced through torch, as --trace: the whole model in memory.")
@click.option("--trace", is_flag=True,
              help="Trace the model through torch (the older exporter: needs torch, about 4x the fp32 weights in "
                   "memory) instead of writing the lean graph layer by layer; for models the graph builder refuses.")
@click.option("--dry-run", "dry_run", is_flag=True,
              help="Print the models' sizes and the memory and disk the export needs, and stop (known model "
                   "names are fetched first).")
@click.option("--no-query-seqlens", "no_query_seqlens", is_flag=True,
              help="Lean graphs for onnxruntime < 1.32 (onnxruntime-gpu 1.31, say): batched multi-token passes "
                   "then run row by row. Default: whatever the onnxruntime exporting supports.")
@click.option("--engine", type=click.Choice(["none", "tensorrt"]), default="none", show_default=True,
              help="tensorrt: also build TensorRT engines (prefill, verify and step profiles) on this machine's GPU.")
@click.option("--prefill-chunk", type=int, default=256, show_default=True,
              help="tensorrt: widest prefill chunk of the engines' profile; longer prompts are run in chunks.")
@click.option("--max-draft-len", type=int, default=8, show_default=True, help="Most draft tokens per round.")
@click.option("--max-len", type=int, default=2048, show_default=True, help="KV cache length (prompt + output).")
@click.option("--block-size", type=int, default=128, show_default=True, help="int4: weights per quantization block.")
@click.option("--accuracy-level", type=int, default=4, show_default=True,
              help="int4: MatMulNBits compute, 4 = int8 activations (fast), 0 = fp32 (one-token and verify passes agree to ~1e-5).")
@click.option("--embedding-bits", type=click.Choice(["0", "4", "8"]), default=None,
              help="Input embeddings weight-only (GatherBlockQuantized): 4 or 8 bits, 0 = as they are "
                   "(default: 4 for --precision int4, else 0).")
@click.option("--embedding-block-size", type=int, default=32, show_default=True,
              help="Embedding values per quantization block.")
@click.option("--asymmetric/--symmetric", default=True, show_default=True,
              help="int4: a 4-bit zero point per block as well as a scale (closer to the weights, same speed).")
@click.option("--overwrite", is_flag=True,
              help="Replace --out if it holds a pair (a folder holding anything else is never replaced).")
@click.option("--quiet", is_flag=True,
              help="No progress lines or bars (shown only when stderr is a terminal); the other messages stay.")
@click.option("--draft-vocab", type=int, default=None,
              help=f"Keep only the N most frequent token ids in the draft's output matrix (0 = all; default: "
                   f"{DEFAULT_DRAFT_VOCAB} with a --draft, all of them if the vocabulary is no larger); a cheaper "
                   "draft step, still exact sampling.")
@click.option("--draft-vocab-text", "draft_vocab_texts", type=click.Path(path_type=Path), multiple=True,
              help="Calibration text for --draft-vocab (repeatable; default: Python's standard library sources).")
@errors
def export(target, draft, out, precision, activations, portable, trace, dry_run, no_query_seqlens, engine, prefill_chunk, max_draft_len,
           max_len, block_size, accuracy_level, embedding_bits, embedding_block_size, asymmetric, draft_vocab,
           draft_vocab_texts, overwrite, quiet):
    """Export a draft and a target checkpoint to one ONNX pair folder."""
    from specrt.export.pair import ExportConfig, dry_run as plan, export_pair
    from specrt.export.progress import Progress

    if draft_vocab is None:
        draft_vocab = DEFAULT_DRAFT_VOCAB if draft else 0
    cfg = ExportConfig(target=target, draft=draft, out=out, precision=precision, max_len=max_len,
                       max_draft_len=max_draft_len, block_size=block_size, accuracy_level=accuracy_level,
                       symmetric=not asymmetric, draft_vocab=draft_vocab, draft_vocab_texts=tuple(draft_vocab_texts),
                       portable=portable, trace=trace, engine=engine, prefill_chunk=prefill_chunk, overwrite=overwrite,
                       activations=activations or "", query_seqlens=False if no_query_seqlens else None,
                       embedding_bits=None if embedding_bits is None else int(embedding_bits),
                       embedding_block_size=embedding_block_size)
    progress = Progress(None if quiet or not sys.stderr.isatty() else sys.stderr)
    if dry_run:
        plan(cfg, log=click.echo, progress=progress)  # the answer: stdout
        return
    m = export_pair(cfg, log=log, progress=progress)
    click.echo(f"wrote {out} (vocab {m.vocab_size}, max_len {m.max_len}, max_draft_len {m.max_draft_len})", err=True)
