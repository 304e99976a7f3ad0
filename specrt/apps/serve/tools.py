"""Tool calls on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The pair's chat template shows the model the tools; the model answers a call as a `<tool_call>` block holding
{"name", "arguments"} (the convention of Qwen2.5's and Hermes' templates), which the reply is parsed for and
returned as OpenAI's `tool_calls`. `tool_choice`:
- "auto" (the default with tools): the model chooses, free text or calls;
- "required", or a named function: the reply is constrained (decoding/constraint.py) to calls whose
  arguments validate against the functions' parameter schemas, of that function only when named;
- "none": no call; the tools are not shown to the model.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specrt.api.grammar_check import JSON_STYLE
from specrt.api.requests import RequestError
from specrt.config import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class Tools:
    """A request's tools as the server uses them."""

    render: list[dict] | None  # what the chat template shows (None: nothing)
    names: frozenset[str]  # the functions a reply may call
    grammar: Grammar | None  # "required" or a named function: the calls' grammar
    parallel: bool


def tools_of(body: dict, codec) -> Tools | None:
    """The request's tools (None: it has none, or tool_choice "none"); RequestError for a bad one."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {name, parameters}}",
                           param="tools")
    functions = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise RequestError(f"tools[{i}] must be " + '{"type": "function", "function": {"name": letters, digits, '
                               '_ or - (at most 64), "parameters": a JSON schema}}', param="tools")
        params = f.get("parameters", {})
        if not isinstance(params, dict) or params.get("type", "object") != "object":  # arguments are an object
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema of type \"object\"",
                               param="tools")
        if f["name"] in functions:
            raise RequestError(f"tools[{i}]: the function {f['name']!r} is given twice", param="tools")
        functions[f["name"]] = {"type": "object", **params}
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if choice is None or choice == "auto":
        called = None
    elif choice == "none":
        return None
    elif choice == "required":
        called = list(functions)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in functions:
            raise RequestError(f"tool_choice.function.name must name a function in 'tools', got "
                               f"{json.dumps(name)[:80]}", param="tool_choice")
        called = [name]
    else:
        raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param="tool_choice")
    if not codec.renders_tools:
        raise RequestError("this pair's chat template does not show tools to the model", param="tools")
    grammar = None if called is None else Grammar("lark", calls_grammar({n: functions[n] for n in called}, parallel, codec))
    return Tools(list(tools), frozenset(functions), grammar, parallel)


def calls_grammar(functions: dict[str, dict], many: bool, codec) -> str:
    """A Lark grammar (llguidance's) of one tool call block, or of several (`many`), of these functions; a
    newline may end it (the blocks' own separator, after which the model may still end). Each function's
    arguments are a `%json` rule of their own, so that its parameters are their own schema's root: their
    `#/$defs/...` and `#` mean what they say, not a place in a schema wrapping every function's."""
    nl = json.dumps("\n")  # a newline as the grammar spells it
    lines = [f"start: call ({nl} call)* {nl}?" if many else f"start: call {nl}?",
             f"call: {_token(codec, OPEN)} {nl} body {nl} {_token(codec, CLOSE)}",
             "body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    for i, (name, params) in enumerate(functions.items()):
        head = '{"name": ' + json.dumps(name) + ', "arguments": '  # the object as JSON_STYLE writes it
        lines += [f"fn{i}: {json.dumps(head)} args{i} {json.dumps('}')}",
                  f"args{i}: %json {json.dumps({**params, 'x-guidance': JSON_STYLE})}"]
    return "\n".join(lines + [""])


def _token(codec, text: str) -> str:
    """The grammar's name for `text`: its token when the tokenizer has it as one (a special token is no text
    to match), else the text."""
    i = codec.tokenizer.token_to_id(text)
    return f"<[{i}]>" if i is not None else json.dumps(text)


def parse(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """A whole reply as (content, OpenAI tool_calls), read as StreamedCalls reads it streamed, so that both
    give the same: each well-formed block calling a known function becomes a call; what is left (blocks
    that are not calls included) is the content (None when empty and there are calls)."""
    s = StreamedCalls(tools)
    items = s.feed(text) + s.finish()
    content = "".join(x for x in items if isinstance(x, str))
    calls = [{k: v for k, v in x.items() if k != "index"} for x in items if isinstance(x, dict)]
    return (content or None) if calls else content, calls


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _bare(text: str, tools: Tools) -> dict | None:
    """A reply that is nothing but one call's JSON, bare or in a ```json fence (how some models, the default
    pair's Qwen2.5-Coder among them, answer when the choice is theirs), as a call."""
    s = text.strip()
    m = _FENCE.match(s)
    return _call(m.group(1) if m else s, tools) if m or s.startswith("{") else None


def _call(inner: str, tools: Tools) -> dict | None:
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):  # not JSON, an integer past Python's digit limit, nested too deep
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
    try:
        args.encode("utf-8")
    except UnicodeEncodeError:  # an escape such as "\ud800" (a lone surrogate) stays an escape
        args = json.dumps(obj.get("arguments", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


class StreamedCalls:
    """A streamed reply split into content deltas and tool calls: text is passed on as it comes, except from
    the start of a `<tool_call>` block (or what may be one) until its end, which is passed on as one call,
    and a reply that may be one bare call, held to its end. Whitespace that ends the content is held back
    until content follows it: a reply with calls ends with none (the newline after a call block is no
    content), nor does its content start with whitespace where a call came first."""

    def __init__(self, tools: Tools):
        self.tools, self.buf, self.calls = tools, "", 0
        self.held = ""  # the reply so far while it may be one bare call (`_bare`): sent at its end
        self.holding = True
        self.space = ""  # whitespace that ends the content so far, not sent yet
        self.said = False  # content other than whitespace was sent

    def feed(self, text: str) -> list[str | dict]:
        """What to send for a chunk: content strings and tool-call dicts (OpenAI's delta.tool_calls items)."""
        if self.holding:
            self.held += text
            s = self.held.lstrip()
            if not s or s.startswith(("{", "```")) or "```".startswith(s):
                return []
            self.holding, text, self.held = False, self.held, ""
        return self._scan(text)

    def _scan(self, text: str) -> list[str | dict]:
        self.buf += text
        out = []
        while self.buf:
            i = self.buf.find(OPEN)
            if i < 0:
                keep = len(self.buf) - _partial(self.buf, OPEN)  # the end may begin a block
                out += self._content(self.buf[:keep])
                self.buf = self.buf[keep:]
                break
            if i:
                out += self._content(self.buf[:i])
                self.buf = self.buf[i:]
            j = self.buf.find(CLOSE)
            if j < 0:
                break  # inside a block: wait for its end
            block, self.buf = self.buf[:j + len(CLOSE)], self.buf[j + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)], self.tools) if self.calls == 0 or self.tools.parallel else None
            if call is None:
                out += self._content(block)
            else:
                out.append({"index": self.calls, **call})
                self.calls += 1
        return out

    def _content(self, text: str) -> list[str]:
        """Content to send: whitespace at its end waits for what follows; after a call, none starts it."""
        text = self.space + text
        if self.calls and not self.said:
            text = text.lstrip()
        body = text.rstrip()
        self.space = text[len(body):]
        self.said = self.said or bool(body)
        return [body] if body else []

    def finish(self) -> list[str | dict]:
        """What is left at the end (an unfinished block is content)."""
        out = []
        if self.holding:
            self.holding, held, self.held = False, self.held, ""
            call = _bare(held, self.tools)
            if call is not None:
                self.calls += 1
                return [{"index": 0, **call}]
            out = self._scan(held)
        rest, self.buf = self.buf, ""
        out += self._content(rest)
        if not self.calls and self.space:
            out.append(self.space)
        self.space = ""
        return out


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
