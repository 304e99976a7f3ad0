"""`specrt serve`: an OpenAI-compatible HTTP server over one pair (FastAPI + uvicorn, the `serve` extra).

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or not),
GET /v1/models, GET (or HEAD) /health, GET /metrics (Prometheus text). Requests run through
apps/serve/scheduler.Scheduler; this module only translates between HTTP and it.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with the status that
fits (400 bad field or malformed HTTP, 401 key, 403 web origin, 404 route or model, 408 body too slow,
413 body too big, 415 body not sent as JSON, 421 foreign Host, 429 queue full, 500 anything else: one
line in the log, never a traceback to the client).
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import os
import secrets
import sys
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from specrt.apps.serve.scheduler import QueueFull, Scheduler, ShuttingDown
from specrt.apps.serve.tools import StreamedCalls, Tools, tools_of
from specrt.apps.serve.tools import parse as tools_parse
from specrt.api import requests
from specrt.config import GenerationConfig
from specrt.errors import SpecrtError

log = logging.getLogger("specrt.serve")

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # OpenAI's finish_reason for ours
# Fields OpenAI defines that change the output and that specrt does not implement, with the values that
# mean "off": a request that sets one to anything else gets a 400, not a silently different answer.
UNSUPPORTED = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False,),
               "top_logprobs": (0,), "functions": ([],),
               "echo": (False,), "best_of": (1,), "suffix": ("",), "n": (1,)}
MAX_HEADER_BYTES = 16384  # a request's line and headers
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # the names a keyless server answers to besides its own address
BIG_BODY = 16 << 10  # bytes: a body above it is parsed in the big prompts' thread (tokenizing: ~1 s a MB)


class APIError(Exception):
    """An error the client gets as an OpenAI error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServeSettings:
    """How the server runs: what it is called, who may use it, how big a body may be."""

    model: str  # the id clients pass as "model"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    draft_len: int | str | None = None  # a request's defaults (None: the pair's, `specrt tune`'s or auto)
    drafter: str | None = None
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers
    body_timeout: float = 30.0  # seconds a request may take to send its body
    max_connections: int = 64  # open connections (and running handlers) beyond which uvicorn answers 503
    hosts: tuple[str, ...] = LOCAL_HOSTS  # Host names (port aside) a server without a key answers
    cors_origins: tuple[str, ...] = ()  # web origins whose pages may call it ("*": any)


