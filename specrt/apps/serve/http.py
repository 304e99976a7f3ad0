"""`specrt serve`: an OpenAI-compatible HTTP server over one pair (FastAPI + uvicorn, the `serve` extra).

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or not),
GET /v1/models, GET (or HEAD) /health, GET /metrics (Prometheus text). Requests run through
apps/serve/scheduler.Scheduler.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with the status that
fits (400 bad field or malformed HTTP, 401 key, 403 web origin, 404 route or model, 408 body too slow,
413 body too big, 415 body not sent as JSON, 421 foreign Host, 429 queue full, 500 anything else: one
line in the log, never a traceback to the client).

This module starts the server (serve); the work is in: settings (ServeSettings), shapes (OpenAI's error and
response objects), params (a request's fields), routes (the FastAPI app), guards (Host, Origin, key and body
limits), transport (uvicorn: connection limits, start and stop), metrics (Prometheus).
"""
from __future__ import annotations

from specrt.apps.serve import transport
from specrt.apps.serve.metrics import Metrics
from specrt.apps.serve.params import generation_config, prompt_ids
from specrt.apps.serve.routes import create_app
from specrt.apps.serve.scheduler import Scheduler
from specrt.apps.serve.settings import LOCAL_HOSTS, ServeSettings, host_name
from specrt.apps.serve.shapes import APIError

__all__ = ["LOCAL_HOSTS", "APIError", "Metrics", "ServeSettings", "create_app", "generation_config", "host_name",
           "prompt_ids", "serve"]


def serve(pair, scheduler: Scheduler, settings: ServeSettings, sock, on_ready=None) -> None:
    """Serve on the bound socket `sock` until SIGINT/SIGTERM: streams in flight then end with an error
    event, and the process exits."""
    metrics = Metrics(lambda: scheduler)
    scheduler.on_finish = metrics.finished
    app = create_app(pair, scheduler, metrics, settings)
    try:
        transport.run(app, settings, sock, stop_work=scheduler.close, on_ready=on_ready)
    finally:
        scheduler.close(timeout=10)
