"""`specrt info` and `specrt check`: what a pair folder holds, and whether it is lossless here.

Registered on the `specrt` group by specrt/cli.py. Heavy imports happen inside the commands.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from specrt.cli_device import device_option, load_pair


def _errors(fn):
    """specrt.cli's `_errors` (bad input: one `Error:` line, exit code 2), looked up when the command
    runs. specrt.cli imports this module to register the commands, so importing it here at import
    time would be circular (`python -m specrt.cli`, or this module imported first)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from specrt.cli import _errors as cli_errors

        return cli_errors(fn)(*a, **kw)

    return wrapper

BUILTIN_PROMPTS = (
    "def quicksort(xs):",
    "def fib(n):\n    ",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
)


# ---------------------------------------------------------------- info


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


def pair_info(pair_dir: Path, budget: str | None = None) -> dict:
    """Everything `specrt info` shows, as a JSON-able dict. Reads the manifest and file sizes only.
    `budget`: a board name or a number of bytes (runtime/memory.parse_budget) to check the pair against."""
    from specrt.config import read_manifest
    from specrt.errors import PairError
    from specrt.runtime import memory

    m = read_manifest(pair_dir)
    for e in (m.target, m.draft):
        for name in e.files if e is not None else ():
            if not (Path(pair_dir) / name).is_file():
                raise PairError(f"missing graph file {Path(pair_dir) / name} (listed in the manifest)")
    est = memory.estimate(pair_dir, m)
    avail = memory.available_bytes()
    models = {}
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            continue
        models[role] = {
            "source": e.source, "model_type": e.model_type, "precision": e.precision, "dtype": e.dtype,
            "quantization": e.quantization, "layers": e.num_layers, "kv_heads": e.num_kv_heads,
            "head_dim": e.head_dim, "logits_width": e.logits_width, "size_bytes": memory.graph_bytes(pair_dir, e),
            "files": sorted(e.files), "graph": e.graph, "kv_layout": e.kv_layout, "embedding": e.embedding,
        }
    tuned = None
    if m.tuned:
        t = m.tuned
        tuned = {k: t.get(k) for k in ("drafter", "draft_len", "confidence_stop", "acceptance", "costs", "measured")}
        tuned["stale"] = t.get("graphs") != m.graph_hashes()
    try:
        import onnxruntime as ort

        ort_version = ort.__version__
    except ImportError:  # pragma: no cover - a runtime dependency
        ort_version = None
    fits = None if avail is None else est.total <= avail
    board = None
    if budget is not None:
        name, total, reserve = memory.parse_budget(budget)
        cuda = memory.CUDA_CONTEXT if (m.for_gpu and reserve) else 0
        room = total - reserve - cuda
        board = {"name": name, "total": total, "os_reserve": reserve, "cuda_context": cuda, "for_specrt": room,
                 "needs": est.total, "fits": est.total <= room,
                 "max_len_that_fits": est.max_len_that_fits(room) if est.total > room else None}
    return {
        "pair": str(pair_dir), "format": m.format, "format_version": m.format_version, "created_by": m.created_by,
        "vocab_size": m.vocab_size, "eos_token_ids": list(m.eos_token_ids), "max_len": m.max_len,
        "max_draft_len": m.max_draft_len, "kv_layout": m.kv_layout, "tokenizer_files": list(m.tokenizer_files),
        "models": models,
        "memory": {**est.as_dict(), "available": avail, "fits": fits,
                   "max_len_that_fits": est.max_len_that_fits(avail) if fits is False else None},
        "budget": board,
        "tuned": tuned,
        "engines": _engines(m, ort_version),
    }


