"""`specrt batch`: an offline job over a JSONL file of prompts (apps/jobs/ does the work)."""
from __future__ import annotations

from pathlib import Path

import click

from specrt.api import requests
from specrt.cli.common import (batch_size_value, constraint_fields, constraint_options, errors, setting_options,
                               settings_given)
from specrt.config import HISTORY_CAP


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
              help='JSONL: one {"id", "prompt" | "messages", and optionally its own ' + ", ".join(
                  f'"{f}"' for f in requests.fields_of("record")) + "} per line (a constraint at most).")
@click.option("--output", "output_path", required=True, type=click.Path(path_type=Path),
              help='JSONL of results, one {"id", "text", "tokens", "finish_reason", "stats"} or {"id", "error"} a '
                   "line. A rerun with the same output resumes where it stopped.")
@click.option("--batch-size", default="auto", show_default=True, callback=batch_size_value,
              help="Sequences decoded together, or 'auto': measure 1, 2, 4, 8 on the first records, keep the fastest "
                   "(sizes measured with the job's own draft lengths).")
@setting_options("job")
@click.option("--history-cap", type=int, default=HISTORY_CAP, show_default=True,
              help="Most tokens of earlier outputs the suffix drafter keeps (4 bytes each; the oldest go first).")
@click.option("--chat/--no-chat", default=False, show_default=True,
              help='Wrap each text "prompt" in the tokenizer\'s chat template ("messages" always are).')
@click.option("--overwrite", is_flag=True, help="Replace an output that belongs to another job (or to no job).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run on Ray: alone, a local Ray instance; or ADDRESS (HOST:PORT, ray://HOST:PORT, auto; "
                   "write --ray=ADDRESS or put --ray after PAIR_DIR). PAIR_DIR must exist at the same path on "
                   "every node.")
@click.option("--ray-actors", type=int, default=None,
              help="Ray actors, each loading the pair once (default: the cluster's CPUs / --ray-cpus-per-actor).")
@click.option("--ray-cpus-per-actor", type=int, default=1, show_default=True,
              help="CPUs (and onnxruntime threads) per Ray actor.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CUDA for a pair with fp16 activations on a machine with a GPU, else the CPU "
                   "(Ray actors run on the CPU).")
@constraint_options
@errors
def batch(pair_dir, input_path, output_path, batch_size, history_cap, chat, overwrite, ray_address, ray_actors,
          ray_cpus_per_actor, progress, device, json_schema, json_object, regex, grammar, **options):
    """Run a JSONL file of prompts through batched speculative decoding into a JSONL file of results.

    The setting options are every record's unless it gives its own; --seed is the base of each record's
    seed (derived from it and the record's id). Without --draft-len, greedy and coupled records draft auto
    (or the tuned length), rejection-sampled ones the tuned length, else 4, so that their draws never follow
    timings.

    Output lines are appended atomically and fsync'ed; a killed job resumes when rerun with the same
    --output (ids already written are skipped, a torn last line is cut off). An output that belongs
    to another input file or other settings is refused unless --overwrite.
    """
    from specrt.apps.jobs import JobSettings, run_job

    given = {**settings_given(options, "job"), **constraint_fields(json_schema, json_object, regex, grammar)}
    settings = JobSettings(**given, chat=chat)
    run_job(pair_dir, input_path, output_path, settings, batch_size=batch_size, overwrite=overwrite,
            ray_address=ray_address, ray_actors=ray_actors, ray_cpus_per_actor=ray_cpus_per_actor,
            progress=progress, device=device, history_cap=history_cap)
