"""What the second hostile probe (issue 46) did to `specrt serve`, one test per defect, each named for what
it guards: huge integers, prompts tokenized on the event loop, foreign hosts and origins, bodies that are
not JSON, a model name that is not text, malformed HTTP and HEAD."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fastapi  # noqa: F401  (the serve extra)
import httpx

from _helpers import copy_pair
from test_server import Server


@pytest.fixture(scope="module")
def server(qwen_dir):
    s = Server(qwen_dir, "--batch-size", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _error(r, status: int) -> dict:
    """The OpenAI error object of a reply that must have `status`."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def _raw(server, data: bytes) -> tuple[bytes, dict, bytes]:
    """Send `data` on a fresh connection; (status line, headers, body) of the reply."""
    host, port = server.base.split("//")[1].split("/")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines)}, body


# ---------------------------------------------------------------------------------------------- huge integers


def test_an_integer_past_4300_digits_is_a_400(server):
    body = b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"
    r = httpx.post(server.url("/v1/completions"), content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert "4300 digits" in _error(r, 400)["message"]
    assert not any("-> 500" in ln or "Traceback" in ln for ln in server.log), "".join(server.log[-20:])


# ---------------------------------------------------------------------------------------------- big prompts


def _app(pair, **settings):
    from specrt.apps.serve import http
    from specrt.apps.serve.scheduler import Scheduler

    scheduler = Scheduler(pair, batch_size=1)
    return http.create_app(pair, scheduler, http.Metrics(lambda: scheduler), http.ServeSettings(model="m", **settings)), scheduler


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1:8000", timeout=60)


def test_prompts_are_parsed_templated_and_tokenized_off_the_event_loop(qwen_pair, monkeypatch):
    """json.loads of the body, the chat template and the tokenizer each run in a thread that is not the
    event loop's; a body over the limit is a 413 that names it."""
    seen: dict[str, set] = {"json": set(), "template": set(), "encode": set()}

    def record(name, fn, only=lambda *a: True):
        def wrapped(*a, **kw):
            if only(*a):
                seen[name].add(threading.current_thread())
            return fn(*a, **kw)
        return wrapped

    codec = qwen_pair.codec
    monkeypatch.setattr(codec, "encode", record("encode", codec.encode))
    monkeypatch.setattr(codec, "apply_chat_template", record("template", codec.apply_chat_template))
    monkeypatch.setattr(json, "loads", record("json", json.loads, lambda s, *a: isinstance(s, (bytes, bytearray)) and b"marker" in s))
    app, scheduler = _app(qwen_pair, max_body_bytes=4096)

    async def go():
        async with _client(app) as c:
            chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "marker"}],
                                                              "max_tokens": 2})
            plain = await c.post("/v1/completions", json={"prompt": "marker", "max_tokens": 2})
            big = await c.post("/v1/completions", json={"prompt": "x" * 5000})
        return threading.current_thread(), chat, plain, big

    try:
        loop_thread, chat, plain, big = asyncio.run(go())
    finally:
        scheduler.close()
    assert chat.status_code == 200 and plain.status_code == 200, (chat.text, plain.text)
    assert all(seen.values()), seen
    assert loop_thread not in set().union(*seen.values()), seen
    assert "4096" in _error(big, 413)["message"] and "--max-body-bytes" in _error(big, 413)["message"]


def test_small_requests_and_health_are_answered_while_big_prompts_are_tokenized(qwen_pair, monkeypatch):
    """Eight big prompts whose tokenizing is held (more than a thread pool's default workers): /health and a
    small request are answered meanwhile, and the big ones are tokenized one at a time."""
    entered, release, lock = threading.Event(), threading.Event(), threading.Lock()
    encode, inside = qwen_pair.codec.encode, {"now": 0, "most": 0}

    def slow(text):
        if len(text) < 100_000:
            return encode(text)
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        entered.set()
        release.wait(10)
        try:
            return encode(text)
        finally:
            with lock:
                inside["now"] -= 1

    monkeypatch.setattr(qwen_pair.codec, "encode", slow)
    app, scheduler = _app(qwen_pair)

    async def go():
        async with _client(app) as c:
            bigs = [asyncio.create_task(c.post("/v1/completions", json={"prompt": "word " * 40_000, "max_tokens": 1}))
                    for _ in range(8)]
            assert await asyncio.to_thread(entered.wait, 30)
            health = await c.get("/health")
            small = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            held = not any(b.done() for b in bigs)
            release.set()
            return health, small, held, await asyncio.gather(*bigs)

    try:
        health, small, held, bigs = asyncio.run(go())
    finally:
        release.set()
        scheduler.close()
    assert held, "/health and the small request waited for the big prompts"
    assert health.status_code == 200 and small.status_code == 200, small.text
    assert all(_error(b, 400)["code"] == "context_length_exceeded" for b in bigs)  # tokenized, then refused
    assert inside["most"] == 1, "big prompts tokenized at once take every core"


