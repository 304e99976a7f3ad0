"""What the third hostile probe (issue 60) did to `specrt serve`, one test per defect, each named for what it
guards: a lone surrogate escape in a tool call the model writes, an integer past Python's digit limit in an
earlier call's arguments, a `tool_choice` name that is not text, function parameters with `$defs` or a
`{"$ref": "#"}`, seeds past int64 that alias others, a streamed tool call with content the whole reply
lacks, earlier calls' arguments encoded again in the prompt, parameters that are not an object schema, and
a request line in absolute form."""
from __future__ import annotations

import json
import shutil
import socket

import pytest

import fastapi  # noqa: F401  (the serve extra)
import httpx

from _helpers import cli, one_line_error
from test_probe2_server import _error as probe2_error
from test_server import Server

MSGS = [{"role": "user", "content": "where"}]
LOC = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
       "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TREE = {"type": "object", "required": ["v", "next"],
        "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
TOOLS = [{"type": "function", "function": {"name": "where", "parameters": LOC}},
         {"type": "function", "function": {"name": "tree", "parameters": TREE}}]
PICK = [{"type": "function", "function": {"name": "pick", "parameters": {
    "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(long_qwen_dir):
    s = Server(long_qwen_dir, "--batch-size", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _error(r, status: int) -> dict:
    """The OpenAI error object of a reply that must have `status`, its message on one line."""
    err = probe2_error(r, status)
    assert "\n" not in err["message"], err
    return err


def _chat(server, **body) -> httpx.Response:
    return httpx.post(server.url("/v1/chat/completions"), json={"messages": MSGS, "max_tokens": 4, **body}, timeout=120)


def _no_500(server, since: int):
    """No internal error in the server's log after its line `since`."""
    assert not any("-> 500" in ln or "Traceback" in ln for ln in server.log[since:]), "".join(server.log[since:][-20:])


def _tools(names=("get",), parallel=True):
    from specrt.apps.serve.tools import Tools

    return Tools(None, frozenset(names), None, parallel)


def _streamed(text: str, tools, cut: int) -> tuple[str, list[dict]]:
    from specrt.apps.serve.tools import StreamedCalls

    s, items = StreamedCalls(tools), []
    for i in range(0, len(text), cut):
        items += s.feed(text[i:i + cut])
    items += s.finish()
    return "".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, dict)]


# ---------------------------------------------------------------------------------------------- 500s


def test_a_lone_surrogate_escape_in_a_tool_calls_arguments_is_kept_escaped():
    """The model writes `"\\ud800"` inside a call's arguments: the reply (whole or streamed) still goes out,
    the escape kept as written."""
    from fastapi.responses import JSONResponse

    from specrt.apps.serve.shapes import Shape as _Shape
    from specrt.apps.serve.tools import parse

    text = '<tool_call>\n{"name": "get", "arguments": {"s": "a\\ud800b", "t": "\u00e9"}}\n</tool_call>'
    _, calls = parse(text, _tools())
    args = calls[0]["function"]["arguments"]
    assert json.loads(args) == {"s": "a\ud800b", "t": "\u00e9"} and "\\ud800" in args
    args.encode("utf-8")  # text UTF-8 can hold
    for cut in (1, 5, len(text)):
        assert [c["function"]["arguments"] for c in _streamed(text, _tools(), cut)[1]] == [args]

    class Res:
        text, tokens, finish_reason, stats = "", [1, 2], "eos", {}

    Res.text = text
    reply = JSONResponse(_Shape("chatcmpl-x", "m", True, 3, _tools()).whole(Res())).body
    assert json.loads(reply)["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == args


def test_an_integer_past_the_digit_limit_in_earlier_arguments_is_a_400(server):
    calls = [{"id": "c1", "type": "function", "function": {"name": "where", "arguments": '{"n": 1' + "0" * 5000 + "}"}}]
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    since = len(server.log)
    err = _error(_chat(server, messages=msgs), 400)
    assert err["param"] == "messages" and "messages[1].tool_calls" in err["message"] and "digits" in err["message"]
    _no_500(server, since)


@pytest.mark.parametrize("name", [["where"], {"name": "where"}])
def test_a_tool_choice_name_that_is_not_a_string_is_a_400(server, name):
    since = len(server.log)
    err = _error(_chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}), 400)
    assert err["param"] == "tool_choice"
    _no_500(server, since)


# ---------------------------------------------------------------------------------------------- $defs and "#"


def _accepts(long_qwen_dir, grammar: str, text: str) -> bool:
    import llguidance

    tok = llguidance.LLTokenizer((long_qwen_dir / "tokenizer.json").read_text(encoding="utf-8"), n_vocab=320,
                                 eos_token=[0])
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("grammar", grammar), log_level=0)
    return m.consume_tokens(tok.tokenize_str(text)) and not m.is_error() and m.is_accepting()


def test_each_functions_parameters_are_their_own_json_schema_root(long_qwen_dir, qwen_pair):
    """`#/$defs/...` resolves in the function's own parameters, and `{"$ref": "#"}` means them, not the
    union of every function's call."""
    from specrt.apps.serve.tools import calls_grammar

    g = calls_grammar({"where": LOC, "tree": TREE}, False, qwen_pair.codec)
    call = '<tool_call>\n{"name": %s, "arguments": %s}\n</tool_call>'
    assert _accepts(long_qwen_dir, g, call % ('"where"', '{"loc": {"city": "Paris"}}'))
    assert not _accepts(long_qwen_dir, g, call % ('"where"', '{"loc": {"town": "Paris"}}'))
    assert _accepts(long_qwen_dir, g, call % ('"tree"', '{"v": 1, "next": {"v": 2, "next": null}}'))
    assert not _accepts(long_qwen_dir, g, call % ('"tree"', '{"v": 1, "next": {"name": "tree", "arguments": '
                                                            '{"v": 2, "next": null}}}'))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "where"}}])
