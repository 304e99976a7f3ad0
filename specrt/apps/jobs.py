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
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import logging
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specrt.api import requests
from specrt.api.pair import load
from specrt.api.grammars import Grammars
from specrt.api.text import TextCodec, check_text
from specrt.config import HISTORY_CAP, MAX_NEW_TOKENS, GenerationConfig, needs_draft_model
from specrt.decoding.decode import Request
from specrt.decoding.proposers import History
from specrt.errors import ConfigError, SpecrtError, first_line
from specrt.manifest import read_manifest, sha256_file

JOB_FORMAT = "specrt-batch-job"
JOB_VERSION = 1
SIDECAR_SUFFIX = ".job.json"
AUTO_SIZES = (1, 2, 4, 8)
FSYNC_EVERY = 16  # records
FSYNC_SECONDS = 1.0


class JobError(SpecrtError):
    """A batch job cannot start or go on (its output file, its input, or the Ray cluster)."""


@dataclass(frozen=True)
class JobSettings:
    """Job-wide defaults; a record may override max_new_tokens, temperature, top_k, top_p, seed, stop, sampling.
    None means the pair's default (what `specrt tune` stored, else api/requests.defaults); resolved, the
    greedy_* fields hold what greedy and coupled records draft with when the job named no draft length
    (see above)."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    draft_len: int | str | None = None
    drafter: str | None = None
    confidence_stop: float | None = None
    chat: bool = False
    sampling: str | None = None
    greedy_draft_len: int | str | None = None
    greedy_drafter: str | None = None
    # structured output for every record without its own (api/requests.CONSTRAINTS): at most one
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    response_format: dict | None = None


@dataclass
class Record:
    line: int
    id: Any  # as given (str or int); None when the line has no usable id
    key: str  # identity across runs: record_key of its output record
    prompt: list[int] | None = None
    cfg: GenerationConfig | None = None
    error: str | None = None

    def error_record(self) -> dict:
        """{"id", "error"}; a malformed line's {"id": null, "line", "error"} (see the module's text)."""
        if self.id is None:
            return {"id": None, "line": self.line, "error": self.error}
        return {"id": self.id, "error": self.error}


def record_key(rec: dict) -> str:
    """An output record's identity across runs: json.dumps of its id, or "line N" for a malformed line's
    (id null), which is no JSON text and so equals no id's."""
    if rec["id"] is None and type(rec.get("line")) is int:
        return f"line {rec['line']}"
    return json.dumps(rec["id"], ensure_ascii=False)


def _malformed(n: int, why: str) -> Record:
    return Record(n, None, f"line {n}", error=f"line {n}: {why}")


# ---------------------------------------------------------------------------------------------- input


def resolve_settings(m, s: JobSettings) -> JobSettings:
    """Fill the pair's defaults in, so that the job identity names what actually runs."""
    tuned = m.tuned or {}
    if tuned and tuned.get("graphs") != m.graph_hashes():
        tuned = {}  # loading the pair refuses such a manifest anyway (Pair)
    has_draft = m.draft is not None
    # a fixed length (a batch row's default) for sampled records, or for all when the job names one
    drafter, k, cs = requests.defaults(m, tuned, has_draft, batched=s.draft_len != "auto")
    out = replace(s, drafter=s.drafter or drafter, draft_len=k if s.draft_len is None else s.draft_len,
                  confidence_stop=cs if s.confidence_stop is None else s.confidence_stop,
                  greedy_draft_len=None, greedy_drafter=None,
                  sampling=s.sampling or "coupled")  # every record is seeded (record_seed): api/requests.parse
    if s.draft_len is None:  # greedy records draft as a request alone would
        g_drafter, g_len, _ = requests.defaults(m, tuned, has_draft)
        out = replace(out, greedy_draft_len=g_len, greedy_drafter=s.drafter or g_drafter)
    # Checks of the job-wide settings: a ConfigError before anything runs.
    requests.check_settings(m, _config(out, {}, 0))
    requests.check_settings(m, _config(out, {"temperature": 1.0}, 0))
    return out


