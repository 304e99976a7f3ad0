"""What settings a request runs with: the one table of them (TABLE: each setting's kind, help and the front
ends that expose it), the one parser, and the one resolver that decides a default and checks it.

Every front end (`Pair.generate`/`stream`, `generate_batch`, the CLIs, the server, batch jobs) hands the
request's raw settings by name to `settings`: its layers in order (the request's own, then the front end's
defaults), each value checked for its kind (`parse`), then `resolve` into a `GenerationConfig`, where
`defaults` is the rule for what no layer gave (`specrt tune`'s choice, then the built-in one); its prompt goes
to `prompt_ids`:

- a request alone: what `specrt tune` stored, else the hybrid drafter (the fastest setting measured
  overall, bench/RESULTS.md) at draft_len "auto", or prompt lookup (ngram) without a draft model;
- a row of a batch (`batched=True`: `generate_batch`, a batch job without --draft-len auto): the tuned
  length if it is a number, else min(4, max_draft_len); drafter the tuned one, else the draft model
  (batches were measured with it), or prompt lookup without one;
- a server's request run as a batch row while the server fixes batched rows' length (`as_batch_row`):
  its "auto" becomes that length.

`tuned` is the pair's stored `specrt tune` result (Pair.tuned; {} when untuned or loaded with
use_tuned=False); a tuned drafter that needs a draft model that is not loaded is ignored.
"""
from __future__ import annotations

import json
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from specrt.api.text import JSONText
from specrt.config import GenerationConfig, Grammar, SamplingConfig, needs_draft_model
from specrt.errors import ConfigError, first_line, show


def tuned_drafter(tuned: dict | None, has_draft: bool) -> str | None:
    """The drafter `specrt tune` chose, unless it needs a draft model that is not loaded."""
    chosen = (tuned or {}).get("drafter")
    return chosen if chosen and (has_draft or not needs_draft_model(chosen)) else None


def defaults(m, tuned: dict | None, has_draft: bool, batched: bool = False) -> tuple[str, int | str, float]:
    """(drafter, draft_len, confidence_stop) of a request that names none of them (see the module's text).
    `m`: the pair's Manifest; `has_draft`: a draft model is loaded (or, before loading, would be)."""
    tuned = tuned or {}
    drafter = tuned_drafter(tuned, has_draft)
    if batched:
        k = tuned.get("draft_len")
        k = min(k, m.max_draft_len) if isinstance(k, int) and not isinstance(k, bool) else min(4, m.max_draft_len)
        return drafter or ("model" if has_draft else "ngram"), k, tuned.get("confidence_stop", 0.0)
    return drafter or ("hybrid" if has_draft else "ngram"), tuned.get("draft_len", "auto"), tuned.get("confidence_stop", 0.0)


def resolve(m, tuned: dict | None, has_draft: bool, *, batched: bool = False, prompt: list[int] | None = None,
            draft_len=None, drafter: str | None = None, confidence_stop: float | None = None,
            **fields) -> GenerationConfig:
    """The request's GenerationConfig: `fields` as given (GenerationConfig's own checks), the drafting
    choices it leaves unset (None) from `defaults`; with `prompt`, also checked against the pair (`check`)."""
    d_drafter, d_len, d_stop = defaults(m, tuned, has_draft, batched)
    cfg = GenerationConfig(draft_len=d_len if draft_len is None else draft_len, drafter=drafter or d_drafter,
                           confidence_stop=d_stop if confidence_stop is None else confidence_stop, **fields)
    if prompt is not None:
        check(m, prompt, cfg, draft_left_out=not has_draft and m.draft is not None, batched=batched)
    return cfg


Layer = Mapping | Callable[[dict], Mapping]


