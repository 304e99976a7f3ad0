"""What a hostile client, a bad record or a second process once did to specrt, one test per defect, each
named for what it guards: stop-string floods, two jobs on one output, invalid text, deep JSON, full disks,
read-only folders, damaged pairs, empty keys, slow connections. The server's fuzzing and soak are at the end."""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrt.config import MAX_STOP_CHARS, MAX_STOPS, GenerationConfig, SamplingConfig
from specrt.errors import ConfigError

from _helpers import cli, copy_pair, one_line_error
from test_probe3 import chain_of_refs, chain_of_rules, properties


def write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def read_out(path: Path) -> dict:
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    # a line without a usable id has the error record {"id": null, "line": N, "error"}: keyed "line N"
    keys = [r["id"] if r["id"] is not None else f"line {r['line']}" for r in recs]
    assert len(keys) == len(set(keys)), "a record written twice"
    return dict(zip(keys, recs))


# ---------------------------------------------------------------------------------------------- stop strings


def test_stop_strings_are_bounded_in_count_and_length(qwen_dir):
    GenerationConfig(stop=tuple("x" * MAX_STOP_CHARS for _ in range(MAX_STOPS)))
    for stop in (tuple(f"s{i}" for i in range(MAX_STOPS + 1)), ("x" * (MAX_STOP_CHARS + 1),), ("a\ud800",)):
        with pytest.raises(ConfigError, match="stop"):
            GenerationConfig(stop=stop)
    r = cli("generate", qwen_dir, "--prompt", "x", "--max-new-tokens", 2, *[f"--stop=s{i}" for i in range(MAX_STOPS + 1)])
    assert f"at most {MAX_STOPS} stop strings" in one_line_error(r)


def _naive(text: str, start: int, stops) -> int | None:
    """Where the earliest stop string that ends at or after `start` begins, by brute force."""
    hits = [i for s in stops for i in [text.find(s, max(0, start - len(s) + 1))] if i >= 0]
    return min(hits) if hits else None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.text("ab\n", min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.text("ab\n", max_size=5), max_size=12))
def test_stop_matching_finds_what_a_search_finds(stops, pieces):
    """The stop-string matcher (an automaton a character at a time, O(new text) a round) against a search
    of the whole text: the same cut, and the same held-back tail."""
    from specrt.api.text import _StopMatcher

    m, text = _StopMatcher(tuple(stops)), ""
    for piece in pieces:
        hit = m.feed(piece, len(text))
        want = _naive(text + piece, len(text), stops)
        text += piece
        assert hit == want, (stops, text)
        if hit is not None:
            break
        held = max((j for s in stops for j in range(1, len(s)) if text.endswith(s[:j])), default=0)
        assert m.pending() == held


def test_a_flood_of_stop_strings_is_refused_at_once(server):
    import httpx

    t = time.monotonic()
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 1000, "stop": ["q"] * 85000},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert f"at most {MAX_STOPS}" in r.json()["error"]["message"] and time.monotonic() - t < 10


# ---------------------------------------------------------------------------------------------- batch jobs


def _records(n: int, **extra) -> list[dict]:
    return [{"id": i, "prompt": f"y = {i} +", **extra} for i in range(n)]


def test_a_second_job_on_the_same_output_is_refused(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", _records(120))
    out = tmp_path / "out.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "specrt.cli", "batch", str(qwen_dir), "--input", str(inp), "--output",
                              str(out), "--max-new-tokens", "24", "--batch-size", "1", "--no-progress"],
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (out.exists() and out.stat().st_size) and time.monotonic() < deadline:  # it is writing now
        time.sleep(0.05)
    assert first.poll() is None, first.stderr.read()
    r = cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 24, "--no-progress")
    msg = one_line_error(r)
    assert "being written by another specrt batch" in msg and f"pid {first.pid}" in msg
    r = cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 24, "--overwrite", "--no-progress")
    assert "being written by another specrt batch" in one_line_error(r)  # --overwrite does not break the lock
    assert first.wait(300) == 0, first.stderr.read()
    assert sorted(read_out(out)) == list(range(120))


