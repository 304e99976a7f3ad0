"""OpenAI's protocol shapes the server answers with: the error object (APIError) and the response objects of
a request, whole or streamed (Shape)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from specrt.apps.serve.scheduler import ShuttingDown
from specrt.apps.serve.tools import StreamedCalls, Tools
from specrt.apps.serve.tools import parse as tools_parse
from specrt.errors import SpecrtError

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # OpenAI's finish_reason for ours


class APIError(Exception):
    """An error the client gets as an OpenAI error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def as_api_error(e: BaseException) -> APIError:
    """The error object a failed request's client gets: 503 when the server is stopping, 400 for a bad
    request, 500 (and nothing more) for anything else."""
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), kind="server_error")
    if isinstance(e, SpecrtError):
        return APIError(400, str(e))
    return APIError(500, "internal error (see the server's log)", kind="server_error")


@dataclass
class Shape:
    """OpenAI's response objects for one request (with `tools`, its reply parsed for tool calls)."""

    rid: str
    model: str
    chat: bool
    prompt_tokens: int
    tools: Tools | None = None

    def __post_init__(self):
        self.calls = StreamedCalls(self.tools) if self.tools is not None else None

    def _obj(self, choices: list, stream: bool, **extra) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model,
                "choices": choices, **extra}

    def usage(self, res) -> dict:
        n = len(res.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": int(res.stats.get("prompt_cached", 0))}}

    def whole(self, res) -> dict:
        fr = FINISH.get(res.finish_reason, res.finish_reason)
        message = {"role": "assistant", "content": res.text}
        if self.tools is not None:
            content, calls = tools_parse(res.text, self.tools)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                fr = "tool_calls" if fr == "stop" else fr
        choice = ({"index": 0, "message": message, "logprobs": None, "finish_reason": fr}
                  if self.chat else {"index": 0, "text": res.text, "logprobs": None, "finish_reason": fr})
        return self._obj([choice], False, usage=self.usage(res), specrt=_stats(res))

    def delta(self, text: str, first: bool = False) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": text} if first else {"content": text}
            return self._obj([{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}], True)
        return self._obj([{"index": 0, "text": text, "logprobs": None, "finish_reason": None}], True)

    def deltas(self, text: str) -> list[dict]:
        """The chunks of a piece of streamed text: content, or (with tools) whole tool calls."""
        return [self.delta(text)] if self.calls is None else self._chunks(self.calls.feed(text))

    def _chunks(self, items: list) -> list[dict]:
        """Chunks of content strings and tool calls (StreamedCalls' items)."""
        return [self.delta(x) if isinstance(x, str) else self._obj(
            [{"index": 0, "delta": {"tool_calls": [x]}, "logprobs": None, "finish_reason": None}], True)
            for x in items]

    def last(self, res, with_usage: bool) -> list[dict]:
        fr = FINISH.get(res.finish_reason, res.finish_reason)
        out = []
        if self.calls is not None:
            out += self._chunks(self.calls.finish())
            fr = "tool_calls" if self.calls.calls and fr == "stop" else fr
        end = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": fr} if self.chat else \
            {"index": 0, "text": "", "logprobs": None, "finish_reason": fr}
        out.append(self._obj([end], True, specrt=_stats(res)))
        if with_usage:
            out.append(self._obj([], True, usage=self.usage(res)))
        return out


def _stats(res) -> dict:
    """A result's stats as the `specrt` field shows them: NaN and infinities (no JSON numbers) as null."""
    st = dict(res.stats)
    st["finish_reason"] = res.finish_reason
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in st.items()}