def host_name(value: str) -> str:
    """A Host header's (or --allow-host's) name, lowercase and without its port: '[::1]:80' -> '::1'."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:].partition("]")[0]
    return v if v.count(":") > 1 else v.partition(":")[0]  # a bare IPv6 address keeps its colons


# ---------------------------------------------------------------------------------------------- requests


def _field(body: dict, name: str, kinds, default=None):
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
    fields = {f: body.get(f) for f in requests.FIELDS if f != "max_new_tokens"}
    fields.update(max_new_tokens=body.get(name), temperature=1.0 if body.get("temperature") is None else body["temperature"])
    for f in ("draft_len", "drafter"):
        if fields[f] is None and defaults is not None:
            fields[f] = getattr(defaults, f)
    try:
        kw = requests.parse(fields)
        given = kw.get("max_new_tokens")
        if given is not None and given < 1:
            raise requests.RequestError(f"'{name}' must be >= 1, got {given}", param=name)
        if not kw["sampling"].temperature <= 2.0:
            raise requests.RequestError(f"'temperature' must be in [0, 2], got {kw['sampling'].temperature}",
                                        param="temperature")
        if tools is not None and tools.grammar is not None:
            if "grammar" in kw:
                raise requests.RequestError("a required or named tool call and a response format cannot both "
                                            "constrain the reply", param="tool_choice")
            kw["grammar"] = tools.grammar
        kw.update(max_new_tokens=min(given or room, room), seed=kw.get("seed", secrets.randbits(31)))
        cfg = pair.config(**kw)
        pair.check(prompt, cfg, grammar=grammar)
    except SpecrtError as e:
        raise _bad_setting(e, body, name) from None
    return cfg


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


# ---------------------------------------------------------------------------------------------- metrics


class Metrics:
    """Prometheus metrics, named as vLLM names its own where one exists (prefix `specrt:`)."""

    def __init__(self, scheduler_ref):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("specrt:request_success", "Requests finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.errors = Counter("specrt:request_errors", "Requests refused or failed, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("specrt:prompt_tokens", "Prompt tokens read", registry=r)
        self.prompt_cached = Counter("specrt:prefix_cache_hits", "Prompt tokens whose cache entries were kept from "
                                     "an earlier request", registry=r)
        self.generation_tokens = Counter("specrt:generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("specrt:e2e_request_latency_seconds", "Time from queueing to the last token",
                                 registry=r, buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80))
        self.ttft = Histogram("specrt:time_to_first_token_seconds", "Time from the start of a run to its first token",
                              registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.queue_time = Histogram("specrt:request_queue_time_seconds", "Time waiting in the queue", registry=r,
                                    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20))
        self.tps = Gauge("specrt:generation_tokens_per_second", "Tokens generated per second over the last 30 s",
                         registry=r)
        self.tps.set_function(self._rate)
        self.running = Gauge("specrt:num_requests_running", "Requests running", registry=r)
        self.running.set_function(lambda: scheduler_ref().running)
        self.waiting = Gauge("specrt:num_requests_waiting", "Requests waiting in the queue", registry=r)
        self.waiting.set_function(lambda: scheduler_ref().waiting)
        self.drafts = Counter("specrt:spec_decode_num_drafts", "Rounds that verified a draft", registry=r)
        self.draft_tokens = Counter("specrt:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specrt:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_at = Counter("specrt:spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.proposed_at = Counter("specrt:spec_decode_num_draft_tokens_per_pos",
                                   "Draft tokens proposed at each draft position", ["position"], registry=r)
        self.acceptance = Gauge("specrt:spec_decode_draft_acceptance_rate", "Accepted over proposed draft tokens",
                                registry=r)
        self.acceptance.set_function(lambda: self._accepted / self._proposed if self._proposed else 0.0)
        self._accepted = self._proposed = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (when, tokens) of finished requests

    def _rate(self) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 30.0:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / 30.0

    def finished(self, job, res) -> None:
        st = res.stats
        self.requests.labels(res.finish_reason).inc()
        self.prompt_tokens.inc(st.get("prompt_tokens", 0))
        self.prompt_cached.inc(st.get("prompt_cached", 0))
        self.generation_tokens.inc(len(res.tokens))
        self._recent.append((time.monotonic(), len(res.tokens)))
        self._rate()  # drops what is older than the window, scraped or not
        self.latency.observe(time.perf_counter() - job.queued_at)
        self.queue_time.observe(job.started_at - job.queued_at)
        if st.get("ttft_s"):
            self.ttft.observe(st["ttft_s"])
        self.drafts.inc(sum(n for k, n in st.get("draft_len_hist", {}).items() if int(k) > 0))
        self.draft_tokens.inc(st.get("proposed", 0))
        self.accepted.inc(st.get("accepted", 0))
        self._proposed += st.get("proposed", 0)
        self._accepted += st.get("accepted", 0)
        for i, (p, rate) in enumerate(zip(st.get("proposed_per_position", []), st.get("accepted_per_position", []))):
            self.proposed_at.labels(str(i)).inc(p)
            self.accepted_at.labels(str(i)).inc(round(p * rate))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---------------------------------------------------------------------------------------------- the app


def create_app(pair, scheduler: Scheduler, metrics: Metrics, settings: ServeSettings) -> FastAPI:
    app = FastAPI(title="specrt", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def error_response(e: APIError) -> JSONResponse:
        metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        log.info("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.error("%s %s -> 500: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return error_response(APIError(500, "internal error (see the server's log)", kind="server_error"))

    if settings.api_key is not None:
        app.add_middleware(_KeyCheck, key=settings.api_key.encode(), reject=lambda: error_response(
            APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")))
    if settings.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    def refuse(scope, e: APIError):
        log.info("%s %s -> %d: %s", scope["method"], scope["path"], e.status, e.message)
        return error_response(e)

    # outermost, so that a page of another site gets nothing of the routes, nor a CORS preflight's answer
    hosts = None if settings.api_key is not None else frozenset(map(host_name, settings.hosts))
    app.add_middleware(_Guard, hosts=hosts, origins=frozenset(settings.cors_origins), refuse=refuse)
    # A body is parsed, templated and tokenized off the event loop (tokenizing takes ~1 s a MB), in one of two
    # threads: big bodies in one, so that they neither take every core from decoding nor make small requests
    # wait behind them, small ones (a few ms at most) in the other. Two threads, not a pool that grows.
    bodies = ThreadPoolExecutor(1, thread_name_prefix="specrt-prompts")
    big_bodies = ThreadPoolExecutor(1, thread_name_prefix="specrt-big-prompts", initializer=_lower_priority)
    # new grammars are checked one at a time (api/grammars.py), in a thread of their own: a slow one delays
    # other new grammars only
    grammar_checks = ThreadPoolExecutor(1, thread_name_prefix="specrt-grammar-checks")

    async def read_body(request: Request) -> bytearray:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > settings.max_body_bytes:
            raise APIError(413, f"the body has {size} bytes; the limit is {settings.max_body_bytes} (--max-body-bytes)")
        # a page of another site can send text/plain (or no type) without the browser asking first: only JSON
        # declared as such is read
        kind = request.headers.get("content-type", "")
        if kind.partition(";")[0].strip().lower() != "application/json":
            raise APIError(415, "the body must be JSON sent with Content-Type: application/json, got "
                                + (repr(kind) if kind else "none"), code="unsupported_media_type")
        raw = bytearray()

        async def read():
            async for part in request.stream():
                raw.extend(part)
                if len(raw) > settings.max_body_bytes:
                    raise APIError(413, f"the body exceeds the limit of {settings.max_body_bytes} bytes "
                                        "(--max-body-bytes)")

        try:
            await asyncio.wait_for(read(), settings.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the body did not arrive within {settings.body_timeout:g} s",
                           code="request_timeout") from None
        return raw

    def parse_body(raw: bytearray) -> dict:
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
        model = body.get("model")
        if model is not None and model != settings.model:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {settings.model!r}",
                           param="model", code="model_not_found", kind="not_found_error")
        return body

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": settings.model}

    def model_object() -> dict:
        return {"id": settings.model, "object": "model", "created": created, "owned_by": "specrt"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != settings.model:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {settings.model!r}",
                           param="model", code="model_not_found", kind="not_found_error")
        return model_object()

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    def parse(raw: bytearray, chat: bool):
        """The request in a body, off the event loop: (prompt ids, settings, stream, usage in the stream)."""
        body = parse_body(raw)
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
        return prompt, cfg, stream, _field(options, "include_usage", (bool,), False) and stream, tools, unchecked

    async def complete(request: Request, chat: bool):
        raw = await read_body(request)
        loop, items = asyncio.get_running_loop(), asyncio.Queue()
        prompt, cfg, stream, usage_in_stream, tools, unchecked = await loop.run_in_executor(
            big_bodies if len(raw) > BIG_BODY else bodies, parse, raw, chat)
        if unchecked is not None:
            await loop.run_in_executor(grammar_checks, check_grammar, pair, unchecked, cfg)
            if await request.is_disconnected():  # its client left during the check: nothing to run
                return PlainTextResponse("", status_code=499)

        def deliver(item):  # from the worker thread; a whole response needs no text chunks
            if stream or not isinstance(item, str):
                loop.call_soon_threadsafe(items.put_nowait, item)

        try:
            job = scheduler.submit(prompt, cfg, deliver)
        except QueueFull as e:
            after = scheduler.retry_after()
            raise APIError(429, f"server busy: {e}; retry after {after} s", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(after)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), kind="server_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        shape = _Shape(rid, settings.model, chat, len(prompt), tools)
        if stream:
            return StreamingResponse(_events(job, items, shape, usage_in_stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.get(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return PlainTextResponse("", status_code=499)
                    continue
                if isinstance(item, BaseException):
                    raise _as_api_error(item)
                return JSONResponse(shape.whole(item))
        finally:
            job.cancel()  # a no-op once it finished; ends it if this handler was cancelled

    return app


def _lower_priority() -> None:
    """This thread yields the cores to decoding (Linux: a thread's own nice value; elsewhere nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class _Guard:
    """Refuses what a web page could make a user's browser send, before any route runs: a Host that is not
    one of `hosts` (DNS rebinding: a page of attacker.example whose name now resolves to 127.0.0.1), unless a
    key is required (`hosts` None: the page does not have it), and an Origin not in `origins` (a request from
    a page of another site). A request target in absolute form (`POST http://host:port/v1/... HTTP/1.1`,
    which RFC 9112 section 3.2.2 has servers accept) is routed by its path, and the host it names must be
    allowed as well as the Host header's. A plain ASGI middleware, as _KeyCheck."""

    def __init__(self, app, hosts: frozenset | None, origins: frozenset, refuse):
        self.app, self.hosts, self.origins, self.refuse = app, hosts, origins, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            names = [headers.get(b"host", b"").decode("latin-1")]
            absolute = _absolute_form(scope)
            if absolute is not None:
                authority, scope = absolute
                names.append(authority)
            origin = headers.get(b"origin")
            foreign = [n for n in names if host_name(n) not in self.hosts] if self.hosts is not None else []
            if foreign:
                e = APIError(421, f"this server does not answer to the Host {foreign[0]!r} (localhost, its address, "
                                  "or one given with --allow-host)", code="host_not_allowed")
                return await self.refuse(scope, e)(scope, receive, send)
            if origin is not None and "*" not in self.origins and origin.decode("latin-1") not in self.origins:
                e = APIError(403, f"requests from pages of {origin.decode('latin-1')!r} are refused (allow an origin "
                                  "with --cors-origin)", code="origin_not_allowed")
                return await self.refuse(scope, e)(scope, receive, send)
        await self.app(scope, receive, send)


def _absolute_form(scope) -> tuple[str, dict] | None:
    """(the authority, the scope with the path alone) of a request whose target is an absolute URI
    ("http://127.0.0.1:8000/v1/models"), else None."""
    scheme, sep, rest = (scope.get("raw_path") or b"").partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    authority, slash, path = rest.partition(b"/")
    raw_path = slash + path or b"/"
    path = scope.get("root_path", "") + urllib.parse.unquote(raw_path.decode("latin-1"))
    return authority.decode("latin-1"), {**scope, "raw_path": raw_path, "path": path}


class _KeyCheck:
    """Every route but /health needs `Authorization: Bearer KEY`. A plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would hide a client's disconnect from the routes."""

    def __init__(self, app, key: bytes, reject):
        self.app, self.key, self.reject = app, key, reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return await self.reject()(scope, receive, send)
        await self.app(scope, receive, send)


def _as_api_error(e: BaseException) -> APIError:
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), kind="server_error")
    if isinstance(e, SpecrtError):
        return APIError(400, str(e))
    return APIError(500, "internal error (see the server's log)", kind="server_error")


