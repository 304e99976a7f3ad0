"""run_job: a batch job from its input to its summary, on the local pair or on Ray (see the package's text)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from specrt.api.grammars import Grammars
from specrt.api.pair import load
from specrt.api.text import TextCodec
from specrt.apps.jobs.input import JobError, JobSettings, Record, job_grammar, needs_draft, read_records, resolve_settings
from specrt.apps.jobs.output import JobOutput, job_identity, result_record
from specrt.apps.jobs.progress import Progress, log_above_bar
from specrt.apps.jobs.ray import run_on_ray, start_ray
from specrt.apps.jobs.sizing import BatchSizer
from specrt.config import HISTORY_CAP
from specrt.decoding.decode import Request
from specrt.decoding.proposers import History
from specrt.errors import ConfigError, SpecrtError
from specrt.manifest import read_manifest


def run_job(pair_dir, input_path, output_path, settings: JobSettings = JobSettings(), batch_size: int | str = "auto",
            overwrite: bool = False, ray_address: str | None = None, ray_actors: int | None = None,
            ray_cpus_per_actor: int = 1, ray_init: dict | None = None, progress: bool = True, log=None,
            threads: int | None = None, device: str = "auto", history_cap: int = HISTORY_CAP) -> dict:
    """Run (or resume) a batch job. Returns a summary dict. See the package's text.
    `device`: where the pair runs ("auto", "cpu", "cuda"; Ray actors run on their CPUs).
    `history_cap`: tokens of earlier records' outputs the suffix drafter keeps (each process its own; a resumed
    local job starts from the outputs already in the file, as the uninterrupted run held them)."""
    log = log or log_above_bar
    _check_options(batch_size, ray_actors, ray_cpus_per_actor, history_cap)
    pair_dir = Path(pair_dir)
    m = read_manifest(pair_dir)
    s = resolve_settings(m, settings)
    codec = TextCodec(pair_dir)
    grammars = Grammars(pair_dir / "tokenizer.json", m.vocab_size, m.eos_token_ids)
    grammar = job_grammar(s)
    if grammar is not None:  # a bad job-wide constraint stops the job before anything runs
        grammars.check(grammar)
    records, digest = read_records(Path(input_path), codec, m, s, grammars)
    if Path(output_path).exists() and os.path.samefile(input_path, output_path):
        raise JobError(f"--input and --output are the same file ({output_path}): results would be written into "
                       "the prompts; choose another --output")
    # a local job resumes drafting from the outputs already written (Ray actors each keep their own)
    out = JobOutput(Path(output_path), job_identity(pair_dir, m, digest, s), overwrite,
                    keep_tokens=history_cap if ray_address is None else 0, vocab=m.vocab_size)
    summary = {"records": len(records), "skipped": 0, "errors": 0, "written": 0, "new_tokens": 0, "wall_s": 0.0,
               "batch_size": batch_size, "output": str(output_path)}
    bar = pair = ray = None
    own_ray = False
    try:
        if out.truncated:
            log(f"{output_path}: cut off a torn last line ({out.truncated} bytes); its record runs again")
        todo = [r for r in records if r.key not in out.done]
        summary["skipped"] = len(records) - len(todo)
        pending = [r for r in todo if r.error is None]
        # Load the pair or reach Ray before writing anything: a bad pair or address leaves the output as it was.
        if pending and ray_address is None:
            pair = _load_pair(pair_dir, device, threads, history_cap, pending, grammars, out.earlier, log)
        elif pending:
            ray, own_ray = start_ray(ray_address, ray_init)
        summary["errors"] += _write_errors(todo, out)
        if summary["skipped"]:
            log(f"resuming: {summary['skipped']} of {len(records)} records already in {output_path}")
        bar = Progress(len(pending), progress and bool(pending))
        t0 = time.perf_counter()
        if pair is not None:
            summary["batch_size"] = _run_local(pair, pending, batch_size, out, bar, summary, log)
        elif ray is not None:
            summary["batch_size"] = run_on_ray(ray, pair_dir, pending, batch_size, out, bar, ray_actors,
                                               ray_cpus_per_actor, log, history_cap)
        else:
            log(f"nothing to run: all {len(records)} records are in {output_path}")
        summary["wall_s"] = time.perf_counter() - t0
    finally:
        _close(bar, out, grammars, pair, ray if own_ray else None)
    _sum_up(summary, out, bar, log)
    return summary


def _check_options(batch_size, ray_actors: int | None, ray_cpus_per_actor: int, history_cap: int) -> None:
    """ConfigError for a bad option, before anything is read."""
    if batch_size != "auto" and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch size must be an integer >= 1 or 'auto', got {batch_size!r}")
    if ray_cpus_per_actor < 1:
        raise ConfigError(f"--ray-cpus-per-actor must be >= 1, got {ray_cpus_per_actor}")
    if ray_actors is not None and ray_actors < 1:
        raise ConfigError(f"--ray-actors must be >= 1, got {ray_actors}")
    History(history_cap)  # a bad cap is refused before anything runs


def _load_pair(pair_dir: Path, device: str, threads: int | None, history_cap: int, pending: list[Record],
               grammars: Grammars, earlier, log):
    """The pair a local job decodes on, its suffix history holding the outputs already written (`earlier`)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"batched decoding runs on onnxruntime: device auto, cpu or cuda, not {device!r}")
    pair = load(pair_dir, threads=threads, device=device, history_cap=history_cap, draft_model=needs_draft(pending))
    pair.grammars = grammars  # the one that checked the records: its tokenizer view is built already
    for note in pair.notes:
        log(f"note: {note}")
    for tokens in earlier:  # what an uninterrupted run's history would hold at this point
        pair.state.history.add(tokens)
    return pair


def _write_errors(todo: list[Record], out: JobOutput) -> int:
    """Write the error records of the records that cannot run; returns how many."""
    bad = [r for r in todo if r.error is not None]
    for r in bad:
        out.write(r.error_record())
    return len(bad)


def _run_local(pair, pending: list[Record], batch_size, out: JobOutput, bar: Progress, summary: dict, log):
    """Decode `pending` on `pair`, writing each result as it ends. Returns the batch size it ran at."""
    ids = {r.key: r.id for r in pending}
    runner = BatchSizer(pair, batch_size, log)
    try:
        for key, res in runner.results(Request(r.key, r.prompt, r.cfg) for r in pending):
            out.write(result_record(ids[key], res))
            bar.update(res)
            summary["errors"] += isinstance(res, SpecrtError)
    finally:
        runner.close()
    return runner.chosen


def _close(bar: Progress | None, out: JobOutput, grammars: Grammars, pair, ray) -> None:
    """Close what the job opened; `ray` is the Ray module when this job started Ray, else None."""
    if bar is not None:
        bar.close()
    out.close()
    grammars.close()
    if pair is not None:
        pair.close()
    if ray is not None:
        ray.shutdown()


def _sum_up(summary: dict, out: JobOutput, bar: Progress, log) -> None:
    """Fill the summary's totals in and log them."""
    summary["written"] = out.written
    summary["new_tokens"] = bar.tokens
    summary["tokens_per_s"] = bar.tokens / summary["wall_s"] if summary["wall_s"] else 0.0
    summary["acceptance_rate"] = bar.acceptance
    log(f"wrote {out.written} records to {summary['output']} ({summary['errors']} errors, {summary['skipped']} already "
        f"there): {bar.tokens} tokens, {summary['tokens_per_s']:.1f} tok/s, acceptance {bar.acceptance:.0%}, "
        f"batch size {summary['batch_size']}")