def test_overwrite_never_replaces_the_input(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", _records(3))
    before = inp.read_bytes()
    for extra in ([], ["--overwrite"]):
        r = cli("batch", qwen_dir, "--input", inp, "--output", inp, "--max-new-tokens", 2, "--no-progress", *extra)
        assert "same file" in one_line_error(r)
    assert inp.read_bytes() == before and not Path(str(inp) + ".job.json").exists()


def test_invalid_text_and_deep_json_in_records_are_error_records(qwen_dir, tmp_path):
    deep = '{"id": "deep", "prompt": ' + "[" * 100000 + "]" * 100000 + "}"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "x = 1"}, {"id": "sur", "prompt": "a\ud800"},
                                              {"id": "msg", "messages": [{"role": "user\udcff", "content": "hi"}]},
                                              deep, {"id": "ok2", "prompt": "y = 2"}])
    out = tmp_path / "out.jsonl"
    r = cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 3, "--no-progress")
    assert r.exit_code == 0, r.output
    recs = read_out(out)
    assert "text" in recs["ok"] and "text" in recs["ok2"]
    assert "not valid text" in recs["sur"]["error"] and "not valid text" in recs["msg"]["error"]
    assert "nested too deep" in recs["line 4"]["error"] and recs["line 4"]["id"] is None


def test_an_output_that_is_not_a_file_is_refused_before_work(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", _records(2))
    r = cli("batch", qwen_dir, "--input", inp, "--output", "/dev/full", "--no-progress")
    assert "not a regular file" in one_line_error(r)
    assert not Path("/dev/full.job.json").exists()


def test_a_full_disk_mid_job_leaves_whole_records_and_resumes(qwen_dir, tmp_path, monkeypatch):
    """os.write fails part-way through the third record (ENOSPC): one line, exit 2, the output valid JSONL
    up to its last whole record; a rerun finishes the job."""
    inp = write_jsonl(tmp_path / "in.jsonl", _records(6))
    out = tmp_path / "out.jsonl"
    real, calls = os.write, {"n": 0}

    def full(fd, data):
        if fd > 2 and os.fstat(fd).st_ino == (out.stat().st_ino if out.exists() else -1):
            calls["n"] += 1
            if calls["n"] == 3:
                real(fd, bytes(data)[:10])  # a torn line first
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    r = cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 3, "--batch-size", 1, "--no-progress")
    msg = one_line_error(r)
    assert "No space left on device" in msg and "resumes" in msg
    assert out.read_bytes().endswith(b"\n") and len(read_out(out)) == 2
    monkeypatch.setattr(os, "write", real)
    r = cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 3, "--batch-size", 1, "--no-progress")
    assert r.exit_code == 0, r.output
    assert sorted(read_out(out)) == list(range(6))


def test_tune_on_a_read_only_pair_stops_before_measuring(qwen_dir, tmp_path, monkeypatch):
    import tempfile

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    t = time.monotonic()
    r = cli("tune", qwen_dir, "--prompts", Path(__file__).parent.parent / "bench/prompts/prompts.jsonl")
    assert "Read-only file system" in one_line_error(r) and "--dry-run" in one_line_error(r)
    assert time.monotonic() - t < 30  # refused before any measurement


def test_tune_prints_its_results_when_they_cannot_be_stored(qwen_dir, tmp_path, monkeypatch):
    from specrt.apps import tune

    d = copy_pair(qwen_dir, tmp_path / "p")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f(x):"}])

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tune, "write_tuned", full)
    r = cli("tune", d, "--prompts", prompts, "--draft-lens", "0,2", "--drafters", "model", "--confidence-stops", "0",
            "--max-new-tokens", 8)
    assert "could not store the results above" in one_line_error(r)
    assert "chose drafter" in r.stdout


# ---------------------------------------------------------------------------------------------- text


