"""Offline batch jobs: a JSONL file of prompts in, a JSONL file of results out, resumable.

Input, one JSON object a line:
    {"id": str | int, "prompt": str | [token ids] | "messages": [{"role", "content"}, ...],
     optional "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop": str | [str],
     "sampling": "rejection" | "coupled"}
Other keys are ignored. Output, one line per input record, in order of completion:
    {"id", "text", "tokens", "finish_reason", "stats"}   or   {"id", "error"}
A line that cannot be read (not JSON, an integer past Python's 4,300-digit limit, nested too deep), is not a
JSON object or has no usable "id" (a string of valid text, or an integer) gets the error record
{"id": null, "line": N, "error"}: null is no record's id, so it never collides with one, and a rerun knows it
by its line number (the input is the job's own, by its sha256). Duplicate ids stop the job before anything
runs.

Guarantees of the output file:
- every record is one `os.write` of the whole line (newline included) on an O_APPEND descriptor,
  fsync'ed every few records, every second and at the end;
- a rerun with the same output skips the ids already in it; a torn last line (a kill mid-write, or
  the zero-filled tail of a crash) is cut off first; the history of outputs the suffix drafter drafts
  from starts from the records already written (their tokens, in file order);
- `OUTPUT.job.json` records the job's identity (sha256 of the input file, the pair's graphs and
  tokenizer, the settings that change results): an output of another job is refused unless
  `overwrite`. The batch size is not part of it: results do not depend on it.

A record without its own "seed" samples with a seed derived from the job's seed and its id, so two
records with the same prompt are independent samples, and a record's result depends neither on the
order of the input nor on the batch it ran in.

Draft lengths, unless the job names one: a greedy record drafts as a request alone does (`auto`: each
round's length chosen by the policy against the cost of the batch's pass; the pair's tuned drafter, else
hybrid), since its tokens are exact whatever drafts them, and so does a sampled record: every record
has a seed, so it samples "coupled" unless it or the job asks otherwise (its tokens are the target-only
sample of its seed whatever drafts them). A record sampled with "rejection" drafts a fixed length (the
tuned one, else 4; the tuned drafter, else the draft model), so its draws never follow timings; with an
explicit draft_len "auto" such a record is a faithful sample but not draw for draw reproducible.

`--ray`: the driver reads, validates and writes exactly as above; Ray actors each load the pair once
(from PAIR_DIR, which must exist at that path on every node) and decode shards of records.

Modules: input (settings and records), output (the durable output file and the job's identity), runner
(decoding at a batch size, auto included), progress (the bar and log lines), ray (the `ray` extra), run
(run_job, which joins them).
"""
from __future__ import annotations

from specrt.apps.jobs.input import (RECORD_FIELDS, JobError, JobSettings, Record, read_records, record_seed,
                                    resolve_settings)
from specrt.apps.jobs.input import _config, _encode  # noqa: F401  (tests check a record's settings and prompt)
from specrt.apps.jobs.output import JobOutput, job_identity, record_key, result_record
from specrt.apps.jobs.ray import RayWorker
from specrt.apps.jobs.run import run_job
from specrt.apps.jobs.sizing import AUTO_SIZES, BatchSizer

__all__ = ["AUTO_SIZES", "RECORD_FIELDS", "JobError", "JobOutput", "JobSettings", "RayWorker", "Record", "BatchSizer",
           "job_identity", "read_records", "record_key", "record_seed", "resolve_settings", "result_record", "run_job"]
