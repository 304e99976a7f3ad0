"""What a request must pass before a route reads it: its Host, its web Origin and its key (ASGI middleware, so
that nothing of the routes runs for a refused request), and the limits on its body's size, type and time."""
from __future__ import annotations

import asyncio
import hmac
import urllib.parse

from fastapi import Request

from specrt.apps.serve.settings import host_name
from specrt.apps.serve.shapes import APIError


class HostGuard:
    """Refuses what a web page could make a user's browser send, before any route runs: a Host that is not
    one of `hosts` (DNS rebinding: a page of attacker.example whose name now resolves to 127.0.0.1), unless a
    key is required (`hosts` None: the page does not have it), and an Origin not in `origins` (a request from
    a page of another site). A request target in absolute form (`POST http://host:port/v1/... HTTP/1.1`,
    which RFC 9112 section 3.2.2 has servers accept) is routed by its path, and the host it names must be
    allowed as well as the Host header's. A plain ASGI middleware, as KeyCheck."""

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


class KeyCheck:
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


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytearray:
    """The request's body: 413 over `max_bytes` (said by its Content-Length, or as it arrives), 415 unless it is
    declared JSON, 408 when it takes over `timeout` seconds."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise APIError(413, f"the body has {size} bytes; the limit is {max_bytes} (--max-body-bytes)")
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
            if len(raw) > max_bytes:
                raise APIError(413, f"the body exceeds the limit of {max_bytes} bytes (--max-body-bytes)")

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the body did not arrive within {timeout:g} s", code="request_timeout") from None
    return raw
