"""`specrt generate`: one prompt through speculative decoding, streamed (api/pair.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.cli.common import constraint_fields, constraint_options, device_option, draft_len_value, errors, load_pair
from specrt.config import MAX_NEW_TOKENS, SAMPLERS


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (with --chat: the user message).")
@click.option("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass to keep (1.0 = off).")
@click.option("--seed", type=int, default=None,
              help="Random seed for sampling (0 when not given). A seeded sampled request samples coupled by default: the target-only sample of that seed, whatever drafts it.")
@click.option("--draft-len", default=None, callback=draft_len_value,
              help="Draft tokens per round (0 = target only), or 'auto' (chosen per round from measured acceptance "
                   "and costs). Default: what `specrt tune` chose for this pair, else auto.")
@click.option("--confidence-stop", type=float, default=None,
              help="Stop a model draft early once its top probability falls below this (0 = never; default: tuned or 0).")
@click.option("--drafter", type=click.Choice(["model", "ngram", "suffix", "hybrid"]), default=None,
              help="model: the pair's draft model; ngram: prompt lookup, no draft model (default without one); "
                   "suffix: prompt lookup over the request and the outputs of earlier requests of the loaded pair "
                   "(ngram and suffix do not load the draft model); "
                   "hybrid: each round the policy chooses between the two (default with a draft model). "
                   "Default: what `specrt tune` chose, if anything.")
@click.option("--draft-window", type=int, default=None,
              help="The most tokens the draft model reads in one catch-up (the prompt, what n-gram rounds emitted); "
                   "further behind, it reads only the last ones (0 = no limit; default: 32 on the CPU, none on a GPU).")
@click.option("--ngram-max", type=int, default=16, show_default=True,
              help="Longest suffix (1..16 tokens) the prompt-lookup drafter matches (ngram, hybrid).")
@click.option("--sampling", type=click.Choice(SAMPLERS), default=None,
              help="How a sampled request verifies drafts: coupled (the default with --seed: the seed gives the "
                   "target-only sample token for token, whatever drafts it) or rejection (the default without: higher "
                   "acceptance at high temperatures; a seed reproduces for the same drafts).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends before it.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {tokens, text, stats} instead of streaming.")
@constraint_options
@device_option
@errors
def generate(pair_dir, device, prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_len, confidence_stop, drafter,
             draft_window, ngram_max, sampling, stop, chat, as_json, json_schema, json_object, regex, grammar):
    """Generate text with speculative decoding from a pair folder."""
    from specrt.config import needs_draft_model
    from specrt.manifest import read_manifest

    # prompt lookup alone (or no drafting) leaves the draft model out: its load time and a fifth of the memory
    chosen = drafter or ((read_manifest(pair_dir).tuned or {}).get("drafter") if draft_len != 0 else None)
    model = needs_draft_model(chosen, draft_len)
    constraint = constraint_fields(json_schema, json_object, regex, grammar)
    with load_pair(pair_dir, device, draft_model=model) as pair:
        cfg = pair.settings(dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=seed, stop=list(stop), draft_len=draft_len, drafter=drafter,
                                 confidence_stop=confidence_stop, draft_window=draft_window, ngram_max=ngram_max,
                                 sampling=sampling, **constraint))
        ids = pair.encode(prompt, chat=chat)
        stream = None if as_json else (lambda s: (click.echo(s, nl=False), sys.stdout.flush()))
        res = pair.run(ids, cfg, on_text=stream)
    if as_json:
        click.echo(json.dumps({"tokens": res.tokens, "text": res.text, "finish_reason": res.finish_reason,
                               "stats": res.stats}))
    else:
        click.echo()
        click.echo(summary(res.stats), err=True)
    if res.stats.get("grammar_complete") is False:
        why = res.stats.get("grammar_error") or f"max_new_tokens ({cfg.max_new_tokens}) came first"
        click.echo(f"note: the output is not a complete match of the constraint: {why}", err=True)


def summary(s: dict) -> str:
    """The one stderr line after a streamed generation."""
    return (f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, draft_len {s['draft_len']}, "
            f"acceptance {s['acceptance_rate']:.0%}, {s['tokens_per_target_pass']:.2f} tokens/target pass, "
            f"ttft {s['ttft_s'] * 1000:.0f} ms]")
