"""`specrt generate`: one prompt through speculative decoding, streamed (api/pair.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.cli.common import (constraint_fields, constraint_options, device_option, errors, load_pair, setting_options,
                               settings_given)


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (with --chat: the user message).")
@setting_options("cli")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {tokens, text, stats} instead of streaming.")
@constraint_options
@device_option
@errors
def generate(pair_dir, device, prompt, chat, as_json, json_schema, json_object, regex, grammar, **options):
    """Generate text with speculative decoding from a pair folder."""
    from specrt.config import needs_draft_model
    from specrt.manifest import read_manifest

    fields = {**settings_given(options, "cli"), **constraint_fields(json_schema, json_object, regex, grammar)}
    draft_len, drafter = fields.get("draft_len"), fields.get("drafter")
    # prompt lookup alone (or no drafting) leaves the draft model out: its load time and a fifth of the memory
    chosen = drafter or ((read_manifest(pair_dir).tuned or {}).get("drafter") if draft_len != 0 else None)
    model = needs_draft_model(chosen, draft_len)
    with load_pair(pair_dir, device, draft_model=model) as pair:
        cfg = pair.settings(fields)
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
