"""`specrt serve` as a client sees it: a live server on 127.0.0.1 over a tiny pair, through the official
`openai` client (and httpx for what that client cannot send)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fastapi  # noqa: F401  (the serve extra)
import httpx
import openai

import specrt


PROMPTS = ["def add(a, b):", "import numpy as np", "class Stack:", "for i in range(10):",
           "# sort a list", "print('hello')", "while True:", "x = [1, 2, 3]"]


class Server:
    """`specrt serve PAIR --port 0 ...` in a subprocess; its URL from the line it prints when ready."""

    def __init__(self, pair_dir: Path, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", str(pair_dir), "--port", "0", *args],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"server exited ({self.proc.wait()}): {''.join(self.log)}")
            self.log.append(line)
            if m := re.search(r" on (http://\S+/v1) ", line):
                self.base = m.group(1)
                break
        else:
            raise RuntimeError("server did not start: " + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def client(self, key: str = "none", **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=120, **kw)

    def url(self, path: str) -> str:
        return self.base.removesuffix("/v1") + path

    def metrics(self, key: str | None = None) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        out = {}
        for line in httpx.get(self.url("/metrics"), headers=headers).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        return self.proc.returncode


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(qwen_dir):
    s = Server(qwen_dir, "--batch-size", "4")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def long_dir(long_qwen_dir) -> Path:
    """A tiny pair with room for long generations (the queue and disconnect tests need requests that last)."""
    return long_qwen_dir


def lone(pair_dir: Path, prompt: str, n: int, chat: bool = False) -> str:
    with specrt.load(pair_dir) as pair:
        return pair.generate(prompt, max_new_tokens=n, chat=chat).text


# ---------------------------------------------------------------------------------------------- the API


def test_models_health_and_metrics(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["pair-qwen2"]
    assert httpx.get(server.url("/health")).json()["status"] == "ok"
    text = httpx.get(server.url("/metrics")).text
    for name in ("specrt:num_requests_running", "specrt:num_requests_waiting", "specrt:generation_tokens_total",
                 "specrt:spec_decode_num_draft_tokens_total", "specrt:spec_decode_num_accepted_tokens_total"):
        assert name in text


def test_chat_and_completion_equal_specrt_generate(server, qwen_dir):
    from click.testing import CliRunner

    from specrt.cli import main

    c = server.client()
    for chat in (False, True):
        r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "24",
                                      "--json", *(["--chat"] if chat else [])])
        want = json.loads(r.stdout)["text"]
        if chat:
            whole = c.chat.completions.create(model="pair-qwen2", messages=[{"role": "user", "content": "def add(a, b):"}],
                                              max_tokens=24, temperature=0)
            got, usage = whole.choices[0].message.content, whole.usage
            parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="pair-qwen2", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=24,
                temperature=0, stream=True) if ch.choices]
        else:
            whole = c.completions.create(model="pair-qwen2", prompt="def add(a, b):", max_tokens=24, temperature=0)
            got, usage = whole.choices[0].text, whole.usage
            parts = [ch.choices[0].text for ch in c.completions.create(
                model="pair-qwen2", prompt="def add(a, b):", max_tokens=24, temperature=0, stream=True) if ch.choices]
        assert got == want and "".join(parts) == want
        assert whole.choices[0].finish_reason in ("length", "stop")
        assert usage.completion_tokens == whole.model_extra["specrt"]["new_tokens"] <= 24
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert whole.model_extra["specrt"]["target_passes"] >= 1


def test_stream_usage_stats_and_stop(server):
    c = server.client()
    chunks = list(c.completions.create(model="pair-qwen2", prompt="class Stack:", max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    final = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(final) == 1 and "tokens_per_target_pass" in final[0].model_extra["specrt"]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    stop = text[3:6]
    cut = c.completions.create(model="pair-qwen2", prompt="class Stack:", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_repeats(server):
    # with a fixed draft length (auto's choices follow measured costs, and the draws with them)
    c = server.client()
    a, b = (c.completions.create(model="pair-qwen2", prompt="x = [1, 2, 3]", max_tokens=16, temperature=0.9,
                                 top_p=0.95, seed=7, extra_body={"top_k": 50, "draft_len": 2}).choices[0].text
            for _ in range(2))
    assert a == b


def test_eight_concurrent_streams_each_get_their_own_text(server, qwen_dir):
    want = {p: lone(qwen_dir, p, 32) for p in PROMPTS}
    c = server.client()
    before = server.metrics()

    def ask(p):
        return "".join(ch.choices[0].text for ch in c.completions.create(
            model="pair-qwen2", prompt=p, max_tokens=32, temperature=0, stream=True) if ch.choices)

    with ThreadPoolExecutor(8) as ex:
        got = dict(zip(PROMPTS, ex.map(ask, PROMPTS)))
    assert got == want
    after = server.metrics()
    done = sum(v for k, v in after.items() if k.startswith("specrt:request_success_total")) - \
        sum(v for k, v in before.items() if k.startswith("specrt:request_success_total"))
    assert done == len(PROMPTS)


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "draft_len": 99}, 400, "draft_len"),
    ({"prompt": "x", "drafter": "bogus"}, 400, "drafter"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "word " * 400}, 400, "prompt"),  # longer than max_len 256
    ({}, 400, "prompt"),
])
def test_bad_completion_requests(server, body, status, param):
    r = httpx.post(server.url("/v1/completions"), json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    assert "Traceback" not in r.text


def test_bad_requests_through_the_client(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="pair-qwen2", messages=[], max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="pair-qwen2", prompt="word " * 400, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"


def test_malformed_body_route_and_size(server):
    r = httpx.post(server.url("/v1/chat/completions"), content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url("/v1/completions"), content=json.dumps({"prompt": "x" * (2 << 20)}))
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = httpx.get(server.url("/v1/nothing"))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_max_tokens_beyond_the_cache_is_bounded(server):
    r = server.client().completions.create(model="pair-qwen2", prompt="def add(a, b):", max_tokens=100000, temperature=0)
    assert r.usage.completion_tokens <= 256 - r.usage.prompt_tokens


# ---------------------------------------------------------------------------------------------- its own servers


def test_requests_share_one_history_of_outputs(server):
    assert "outputs shared across requests" in server.log[0]  # it says so when it starts
    c = server.client()
    body = dict(model="pair-qwen2", prompt="print('hello')", max_tokens=24, temperature=0,
                extra_body={"drafter": "suffix", "draft_len": 4})
    first = c.completions.create(**body)
    again = c.completions.create(**body)
    assert again.choices[0].text == first.choices[0].text
    assert again.model_extra["specrt"]["accepted_by_drafter"].get("suffix", 0) > 0  # drafted from the first answer


LONG_SYSTEM = " ".join(f"rule {i}: answer briefly." for i in range(6))  # ~150 tokens of the tiny tokenizer


def _chat_twice(server, key="none"):
    c = server.client(key)
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "and then?"}]
    return [c.chat.completions.create(model="pair-qwen2", messages=msgs, max_tokens=8, temperature=0)
            for _ in range(2)]


def test_a_shared_prompt_prefix_is_read_once(server):
    first, again = _chat_twice(server)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # whole chunks of the system prompt
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    assert "specrt:prefix_cache_hits_total" in httpx.get(server.url("/metrics")).text


def test_api_key(qwen_dir):
    s = Server(qwen_dir, "--batch-size", "1", "--no-history", env={"SPECRT_API_KEY": "sekrit"})
    try:
        assert "nothing shared between requests" in s.log[0] and "key required" in s.log[0]
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        r = httpx.get(s.url("/v1/models"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url("/metrics")).status_code == 401
        assert httpx.get(s.url("/health")).status_code == 200  # a liveness probe needs no key
        assert s.client("sekrit").completions.create(model="pair-qwen2", prompt="x", max_tokens=4).usage.completion_tokens >= 1
        assert all(r.usage.prompt_tokens_details.cached_tokens == 0 for r in _chat_twice(s, "sekrit"))  # --no-history: nothing kept
    finally:
        assert s.stop() == 0


def _stream_raw(s: Server, n: int, prompt: str = "def add(a, b):"):
    """A streamed request through httpx, whose connection the test can drop."""
    client = httpx.Client(timeout=60)
    cm = client.stream("POST", s.url("/v1/completions"),
                       json={"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True})
    return client, cm


def test_disconnect_frees_its_slot_and_full_queue_gives_429(long_dir):
    s = Server(long_dir, "--batch-size", "1", "--max-queue", "1")
    try:
        client, cm = _stream_raw(s, 1800)
        r = cm.__enter__()
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: s.metrics()["specrt:num_requests_running"] == 1, what="the first request running")
        # one may wait; the next is refused with a Retry-After
        client2, cm2 = _stream_raw(s, 8)
        waiting = threading.Thread(target=lambda: cm2.__enter__().read(), daemon=True)
        waiting.start()
        wait_for(lambda: s.metrics()["specrt:num_requests_waiting"] == 1, what="a waiting request")
        full = httpx.post(s.url("/v1/completions"), json={"prompt": "x", "max_tokens": 4})
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["type"] == "rate_limit_error"
        # the first client goes away mid-stream: its generation ends at the next round, the waiting one runs
        cm.__exit__(None, None, None)
        client.close()
        wait_for(lambda: s.metrics().get('specrt:request_success_total{finished_reason="cancelled"}', 0) == 1,
                 what="the dropped stream cancelled")
        waiting.join(30)
        assert not waiting.is_alive()
        m = s.metrics()
        assert m["specrt:num_requests_running"] == 0 and m["specrt:num_requests_waiting"] == 0
        # the cancelled request did not run to its end
        assert m["specrt:generation_tokens_total"] < 1800
        assert s.client().completions.create(model="pair-qwen2-long", prompt="x", max_tokens=4).usage.completion_tokens >= 1
        # a non-streamed request whose client gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url("/v1/completions"), json={"prompt": "def add(a, b):", "max_tokens": 1800, "temperature": 0},
                       timeout=0.5)
        wait_for(lambda: s.metrics().get('specrt:request_success_total{finished_reason="cancelled"}', 0) == 2,
                 what="the abandoned request cancelled")
    finally:
        assert s.stop() == 0


def test_sigterm_while_streaming_ends_streams_with_an_error(long_dir):
    s = Server(long_dir, "--batch-size", "1")
    client, cm = _stream_raw(s, 1800)
    r = cm.__enter__()
    lines = r.iter_lines()
    assert next(lines).startswith("data: ")
    s.proc.send_signal(signal.SIGTERM)
    rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert "error" in json.loads(rest[-2].removeprefix("data: ")), rest[-2]
    assert s.proc.wait(30) == 0
    client.close()


def test_bad_starts_are_one_line(tmp_path, qwen_dir):
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", str(tmp_path / "missing"), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("Error: ") and len(r.stderr.strip().splitlines()) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "specrt.cli", "serve", str(qwen_dir), "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "in use" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_load_loses_nothing_and_does_not_grow(server, qwen_dir):
    prompts = PROMPTS[:4]
    want = {p: lone(qwen_dir, p, 8) for p in prompts}
    c = server.client()
    before = server.metrics()

    def ask(i):
        p = prompts[i % len(prompts)]
        if i % 2:
            text = "".join(ch.choices[0].text for ch in c.completions.create(
                model="pair-qwen2", prompt=p, max_tokens=8, temperature=0, stream=True) if ch.choices)
        else:
            text = c.completions.create(model="pair-qwen2", prompt=p, max_tokens=8, temperature=0).choices[0].text
        return i, text

    with ThreadPoolExecutor(4) as ex:
        warm = list(ex.map(ask, range(60)))
        rss0 = server.rss_kb()
        rest = list(ex.map(ask, range(60, 360)))
    rss1 = server.rss_kb()
    results = warm + rest
    assert sorted(i for i, _ in results) == list(range(360))  # nothing lost, nothing twice
    assert all(text == want[prompts[i % len(prompts)]] for i, text in results)
    after = server.metrics()
    done = sum(v for k, v in after.items() if k.startswith("specrt:request_success_total")) - \
        sum(v for k, v in before.items() if k.startswith("specrt:request_success_total"))
    assert done == 360
    assert rss1 <= rss0 * 1.05, (rss0, rss1)


def test_the_example_client_runs(server):
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "examples" / "client.py"), "--base-url", server.base, "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tokens/target pass" in r.stderr and r.stdout


def test_no_draft_model_serves_prompt_lookup_and_refuses_a_model_drafter(qwen_dir):
    s = Server(qwen_dir, "--no-draft-model")
    try:
        assert "the draft model left out" in "".join(s.log)
        r = httpx.post(s.url("/v1/completions"), json={"prompt": "x = 1 +", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["specrt"]["accepted_by_drafter"].keys() <= {"ngram", "suffix"}
        r = httpx.post(s.url("/v1/completions"), json={"prompt": "x = 1 +", "max_tokens": 4, "drafter": "model"})
        assert r.status_code == 400 and "loaded without its draft model" in r.json()["error"]["message"]
    finally:
        assert s.stop() == 0
