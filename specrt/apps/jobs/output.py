"""A batch job's output file: durable appends, resume after a kill, and the job-identity sidecar.

Every record is one `os.write` of the whole line on an O_APPEND descriptor, fsync'ed every FSYNC_EVERY
records, every FSYNC_SECONDS and at the end; on open, a torn last line is cut off and the ids already
written are known (a rerun skips them). `OUTPUT.job.json` holds the job's identity (job_identity): an
output of another job is refused unless `overwrite`."""
from __future__ import annotations

import collections
import fcntl
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from specrt.api import requests
from specrt.apps.jobs.input import JobError, JobSettings
from specrt.errors import SpecrtError
from specrt.manifest import sha256_file

JOB_FORMAT = "specrt-batch-job"
JOB_VERSION = 1
SIDECAR_SUFFIX = ".job.json"
FSYNC_EVERY = 16  # records
FSYNC_SECONDS = 1.0


def record_key(rec: dict) -> str:
    """An output record's identity across runs: json.dumps of its id, or "line N" for a malformed line's
    (id null), which is no JSON text and so equals no id's."""
    if rec["id"] is None and type(rec.get("line")) is int:
        return f"line {rec['line']}"
    return json.dumps(rec["id"], ensure_ascii=False)


def job_identity(pair_dir: Path, m, input_sha256: str, s: JobSettings) -> dict:
    tok = {f: sha256_file(Path(pair_dir) / f) for f in m.tokenizer_files if (Path(pair_dir) / f).is_file()}
    return {"format": JOB_FORMAT, "version": JOB_VERSION, "input_sha256": input_sha256,
            "pair_graphs": m.graph_hashes(), "tokenizer": tok, "settings": asdict(s)}


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
        if isinstance(settings, dict) and "min_tokens" not in settings:
            # written before jobs took min_tokens and a job-wide stop: none
            theirs["settings"] = {**theirs["settings"], "min_tokens": 0, "stop": None}
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
