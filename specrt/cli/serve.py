"""`specrt serve`: an OpenAI-compatible local server over one pair (specrt/apps/serve/, the `serve` extra)."""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import click

from specrt.cli.common import BadInput, batch_size_value, device_option, draft_len_value, errors, load_pair
from specrt.config import HISTORY_CAP
from specrt.errors import SpecrtError


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the pair loads: a port in use is one line, at once."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise BadInput(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        why = "in use" if e.errno == 98 else e.strerror
        raise BadInput(f"cannot listen on {host}:{port}: {why}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _origin(value: str) -> str:
    """A --cors-origin: `*`, or scheme://host[:port] as a browser sends it in Origin (lowercase)."""
    try:
        u = urlsplit(value)
    except ValueError:
        u = None
    if value != "*" and not (u and u.scheme and u.netloc and not (u.path or u.query or u.fragment)):
        raise BadInput(f"--cors-origin {value!r} is not a web origin: scheme://host[:port] with no path (such as "
                       "http://localhost:3000), or *")
    return value.lower()


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback should come with --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--api-key", default=None, envvar="SPECRT_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health.")
@click.option("--model-name", default=None, help="The model id clients name (default: the pair folder's name).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="A name clients call this server by, besides localhost and --host (repeatable). Without --api-key, "
                   "a request whose Host names another gets HTTP 421 (DNS rebinding).")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="A web origin (scheme://host[:port], or *) whose pages may call this server from a browser "
                   "(repeatable); a request from any other origin gets HTTP 403.")
@click.option("--max-queue", type=click.IntRange(1), default=16, show_default=True,
              help="Requests that may wait; beyond them a request gets HTTP 429 with Retry-After.")
@click.option("--batch-size", default="auto", show_default=True, callback=batch_size_value,
              help="Rows of the batched decoder that runs requests while more than one waits (1: one at a time; "
                   "auto: 4, or fewer if their KV caches do not fit).")
@click.option("--batch-draft-len", type=click.IntRange(0), default=None,
              help="A fixed draft length for batched rows whose request asks for auto (default: auto stays auto, "
                   "its lengths chosen against what the batch's pass costs).")
@click.option("--draft-len", default=None, callback=draft_len_value,
              help="Default draft length of a request (an integer or 'auto'; default: `specrt tune`'s, else auto).")
@click.option("--drafter", type=click.Choice(["model", "ngram", "suffix", "hybrid"]), default=None,
              help="Default drafter of a request (default: `specrt tune`'s, else hybrid, or ngram without a draft model).")
@click.option("--history/--no-history", default=True, show_default=True,
              help="Keep the outputs of all requests for the suffix drafter to draft from (one history for every "
                   "client), and the prompt prefix a request shares with the previous one in the caches; "
                   "--no-history: nothing of one request is kept for another (isolation between users).")
@click.option("--history-cap", type=int, default=HISTORY_CAP, show_default=True,
              help="Most tokens of earlier outputs kept (4 bytes each; the oldest requests go first).")
@click.option("--draft-model/--no-draft-model", default=True, show_default=True,
              help="Load the pair's draft model; --no-draft-model: requests draft by prompt lookup only (ngram, "
                   "suffix), for the memory of the target alone.")
@click.option("--max-body-bytes", type=click.IntRange(1024), default=1 << 20, show_default=True,
              help="Largest request body accepted (413 beyond).")