def test_required_and_named_calls_of_parameters_with_defs_are_served(server, choice):
    r = _chat(server, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=80, temperature=0.8,
              seed=3)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    for call in choice0["message"].get("tool_calls") or []:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "where":
            assert isinstance(args["loc"]["city"], str)
        else:
            assert choice == "required" and isinstance(args["v"], int)


# ---------------------------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**200, int("9" * 4001)],
                         ids=["2**63", "2**64", "2**200", "4001-digits"])
def test_a_seed_past_int64_is_a_400_naming_seed(server, seed):
    body = b'{"prompt": "x", "max_tokens": 2, "seed": ' + str(seed).encode() + b"}"
    r = httpx.post(server.url("/v1/completions"), content=body, headers={"Content-Type": "application/json"})
    err = _error(r, 400)
    assert err["param"] == "seed" and len(err["message"]) < 200, err
    ok = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 2, "seed": 2**63 - 1})
    assert ok.status_code == 200, ok.text


def test_a_seed_past_int64_is_refused_by_the_python_api_and_the_cli(qwen_pair, qwen_dir):
    from specrt.errors import ConfigError

    for seed in (2**63, 2**64):
        with pytest.raises(ConfigError) as e:
            qwen_pair.generate("x", max_new_tokens=2, temperature=1.0, seed=seed)
        assert e.value.param == "seed"
        with pytest.raises(ConfigError):
            qwen_pair.run(qwen_pair.encode("x"), qwen_pair.config(max_new_tokens=2, seed=seed))
    assert qwen_pair.generate("x", max_new_tokens=2, temperature=1.0, seed=2**63 - 1).tokens
    r = cli("generate", qwen_dir, "--prompt", "x", "--max-new-tokens", "2", "--seed", str(2**64))
    assert "seed" in one_line_error(r)


# ---------------------------------------------------------------------------------------------- tool calls


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>\n',
    '  \n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>\n\n',
    'Sure.\n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call>\n',
    'ok then\n<tool_call>\n{"name": "get", "arguments": {}}\n</tool_call> done \n',
    '<tool_call>\n{"name": "nope"}\n</tool_call>\n',
    'no calls \n\n',
    ' {"name": "get", "arguments": {}}\n',
])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_streamed_tool_call_reply_has_the_content_and_calls_of_the_whole_one(text, parallel):
    from specrt.apps.serve.tools import parse

    content, calls = parse(text, _tools(parallel=parallel))
    strip = [{k: v for k, v in c.items() if k not in ("id", "index")} for c in calls]
    for cut in (1, 2, 3, 7, len(text)):
        s_content, s_calls = _streamed(text, _tools(parallel=parallel), cut)
        assert s_content == (content or ""), (cut, s_content, content)
        assert [{k: v for k, v in c.items() if k not in ("id", "index")} for c in s_calls] == strip