def record_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") >> 1


# what a record may set for itself; the rest of its settings are the job's (and part of its identity)
RECORD_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "sampling", *requests.CONSTRAINTS)


def _config(s: JobSettings, rec: dict, seed: int) -> GenerationConfig:
    """A record's settings: the job's, overridden by the record's own RECORD_FIELDS (api/requests.parse); a
    record's own constraint replaces the job's."""
    own = {f: rec[f] for f in RECORD_FIELDS if rec.get(f) is not None}
    job = {f: getattr(s, f, None) for f in RECORD_FIELDS
           if not (f in requests.CONSTRAINTS and any(c in own for c in requests.CONSTRAINTS))}
    fields = requests.parse({**job, "seed": seed, **own})
    cfg = GenerationConfig(draft_len=s.draft_len, drafter=s.drafter, confidence_stop=s.confidence_stop, **fields)
    if s.greedy_draft_len is not None and (cfg.sampling.greedy or cfg.sampling.method == "coupled"):
        cfg = replace(cfg, draft_len=s.greedy_draft_len, drafter=s.greedy_drafter)
    return cfg


def _encode(codec, m, rec: dict, chat: bool) -> list[int]:
    if "messages" not in rec and "prompt" not in rec:
        raise ValueError('needs "prompt" (a string or a list of token ids) or "messages"')
    return requests.prompt_ids(codec, m.vocab_size, prompt=rec.get("prompt"), messages=rec.get("messages"), chat=chat)