def test_invalid_text_on_the_command_line_and_in_the_api(qwen_dir, qwen_pair):
    r = cli("generate", qwen_dir, "--prompt", "abc\udcff", "--max-new-tokens", 2)  # bytes that were not UTF-8
    assert "not valid text" in one_line_error(r)
    for call in (lambda: qwen_pair.generate("a\ud800", max_new_tokens=2),
                 lambda: qwen_pair.generate("x", max_new_tokens=2, stop=["\ud800"]),
                 lambda: qwen_pair.generate("x\udcff", max_new_tokens=2, chat=True)):
        with pytest.raises(ConfigError, match="not valid text"):
            call()


# ---------------------------------------------------------------------------------------------- damaged pairs


def _edit_manifest(d: Path, fn) -> None:
    p = d / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def _info(d):
    r = cli("info", d)
    return r, [ln for ln in r.stdout.splitlines() if ln.startswith("problem: ")]


def test_info_reports_every_damage_and_exits_1(qwen_dir, tmp_path):
    from specrt.manifest import read_manifest, sha256_file

    m = read_manifest(qwen_dir)
    cases = {}
    d = cases["truncated graph"] = copy_pair(qwen_dir, tmp_path / "trunc")
    f = d / m.target.path
    f.write_bytes(f.read_bytes()[:1000])
    d = cases["wrong hash"] = copy_pair(qwen_dir, tmp_path / "hash")
    _edit_manifest(d, lambda x: x["draft"]["files"].update({m.draft.path: "0" * 64}))
    d = cases["empty draft graph"] = copy_pair(qwen_dir, tmp_path / "empty")
    (d / m.draft.path).write_bytes(b"")
    _edit_manifest(d, lambda x: x["draft"]["files"].update({m.draft.path: sha256_file(d / m.draft.path)}))
    d = cases["no tokenizer"] = copy_pair(qwen_dir, tmp_path / "tok")
    (d / "tokenizer.json").unlink()
    want = {"truncated graph": "does not match the sha256", "wrong hash": "does not match the sha256",
            "empty draft graph": "has no nodes", "no tokenizer": "tokenizer.json"}
    for name, d in cases.items():
        r, problems = _info(d)
        assert r.exit_code == 1 and problems and want[name] in " ".join(problems), (name, r.output)
        assert "Traceback" not in r.output
    r, problems = _info(qwen_dir)
    assert r.exit_code == 0 and not problems, r.output


@pytest.mark.parametrize("where", ["target.path", "draft.files", "tokenizer_files"])
def test_a_manifest_path_leaving_the_pair_is_refused_everywhere(qwen_dir, tmp_path, where):
    d = copy_pair(qwen_dir, tmp_path / "p")
    evil = "../../etc/passwd"

    def edit(m):
        if where == "target.path":
            m["target"]["path"] = evil
        elif where == "draft.files":
            m["draft"]["files"][evil] = "0" * 64
        else:
            m["tokenizer_files"].append(evil)

    _edit_manifest(d, edit)
    for cmd in (["info", d], ["generate", d, "--prompt", "x", "--max-new-tokens", 1]):
        assert "leaves the pair folder" in one_line_error(cli(*cmd))


def test_a_manifest_missing_a_key_names_it(qwen_dir, tmp_path):
    d = copy_pair(qwen_dir, tmp_path / "p")
    _edit_manifest(d, lambda m: (m.pop("max_len"), m["target"].pop("num_layers")))
    msg = one_line_error(cli("info", d))
    assert "has no 'max_len'" in msg and "__init__" not in msg
    d2 = copy_pair(qwen_dir, tmp_path / "q")
    _edit_manifest(d2, lambda m: m["target"].pop("num_layers"))
    assert "target has no 'num_layers'" in one_line_error(cli("info", d2))


