"""`specrt bench`: tokens/s per draft length and drafter, against target-only (apps/bench.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from specrt.cli.common import batch_size_list, command_line, device_option, draft_len_list, errors, load_pair
from specrt.config import MAX_NEW_TOKENS


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), multiple=True,
              help="JSONL file: one {id, prompt | messages, class, chat} per line (repeat for several files).")
@click.option("--prompt", "prompt_text", default=None, help="A single chat prompt instead of --prompts.")
@click.option("--draft-lens", default="0,1,2,3,4,6,8", show_default=True, callback=draft_len_list,
              help="Comma-separated draft lengths to compare (0 = target only; 'auto' allowed).")
@click.option("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, show_default=True, help="Tokens per generation.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed repeats (median reported).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--drafters", default=None,
              help="Comma-separated drafters to compare: model, ngram, suffix, hybrid (default: the pair's default drafter).")
@click.option("--trees", default="auto", show_default=True,
              help="Comma-separated tree settings to compare: auto (a round may verify a tree of drafts), off (chains).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--batch-sizes", default=None, callback=batch_size_list,
              help="Comma-separated batch sizes: measure batched decoding's aggregate tokens/s instead "
                   "(whole prompt list per setting, slots refilled).")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Write the numbers here.")
@click.option("--report", "report_dir", type=click.Path(path_type=Path), default=None,
              help="Also measure this machine's pass costs and write DIR/index.html with plots (needs specrt[plots]).")
@device_option
@errors
def bench(pair_dir, device, prompts, prompt_text, draft_lens, max_new_tokens, repeats, temperature, drafters, trees,
          limit, batch_sizes, json_out, report_dir):
    """Measure tokens/s per draft length, speedup vs target-only, acceptance, TTFT, latency, RSS."""
    from specrt.config import SamplingConfig
    from specrt.errors import ConfigError
    from specrt.api import requests
    from specrt.apps.bench import (Prompt, format_batch_table, format_table, read_prompts, run_batch_bench, run_bench,
                                   settings_grid)
    from specrt.config import TREES

    if bool(prompts) == (prompt_text is not None):
        raise ConfigError("give exactly one of --prompts FILE or --prompt TEXT")
    if json_out is not None:  # fail now, not after the whole run (and create nothing yet)
        folder = json_out.parent if str(json_out.parent) else Path(".")
        if json_out.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"cannot write --json {json_out}: not a writable file path")
    tree_list = [t.strip() for t in trees.split(",") if t.strip()]
    if not tree_list or any(t not in TREES for t in tree_list):
        raise ConfigError(f"--trees must be comma-separated values of {', '.join(TREES)}, got {trees!r}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    if report_dir is not None:
        from specrt.apps import report

        report.require(report_dir)
    sampling = SamplingConfig(temperature=temperature)
    with load_pair(pair_dir, device) as pair:
        plist = read_prompts(prompts, pair, limit) if prompts else [Prompt("prompt", pair.encode(prompt_text, True), "default")]
        default = requests.defaults(pair.manifest, pair.tuned, pair.draft is not None, batched=bool(batch_sizes))[0]
        names = [d.strip() for d in (drafters or default).split(",") if d.strip()]
        if batch_sizes:
            if len(names) != 1:
                raise ConfigError("--batch-sizes compares batch sizes for one drafter; give one in --drafters")
            runs = sum(len(tree_list) if k else 1 for k in draft_lens) * len(batch_sizes)
            with click.progressbar(length=repeats * runs, label="bench",
                                   file=sys.stderr) as bar:
                res = run_batch_bench(pair, plist, batch_sizes, draft_lens, max_new_tokens, repeats, sampling,
                                      drafter=names[0], progress=lambda: bar.update(1), trees=tree_list)
            table = format_batch_table(res)
        else:
            with click.progressbar(length=repeats * len(plist) * len(settings_grid(draft_lens, names, (0.0,), tree_list)),
                                   label="bench", file=sys.stderr) as bar:
                res = run_bench(pair, plist, draft_lens, max_new_tokens, repeats, sampling, drafters=names,
                                progress=lambda: bar.update(1), trees=tree_list)
            table = format_table(res)
        if report_dir is not None:
            from specrt.apps.tune import measure_costs

            # over a past as long as these prompts' median plus half the new tokens: the context they decode at
            past = sorted(len(p.ids) for p in plist)[len(plist) // 2] + max_new_tokens // 2
            costs = measure_costs(pair, past=past, batch_sizes=tuple(batch_sizes or ()))
            page = report.write_report(report_dir, report.header(pair, command_line()), costs, pair.manifest.max_draft_len,
                                       bench=None if batch_sizes else res, batch=res if batch_sizes else None)
    click.echo(table)
    if report_dir is not None:
        click.echo(f"report: {page}")
    if json_out:
        json_out.write_text(json.dumps(res, indent=2))