# ---------------------------------------------------------------------------------------------- web pages


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST:1"])
def test_local_host_names_are_served(server, host):
    port = server.base.rsplit(":", 1)[1].split("/")[0]
    assert httpx.get(server.url("/v1/models"), headers={"Host": host.format(port=port)}).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.attacker.example",
                                  "10.0.0.1:{port}"])
def test_a_foreign_host_is_refused_without_a_key(server, host):
    port = server.base.rsplit(":", 1)[1].split("/")[0]
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/completions")):
        r = httpx.request(method, server.url(path), headers={"Host": host.format(port=port)},
                          json={"prompt": "x", "max_tokens": 1})
        assert "--allow-host" in _error(r, 421)["message"], (method, path)


def test_a_foreign_origin_is_refused(server):
    evil = {"Origin": "http://attacker.example"}
    assert "--cors-origin" in _error(httpx.get(server.url("/v1/models"), headers=evil), 403)["message"]
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 1}, headers=evil)
    _error(r, 403)
    preflight = httpx.options(server.url("/v1/completions"), headers={
        **evil, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    _error(preflight, 403)
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                   None])
def test_a_body_not_sent_as_json_is_a_415(server, ctype):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    headers = {"Content-Type": ctype} if ctype else {}
    r = httpx.post(server.url("/v1/completions"), content=body, headers=headers)
    assert "application/json" in _error(r, 415)["message"]
    ok = httpx.post(server.url("/v1/completions"), content=body,
                    headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_allowed_hosts_and_origins(qwen_dir):
    s = Server(qwen_dir, "--batch-size", "1", "--allow-host", "MyBox.lan", "--cors-origin", "http://localhost:3000")
    try:
        assert httpx.get(s.url("/v1/models"), headers={"Host": "mybox.lan:8000"}).status_code == 200
        _error(httpx.get(s.url("/v1/models"), headers={"Host": "other.lan"}), 421)
        ui = {"Origin": "http://localhost:3000"}
        preflight = httpx.options(s.url("/v1/chat/completions"), headers={
            **ui, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        r = httpx.post(s.url("/v1/completions"), json={"prompt": "x", "max_tokens": 1}, headers=ui)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        _error(httpx.get(s.url("/v1/models"), headers={"Origin": "http://localhost:3001"}), 403)
    finally:
        assert s.stop() == 0


def test_with_a_key_any_host_is_served_but_not_any_origin(qwen_dir):
    s = Server(qwen_dir, "--batch-size", "1", "--api-key", "k")
    try:
        key = {"Authorization": "Bearer k"}
        assert httpx.get(s.url("/v1/models"), headers={**key, "Host": "server.example"}).status_code == 200
        _error(httpx.get(s.url("/v1/models"), headers={"Host": "server.example"}), 401)
        _error(httpx.get(s.url("/v1/models"), headers={**key, "Origin": "http://attacker.example"}), 403)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("flag, value", [("--cors-origin", "http://localhost:3000/"), ("--cors-origin", "localhost"),
                                         ("--cors-origin", "null"), ("--allow-host", "http://x.lan"),
                                         ("--allow-host", "")])
def test_a_bad_allowed_host_or_origin_is_refused_at_start(qwen_dir, flag, value):
    p = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", str(qwen_dir), "--port", "0", flag, value],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith(f"Error: {flag}") and len(p.stderr.splitlines()) == 1, p.stderr


# ---------------------------------------------------------------------------------------------- the model's name


@pytest.mark.parametrize("where", ["flag", "folder"])
def test_a_model_name_that_is_not_utf8_is_refused_at_start(qwen_dir, tmp_path, where):
    """`--model-name $'a\\x80b'`, or a pair folder so named without the flag (the default model name)."""
    if where == "flag":
        args, want = [str(qwen_dir).encode(), b"--model-name", b"a\x80b"], "Error: --model-name is not valid text"
    else:
        d = copy_pair(qwen_dir, Path(os.fsdecode(bytes(tmp_path) + b"/a\x80b")))
        args, want = [os.fsencode(d)], "Error: the pair folder's name 'a\\udc80b' (the default --model-name) is not valid text"
    p = subprocess.Popen([sys.executable.encode(), b"-m", b"specrt.cli", b"serve", *args, b"--port", b"0"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail("the server started")
    assert p.returncode == 2 and err.startswith(want) and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------- malformed HTTP


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: -1\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"\x16\x03\x01 garbage / HTTP/9\r\n\r\n",
], ids=["negative-content-length", "200kb-header", "garbage-request-line"])
def test_malformed_http_gets_a_json_error(server, request_bytes):
    status, headers, body = _raw(server, request_bytes)
    assert status.startswith(b"HTTP/1.1 400 ") and headers[b"content-type"] == b"application/json", (status, headers)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_head_on_health_is_200_without_a_body(server):
    r = httpx.head(server.url("/health"))
    assert r.status_code == 200 and r.content == b""
    status, _, body = _raw(server, b"HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 ") and body == b""