# ---------------------------------------------------------------------------------------------- one draw alone and batched


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_seeded_sampling_alone_equals_batched_on_long_prompts(qwen_pair, qwen_dir, tmp_path, drafter):
    """Prompts longer than the draft's catch-up window (32 on the CPU): alone (the API and `specrt generate`),
    after a request sharing a long prefix (the draft's memory keeps it) and as rows of the batched decoder
    (`specrt batch`), the same seeded draws."""
    from specrt.decoding.decode import Request

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, qwen_pair.manifest.vocab_size, n).tolist() for n in (40, 75, 120)]
    cfg = GenerationConfig(max_new_tokens=20, draft_len=3, drafter=drafter, seed=11,
                           sampling=SamplingConfig(temperature=0.9, top_k=30))
    alone = []
    for p in prompts:
        qwen_pair.run([7, 8, 9], cfg)  # whatever ran before
        alone.append(qwen_pair.run(p, cfg).tokens)
    for p, want in zip(prompts, alone):
        qwen_pair.run(p[:-5], cfg)  # leaves all but the last 5 tokens in the draft's memory
        assert qwen_pair.run(p, cfg).tokens == want
    with qwen_pair.runner(3) as dec:
        got = dict(dec.run([Request(i, p, cfg) for i, p in enumerate(prompts)]))
    assert [got[i].tokens for i in range(3)] == alone
    if drafter == "hybrid":
        return
    text = "def long_function_name(argument_one, argument_two, argument_three):\n    " * 2
    r = cli("generate", qwen_dir, "--prompt", text, "--max-new-tokens", 16, "--temperature", 0.9, "--seed", 5,
            "--draft-len", 3, "--drafter", "model", "--json")
    assert r.exit_code == 0, r.output
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": text if i == 1 else f"z{i}", "seed": 5} for i in range(4)])
    out = tmp_path / "out.jsonl"
    r2 = cli("batch", qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 16, "--temperature", 0.9,
             "--draft-len", 3, "--drafter", "model", "--batch-size", 4, "--no-progress")
    assert r2.exit_code == 0, r2.output
    assert read_out(out)[1]["tokens"] == json.loads(r.stdout)["tokens"]


# ---------------------------------------------------------------------------------------------- the server

import fastapi  # noqa: E402,F401  (the serve extra)
import httpx  # noqa: E402
import openai  # noqa: E402
from test_server import Server  # noqa: E402


@pytest.fixture(scope="module")
def server(qwen_dir):
    s = Server(qwen_dir, "--batch-size", "4", "--header-timeout", "1", "--body-timeout", "2", "--max-connections", "12")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _post(server, path, body=None, content=None):
    return httpx.post(server.url(path), json=body, content=content, timeout=60,
                      headers={"content-type": "application/json"} if content is not None else None)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_bodies_are_400_not_500(server, route):
    chat = route.endswith("chat/completions")
    good = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    cases = [({**good, "stream": True, "stream_options": "x"}, "stream_options"),
             ({**good, "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage")]
    if chat:
        cases += [({"messages": [{"role": "user", "content": "a\ud800"}]}, None),
                  ({"messages": [{"role": "us\ud800er", "content": "hi"}]}, None)]
    else:
        cases += [({"prompt": "a\ud800"}, None)]
    for body, param in cases:
        r = _post(server, route, content=json.dumps(body).encode())
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and (param is None or err["param"] == param), err
    deep = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = _post(server, route, content=deep)
    assert r.status_code == 400 and "nests too deep" in r.json()["error"]["message"]
    assert not any("Traceback" in ln or "-> 500" in ln for ln in server.log)


def test_openai_no_op_values_and_model_retrieve(server):
    c = server.client()
    r = c.completions.create(model="pair-qwen2", prompt="x", max_tokens=2, logprobs=None, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False,
            "response_format": {"type": "text"}}
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    assert _post(server, "/v1/chat/completions", {**body, "logprobs": True}).status_code == 400
    assert _post(server, "/v1/chat/completions", {**body, "functions": [{"name": "f"}]}).status_code == 400
    assert _post(server, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"},
                                                  "max_tokens": 8}).json()["choices"][0]["message"]["content"][0] == "{"
    assert c.models.retrieve("pair-qwen2").id == "pair-qwen2"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_api_key_is_refused(qwen_dir, how):
    env = {**os.environ, "SPECRT_API_KEY": ""} if how == "env" else dict(os.environ)
    args = [sys.executable, "-m", "specrt.cli", "serve", str(qwen_dir), "--port", "0"] + (["--api-key", ""] if how == "flag" else [])
    p = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "API key is empty" in p.stderr and "Traceback" not in p.stderr


