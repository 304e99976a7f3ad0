"""A request's body read as OpenAI's fields: its prompt as token ids and its GenerationConfig, or the
APIError (400, 404) that says which field is wrong."""
from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass

from specrt.api import requests
from specrt.apps.serve.settings import ServeSettings
from specrt.apps.serve.shapes import APIError
from specrt.apps.serve.tools import Tools, tools_of
from specrt.config import GenerationConfig
from specrt.errors import SpecrtError

# Fields OpenAI defines that change the output and that specrt does not implement, with the values that
# mean "off": a request that sets one to anything else gets a 400, not a silently different answer.
UNSUPPORTED = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False,),
               "top_logprobs": (0,), "functions": ([],),
               "echo": (False,), "best_of": (1,), "suffix": ("",), "n": (1,)}


def _field(body: dict, name: str, kinds, default=None):
    """The body's field `name`, one of `kinds` (`default` when absent or null), else an APIError 400."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
        names = " or ".join(what.get(k, k.__name__) for k in kinds).replace("an integer or a number", "a number")
        raise APIError(400, f"'{name}' must be {names}, got {json.dumps(v)[:80]}", param=name)
    return v


def prompt_ids(pair, body: dict, chat: bool, tools: Tools | None = None) -> list[int]:
    """The request's prompt as token ids (api/requests.prompt_ids): chat `messages` (with the `tools` the
    template shows), or `prompt` (OpenAI also allows a list holding one prompt)."""
    if chat:
        where, fields = "messages", {"messages": body.get("messages"), "tools": tools.render if tools else None}
        if fields["messages"] is None:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # one prompt in a list
        where, fields = "prompt", {"prompt": p}
    try:
        return requests.prompt_ids(pair.codec, pair.manifest.vocab_size, **fields)
    except SpecrtError as e:  # a bad field, the chat template failing
        raise APIError(400, str(e), param=getattr(e, "param", None) or where) from None


def _off(value, noops: tuple) -> bool:
    """Whether `value` is one of `noops` (True is not 1, nor False 0)."""
    return any(type(value) is type(n) and value == n for n in noops) or (
        isinstance(value, float) and any(type(n) is int and value == n for n in noops))


def generation_config(pair, body: dict, prompt: list[int], defaults: ServeSettings | None = None,
                      tools: Tools | None = None, grammar: bool = True) -> GenerationConfig:
    """The request's settings (api/requests.parse, with OpenAI's names and defaults: `max_tokens` or
    `max_completion_tokens`, temperature 1 in [0, 2], a random seed); max_tokens is bounded by the room the
    cache leaves; a required or named tool call constrains the reply (apps/serve/tools.py). `grammar` False
    leaves the constraint's check to `check_grammar`."""
    for name, noops in UNSUPPORTED.items():
        if body.get(name) is not None and not _off(body[name], noops):
            allowed = " or ".join(json.dumps(n) for n in noops)
            raise APIError(400, f"'{name}' is not supported by specrt (supported: {allowed}, or unset)", param=name)
    m = pair.manifest
    room = m.max_len - len(prompt) - m.max_draft_len - 1  # what any draft length leaves
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is {m.max_len} tokens "
                            f"({m.max_draft_len + 1} of them kept for drafting)", param="messages" if "messages" in body else "prompt",
                       code="context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    try:
        own = {f: body.get(f) for f in requests.fields_of("server")}
        own = requests.chain({**own, "max_new_tokens": body.get(name)})  # the body's own, checked for kind
        given = own.get("max_new_tokens")
        if given is not None and given < 1:
            raise requests.RequestError(f"'{name}' must be >= 1, got {given}", param=name)
        if not own.get("temperature", 1.0) <= 2.0:
            raise requests.RequestError(f"'temperature' must be in [0, 2], got {own['temperature']}", param="temperature")
        if tools is not None and tools.grammar is not None:
            if any(own.get(c) is not None for c in requests.CONSTRAINTS):
                raise requests.RequestError("a required or named tool call and a response format cannot both "
                                            "constrain the reply", param="tool_choice")
            own["grammar"] = tools.grammar
        own["max_new_tokens"] = min(given or room, room)
        cfg = pair.settings(own, server_layer(defaults), prompt=prompt)
        if grammar and cfg.grammar is not None:
            pair.grammars.check(cfg.grammar)
    except SpecrtError as e:
        raise _bad_setting(e, body, name) from None
    return cfg


def server_layer(defaults: ServeSettings | None) -> dict:
    """The server's defaults under a request's own settings (OpenAI's): temperature 1, a random seed (which,
    not being the request's, leaves its sampling "rejection"), and `specrt serve`'s --draft-len/--drafter."""
    return {"temperature": 1.0, "seed": secrets.randbits(31),
            "draft_len": defaults.draft_len if defaults else None, "drafter": defaults.drafter if defaults else None}


def check_grammar(pair, body: dict, cfg: GenerationConfig) -> None:
    """APIError 400 unless the request's constraint starts (api/grammars.py: checked once per distinct one)."""
    try:
        pair.grammars.check(cfg.grammar)
    except SpecrtError as e:
        raise _bad_setting(e, body) from None


def _bad_setting(e: SpecrtError, body: dict, max_name: str = "max_tokens") -> APIError:
    param = getattr(e, "param", None)
    if param in requests.CONSTRAINTS:  # a grammar's error names the field that gave it
        param = next((f for f in requests.CONSTRAINTS if body.get(f) is not None), "tools")
    return APIError(400, str(e), param=max_name if param == "max_new_tokens" else param)


@dataclass
class Parsed:
    """A request read from its body: what to run, how to answer, and (`unchecked`) the body of a constraint
    whose grammar is new, to check before it runs (check_grammar)."""

    prompt: list[int]
    cfg: GenerationConfig
    stream: bool
    usage_in_stream: bool
    tools: Tools | None
    unchecked: dict | None


def parse_request(pair, settings: ServeSettings, raw: bytearray, chat: bool) -> Parsed:
    """The request in a body (chat: a /v1/chat/completions one); run off the event loop: tokenizing is slow."""
    body = parse_body(raw, settings.model)
    try:
        tools = tools_of(body, pair.codec) if chat else None
    except SpecrtError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    if not chat and body.get("tools"):
        raise APIError(400, "'tools' is for /v1/chat/completions", param="tools")
    prompt = prompt_ids(pair, body, chat, tools)
    cfg = generation_config(pair, body, prompt, settings, tools, grammar=False)
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    unchecked = None
    if cfg.grammar is not None:  # a grammar seen lately answers at once; a new one waits in its own thread
        if pair.grammars.known(cfg.grammar):
            check_grammar(pair, body, cfg)
        else:
            unchecked = body
    return Parsed(prompt, cfg, stream, _field(options, "include_usage", (bool,), False) and stream, tools, unchecked)


def parse_body(raw: bytearray, model: str) -> dict:
    """The body as a JSON object naming this server's `model` (or none)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: it nests too deep") from None
    except ValueError:  # Python's bound on the digits an int is read from
        raise APIError(400, f"the body holds an integer of more than {sys.get_int_max_str_digits()} "
                            "digits") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    given = body.get("model")
    if given is not None and given != model:
        raise APIError(404, f"the model {given!r} does not exist; this server serves {model!r}",
                       param="model", code="model_not_found", kind="not_found_error")
    return body