@click.option("--header-timeout", type=click.FloatRange(0.1), default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers before it is closed.")
@click.option("--body-timeout", type=click.FloatRange(0.1), default=30.0, show_default=True,
              help="Seconds a request may take to send its body (408 beyond).")
@click.option("--max-connections", type=click.IntRange(1), default=64, show_default=True,
              help="Open connections served at once; beyond them a connection gets HTTP 503.")
@device_option
@errors
def serve(pair_dir, device, host, port, api_key, model_name, allow_hosts, cors_origins, max_queue, batch_size,
          batch_draft_len, draft_len, drafter, history, history_cap, draft_model, max_body_bytes, header_timeout,
          body_timeout, max_connections):
    """Serve a pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics) until Ctrl-C or SIGTERM."""
    try:
        from specrt.apps.serve.http import LOCAL_HOSTS, ServeSettings, host_name, serve as run_server
    except ImportError as e:
        raise BadInput(f"specrt serve needs the serve extra ({e.name} is missing): pip install 'specrt[serve]'") from None
    from specrt.api.text import check_text
    from specrt.apps.serve.scheduler import Scheduler
    from specrt.config import needs_draft_model
    from specrt.errors import ConfigError

    logging.basicConfig(level=logging.INFO, format="specrt serve: %(message)s")
    if api_key is None and os.environ.get("SPECRT_API_KEY") is not None:
        api_key = os.environ["SPECRT_API_KEY"]  # click reads an empty variable as unset: that must not turn auth off
    if api_key is not None and not api_key.strip():
        raise BadInput("the API key is empty (--api-key or SPECRT_API_KEY): give a key, or leave both unset to "
                       "serve without one")
    if not api_key and not _loopback(host):
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)
    if history_cap < 1:
        raise BadInput(f"--history-cap must be >= 1 (tokens), got {history_cap}")
    name = model_name or Path(os.path.abspath(pair_dir)).name
    check_text(name, "--model-name" if model_name else f"the pair folder's name {name!r} (the default --model-name)")
    for h in allow_hosts:
        if not host_name(h) or re.search(r"[/@\s]", h):
            raise BadInput(f"--allow-host {h!r} is not a host name (such as mybox.lan, a port aside)")
    hosts, cors_origins = (*LOCAL_HOSTS, host, *allow_hosts), tuple(map(_origin, cors_origins))
    sock = _bind(host, port)
    if not draft_model and drafter is not None and needs_draft_model(drafter):
        raise BadInput(f"--drafter {drafter} needs the draft model, which --no-draft-model leaves out")
    with load_pair(pair_dir, device, history=history, history_cap=history_cap, share_prefix=history,
                   draft_model=draft_model) as pair:
        # the grammar library's view of the tokenizer (about a second) is built now, beside the start, not in
        # the first structured request
        threading.Thread(target=_warm_grammars, args=(pair,), name="specrt-grammars", daemon=True).start()
        sizes = [batch_size] if batch_size != "auto" else [4, 2, 1]
        for b in sizes:
            try:
                scheduler = Scheduler(pair, max_queue=max_queue, batch_size=b, batch_draft_len=batch_draft_len)
                break
            except ConfigError as e:
                if b == sizes[-1]:
                    raise
                if batch_size == "auto":
                    click.echo(f"note: batch size {b} does not fit ({e}); trying {sizes[sizes.index(b) + 1]}", err=True)
        settings = ServeSettings(model=name, api_key=api_key or None, max_body_bytes=max_body_bytes,
                                 draft_len=draft_len, drafter=drafter, header_timeout=header_timeout,
                                 body_timeout=body_timeout, max_connections=max_connections, hosts=hosts,
                                 cors_origins=cors_origins)
        bound = sock.getsockname()
        url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}/v1"

        def ready():
            shared = (f"outputs shared across requests for drafting, up to {history_cap} tokens, and prompt prefixes"
                      if history else "nothing shared between requests")
            if pair.draft_left_out:
                shared += ", the draft model left out"
            click.echo(f"specrt serve: {name} on {url} (batch size {scheduler.batch_size}, queue {max_queue}, {shared}"
                       f"{', key required' if api_key else ''})", err=True)

        run_server(pair, scheduler, settings, sock, on_ready=ready)


def _warm_grammars(pair) -> None:
    try:
        pair.grammars.warm()  # the tokenizer's view and the checker process
    except SpecrtError:  # said again, as a 400, to the first request that needs it
        pass