def _engines(m, ort_version) -> list[dict]:
    """What can run this pair here: onnxruntime CPU always, CUDA for a pair with fp16 activations, TensorRT engines."""
    from specrt.engines.ort import cuda_available

    why = cuda_available() if ort_version else "onnxruntime is not installed"
    gpu = "" if m.for_gpu else ("; this pair's graphs run on the CPU only (fp32 activations, or an older specrt's "
                                "CPU ops): export with --precision fp16 (or int4 --activations fp16) for a GPU")
    out = [{"name": "onnxruntime", "version": ort_version, "provider": "CPUExecutionProvider",
            "note": "runs every pair (--device cpu)"},
           {"name": "onnxruntime", "version": ort_version, "provider": "CUDAExecutionProvider",
            "note": (why or "available") + gpu}]
    try:
        import tensorrt

        trt_version = tensorrt.__version__
    except ImportError:
        trt_version = None
    if m.engines:
        built = f"engines built for TensorRT {m.engines.get('tensorrt_version')} on compute capability " \
                f"{m.engines.get('compute_capability')} (unverified on hardware)"
    else:
        built = "no engines in this pair (specrt build-engines)"
    out.append({"name": "tensorrt", "version": trt_version, "provider": "native", "note": built})
    return out


def format_info(d: dict) -> str:
    from specrt.runtime.memory import fmt

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
    mem = d["memory"]
    per = sum(mem["kv_bytes_per_token"].values())
    lines.append(f"memory:    about {fmt(mem['total'])} to load (estimate)")
    for role in d["models"]:
        lines.append(f"           {role}: weights {fmt(mem['weights'][role])}, KV cache {fmt(mem['kv_cache'][role])}, "
                     f"logits {fmt(mem['logits'][role])}")
    lines.append(f"           workspace {fmt(mem['workspace'])} (Python, onnxruntime, the tokenizer, sessions, "
                 f"activations); KV {per / 1024:.1f} KB per token of max_len")
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
        lines.append(f"budget:    {b['name']}: {fmt(b['total'])}{kept}, {fmt(b['for_specrt'])} for specrt: {verdict}")
    if plain := [r for r, e in d["models"].items() if e["precision"] == "int4" and not e.get("embedding")]:
        lines.append(f"           the {' and '.join(plain)} embeddings are not quantized (exported by an older specrt): "
                     "a re-export stores them in int4, about half the pair's size on disk")
    t = d["tuned"]
    if t is None:
        lines.append("tuned:     no (defaults: drafter model or ngram, draft_len auto); run `specrt tune` on this machine")
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


def measure(pair_dir: Path, max_new_tokens: int = 128) -> dict:
    """Load the pair on the CPU and run one greedy generation of a built-in chat prompt: this process's peak
    resident memory afterwards, beside the estimate for the same number of cache positions."""
    import resource

    from specrt.runtime import memory
    from specrt.runtime.pair import load

    with load(pair_dir, device="cpu") as pair:
        res = pair.generate("Write a Python function is_palindrome(s) that ignores case, spaces and punctuation, "
                            "with a short docstring.", chat=True, max_new_tokens=max_new_tokens, draft_len=2)
        tokens = res.stats["prompt_tokens"] + res.stats["new_tokens"] + pair.manifest.max_draft_len + 1
        est = memory.estimate(pair_dir, pair.manifest, tokens=tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"peak_rss": peak, "estimate": est.total, "tokens": tokens, "new_tokens": res.stats["new_tokens"],
            "ratio": est.total / peak}


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--budget", default=None, metavar="BOARD|BYTES",
              help="Check the pair against a board's memory (orin-nano-8gb, orin-nx-16gb, agx-orin-64gb; the OS's "
                   "and the CUDA context's share assumed taken) or a number of bytes for specrt.")
@click.option("--measure", "do_measure", is_flag=True,
              help="Also load the pair and run a 128-token generation: the measured peak memory beside the estimate.")
@_errors
def info(pair_dir, as_json, budget, do_measure):
    """Show a pair folder: models, sizes, estimated memory, limits, tuned settings, engines."""
    from specrt.runtime.memory import fmt

    d = pair_info(pair_dir, budget)
    if do_measure:
        d["measured"] = meas = measure(pair_dir)
    click.echo(json.dumps(d, indent=2) if as_json else format_info(d))
    if do_measure and not as_json:
        click.echo(f"measured:  peak resident memory {fmt(meas['peak_rss'])} after a {meas['new_tokens']}-token "
                   f"generation; the estimate for its {meas['tokens']} cache positions: {fmt(meas['estimate'])} "
                   f"({meas['ratio'] - 1:+.0%})")


