"""What a batch job is asked to do: its settings, resolved against the pair, and its input's records, each
parsed and checked into a prompt and a GenerationConfig (or an error record) before anything runs."""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, make_dataclass, replace
from pathlib import Path
from typing import Any

from specrt.api import requests
from specrt.api.grammars import Grammars
from specrt.api.text import check_text
from specrt.config import GenerationConfig, needs_draft_model
from specrt.errors import ConfigError, SpecrtError


class JobError(SpecrtError):
    """A batch job cannot start or go on (its output file, its input, or the Ray cluster)."""


# the settings a job takes for all its records (`specrt batch`'s options), by the names of api/requests.TABLE
JOB_FIELDS = tuple(f for f in requests.fields_of("job") if f != "seed")
# what a record may set for itself; the rest of its settings are the job's (and part of its identity)
RECORD_FIELDS = requests.fields_of("record")

JobSettings = make_dataclass(
    "JobSettings", [(f, Any, None) for f in JOB_FIELDS]
    + [("seed", int, 0), ("chat", bool, False), ("greedy_draft_len", Any, None), ("greedy_drafter", Any, None)],
    frozen=True)
JobSettings.__module__ = __name__
JobSettings.__doc__ = """A job's settings: the request settings of JOB_FIELDS every record gets unless it gives its own (None:
the default); `seed`, the base of each record's seed (record_seed); `chat`, text prompts wrapped in the chat
template. Resolved (resolve_settings) they name what runs: the defaults filled in, and the greedy_* fields
what greedy and coupled records draft with when the job named no draft length (see the package's text)."""


@dataclass
class Record:
    line: int
    id: Any  # as given (str or int); None when the line has no usable id
    key: str  # identity across runs: output.record_key of its output record
    prompt: list[int] | None = None
    cfg: GenerationConfig | None = None
    error: str | None = None

    def error_record(self) -> dict:
        """{"id", "error"}; a malformed line's {"id": null, "line", "error"} (see the package's text)."""
        if self.id is None:
            return {"id": None, "line": self.line, "error": self.error}
        return {"id": self.id, "error": self.error}


def _malformed(n: int, why: str) -> Record:
    return Record(n, None, f"line {n}", error=f"line {n}: {why}")


# ---------------------------------------------------------------------------------------------- settings


def resolve_settings(m, s: JobSettings) -> JobSettings:
    """Fill the defaults in, so that the job identity names what actually runs."""
    tuned = m.tuned or {}
    if tuned and tuned.get("graphs") != m.graph_hashes():
        tuned = {}  # loading the pair refuses such a manifest anyway (Pair)
    has_draft = m.draft is not None
    # a fixed length (a batch row's default) for sampled records, or for all when the job names one
    drafter, k, cs = requests.defaults(m, tuned, has_draft, batched=s.draft_len != "auto")
    plain = {f: requests.builtin(f) for f in ("max_new_tokens", "min_tokens", "temperature", "top_k", "top_p")
             if getattr(s, f) is None}
    out = replace(s, **plain, drafter=s.drafter or drafter, draft_len=k if s.draft_len is None else s.draft_len,
                  confidence_stop=cs if s.confidence_stop is None else s.confidence_stop,
                  greedy_draft_len=None, greedy_drafter=None,
                  sampling=s.sampling or "coupled")  # every record is seeded (record_seed): api/requests.parse
    if s.draft_len is None:  # greedy records draft as a request alone would
        g_drafter, g_len, _ = requests.defaults(m, tuned, has_draft)
        out = replace(out, greedy_draft_len=g_len, greedy_drafter=s.drafter or g_drafter)
    # Checks of the job-wide settings: a ConfigError before anything runs.
    requests.check_settings(m, _config(m, out, {}, 0))
    requests.check_settings(m, _config(m, out, {"temperature": 1.0}, 0))
    return out


def record_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") >> 1


def sampled_records(s: JobSettings) -> requests.Layer:
    """The jobs' rule for drafting, a layer over the job's settings: where the job named no draft length,
    greedy and coupled records (their tokens do not depend on the drafts) draft as a request alone would
    (auto), rejection-sampled ones a fixed length, so that their draws never follow timings."""
    def layer(above: dict) -> dict:
        greedy = above.get("temperature", s.temperature) == 0
        coupled = above.get("sampling", s.sampling) == "coupled"
        if s.greedy_draft_len is None or not (greedy or coupled):
            return {}
        return {"draft_len": s.greedy_draft_len, "drafter": s.greedy_drafter}
    return layer


def _config(m, s: JobSettings, rec: dict, seed: int) -> GenerationConfig:
    """A record's settings: its own RECORD_FIELDS, then its seed, the jobs' rule for sampled records, the job's
    settings (api/requests.settings); a record's own constraint replaces the job's."""
    own = {f: rec.get(f) for f in RECORD_FIELDS}
    return requests.settings(m, {}, m.draft is not None, own, {"seed": seed}, sampled_records(s),
                             {f: getattr(s, f) for f in JOB_FIELDS}, batched=True)


def job_grammar(s: JobSettings):
    """The job-wide constraint's grammar (what a record without its own is constrained by), or None."""
    return requests.parse(requests.chain({f: getattr(s, f) for f in requests.CONSTRAINTS})).get("grammar")


# ---------------------------------------------------------------------------------------------- records


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
    records = [_record(n, line, codec, m, s, grammars) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    seen = {}
    for r in records:
        if r.key in seen:
            raise JobError(f"{path}: duplicate id {r.id!r} on lines {seen[r.key]} and {r.line}; ids must be unique")
        seen[r.key] = r.line
    if not records:
        raise JobError(f"input {path} holds no records")
    return records, hashlib.sha256(raw).hexdigest()


def _record(n: int, line: str, codec, m, s: JobSettings, grammars: Grammars | None) -> Record:
    """Line `n` of the input as a Record: its prompt and settings, or its error."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        return _malformed(n, f"not JSON ({e.msg})")
    except ValueError:  # what json raises for an integer past Python's int-digit limit
        return _malformed(n, f"an integer longer than {sys.get_int_max_str_digits()} digits")
    except RecursionError:
        return _malformed(n, "JSON nested too deep")
    rid = rec.get("id") if isinstance(rec, dict) else None
    if not isinstance(rec, dict) or isinstance(rid, bool) or not isinstance(rid, (str, int)):
        why = "not a JSON object" if not isinstance(rec, dict) else (
            'no "id"' if rid is None else f'"id" must be a string or an integer, got {rid!r}')
        return _malformed(n, why)
    try:
        if isinstance(rid, str):
            check_text(rid, '"id"')
    except ConfigError as e:  # such an id could be neither written nor known again on a rerun
        return _malformed(n, str(e))
    r = Record(n, rid, json.dumps(rid, ensure_ascii=False))
    try:
        r.prompt = _encode(codec, m, rec, s.chat)
        r.cfg = _config(m, s, rec, record_seed(s.seed, r.key))
        requests.check(m, r.prompt, r.cfg, batched=True)
        if r.cfg.grammar is not None and grammars is not None:
            grammars.check(r.cfg.grammar)
    except (ValueError, TypeError, SpecrtError) as e:
        r.prompt = r.cfg = None
        r.error = f"line {n}: {e}"
    return r


def needs_draft(pending: list[Record]) -> bool:
    """Whether a record drafts with the draft model: a job that drafts by prompt lookup leaves it out (its memory)."""
    return any(needs_draft_model(r.cfg.drafter, r.cfg.draft_len) for r in pending)
