"""How `specrt serve` runs (ServeSettings), and the Host names a server without a key answers to."""
from __future__ import annotations

from dataclasses import dataclass

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # the names a keyless server answers to besides its own address


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