def read_records(path: Path, codec, m, s: JobSettings, grammars: Grammars | None = None) -> tuple[list[Record], str]:
    """Parse and validate every line (a record's grammar with `grammars`, the pair's compiler). Returns
    (records, sha256 of the file). Bad records become records with an error; duplicate ids, an unreadable or
    empty file raise JobError."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise JobError(f"cannot read input {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise JobError(f"input {path} is not UTF-8 (byte {e.start})") from None
    records, seen = [], {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            records.append(_malformed(n, f"not JSON ({e.msg})"))
            continue
        except ValueError:  # what json raises for an integer past Python's int-digit limit
            records.append(_malformed(n, f"an integer longer than {sys.get_int_max_str_digits()} digits"))
            continue
        except RecursionError:
            records.append(_malformed(n, "JSON nested too deep"))
            continue
        rid = rec.get("id") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or isinstance(rid, bool) or not isinstance(rid, (str, int)):
            why = "not a JSON object" if not isinstance(rec, dict) else (
                'no "id"' if rid is None else f'"id" must be a string or an integer, got {rid!r}')
            records.append(_malformed(n, why))
            continue
        try:
            if isinstance(rid, str):
                check_text(rid, '"id"')
        except ConfigError as e:  # such an id could be neither written nor known again on a rerun
            records.append(_malformed(n, str(e)))
            continue
        r = Record(n, rid, json.dumps(rid, ensure_ascii=False))
        try:
            r.prompt = _encode(codec, m, rec, s.chat)
            r.cfg = _config(s, rec, record_seed(s.seed, r.key))
            requests.check(m, r.prompt, r.cfg, batched=True)
            if r.cfg.grammar is not None and grammars is not None:
                grammars.check(r.cfg.grammar)
        except (ValueError, TypeError, SpecrtError) as e:
            r.prompt = r.cfg = None
            r.error = f"line {n}: {e}"
        records.append(r)
    for r in records:
        if r.key in seen:
            raise JobError(f"{path}: duplicate id {r.id!r} on lines {seen[r.key]} and {r.line}; ids must be unique")
        seen[r.key] = r.line
    if not records:
        raise JobError(f"input {path} holds no records")
    return records, hashlib.sha256(raw).hexdigest()


def job_identity(pair_dir: Path, m, input_sha256: str, s: JobSettings) -> dict:
    tok = {f: sha256_file(Path(pair_dir) / f) for f in m.tokenizer_files if (Path(pair_dir) / f).is_file()}
    return {"format": JOB_FORMAT, "version": JOB_VERSION, "input_sha256": input_sha256,
            "pair_graphs": m.graph_hashes(), "tokenizer": tok, "settings": asdict(s)}


# ---------------------------------------------------------------------------------------------- output


class JobOutput:
    """The output file: atomic appends, resume after a kill, and the job-identity sidecar."""

    def __init__(self, path: Path, identity: dict, overwrite: bool = False, keep_tokens: int = 0, vocab: int = 0):
        """`keep_tokens`: keep the output tokens of the last records already written, up to about that many
        (`earlier`, in file order: the history of outputs a resumed job drafts from); tokens that are not
        ids of a `vocab`-id vocabulary are not kept."""
        self.path = Path(path)
        self.sidecar = Path(str(path) + SIDECAR_SUFFIX)
        self.done: set[str] = set()
        self.earlier: collections.deque[list[int]] = collections.deque()
        self._keep, self._vocab, self._kept = keep_tokens, vocab, 0
        self.written = 0
        self.truncated = 0  # bytes of torn tail cut off at open
        self._fd = None
        self._unsynced, self._synced_at = 0, time.monotonic()
        if self.path.is_dir():
            raise JobError(f"output {self.path} is a folder")
        if self.path.exists() and not self.path.is_file():
            raise JobError(f"output {self.path} is not a regular file (a job's output must be a file it can cut back)")
        existed = self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise JobError(f"cannot open output {self.path}: {e.strerror}") from None
        try:
            # one job at a time writes an output (and its sidecar): the lock lives as long as the job
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise JobError(f"{self.path} is being written by another specrt batch{_holder(self._fd)}; wait for it "
                               "to end, or use another --output") from None
            has_output = os.fstat(self._fd).st_size > 0
            if has_output and not overwrite:
                self._check_identity(identity)
            else:
                # Old output first, then the new identity: a kill in between never pairs old lines with it.
                if has_output:
                    os.ftruncate(self._fd, 0)
                    os.fsync(self._fd)
                self._write_sidecar(identity)
            self._recover()
        except BaseException as e:
            os.close(self._fd)
            self._fd = None
            if not existed:
                self.path.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise JobError(f"cannot prepare output {self.path}: {e.strerror}") from None
            raise

    def _check_identity(self, identity: dict) -> None:
        hint = "use --overwrite to replace it, or another --output"
        try:
            theirs = json.loads(self.sidecar.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise JobError(f"{self.path} exists and was not written by a specrt batch job (no {self.sidecar.name}); "
                           f"{hint}") from None
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, an integer past the digit limit
            raise JobError(f"cannot read {self.sidecar}: {e}; {hint}") from None
        settings = theirs.get("settings") if isinstance(theirs, dict) else None
        if isinstance(settings, dict) and "sampling" in settings and settings["sampling"] is None:
            # written before the job identity named its sampling default, which then was rejection: such a
            # job resumes with --sampling rejection
            theirs = {**theirs, "settings": {**settings, "sampling": "rejection"}}
        if isinstance(settings, dict) and "sampling" in settings:
            # written before jobs had structured output: none
            theirs["settings"] = {**{c: None for c in requests.CONSTRAINTS}, **theirs["settings"]}
        if theirs != identity:
            diff = [k for k in ("format", "version", "input_sha256", "pair_graphs", "tokenizer")
                    if not isinstance(theirs, dict) or theirs.get(k) != identity[k]]
            old = theirs.get("settings") if isinstance(theirs, dict) else None
            old = old if isinstance(old, dict) else {}
            diff += [f"{k} ({old.get(k)!r} -> {v!r})" for k, v in identity["settings"].items() if old.get(k) != v]
            names = {"input_sha256": "input file", "pair_graphs": "pair graphs"}
            what = ", ".join(names.get(d, d) for d in diff) or "identity"
            raise JobError(f"{self.path} belongs to another job ({what} differ); {hint}")

    def _write_sidecar(self, identity: dict) -> None:
        tmp = self.sidecar.with_name(self.sidecar.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(identity, indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.sidecar)
            _fsync_dir(self.sidecar.parent)
        except OSError as e:
            raise JobError(f"cannot write {self.sidecar}: {e.strerror}") from None

    def _recover(self) -> None:
        """Read the ids already written; cut off a torn tail (only trailing damage is repaired)."""
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        good_end, bad_at = 0, None
        pos = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            end = len(data) if nl < 0 else nl + 1
            rec = _parse_line(data[pos:end]) if nl >= 0 else None
            if rec is None:
                bad_at = pos if bad_at is None else bad_at
            elif bad_at is not None:
                line_no = data.count(b"\n", 0, bad_at) + 1
                raise JobError(f"{self.path} is corrupt at line {line_no} (a damaged line followed by good ones); "
                               "repair or remove it, or use --overwrite")
            else:
                self.done.add(record_key(rec))
                self._remember(rec.get("tokens"))
                good_end = end
            pos = end
        if good_end < len(data):
            self.truncated = len(data) - good_end
            os.ftruncate(self._fd, good_end)
            os.fsync(self._fd)

    def _remember(self, tokens) -> None:
        if not self._keep or not isinstance(tokens, list) or not tokens:
            return
        if not all(type(t) is int and 0 <= t < self._vocab for t in tokens):
            return  # not what this pair wrote: never drafted from
        self.earlier.append(tokens)
        self._kept += len(tokens)
        while self._kept - len(self.earlier[0]) >= self._keep:  # older ones would be evicted anyway
            self._kept -= len(self.earlier.popleft())

    def write(self, rec: dict) -> None:
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(line)
        end = os.fstat(self._fd).st_size
        try:
            while view:  # a regular file takes it in one write; loop only on a short write
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:  # disk full, quota, I/O error: cut back to the last whole record
            self._failed(e, end)
        self.done.add(record_key(rec))
        self.written += 1
        self._unsynced += 1
        if self._unsynced >= FSYNC_EVERY or time.monotonic() - self._synced_at >= FSYNC_SECONDS:
            self.sync()

    def sync(self) -> None:
        if self._fd is not None and self._unsynced:
            try:
                os.fsync(self._fd)
            except OSError as e:  # a full disk can show only here, when the data is written back
                self._failed(e, None)
        self._unsynced, self._synced_at = 0, time.monotonic()

    def _failed(self, e: OSError, end: int | None) -> None:
        """A write or fsync failed: the file ends at its last whole record (a rerun resumes from there)."""
        try:
            if end is not None:
                os.ftruncate(self._fd, end)
            self._recover_tail()
        except OSError:
            pass
        raise JobError(f"cannot write {self.path}: {e.strerror}; {self.written} records written this run, the file "
                       "ends at the last whole record and a rerun with the same --output resumes there") from None

    def _recover_tail(self) -> None:
        """Cut a partly written last line off (what a failed write-back may leave)."""
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            data = os.pread(self._fd, min(size, 1 << 20), max(0, size - (1 << 20)))
            nl = data.rfind(b"\n")
            os.ftruncate(self._fd, size - len(data) + nl + 1 if nl >= 0 else max(0, size - len(data)))

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.sync()
            except JobError:
                pass  # the error that stopped the job is the one to report
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> str:
    """" (pid N: its command)" of the process holding the lock on `fd`'s file, from /proc/locks (Linux)."""
    try:
        st = os.fstat(fd)
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if "FLOCK" in parts and where in parts:
                pid = parts[parts.index(where) - 1]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f" (pid {pid}: {cmd[:120]})" if cmd else f" (pid {pid})"
    except (OSError, ValueError, IndexError):
        pass
    return ""