def _stream(server, **body) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    with httpx.stream("POST", server.url("/v1/chat/completions"), timeout=120,
                      json={"messages": MSGS, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if choices:
                d = choices[0]["delta"]
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    calls[tc["index"]] = (tc["function"]["name"], tc["function"]["arguments"])
                finish = choices[0]["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_and_whole_tool_call_replies_are_the_same(server):
    for seed in range(8):  # some end their call with a newline, some do not
        kw = dict(tools=PICK, tool_choice="required", max_tokens=100, temperature=1.0, seed=seed)
        whole = _chat(server, **kw).json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls") or []]
        assert _stream(server, **kw) == (whole["message"]["content"] or "", calls, whole["finish_reason"]), seed


def test_string_arguments_are_rendered_as_the_json_text_given(qwen_dir, tmp_path):
    """An earlier call's `arguments`, a JSON string in OpenAI's messages, goes into the prompt as that text."""
    from specrt.api.requests import prompt_ids
    from specrt.api.text import TextCodec

    shutil.copy(qwen_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(  # Qwen2.5's way of writing an assistant's calls
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
        '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
        "{% endfor %}\n{% endfor %}")
    codec = TextCodec(tmp_path)
    given = '{"city": "Paris", "t": 1.50, "s": "\\u00e9\\ud800"}'
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "where", "arguments": given}}]}]
    ids = prompt_ids(codec, 320, messages=msgs)
    assert f'<tool_call>{{"name": "where", "arguments": {given}}}</tool_call>' in codec.tokenizer.decode(ids)
    as_object = [{**msgs[1], "tool_calls": [{"function": {"name": "where", "arguments": {"city": "Paris"}}}]}]
    assert '"arguments": {"city": "Paris"}}' in codec.tokenizer.decode(prompt_ids(codec, 320, messages=as_object))


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": "array"}, {"type": ["object", "null"]}])
def test_function_parameters_that_are_not_an_object_schema_are_a_400(server, params):
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    err = _error(_chat(server, tools=tools), 400)
    assert err["param"] == "tools" and "tools[0].function.parameters" in err["message"]


# ---------------------------------------------------------------------------------------------- absolute form


def _raw(server, data: bytes) -> tuple[bytes, bytes]:
    """Send `data` on a fresh connection; (status line, body) of the reply."""
    host, port = server.base.split("//")[1].split("/")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


def test_a_request_target_in_absolute_form_is_routed_by_its_path(server):
    since = len(server.log)
    origin = server.base.removesuffix("/v1").encode()
    port = origin.rsplit(b":", 1)[1]
    body = b'{"prompt": "x", "max_tokens": 2}'

    def post(target: bytes, host: bytes) -> tuple[bytes, bytes]:
        return _raw(server, b"POST " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: application/json"
                    b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    status, reply = post(origin + b"/v1/completions", b"127.0.0.1:" + port)
    assert status.startswith(b"HTTP/1.1 200 ") and json.loads(reply)["object"] == "text_completion", (status, reply)
    status, reply = _raw(server, b"GET " + origin + b"/health?x=1 HTTP/1.1\r\nHost: localhost\r\n"
                                 b"Connection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 ") and json.loads(reply)["status"] == "ok", (status, reply)
    # the Host check sees the name in the target as well as the header's
    for target, host in ((b"http://attacker.example:" + port + b"/v1/completions", b"127.0.0.1:" + port),
                         (origin + b"/v1/completions", b"attacker.example")):
        status, reply = post(target, host)
        assert status.startswith(b"HTTP/1.1 421 ") and json.loads(reply)["error"]["code"] == "host_not_allowed", status
    _no_500(server, since)