def _connect(server) -> socket.socket:
    host, port = server.base.split("//")[1].split("/")[0].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_slow_clients_are_cut_off(server):
    """A connection that never finishes its headers is closed after --header-timeout; a body that never
    finishes gets a 408 after --body-timeout; connections past --max-connections get 503."""
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
    t = time.monotonic()
    assert s.recv(100) == b"" and time.monotonic() - t < 5  # closed by the server
    s.close()
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    reply = s.recv(4096)
    assert b" 408 " in reply.split(b"\r\n")[0], reply[:200]
    s.close()
    held = [_connect(server) for _ in range(12)]
    for h in held:
        h.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # open, headers unfinished
    time.sleep(0.3)
    extra = httpx.get(server.url("/health"), timeout=10)
    assert extra.status_code == 503
    for h in held:
        h.close()
    wait = time.monotonic() + 10
    while httpx.get(server.url("/health"), timeout=10).status_code != 200 and time.monotonic() < wait:
        time.sleep(0.1)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_seeded_sampling_through_the_server_alone_equals_batched(server):
    text = "def long_function_name(argument_one, argument_two, argument_three):\n    " * 2
    body = {"prompt": text, "max_tokens": 16, "temperature": 0.9, "seed": 9, "draft_len": 3, "drafter": "model"}
    alone = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    from concurrent.futures import ThreadPoolExecutor

    # Eight long requests first (~0.2 s each alone here, in batches of 4 the server is busy for ~0.6 s): this
    # one comes while they run and joins them as a row of the batch. Timing decides that, so a run in which
    # it came alone after all (the fillers' requests arriving late) is tried again.
    for _ in range(3):
        with ThreadPoolExecutor(9) as ex:
            fillers = [ex.submit(_post, server, "/v1/completions", {"prompt": f"x{i}", "max_tokens": 200,
                                                                    "temperature": 0}) for i in range(8)]
            time.sleep(0.1)
            got = _post(server, "/v1/completions", body)
            assert all(f.result().status_code == 200 for f in fillers)
        if got.json()["specrt"]["batch_size"] > 1:
            break
    assert got.json()["specrt"]["batch_size"] > 1  # it ran as a row of the batched decoder
    assert got.json()["choices"][0]["text"] == alone


def test_coupled_sampling_through_the_server_is_the_target_only_sample_alone_or_batched(server):
    """With "sampling": "coupled" a seed's text is the target-only sample whatever drafts it: here auto
    lengths with the hybrid drafter, as a row of the batched decoder, against draft length 0 alone."""
    text = "def long_function_name(argument_one, argument_two, argument_three):\n    " * 2
    body = {"prompt": text, "max_tokens": 16, "temperature": 0.9, "seed": 9, "sampling": "coupled"}
    alone = _post(server, "/v1/completions", {**body, "draft_len": 0}).json()["choices"][0]["text"]
    from concurrent.futures import ThreadPoolExecutor

    for _ in range(3):  # as above: retried if it happened to run alone
        with ThreadPoolExecutor(9) as ex:
            fillers = [ex.submit(_post, server, "/v1/completions", {"prompt": f"x{i}", "max_tokens": 200,
                                                                    "temperature": 0}) for i in range(8)]
            time.sleep(0.1)
            got = _post(server, "/v1/completions", {**body, "draft_len": "auto", "drafter": "hybrid"})
            assert all(f.result().status_code == 200 for f in fillers)
        if got.json()["specrt"]["batch_size"] > 1:
            break
    assert got.json()["specrt"]["batch_size"] > 1
    assert got.json()["choices"][0]["text"] == alone