def _parse_line(b: bytes) -> dict | None:
    try:
        rec = json.loads(b.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, an integer past the digit limit, too deep
        return None
    if not isinstance(rec, dict) or "id" not in rec or not ({"text", "tokens"} <= rec.keys() or "error" in rec):
        return None
    return rec


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def result_record(rid, res) -> dict:
    """A result's record; a request that could not start (res: its ConfigError) gets its error record."""
    if isinstance(res, SpecrtError):
        return {"id": rid, "error": str(res)}
    return {"id": rid, "text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason, "stats": res.stats}


# ---------------------------------------------------------------------------------------------- running


class Runner:
    """Decodes requests on one loaded pair with a fixed batch size, or "auto": the first records run at
    each of AUTO_SIZES in turn (their results are kept), and the fastest aggregate tokens/s wins.
    Rows with draft_len "auto" choose each round's length against the cost of the batch's pass and its
    rate (decoding/policy.py), at any batch size: drafting that does not pay in a batch is not done."""

    def __init__(self, pair, batch_size: int | str, log=None):
        self.pair, self.log = pair, log or (lambda s: None)
        self.chosen = None if batch_size == "auto" else int(batch_size)
        self.measured: dict[int, float] = {}
        self._dec = None

    def results(self, requests):
        reqs, i = list(requests), 0
        if self.chosen is None:
            for b in AUTO_SIZES:
                n = max(2 * b, 4)
                if len(reqs) - i < n:
                    break
                tokens, t0 = 0, time.perf_counter()
                try:
                    dec = self.pair.runner(b)
                except ConfigError as e:  # its KV caches do not fit: neither will larger batches
                    self.log(f"batch size auto: {b} skipped ({e})")
                    break
                with dec:
                    for key, res in dec.run(reqs[i:i + n]):
                        tokens += 0 if isinstance(res, SpecrtError) else len(res.tokens)
                        yield key, res
                self.measured[b] = tokens / (time.perf_counter() - t0)
                i += n
            if self.measured:
                self.chosen = max(self.measured, key=self.measured.get)
                self.log("batch size auto: " + ", ".join(f"{b}: {v:.1f} tok/s" for b, v in self.measured.items())
                         + f" -> {self.chosen}")
            else:
                self.chosen = max(1, min(4, len(reqs)))
                self.log(f"batch size auto: too few records to measure, using {self.chosen}")
        if i < len(reqs):
            if self._dec is None or self._dec.batch_size != self.chosen:
                self.close()
                self._dec = self.pair.runner(self.chosen)
            yield from self._dec.run(reqs[i:])

    def close(self) -> None:
        if self._dec is not None:
            self._dec.close()
            self._dec = None


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.tokens = self.proposed = self.accepted = self.records = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rec", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                            desc="batch")

    def update(self, res) -> None:
        self.records += 1
        if res is not None and not isinstance(res, SpecrtError):
            s = res.stats
            self.tokens += s["new_tokens"]
            self.proposed += s["proposed"]
            self.accepted += s["accepted"]
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n == self.bar.total or self.records % 8 == 0:
                self.bar.set_postfix_str(f"{self.rate:.1f} tok/s, acceptance {self.acceptance:.0%}", refresh=False)

    @property
    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        return self.tokens / dt if dt > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)  # above a running progress bar, not through it


def run_job(pair_dir, input_path, output_path, settings: JobSettings = JobSettings(), batch_size: int | str = "auto",
            overwrite: bool = False, ray_address: str | None = None, ray_actors: int | None = None,
            ray_cpus_per_actor: int = 1, ray_init: dict | None = None, progress: bool = True, log=None,
            threads: int | None = None, device: str = "auto", history_cap: int = HISTORY_CAP) -> dict:
    """Run (or resume) a batch job. Returns a summary dict. See the module docstring.
    `device`: where the pair runs ("auto", "cpu", "cuda"; Ray actors run on their CPUs).
    `history_cap`: tokens of earlier records' outputs the suffix drafter keeps (each process its own; a resumed
    local job starts from the outputs already in the file, as the uninterrupted run held them)."""
    log = log or _log
    if batch_size != "auto" and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"batch size must be an integer >= 1 or 'auto', got {batch_size!r}")
    if ray_cpus_per_actor < 1:
        raise ConfigError(f"--ray-cpus-per-actor must be >= 1, got {ray_cpus_per_actor}")
    if ray_actors is not None and ray_actors < 1:
        raise ConfigError(f"--ray-actors must be >= 1, got {ray_actors}")
    History(history_cap)  # a bad cap is refused before anything runs
    pair_dir = Path(pair_dir)
    m = read_manifest(pair_dir)
    s = resolve_settings(m, settings)
    codec = TextCodec(pair_dir)
    grammars = Grammars(pair_dir / "tokenizer.json", m.vocab_size, m.eos_token_ids)
    job_grammar = _config(s, {}, 0).grammar
    if job_grammar is not None:  # a bad job-wide constraint stops the job before anything runs
        grammars.check(job_grammar)
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
            if device not in ("auto", "cpu", "cuda"):
                raise ConfigError(f"batched decoding runs on onnxruntime: device auto, cpu or cuda, not {device!r}")
            pair = load(pair_dir, threads=threads, device=device, history_cap=history_cap,
                        draft_model=_needs_draft(pending))
            pair.grammars = grammars  # the one that checked the records: its tokenizer view is built already
            for note in pair.notes:
                log(f"note: {note}")
            for tokens in out.earlier:  # what an uninterrupted run's history would hold at this point
                pair.state.history.add(tokens)
        elif pending:
            ray, own_ray = _ray_start(ray_address, ray_init)
        for r in todo:
            if r.error is not None:
                out.write(r.error_record())
                summary["errors"] += 1
        if summary["skipped"]:
            log(f"resuming: {summary['skipped']} of {len(records)} records already in {output_path}")
        bar = _Progress(len(pending), progress and bool(pending))
        t0 = time.perf_counter()
        if pair is not None:
            ids = {r.key: r.id for r in pending}
            runner = Runner(pair, batch_size, log)
            try:
                for key, res in runner.results(Request(r.key, r.prompt, r.cfg) for r in pending):
                    out.write(result_record(ids[key], res))
                    bar.update(res)
                    summary["errors"] += isinstance(res, SpecrtError)
            finally:
                runner.close()
            summary["batch_size"] = runner.chosen
        elif ray is not None:
            summary["batch_size"] = _run_ray(ray, pair_dir, pending, batch_size, out, bar, ray_actors,
                                             ray_cpus_per_actor, log, history_cap)
        else:
            log(f"nothing to run: all {len(records)} records are in {output_path}")
        summary["wall_s"] = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
        out.close()
        grammars.close()
        if pair is not None:
            pair.close()
        if ray is not None and own_ray:
            ray.shutdown()
    summary["written"] = out.written
    summary["new_tokens"] = bar.tokens
    summary["tokens_per_s"] = bar.tokens / summary["wall_s"] if summary["wall_s"] else 0.0
    summary["acceptance_rate"] = bar.acceptance
    log(f"wrote {out.written} records to {output_path} ({summary['errors']} errors, {summary['skipped']} already "
        f"there): {bar.tokens} tokens, {summary['tokens_per_s']:.1f} tok/s, acceptance {bar.acceptance:.0%}, "
        f"batch size {summary['batch_size']}")
    return summary