def chain(*layers: Layer) -> dict:
    """A request's settings from `layers` in order of precedence, each a mapping by the names of TABLE, or a
    function of what the layers above it set: every setting from the first layer that sets it (None: unset),
    checked for its kind. The constraint is one slot: a layer's json_schema, regex, grammar or
    response_format replaces every lower layer's."""
    out: dict = {}
    for layer in layers:
        given = layer(dict(out)) if callable(layer) else layer
        constrained = any(c in out for c in CONSTRAINTS)
        for name, v in given.items():
            if v is not None and name not in out and not (constrained and name in CONSTRAINTS):
                out[name] = _value(name, v)
    return out


def settings(m, tuned: dict | None, has_draft: bool, *layers: Layer, batched: bool = False,
             prompt: list[int] | None = None) -> GenerationConfig:
    """The one resolver of a request's settings: `layers` in order (the request's own first, then its front
    end's defaults: the server's, a job's, a named rule like a job's for sampled records), then what `specrt
    tune` chose, then the built-in defaults (`defaults`, GenerationConfig's). A seed given by the request
    itself (the first layer) makes a sampled request coupled unless it names its sampling (`parse`)."""
    own = layers[0] if layers and not callable(layers[0]) else {}
    return resolve(m, tuned, has_draft, batched=batched, prompt=prompt,
                   **parse(chain(*layers), seeded=own.get("seed") is not None))


def as_batch_row(cfg: GenerationConfig, batch_draft_len: int) -> GenerationConfig:
    """A request resolved to run alone, run as a row of a batch whose rows the server fixes at
    `batch_draft_len` (`specrt serve --batch-draft-len`): draft_len "auto" becomes that length."""
    return replace(cfg, draft_len=batch_draft_len) if cfg.draft_len == "auto" else cfg


SEED_LIMIT = 2**63  # seeds are OpenAI's int64s that are >= 0: coupled sampling reads them modulo 2**64


def check_settings(m, cfg: GenerationConfig, draft_left_out: bool = False, batched: bool = False) -> None:
    """Raise ConfigError for settings the pair cannot run whatever the prompt: a seed of 2**63 or more (it
    would give another seed's text), a draft length above its max_draft_len ("auto" as a batch row), a
    drafter that needs a draft model it lacks."""
    if cfg.seed >= SEED_LIMIT:
        raise RequestError(f"seed must be below 2**63 (an int64), got {show(cfg.seed)}", param="seed")
    k = m.max_draft_len if cfg.draft_len == "auto" else cfg.draft_len
    if k > m.max_draft_len:
        raise ConfigError(f"draft_len {cfg.draft_len} is above this pair's max_draft_len {m.max_draft_len} "
                          "(set at export with --max-draft-len)", param="draft_len")
    if needs_draft_model(cfg.drafter, k) and (m.draft is None or draft_left_out):
        what = ("the pair was loaded without its draft model" if m.draft is not None
                else "this pair has no draft model")
        raise ConfigError(f"{what}, which drafter {cfg.drafter!r} needs; use drafter 'ngram' or 'suffix', "
                          "or draft_len 0", param="drafter")


def check(m, prompt: list[int], cfg: GenerationConfig, draft_left_out: bool = False, batched: bool = False) -> None:
    """Raise ConfigError for a request the pair (manifest `m`) cannot run: its settings (`check_settings`),
    then its prompt and the cache room. `draft_left_out`: the pair was loaded without its draft model."""
    check_settings(m, cfg, draft_left_out, batched)
    k = m.max_draft_len if cfg.draft_len == "auto" else cfg.draft_len
    if not prompt:
        raise ConfigError("the prompt is empty")
    if len(prompt) >= m.max_len:
        raise ConfigError(f"the prompt has {len(prompt)} tokens; this pair's max_len is {m.max_len}")
    if len(prompt) + cfg.max_new_tokens + k + 1 > m.max_len:
        room = m.max_len - len(prompt) - k - 1
        fix = f"use max_new_tokens <= {room}" if room >= 1 else "use a shorter prompt or export with a larger --max-len"
        raise ConfigError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({show(cfg.max_new_tokens)}) + draft_len+1 "
                          f"exceeds max_len {m.max_len}; {fix}")