@dataclass
class _Shape:
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
    st = dict(res.stats)
    st["finish_reason"] = res.finish_reason
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in st.items()}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _events(job, items: asyncio.Queue, shape: _Shape, with_usage: bool):
    """The server-sent events of a streamed request; a client that goes away cancels the job."""
    try:
        yield _sse(shape.delta("", first=True))
        while True:
            item = await items.get()
            if isinstance(item, str):
                for obj in shape.deltas(item):
                    yield _sse(obj)
                continue
            if isinstance(item, BaseException):
                yield _sse(_as_api_error(item).body())
            else:
                for obj in shape.last(item, with_usage):
                    yield _sse(obj)
            yield b"data: [DONE]\n\n"
            return
    finally:
        job.cancel()


# ---------------------------------------------------------------------------------------------- running


def _header_deadline_protocol(timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's headers: a connection that opens (or idles
    after a response) and does not finish a request's headers within `timeout` seconds is closed."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline = None
        _refused = False  # a malformed request was answered: what the client still sends is dropped

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self._late)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self):
            self._deadline = None
            if not self.transport.is_closing():
                log.info("closed a connection whose request headers took over %g s", timeout)
                self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def handle_events(self):
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived: its handler runs
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data):
            if not self._refused:
                super().data_received(data)

        def send_400_response(self, msg):
            # h11 refused the request before the app saw it (a bad request line, header or Content-Length,
            # headers over MAX_HEADER_BYTES): the error object of every other refusal, not uvicorn's plain text
            import h11

            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                e = APIError(400, "malformed HTTP request: a bad request line, header or Content-Length, or "
                                  f"headers over {MAX_HEADER_BYTES} bytes")
                body = json.dumps(e.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                           (b"connection", b"close")]
                for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            # Closing with the client's data unread would reset the connection, and a client still sending (a
            # 200 KB header) would lose the answer: stop writing, drop what comes, close at its end or in 1 s.
            self._refused = True
            self.transport.write_eof()
            self.loop.call_later(1.0, self.transport.close)

    return Protocol