# ---------------------------------------------------------------------------------------------- fuzzing

# What Python's json reads besides what clients usually send: huge integers, some past the 4,300 digits
# Python reads one from (written with that bound lifted, _fuzz), floats at float64's ends and Infinity/NaN,
# and lone surrogates (JSON's "\ud800") in any text.
HUGE = st.builds(lambda n, sign: sign * 10 ** n, st.integers(4301, 5000) | st.integers(300, 4300), st.sampled_from([1, -1]))
EXTREME = st.sampled_from([5e-324, -5e-324, 1e-310, 1.7976931348623157e308, -1.7976931348623157e308,
                           float("inf"), float("-inf"), float("nan")])


def _text(max_size: int, min_size: int = 0):
    """Text, or text holding a lone surrogate."""
    return st.text(min_size=min_size, max_size=max_size) | st.tuples(
        st.text(max_size=max_size // 2), st.characters(categories=["Cs"]), st.text(max_size=max_size // 2)).map("".join)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | HUGE | st.floats(allow_nan=False, width=32) |
                    EXTREME | _text(8), lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(_text(6), inner, max_size=3), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "response_format", "logit_bias",
          "frequency_penalty", "presence_penalty", "echo", "best_of", "suffix", "draft_len", "drafter", "tools", "user",
          "tool_choice", "parallel_tool_calls", "json_schema", "regex", "grammar"]
# Constraints that once crashed the server or failed others (issue 60): chains of named rules and of $refs,
# huge property sets, constraints that match nothing, tool parameters with $defs and self-references.
_SCHEMAS = (st.builds(lambda n: json.loads(chain_of_refs(n)), st.sampled_from([1, 30, 300, 1000]))
            | st.builds(lambda n: json.loads(properties(n)), st.sampled_from([1, 40, 12000]))
            | st.sampled_from([{"$ref": "#"}, True, False, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
                               {"type": "object", "properties": {"loc": {"$ref": "#/$defs/L"}},
                                "$defs": {"L": {"type": "object", "properties": {"c": {"type": "string"}}}}}]))
_TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]) | _text(4), "parameters": _SCHEMAS | JSON})})
GRAMMARS = {"grammar": st.builds(chain_of_rules, st.sampled_from([1, 50, 3000]))
            | st.sampled_from(['start: a\na: a "x"\n', 'start: "a"+\n']),
            "json_schema": _SCHEMAS, "regex": st.sampled_from(["(a{1000}){1000}", "[ab]+", "(", ""]) | _text(6),
            "response_format": st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                                         _SCHEMAS),
            "tools": st.lists(_TOOL, min_size=1, max_size=2),
            "tool_choice": st.sampled_from(["required", "auto", "none"])
            | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["f", "g"]) | JSON})})}
GOODISH = {"prompt": _text(20, min_size=1) | st.lists(st.integers(0, 400), min_size=1, max_size=5),
           "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | _text(8),
                                                       "content": _text(20)}), min_size=1, max_size=2),
           "max_tokens": st.integers(-1, 3) | HUGE, "temperature": st.floats(-1, 3, width=32) | EXTREME,
           "top_p": st.floats(0, 1) | EXTREME, "seed": st.integers(-1, 2**64), "stream": st.booleans(),
           "stop": _text(3) | st.lists(_text(3), max_size=18), "model": st.just("pair-qwen2") | _text(10),
           "drafter": st.sampled_from(["model", "ngram", "suffix", "hybrid"]) | _text(8),
           **GRAMMARS}


def _short(b: dict) -> dict:
    """A generation of at most a few tokens (any other type of value stays, to be refused)."""
    for name in ("max_tokens", "max_completion_tokens"):
        v = b.get(name, 3)
        b[name] = v if not isinstance(v, int) or isinstance(v, bool) or v < 4 or v > 10 ** 4300 else 3
    return b