# ---------------------------------------------------------------------------------------------- parsing

class RequestError(ConfigError):
    """A request's field is missing or of the wrong kind; `param` names it (an HTTP 400)."""


ALL = ("server", "cli", "job", "record")


@dataclass(frozen=True)
class Field:
    """A request setting: `kind`, what its value must be (checked by `parse`); `fronts`, the front ends besides
    the Python API (which takes every one) that expose it: "server" (an OpenAI body's specrt fields), "cli"
    (`specrt generate`'s options), "job" (`specrt batch`'s job-wide options), "record" (a job record's own);
    `help`, what it does, for those front ends' help."""

    kind: str
    help: str
    fronts: tuple[str, ...] = ALL


# The one table of request settings: every front end takes these names (Python keywords, a JSONL record, an
# OpenAI body's fields, CLI flags) where it declares them. None anywhere means "unset": the default.
TABLE = {
    "max_new_tokens": Field("int", "Most new tokens (default 128; the server: max_tokens).", ("cli", "job", "record")),
    "min_tokens": Field("int", "No end of text before this many new tokens (default 0); a stop string still ends it."),
    "temperature": Field("num", "0 = greedy (the default; the server's is 1)."),
    "top_k": Field("int", "Keep the k most likely tokens (0 = off, the default)."),
    "top_p": Field("num", "Nucleus mass to keep (1.0 = off, the default)."),
    "seed": Field("int", "Random seed for sampling (0 when not given; the server: a random one). A seeded sampled "
                         "request samples coupled by default: the target-only sample of that seed, whatever drafts it."),
    "stop": Field("stops", "Stop string(s); the text ends before the first one that appears."),
    "draft_len": Field("draft_len", "Draft tokens per round (0 = target only), or 'auto' (chosen per round from measured "
                                    "acceptance and costs). Default: what `specrt tune` chose for this pair, else auto.",
                       ("server", "cli", "job")),
    "drafter": Field("str", "model: the pair's draft model; ngram: prompt lookup; suffix: prompt lookup over the request "
                            "and earlier outputs; hybrid: each round the policy chooses (default with a draft model). "
                            "Default: what `specrt tune` chose, if anything.", ("server", "cli", "job")),
    "draft_window": Field("int", "The most tokens the draft model reads in one catch-up; further behind, only the last "
                                 "ones (0 = no limit; default: 32 on the CPU, none on a GPU).", ("server", "cli")),
    "confidence_stop": Field("num", "Stop a model draft once its top probability falls below this (0 = never; "
                                    "default: tuned or 0).", ("server", "cli", "job")),
    "tree": Field("str", "auto: a round may verify a tree of drafts (the draft model's next choices, a lookup's "
                         "continuation) where the pair's target takes one and it pays; off: chains only. Default auto."),
    "ngram_max": Field("int", "Longest suffix (1..16 tokens) prompt lookup matches (default 16).", ("server", "cli")),
    "sampling": Field("str", "How a sampled request verifies drafts: coupled (the default with a seed: the seed gives "
                             "the target-only sample, whatever drafts it) or rejection (the default without)."),
    # structured output (at most one): a JSON schema, a regular expression, a Lark grammar, or OpenAI's
    # response_format object (the CLIs read schemas and grammars from files: cli/common.constraint_options)
    "json_schema": Field("schema", "The output matches this JSON schema."),
    "regex": Field("str", "The output matches this regular expression."),
    "grammar": Field("grammar", "The output matches this Lark grammar."),
    "response_format": Field("response_format", "OpenAI's response_format object."),
}
_KINDS = {name: f.kind for name, f in TABLE.items()}
FIELDS = tuple(TABLE)
CONSTRAINTS = ("json_schema", "regex", "grammar", "response_format")


