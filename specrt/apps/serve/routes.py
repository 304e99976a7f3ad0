"""The FastAPI app: its routes and what they answer, whole or streamed as server-sent events. Requests run
through apps/serve/scheduler.Scheduler; this module only translates between HTTP and it."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from specrt.apps.serve.guards import HostGuard, KeyCheck, read_body
from specrt.apps.serve.metrics import Metrics
from specrt.apps.serve.params import Parsed, check_grammar, parse_request
from specrt.apps.serve.scheduler import QueueFull, Scheduler, ShuttingDown
from specrt.apps.serve.settings import ServeSettings, host_name
from specrt.apps.serve.shapes import APIError, Shape, as_api_error

log = logging.getLogger("specrt.serve")

BIG_BODY = 16 << 10  # bytes: a body above it is parsed in the big prompts' thread (tokenizing: ~1 s a MB)


def create_app(pair, scheduler: Scheduler, metrics: Metrics, settings: ServeSettings) -> FastAPI:
    app = FastAPI(title="specrt", docs_url=None, redoc_url=None, openapi_url=None)
    r = _Routes(pair, scheduler, metrics, settings)
    app.add_exception_handler(APIError, r.api_error)
    app.add_exception_handler(HTTPException, r.http_error)
    app.add_exception_handler(Exception, r.internal_error)
    if settings.api_key is not None:
        app.add_middleware(KeyCheck, key=settings.api_key.encode(), reject=r.wrong_key)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    # outermost, so that a page of another site gets nothing of the routes, nor a CORS preflight's answer
    hosts = None if settings.api_key is not None else frozenset(map(host_name, settings.hosts))
    app.add_middleware(HostGuard, hosts=hosts, origins=frozenset(settings.cors_origins), refuse=r.refuse)
    app.add_api_route("/health", r.health, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models", r.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", r.model, methods=["GET"])
    app.add_api_route("/metrics", r.metrics_text, methods=["GET"])
    app.add_api_route("/v1/chat/completions", r.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", r.completions, methods=["POST"])
    return app


class _Routes:
    """The routes' handlers and what they share: the pair and its scheduler, the metrics, the settings, and the
    threads request bodies are parsed in."""

    def __init__(self, pair, scheduler: Scheduler, metrics: Metrics, settings: ServeSettings):
        self.pair, self.scheduler, self.metrics, self.settings = pair, scheduler, metrics, settings
        self.created = int(time.time())
        # A body is parsed, templated and tokenized off the event loop (tokenizing takes ~1 s a MB), in one of two
        # threads: big bodies in one, so that they neither take every core from decoding nor make small requests
        # wait behind them, small ones (a few ms at most) in the other. Two threads, not a pool that grows.
        self.bodies = ThreadPoolExecutor(1, thread_name_prefix="specrt-prompts")
        self.big_bodies = ThreadPoolExecutor(1, thread_name_prefix="specrt-big-prompts", initializer=_lower_priority)
        # new grammars are checked one at a time (api/grammars.py), in a thread of their own: a slow one delays
        # other new grammars only
        self.grammar_checks = ThreadPoolExecutor(1, thread_name_prefix="specrt-grammar-checks")

    # ------------------------------------------------------------------------------------------ errors

    def error_response(self, e: APIError) -> JSONResponse:
        self.metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def api_error(self, request: Request, e: APIError):
        log.info("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return self.error_response(e)

    async def http_error(self, request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return self.error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                            kind=kind))

    async def internal_error(self, request: Request, e: Exception):
        log.error("%s %s -> 500: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return self.error_response(APIError(500, "internal error (see the server's log)", kind="server_error"))

    def wrong_key(self) -> JSONResponse:
        return self.error_response(APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                            code="invalid_api_key"))

    def refuse(self, scope, e: APIError) -> JSONResponse:
        log.info("%s %s -> %d: %s", scope["method"], scope["path"], e.status, e.message)
        return self.error_response(e)

    # ------------------------------------------------------------------------------------------ routes
    # (no return annotations: FastAPI would take one for a response model)

    async def health(self):
        return {"status": "ok", "model": self.settings.model}

    def _model_object(self) -> dict:
        return {"id": self.settings.model, "object": "model", "created": self.created, "owned_by": "specrt"}

    async def models(self):
        return {"object": "list", "data": [self._model_object()]}

    async def model(self, model_id: str):
        if model_id != self.settings.model:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {self.settings.model!r}",
                           param="model", code="model_not_found", kind="not_found_error")
        return self._model_object()

    async def metrics_text(self):
        return PlainTextResponse(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    # ------------------------------------------------------------------------------------------ completions

    async def _complete(self, request: Request, chat: bool):
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)
        loop, items = asyncio.get_running_loop(), asyncio.Queue()
        req = await loop.run_in_executor(self.big_bodies if len(raw) > BIG_BODY else self.bodies,
                                         parse_request, self.pair, self.settings, raw, chat)
        if req.unchecked is not None:
            await loop.run_in_executor(self.grammar_checks, check_grammar, self.pair, req.unchecked, req.cfg)
            if await request.is_disconnected():  # its client left during the check: nothing to run
                return PlainTextResponse("", status_code=499)
        job = self._submit(req, loop, items)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        shape = Shape(rid, self.settings.model, chat, len(req.prompt), req.tools)
        if req.stream:
            return StreamingResponse(_events(job, items, shape, req.usage_in_stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, job, items, shape)

    def _submit(self, req: Parsed, loop: asyncio.AbstractEventLoop, items: asyncio.Queue):
        """Queue the request; what it makes (text, then its result or error) arrives in `items`."""
        def deliver(item):  # from the worker thread; a whole response needs no text chunks
            if req.stream or not isinstance(item, str):
                loop.call_soon_threadsafe(items.put_nowait, item)

        try:
            return self.scheduler.submit(req.prompt, req.cfg, deliver)
        except QueueFull as e:
            after = self.scheduler.retry_after()
            raise APIError(429, f"server busy: {e}; retry after {after} s", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(after)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), kind="server_error") from None


async def _whole(request: Request, job, items: asyncio.Queue, shape: Shape):
    """The response of a request not streamed; a client that goes away cancels the job."""
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
                raise as_api_error(item)
            return JSONResponse(shape.whole(item))
    finally:
        job.cancel()  # a no-op once it finished; ends it if this handler was cancelled


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _events(job, items: asyncio.Queue, shape: Shape, with_usage: bool):
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
                yield _sse(as_api_error(item).body())
            else:
                for obj in shape.last(item, with_usage):
                    yield _sse(obj)
            yield b"data: [DONE]\n\n"
            return
    finally:
        job.cancel()


def _lower_priority() -> None:
    """This thread yields the cores to decoding (Linux: a thread's own nice value; elsewhere nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
