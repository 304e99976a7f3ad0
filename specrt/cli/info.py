"""`specrt info`: what a pair folder holds, its memory against this machine or a board (apps/info.py)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.common import BadInput, errors


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--budget", default=None, metavar="BOARD|BYTES",
              help="Check the pair against a board's memory (orin-nano-8gb, orin-nx-16gb, agx-orin-64gb; the OS's "
                   "and the CUDA context's share assumed taken) or a number of bytes for specrt.")
@click.option("--measure", "do_measure", is_flag=True,
              help="Also load the pair and run a 128-token generation: the measured peak memory beside the estimate.")
@click.option("--no-draft-model", "lone", is_flag=True,
              help="With --measure: measure the target alone (drafting by prompt lookup), as `generate --drafter suffix` runs.")
@errors
def info(pair_dir, as_json, budget, do_measure, lone):
    """Show a pair folder: models, sizes, estimated memory, limits, tuned settings, engines.

    The pair's files are checked too (hashes, graphs, tokenizer): exit code 1 and one `problem:` line each
    if anything is wrong, 2 if the folder cannot be read as a pair at all."""
    from specrt.apps.info import measure, pair_info
    from specrt.api.memory import fmt

    if lone and not do_measure:
        raise BadInput("--no-draft-model applies to --measure (the estimate without the draft model is always shown)")
    d = pair_info(pair_dir, budget)
    if d["problems"]:  # a damaged pair: what is wrong, and no measurement
        if as_json or "models" in d:  # without "models": a manifest whose values cannot be shown
            click.echo(json.dumps(d, indent=2) if as_json else format_info(d))
        if not as_json:
            for p in d["problems"]:
                click.echo(f"problem: {p}")
            click.echo(f"{pair_dir} is damaged ({len(d['problems'])} problem(s)); re-export the pair")
        raise SystemExit(1)
    if do_measure:
        d["measured"] = meas = measure(pair_dir, draft_model=not lone)
    click.echo(json.dumps(d, indent=2) if as_json else format_info(d))
    if do_measure and not as_json:
        what = "" if meas["draft_model"] else " (the target alone)"
        click.echo(f"measured:  peak resident memory {fmt(meas['peak_rss'])} after a {meas['new_tokens']}-token "
                   f"generation{what}; the estimate for its {meas['tokens']} cache positions: {fmt(meas['estimate'])} "
                   f"({meas['ratio'] - 1:+.0%})")


def _quant_text(q: dict | None) -> str:
    if not q:
        return "none"
    parts = [f"{q.get('method', '?')} {q.get('bits', '?')}-bit"]
    if "block_size" in q:
        parts.append(f"block {q['block_size']}")
    if "accuracy_level" in q:
        parts.append(f"accuracy level {q['accuracy_level']}")
    if "symmetric" in q:
        parts.append("symmetric" if q["symmetric"] else "asymmetric")
    return ", ".join(parts)


def format_info(d: dict) -> str:
    from specrt.api.memory import fmt

    lines = [f"pair:      {d['pair']}  ({d['format']} v{d['format_version']}, created by {d['created_by'] or '?'})",
             f"vocab:     {d['vocab_size']} ids, EOS {d['eos_token_ids']}",
             f"max_len:   {d['max_len']} tokens (prompt + output + draft_len + 1; fixed at export)",
             f"max_draft_len: {d['max_draft_len']}",
             f"tokenizer: {', '.join(d['tokenizer_files'])}"]
    for role in ("target", "draft"):
        e = d["models"].get(role)
        if e is None:
            lines.append(f"{role + ':':<11}none (target-only pair: the n-gram drafter proposes)")
            continue
        lines.append(f"{role + ':':<11}{e['model_type']} from {e['source']}")
        emb = e.get("embedding")
        lines.append(f"           precision {e['precision']} ({e['dtype']} activations/KV), quantization "
                     f"{_quant_text(e['quantization'])}"
                     + (f"; embeddings {emb['bits']}-bit, block {emb['block_size']}" if emb else ""))
        lines.append(f"           {e['layers']} layers, {e['kv_heads']} KV heads x head_dim {e['head_dim']}, "
                     f"logits {e['logits_width']} wide; {fmt(e['size_bytes'])} on disk")
        graph = {"lean": "lean (fused onnxruntime ops, caches read and written in place)",
                 "portable": "portable (standard ops, for TensorRT)",
                 "contrib": "exported by an older specrt: re-export for the lean graph (faster, and batches)"}
        lines.append(f"           graph {graph.get(e['graph'], e['graph'])}")
        if e.get("int4_kernel"):
            lines.append(f"           kernels on the CPU: {e['int4_kernel']['describe']}")
            k = e["int4_kernel"]
            if role == "target" and k.get("invariant"):  # what exact rows buy (docs/kernel.md)
                lines.append("           rows exact: a token's logits are the same in any pass; a request keeps "
                             "every token it shares with the previous one")
            elif role == "target" and k.get("total"):  # what is lost without them (docs/kernel.md)
                lines.append("           specrt's kernels are off: wide passes (verify, batches, prompts) cost more "
                             "per row; rows are not exact, so greedy speculative equals target-only only up to "
                             "near-ties, and a request reuses a shared prompt prefix in whole chunks only")
            if role == "target":  # what a round may verify here (decoding/tree.py)
                lines.append("           trees: a round may verify a tree of drafts (--tree auto)" if k.get("trees") else
                             f"           trees: no, rounds verify chains ({k.get('trees_why') or 'no tree input'})")
        elif role == "target":
            lines.append("           trees: no, rounds verify chains (only specrt's attention on the CPU takes trees)")
    mem = d["memory"]
    per = sum(mem["kv_bytes_per_token"].values())
    lines.append(f"memory:    about {fmt(mem['total'])} to load (estimate)")
    for role in d["models"]:
        lines.append(f"           {role}: weights {fmt(mem['weights'][role])}, KV cache {fmt(mem['kv_cache'][role])}, "
                     f"logits {fmt(mem['logits'][role])}")
    lines.append(f"           workspace {fmt(mem['workspace'])} (Python, onnxruntime, the tokenizer, sessions, "
                 f"activations); KV {per / 1024:.1f} KB per token of max_len")
    if mem.get("without_draft") is not None:
        lines.append(f"           without the draft model: about {fmt(mem['without_draft'])} (drafters ngram and "
                     "suffix; `generate --drafter suffix` and `serve --no-draft-model` leave it out)")
    if mem["available"] is None:
        lines.append("           available: unknown (no /proc/meminfo); not checked")
    elif mem["fits"]:
        lines.append(f"           available: {fmt(mem['available'])}: fits")
    else:
        hint = (f"re-export with --max-len {mem['max_len_that_fits']}" if mem["max_len_that_fits"]
                else "the weights alone do not fit")
        lines.append(f"           available: {fmt(mem['available'])}: DOES NOT FIT ({hint})")
    b = d.get("budget")
    if b is not None:
        kept = (f", {fmt(b['os_reserve'])} assumed kept by the OS" if b["os_reserve"] else "") + \
               (f" and {fmt(b['cuda_context'])} by the CUDA context" if b["cuda_context"] else "")
        verdict = "fits" if b["fits"] else (
            f"DOES NOT FIT (re-export with --max-len {b['max_len_that_fits']})" if b["max_len_that_fits"]
            else "DOES NOT FIT (the weights alone do not fit)")
        if not b["fits"] and b.get("fits_without_draft"):
            verdict += "; fits without the draft model (drafters ngram and suffix)"
        lines.append(f"budget:    {b['name']}: {fmt(b['total'])}{kept}, {fmt(b['for_specrt'])} for specrt: {verdict}")
    if plain := [r for r, e in d["models"].items() if e["precision"] == "int4" and not e.get("embedding")]:
        lines.append(f"           the {' and '.join(plain)} embeddings are not quantized (exported by an older specrt): "
                     "a re-export stores them in int4, about half the pair's size on disk")
    t = d["tuned"]
    if t is None:
        df = d["defaults"]
        lines.append(f"tuned:     no (a request gets: drafter {df['drafter']}, draft_len {df['draft_len']}); "
                     "run `specrt tune` on this machine")
    else:
        meas = t.get("measured") or {}
        speed = f"{meas['tokens_per_s']:.1f} tok/s" if meas.get("tokens_per_s") is not None else "speed not recorded"
        if meas.get("speedup"):
            speed += f", {meas['speedup']:.2f}x target-only"
        where = ", ".join(str(meas[k]) for k in ("date", "machine") if meas.get(k))
        lines.append(f"tuned:     drafter {t['drafter']}, draft_len {t['draft_len']}, confidence_stop "
                     f"{t['confidence_stop']}: {speed}" + (f" (measured {where})" if where else ""))
        if t["stale"]:
            lines.append("           STALE: measured on other graphs; loading refuses it until `specrt tune` runs again")
    for e in d["engines"]:
        lines.append(f"engines:   {e['name']} {e['version'] or '(not installed)'}, {e['provider']}: {e['note']}")
    return "\n".join(lines)