# ---------------------------------------------------------------------------------------------- Ray


class RayWorker:
    """A Ray actor (wrapped by ray.remote at run time): loads the pair once, decodes shards."""

    def __init__(self, pair_dir: str, batch_size, threads: int, draft_model: bool = True,
                 history_cap: int = HISTORY_CAP):
        self.pair = load(pair_dir, threads=threads, device="cpu", draft_model=draft_model, history_cap=history_cap)
        self.runner = Runner(self.pair, batch_size)

    def run(self, shard: list[tuple[str, list[int], GenerationConfig]]) -> tuple[list[tuple[str, Any]], int | None]:
        done = list(self.runner.results(Request(k, p, c) for k, p, c in shard))
        return done, self.runner.chosen


def _ray_start(address: str, init: dict | None):
    """Import Ray and start a local instance ("local") or join a cluster. Returns (the ray module,
    whether this job connected it and so shuts it down at the end). A process already connected to
    Ray (a notebook, a test) keeps its connection: the job runs there and leaves it on."""
    try:
        import ray
    except ImportError:
        raise JobError("--ray needs Ray: pip install 'ray[default]' (or specrt[ray])") from None
    if address not in ("local", "auto"):  # ray.init retries an unreachable address for minutes: probe it first
        hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise JobError(f"bad Ray address {address!r}: expected HOST:PORT, ray://HOST:PORT, auto or local")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as e:
            raise JobError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None
    if ray.is_initialized():
        return ray, False
    kw = {"address": address, "include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if address == "local":
        kw.update(object_store_memory=256 * 1024 * 1024, num_cpus=os.cpu_count())
    kw.update(init or {})
    try:
        ray.init(**kw)
    except Exception as e:  # ray raises ConnectionError, RuntimeError, ValueError... with long texts
        msg = first_line(e)
        raise JobError(f"cannot start or join Ray at {address}: {msg}") from None
    return ray, True


def _needs_draft(pending: list[Record]) -> bool:
    """Whether a record drafts with the draft model: a job that drafts by prompt lookup leaves it out (its memory)."""
    return any(needs_draft_model(r.cfg.drafter, r.cfg.draft_len) for r in pending)


def _run_ray(ray, pair_dir: Path, pending: list[Record], batch_size, out: JobOutput, bar: _Progress,
             actors: int | None, cpus_per_actor: int, log, history_cap: int = HISTORY_CAP) -> int | str:
    cpus = int(ray.cluster_resources().get("CPU", 1))
    n = actors or max(1, cpus // cpus_per_actor)
    size = 32 if batch_size == "auto" else max(8, 4 * int(batch_size))
    size = max(1, min(size, math.ceil(len(pending) / n)))
    shards = [pending[i:i + size] for i in range(0, len(pending), size)]
    log(f"ray: {n} actors x {cpus_per_actor} CPU, {len(shards)} shards of <= {size} records")
    Worker = ray.remote(num_cpus=cpus_per_actor)(RayWorker)
    workers = [Worker.remote(str(pair_dir.resolve()), batch_size, cpus_per_actor, _needs_draft(pending),
                             history_cap) for _ in range(n)]
    ids = {r.key: r.id for r in pending}
    queue = list(reversed(shards))
    inflight = {}
    chosen = set()

    def submit(w):
        if queue:
            shard = queue.pop()
            inflight[w.run.remote([(r.key, r.prompt, r.cfg) for r in shard])] = w

    for w in workers:  # two shards per actor in flight: no idle gap between shards
        submit(w)
        submit(w)
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1)
        w = inflight.pop(ready[0])
        try:
            done, b = ray.get(ready[0])
        except Exception as e:
            raise JobError(f"a Ray actor failed: {first_line(e, last=True)}; "
                           "the records written so far are kept, rerun to resume") from None
        chosen.add(b)
        for key, res in done:
            out.write(result_record(ids[key], res))
            bar.update(res)
        submit(w)
    return ",".join(str(b) for b in sorted(chosen)) if len(chosen) > 1 else next(iter(chosen))