# ---------------------------------------------------------------- check


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), default=None,
              help="JSONL prompts in the bench format (default: a few built-in short prompts).")
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Tokens per greedy comparison.")
@click.option("--draft-len", type=int, default=4, show_default=True, help="Draft length of the speculative run.")
@click.option("--samples", type=int, default=400, show_default=True,
              help="Sampled generations for the statistical test (0 = skip it).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@device_option
@_errors
def check(pair_dir, device, prompts, max_new_tokens, draft_len, samples, limit, as_json):
    """Check losslessness on this machine: greedy speculative == target-only, and a sampling test.

    Per prompt, greedy speculative and greedy target-only decoding run side by side; where they
    differ, the target's logit margin between the two tokens says whether numerics explain it
    (a near-tie) or not (BUG). Then the second token of SAMPLES speculative samples (temperature 1)
    is tested against its exact distribution under the target (chi-square, fails below p = 1e-4).
    Exit code 1 if anything failed, 0 if all is well, 2 on bad input.
    """
    from specrt.config import GenerationConfig
    from specrt.errors import ConfigError
    from specrt.runtime import check as chk
    from specrt.runtime.bench import Prompt, read_prompts

    if draft_len < 1:
        raise ConfigError(f"--draft-len must be >= 1 (0 would compare target-only with itself), got {draft_len}")
    if samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {samples}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    with load_pair(pair_dir, device) as pair:
        drafter = "model" if pair.draft is not None else "ngram"
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len, drafter=drafter)
        if prompts is not None:
            plist = read_prompts(prompts, pair, limit)
        else:
            plist = [Prompt(str(i), pair.encode(p), "builtin") for i, p in enumerate(BUILTIN_PROMPTS, 1)][:limit]
        for p in plist:  # every bad setting is reported before anything runs
            try:
                pair._check_request(p.ids, cfg)
            except ConfigError as e:
                raise ConfigError(f"prompt {p.id}: {e}") from None
        threshold, why = chk.noise_threshold(pair.manifest.target)
        out = {"pair": str(pair_dir), "draft_len": draft_len, "drafter": drafter, "max_new_tokens": max_new_tokens,
               "threshold": threshold, "numerics": why, "prompts": [], "sampling": None}
        say = (lambda s: None) if as_json else (lambda s: click.echo(s))
        say(f"greedy speculative (drafter {drafter}, draft_len {draft_len}) vs greedy target-only, "
            f"{max_new_tokens} tokens; near-tie threshold {threshold} ({why})")
        for p in plist:
            d = chk.first_divergence(pair, p.ids, max_new_tokens, draft_len, drafter)
            verdict = chk.classify(d, pair.manifest.target)
            out["prompts"].append({"id": p.id, "verdict": verdict, "index": d["index"], "margin": d["margin"],
                                   "tokens": len(d["target_only"])})
            label = f"prompt {p.id}: "
            if verdict == "equal":
                say(label + f"equal ({len(d['target_only'])} tokens)")
            else:
                margin = "unknown" if d["margin"] is None else f"{d['margin']:.3g}"
                say(label + f"differs at token {d['index']}, target logit margin {margin}: {verdict}")
        if samples:
            k = min(2, pair.manifest.max_draft_len)
            say(f"sampling: {samples} speculative samples of prompt {plist[0].id} (temperature 1, drafter {drafter}, "
                f"draft_len {k}), second token vs the target's exact distribution ...")
            s = chk.second_token_test(pair, plist[0].ids, samples=samples, draft_len=k, drafter=drafter)
            out["sampling"] = {"prompt": plist[0].id, **s}
            say(f"sampling: chi-square {s['chi2']:.2f} on {s['dof']} dof, p = {s['p_value']:.3g} "
                f"({s['first_tokens']} first tokens, {s['mass_covered']:.1%} of the mass): "
                + ("ok" if s["ok"] else f"FAILED (p < {chk.P_MIN})"))
    bugs = sum(r["verdict"] == "BUG" for r in out["prompts"])
    failed = bool(bugs) or (out["sampling"] is not None and not out["sampling"]["ok"])
    out["ok"] = not failed
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        problems = ([f"{bugs} prompt(s) differ beyond numerical noise"] if bugs else []) + (
            ["the sampling test failed"] if out["sampling"] is not None and not out["sampling"]["ok"] else [])
        click.echo("check FAILED: " + "; ".join(problems) if failed else "check passed")
    if failed:
        raise SystemExit(1)