def bodies():
    value = lambda f: GOODISH[f] | JSON if f in GOODISH else JSON  # noqa: E731
    return st.fixed_dictionaries({}, optional={f: value(f) for f in FIELDS}).map(_short)


def _check_reply(r) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


def _fuzz(server, n: int, seed: int):
    routes = st.sampled_from(["/v1/completions", "/v1/chat/completions"])

    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(routes, bodies())
    def run(route, body):
        _check_reply(_post(server, route, content=json.dumps(body).encode()))

    digits = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # json.dumps writes HUGE
    try:
        run()
    finally:
        sys.set_int_max_str_digits(digits)
    for path in ("/health", "/v1/models", "/v1/models/pair-qwen2", "/v1/models/x", "/metrics", "/nope"):
        _check_reply(httpx.get(server.url(path), timeout=30))
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    assert not any("-> 500" in ln or "Traceback" in ln for ln in server.log), "".join(server.log[-20:])


def test_fuzzed_requests_get_2xx_or_4xx(server):
    _fuzz(server, 120, 0)


@pytest.mark.slow
def test_fuzzed_requests_get_2xx_or_4xx_many(server):
    _fuzz(server, 1500, 1)


# ---------------------------------------------------------------------------------------------- soak


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    return int(next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Threads:")).split()[1])


@pytest.mark.slow
def test_soak_a_thousand_mixed_requests(qwen_dir):
    """1,000 requests from 8 clients: good, sampled, streamed, cancelled and bad ones. Nothing lost or
    duplicated, every good one answered, RSS after warm-up within 5%, files and threads back to where they were."""
    from concurrent.futures import ThreadPoolExecutor

    s = Server(qwen_dir, "--batch-size", "4", "--max-queue", "64")
    try:
        c = s.client()

        def one(i):
            kind = i % 10
            if kind == 7:  # bad
                return _post(s, "/v1/completions", {"prompt": "x", "temperature": -1}).status_code
            if kind == 8:  # cancelled: the client goes away mid-stream
                with httpx.stream("POST", s.url("/v1/completions"), json={"prompt": f"p{i}", "max_tokens": 40,
                                                                             "stream": True}, timeout=60) as r:
                    for _ in r.iter_lines():
                        break
                return 499
            kw = dict(model="pair-qwen2", prompt=f"x = {i} +", max_tokens=1 + i % 12, temperature=0 if kind < 4 else 0.8,
                      seed=i)
            if kind == 9:
                return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
            return c.completions.create(**kw).choices[0].text

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, range(100)))  # warm-up
        time.sleep(1)
        rss0, fds0, threads0 = s.rss_kb(), _fds(s.proc.pid), _threads(s.proc.pid)
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(one, range(1000)))
        wall = time.monotonic() - t0
        assert len(results) == 1000
        assert all(r == 400 for i, r in enumerate(results) if i % 10 == 7)
        assert all(isinstance(r, str) for i, r in enumerate(results) if i % 10 not in (7, 8))
        # nothing swapped, lost or repeated: greedy answers are what each request gets on its own, one at a time
        greedy = [i for i in range(1000) if i % 10 < 4][:40]
        assert [one(i) for i in greedy] == [results[i] for i in greedy]
        deadline = time.monotonic() + 30
        while (_fds(s.proc.pid) > fds0 or _threads(s.proc.pid) > threads0) and time.monotonic() < deadline:
            time.sleep(0.2)
        rss1, fds1, threads1 = s.rss_kb(), _fds(s.proc.pid), _threads(s.proc.pid)
        print(f"soak: 1000 requests in {wall:.1f} s; RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MB "
              f"({(rss1 / rss0 - 1) * 100:+.1f}%); open files {fds0} -> {fds1}; threads {threads0} -> {threads1}")
        assert fds1 <= fds0 and threads1 <= threads0
        assert rss1 <= rss0 * 1.05, (rss0, rss1)
    finally:
        assert s.stop() == 0, "".join(s.log)
