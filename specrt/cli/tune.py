"""`specrt tune`: pick this machine's fastest drafting settings and store them in the manifest (apps/tune.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from specrt.cli.common import BadInput, command_line, device_option, draft_len_list, errors, load_pair


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), required=True, multiple=True,
              help="JSONL file of representative prompts (see bench/prompts/prompts.jsonl; repeat for several files).")
@click.option("--draft-lens", default="0,1,2,3,4,6,auto", show_default=True, callback=draft_len_list,
              help="Draft lengths to sweep.")
@click.option("--drafters", default=None, help="Drafters to sweep (default: model,ngram,hybrid, or ngram for a target-only pair).")
@click.option("--confidence-stops", default="0,0.4", show_default=True,
              help="Early-stop thresholds on the draft's top probability to sweep.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens per generation.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed repeats per setting.")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--dry-run", is_flag=True, help="Print what would be chosen; leave the manifest alone.")
@click.option("--report", "report_dir", type=click.Path(path_type=Path), default=None,
              help="Also write DIR/index.html with plots of what was measured (needs specrt[plots]).")
@device_option
@errors
def tune(pair_dir, device, prompts, draft_lens, drafters, confidence_stops, max_new_tokens, repeats, limit, dry_run,
         report_dir):
    """Measure this device and the prompts, pick the fastest drafting settings, store them in the manifest."""
    from specrt.errors import ConfigError
    from specrt.apps.bench import format_table, read_prompts, settings_grid
    from specrt.apps.tune import tune as run_tune, write_tuned

    try:
        stops = [float(c) for c in confidence_stops.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"--confidence-stops must be comma-separated numbers, got {confidence_stops!r}") from None
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    if not dry_run:
        _check_writable(pair_dir)  # before minutes of measuring, not after
    if report_dir is not None:
        from specrt.apps import report

        report.require(report_dir)
    with load_pair(pair_dir, device, use_tuned=False) as pair:
        names = [d.strip() for d in (drafters or ("model,ngram,hybrid" if pair.draft else "ngram")).split(",")]
        plist = read_prompts(prompts, pair, limit)
        total = repeats * len(plist) * len(settings_grid(draft_lens, names, stops))
        with click.progressbar(length=total, label="tune", file=sys.stderr) as bar:
            tuned = run_tune(pair, plist, max_new_tokens, repeats, draft_lens, names, stops, lambda: bar.update(1))
        if report_dir is not None:
            chosen = f"drafter {tuned['drafter']}, draft_len {tuned['draft_len']}, confidence_stop {tuned['confidence_stop']}"
            page = report.write_report(report_dir, report.header(pair, command_line()), tuned["costs"],
                                       pair.manifest.max_draft_len, bench=tuned["bench"], chosen=chosen)
    click.echo(format_table(tuned["bench"]))
    c = tuned["costs"]
    widths = ", ".join(f"{w}: {s * 1000:.1f}" for w, s in c["target_s"].items())
    read = f", a draft catch-up {c['draft_read_s'] * 1000:.2f} a token" if c.get("draft_read_s") else ""
    click.echo(f"measured pass costs (ms): draft {c['draft_s'] * 1000 if c['draft_s'] else 0:.1f}{read}; target by width {widths}")
    click.echo(f"chose drafter {tuned['drafter']}, draft_len {tuned['draft_len']}, confidence_stop "
               f"{tuned['confidence_stop']}: {tuned['measured']['tokens_per_s']:.1f} tok/s"
               + (f", {tuned['measured']['speedup']:.2f}x target-only" if tuned["measured"]["speedup"] else ""))
    if not dry_run:
        try:
            write_tuned(pair_dir, tuned)
        except OSError as e:  # the results are printed above: say why they are not stored
            raise BadInput(f"could not store the results above in {pair_dir}/manifest.json: {e.strerror}") from None
        click.echo(f"stored in {pair_dir}/manifest.json; generate, bench and the API now use these defaults")
    if report_dir is not None:
        click.echo(f"report: {page}")


def _check_writable(pair_dir: Path) -> None:
    """BadInput unless a file can be created in the pair folder (where the manifest is replaced)."""
    import tempfile

    if not Path(pair_dir).is_dir():
        return  # loading the pair says what is wrong
    try:
        with tempfile.NamedTemporaryFile(dir=pair_dir, prefix=".specrt-tune-"):
            pass
    except OSError as e:
        raise BadInput(f"cannot store results in {pair_dir} ({e.strerror}): make the folder writable, or add "
                       "--dry-run to only print them") from None