def builtin(name: str):
    """The built-in default of setting `name` (GenerationConfig's, SamplingConfig's)."""
    return getattr(SamplingConfig(), name) if name in ("temperature", "top_k", "top_p") else getattr(GenerationConfig(), name)


def fields_of(front: str) -> tuple[str, ...]:
    """The settings a front end exposes ("api": all of them)."""
    return FIELDS if front == "api" else tuple(n for n, f in TABLE.items() if front in f.fronts)


_WHAT = {"int": "an integer", "num": "a number", "str": "a string", "stops": "a string or a list of strings",
         "grammar": "a string (a Lark grammar)",
         "draft_len": "an integer or 'auto'"}


def _value(name: str, v):
    kind, bad = _KINDS[name], False
    if kind == "int":
        bad = isinstance(v, bool) or not isinstance(v, numbers.Integral)
        v = v if bad else int(v)
    elif kind == "num":
        bad = isinstance(v, bool) or not isinstance(v, numbers.Real)
        try:
            v = v if bad else float(v)
        except OverflowError:  # an integer past float's range (JSON allows any number of digits)
            raise RequestError(f"{name} must be a finite number, got an integer too large for a float",
                               param=name) from None
    elif kind == "str":
        bad = not isinstance(v, str)
    elif kind == "schema":
        return v if isinstance(v, Grammar) else grammar_of(name, v)
    elif kind == "grammar":  # Lark text, or a Grammar of any kind (the Python API)
        bad = not isinstance(v, (str, Grammar))
    elif kind == "response_format":
        return v if isinstance(v, Grammar) else response_format(v)
    elif kind == "draft_len":
        bad = v != "auto" and (isinstance(v, bool) or not isinstance(v, numbers.Integral))
        v = v if bad or v == "auto" else int(v)
    elif isinstance(v, str):
        v = (v,)  # one stop string, not its letters
    elif isinstance(v, Iterable) and not isinstance(v, (bytes, bytearray, Mapping)):
        v = tuple(v)
        bad = not all(isinstance(s, str) for s in v)
    else:
        bad = True
    if bad:
        try:
            given = show(v) if isinstance(v, int) else json.dumps(v, default=repr)[:80]
        except ValueError:  # an integer past Python's digit limit inside a list
            given = type(v).__name__
        raise RequestError(f"{name} must be {_WHAT[kind]}, got {given}", param=name)
    return v


def parse(fields: Mapping, seeded: bool | None = None) -> dict:
    """The request settings among `fields` (any of FIELDS; other keys are the caller's), each checked for its
    kind: keyword arguments for `resolve` (unset ones left out). Ranges are GenerationConfig's checks. `seeded`: whether the request gave its own seed (default: whether `fields`
    hold one), which makes a sampled request coupled unless it names its sampling."""
    out = {name: _value(name, fields[name]) for name in FIELDS if fields.get(name) is not None}
    given = [name for name in CONSTRAINTS if name in out]
    if len(given) > 1:
        raise RequestError(f"give one of {', '.join(CONSTRAINTS)}, not {' and '.join(given)}", param=given[1])
    for name in given:
        g = out.pop(name)
        if name in ("regex", "grammar") and not isinstance(g, Grammar):
            g = Grammar("regex" if name == "regex" else "lark", g)
        if g is not None:
            out["grammar"] = g
    sampling = {n: out.pop(n) for n in ("temperature", "top_k", "top_p") if n in out}
    if "sampling" in out:
        sampling["method"] = out.pop("sampling")
    elif ("seed" in out) if seeded is None else seeded:
        # a seeded request samples coupled: its tokens are the target-only sample of its seed whatever drafts
        # them; unseeded ones keep rejection, whose acceptance is higher (docs/drafting.md)
        sampling["method"] = "coupled"
    if sampling:
        out["sampling"] = SamplingConfig(**sampling)
    return out