def serve(pair, scheduler: Scheduler, settings: ServeSettings, sock, on_ready=None) -> None:
    """Serve on the bound socket `sock` until SIGINT/SIGTERM: streams in flight then end with an error
    event, and the process exits."""
    import uvicorn

    metrics = Metrics(lambda: scheduler)
    scheduler.on_finish = metrics.finished
    app = create_app(pair, scheduler, metrics, settings)

    class Server(uvicorn.Server):
        closing = None

        def handle_exit(self, sig, frame):
            # End what runs first, so that open streams close and uvicorn's graceful shutdown can finish;
            # in a thread, as close() waits for the worker while the event loop must go on sending.
            if self.closing is None:
                self.closing = threading.Thread(target=scheduler.close, name="specrt-close", daemon=True)
                self.closing.start()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets)
            # A stop that went gracefully is a clean exit (status 0), not a death by the signal re-raised.
            getattr(self, "_captured_signals", []).clear()
            log.info("stopped")

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if on_ready is not None and self.started:
                on_ready()

    # a slow or idle client cannot hold a connection open for long, nor open many: uvicorn closes idle
    # keep-alive connections and answers 503 beyond settings.max_connections, h11 bounds the headers' size, and the
    # protocol below bounds the time a request's headers may take (the body's: read_body)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, access_log=False, lifespan="off",
                            http=_header_deadline_protocol(settings.header_timeout),
                            limit_concurrency=settings.max_connections, timeout_keep_alive=5,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    try:
        Server(config).run(sockets=[sock])
    finally:
        scheduler.close(timeout=10)
