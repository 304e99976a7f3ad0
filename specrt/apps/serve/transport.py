"""The server's connections (uvicorn): limits on what a slow, idle or malformed client can hold, and the
server's start and stop.

uvicorn's public options bound what they can: open connections (limit_concurrency: 503 beyond), the idle
time between requests (timeout_keep_alive) and the size of a request's line and headers
(h11_max_incomplete_event_size). Two behaviours no option or ASGI middleware gives, as the app is called only
once a request's headers are whole, need uvicorn's h11 protocol subclassed (HeaderDeadlineProtocol): a
deadline for the headers themselves (uvicorn's keep-alive timer runs only between requests and stops at the
first byte, so a client sending its headers a byte at a time would hold the connection for ever), and the
answer to a request h11 refuses (OpenAI's error object instead of plain text, and the client's unread data
drained so that it gets the answer). Its overrides use H11Protocol's methods and its `cycle`, `conn`,
`transport` and `loop` attributes, uvicorn internals that an upgrade can change: tests/test_hardening.py
(slow clients) and tests/test_probe2_server.py (malformed HTTP) check them.

_Server subclasses uvicorn.Server (its handle_exit, startup and shutdown) since no option runs code when a
signal arrives or once the server listens.
"""
from __future__ import annotations

import json
import logging
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specrt.apps.serve.settings import ServeSettings
from specrt.apps.serve.shapes import APIError

log = logging.getLogger("specrt.serve")

MAX_HEADER_BYTES = 16384  # a request's line and headers


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers: a connection that opens (or idles
    after a response) and does not finish a request's headers within `header_timeout` seconds is closed.
    A request h11 refuses gets an APIError 400 (see the module's text)."""

    header_timeout = 10.0  # set per server by protocol_class
    _deadline = None
    _refused = False  # a malformed request was answered: what the client still sends is dropped

    def _arm(self):
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._late)

    def _disarm(self):
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self):
        self._deadline = None
        if not self.transport.is_closing():
            log.info("closed a connection whose request headers took over %g s", self.header_timeout)
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


def protocol_class(header_timeout: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn makes each connection's protocol of (Config's `http`), with this deadline."""
    return type("Protocol", (HeaderDeadlineProtocol,), {"header_timeout": header_timeout})


class _Server(uvicorn.Server):
    """uvicorn's server, stopping as `specrt serve` must. No Config option does these: `stop_work` runs when
    SIGINT or SIGTERM arrives (lifespan's shutdown would run only after the open streams it must end),
    `on_ready` once the server listens, and a stop that went gracefully exits with status 0."""

    def __init__(self, config: uvicorn.Config, stop_work, on_ready=None):
        super().__init__(config)
        self.stop_work, self.on_ready = stop_work, on_ready
        self.closing = None

    def handle_exit(self, sig, frame):
        # End what runs first, so that open streams close and uvicorn's graceful shutdown can finish;
        # in a thread, as stop_work waits for the worker while the event loop must go on sending.
        if self.closing is None:
            self.closing = threading.Thread(target=self.stop_work, name="specrt-close", daemon=True)
            self.closing.start()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None):
        await super().shutdown(sockets)
        # uvicorn raises the signal it caught again once it stopped (a death by the signal): a stop that went
        # gracefully is a clean exit instead. `_captured_signals` is uvicorn's private list of them.
        getattr(self, "_captured_signals", []).clear()
        log.info("stopped")

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.on_ready is not None and self.started:
            self.on_ready()


def run(app, settings: ServeSettings, sock, stop_work, on_ready=None) -> None:
    """Serve `app` on the bound socket `sock` until SIGINT or SIGTERM (`stop_work` then ends what runs)."""
    # a slow or idle client cannot hold a connection open for long, nor open many: uvicorn closes idle
    # keep-alive connections and answers 503 beyond settings.max_connections, h11 bounds the headers' size,
    # and the protocol bounds the time a request's headers may take (the body's: guards.read_body)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, access_log=False, lifespan="off",
                            http=protocol_class(settings.header_timeout),
                            limit_concurrency=settings.max_connections, timeout_keep_alive=5,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    _Server(config, stop_work, on_ready).run(sockets=[sock])