def check_names(fields: Mapping) -> None:
    """RequestError for a name among `fields` that is no setting (a typo the Python API must not ignore)."""
    if unknown := [k for k in fields if k not in TABLE]:
        raise RequestError(f"unknown setting {unknown[0]!r}; the settings are: {', '.join(FIELDS)}", param=unknown[0])


def grammar_of(name: str, schema) -> Grammar:
    """A JSON schema (a dict, or JSON text) as a request's Grammar."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{name} is not valid JSON: {e}", param=name) from None
        except RecursionError:
            raise RequestError(f"{name} is nested too deep", param=name) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{name} must be a JSON schema (an object), got {type(schema).__name__}", param=name)
    try:
        return Grammar("json_schema", json.dumps(schema, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError(f"{name} is not JSON data: {first_line(e)}", param=name) from None


def response_format(v) -> Grammar | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    kind = v.get("type") if isinstance(v, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_schema", '{"type": "object"}')
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, Mapping):
            raise RequestError("response_format json_schema needs a 'json_schema' object ({name, schema})",
                               param="response_format")
        schema = spec.get("schema")
        return grammar_of("response_format.json_schema.schema", {"type": "object"} if schema is None else schema)
    raise RequestError("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}"
                       + (f", got type {kind!r}" if kind is not None else ""), param="response_format")


def prompt_ids(codec, vocab_size: int, prompt=None, messages=None, chat: bool = False,
               tools: list[dict] | None = None) -> list[int]:
    """A request's prompt as token ids, the one rule for every front end: `prompt` text (with `chat`, wrapped
    as one user message), a list of token ids, or `messages` ([{role, content}], content a string or a list
    of text parts; an assistant's `tool_calls` and a tool reply's `tool_call_id` kept) through the tokenizer's
    chat template, which also renders `tools` (OpenAI's tool objects) when given."""
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
            msg = {"role": m["role"], "content": _content(m.get("content"), i)}
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            if isinstance(m.get("tool_call_id"), str):
                msg["tool_call_id"] = m["tool_call_id"]
            clean.append(msg)
        return _nonempty(codec.encode(codec.apply_chat_template(clean, tools)))
    if isinstance(prompt, str):
        if chat:
            prompt = codec.apply_chat_template([{"role": "user", "content": prompt}])
        return _nonempty(codec.encode(prompt))
    if isinstance(prompt, (bytes, bytearray, dict)) or not isinstance(prompt, Iterable):
        raise RequestError(f"the prompt must be a str or a list of token ids, got {type(prompt).__name__}",
                           param="prompt")
    ids = list(prompt)
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids):
        raise RequestError("a prompt given as a list must hold integer token ids", param="prompt")
    ids = [int(i) for i in ids]
    if any(not 0 <= i < vocab_size for i in ids):
        raise RequestError(f"prompt token ids must be in 0..{vocab_size - 1}", param="prompt")
    return _nonempty(ids)


def _content(content, i: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}]: 'content' must be a string or a list of text parts", param="messages")


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's earlier tool calls, as chat templates read them: each call's `arguments` (a
    JSON string in OpenAI's messages) as the object it encodes, which a template's `tojson` writes as the
    text given (api/text.JSONText), not that text encoded again."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list of tool calls", param="messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(f"{where}: each call needs a 'function' with a string 'name'", param="messages")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            text = args.strip() or "{}"
            try:
                args = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                raise RequestError(f"{where}: the arguments of {f['name']!r} are not JSON", param="messages") from None
            except ValueError:  # Python's bound on the digits an integer is read from
                raise RequestError(f"{where}: the arguments of {f['name']!r} hold an integer of more than "
                                   f"{sys.get_int_max_str_digits()} digits", param="messages") from None
            if isinstance(args, dict):
                args = JSONText(args, text)
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def _nonempty(ids: list[int]) -> list[int]:
    if not ids:
        raise RequestError("the prompt is empty", param="prompt")
    return ids
