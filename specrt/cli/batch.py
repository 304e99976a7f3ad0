"""`specrt batch`: an offline job over a JSONL file of prompts (apps/jobs/ does the work)."""
from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import batch_size_value, constraint_fields, constraint_options, draft_len_value, errors
from specrt.config import HISTORY_CAP, MAX_NEW_TOKENS, SAMPLERS


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
              help='JSONL: one {"id", "prompt" | "messages", optional "max_new_tokens", "temperature", "top_k", '
                   '"top_p", "seed", "stop", "sampling", and one of "json_schema", "regex", "grammar", '
                   '"response_format"} per line.')
@click.option("--output", "output_path", required=True, type=click.Path(path_type=Path),
              help='JSONL of results, one {"id", "text", "tokens", "finish_reason", "stats"} or {"id", "error"} a '
                   "line. A rerun with the same output resumes where it stopped.")
@click.option("--batch-size", default="auto", show_default=True, callback=batch_size_value,
              help="Sequences decoded together, or 'auto': measure 1, 2, 4, 8 on the first records, keep the fastest "
                   "(sizes measured with the job's own draft lengths).")
@click.option("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, show_default=True, help="Most new tokens per record (a record's own value wins).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy (a record's own value wins).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens, 0 = off (a record's own value wins).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass to keep, 1.0 = off (a record's own value wins).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Base seed: a record without its own \"seed\" uses one derived from this and its id.")
@click.option("--draft-len", default=None, callback=draft_len_value,
              help="Draft tokens per round, 0 = target only, or 'auto': each round's length chosen against the cost of the "
                   "batch's pass. Default: greedy records auto (or the tuned length), sampled records the tuned "
                   "length, else 4, so that their draws never follow timings.")
@click.option("--drafter", type=click.Choice(["model", "ngram", "suffix", "hybrid"]), default=None,
              help="Drafter (default: the tuned one, else hybrid for greedy records and --draft-len auto, model for "
                   "sampled records with a fixed length, or "
                   "ngram for a pair without a draft model); suffix: prompt lookup over the record and the outputs "
                   "of the records before it.")
@click.option("--sampling", type=click.Choice(SAMPLERS), default=None,
              help="How sampled records verify drafts (a record's own value wins): coupled (default: every record "
                   "has a seed, and its tokens are the target-only sample of that seed whatever drafts them, so "
                   "sampled records draft auto like greedy ones) or rejection (a fixed draft length).")
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
def batch(pair_dir, input_path, output_path, batch_size, max_new_tokens, temperature, top_k, top_p, seed, draft_len,
          drafter, sampling, history_cap, chat, overwrite, ray_address, ray_actors, ray_cpus_per_actor, progress,
          device, json_schema, json_object, regex, grammar):
    """Run a JSONL file of prompts through batched speculative decoding into a JSONL file of results.

    Output lines are appended atomically and fsync'ed; a killed job resumes when rerun with the same
    --output (ids already written are skipped, a torn last line is cut off). An output that belongs
    to another input file or other settings is refused unless --overwrite.
    """
    from specrt.apps.jobs import JobSettings, run_job

    settings = JobSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, draft_len=draft_len, drafter=drafter, chat=chat, sampling=sampling,
                           **constraint_fields(json_schema, json_object, regex, grammar))
    run_job(pair_dir, input_path, output_path, settings, batch_size=batch_size, overwrite=overwrite,
            ray_address=ray_address, ray_actors=ray_actors, ray_cpus_per_actor=ray_cpus_per_actor,
            progress=progress, device=device, history_cap=history_cap)
