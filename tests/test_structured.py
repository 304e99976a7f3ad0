"""Structured output (decoding/constraint.py): constrained speculation is exact, forced tokens draft for free,
and every front end takes a constraint and refuses a bad one in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
from _helpers import (P_MIN, ByteTokens, FakeEngine, FakeMatcher, chi2_pvalue, cli, fake_exact_joint, one_line_error, rule,
                      sequence_index)

from specrt.config import GenerationConfig, Grammar, SamplingConfig
from specrt.decoding.constraint import Constraint
from specrt.decoding.decode import decode
from specrt.decoding.policy import Auto, Fixed, Forced, PolicyConfig
from specrt.decoding.proposers import GrammarProposer, LookupProposer, ModelProposer
from specrt.errors import ConfigError

# ------------------------------------------------------------------------------- the round, on fake engines


def _fake_run(target, draft, prompt, g, k, V=5, auto=False, forced=True):
    c = Constraint(FakeMatcher(rule, V, prompt[-1]), ByteTokens, V)
    proposers = [] if draft is None else [ModelProposer(draft, V)]
    policy = (Auto if auto else Fixed)(*((proposers, k) if auto else (k, proposers)))
    if forced:
        policy = Forced(policy, GrammarProposer(c), PolicyConfig().forced_first)
    return decode(target, policy, prompt, g, V, frozenset(), constraint=c)


@pytest.mark.parametrize("method, auto", [("rejection", False), ("coupled", False), ("rejection", True)])
def test_constrained_speculation_is_lossless_on_fake_engines(method, auto):
    V, prompt = 5, [1, 2]
    cfg = SamplingConfig(1.0, method=method)
    target = FakeEngine(0, V)
    draft = FakeEngine(1, V, like=target)
    exact = fake_exact_joint(target, prompt, cfg, 3, rule)
    obs = np.zeros_like(exact)
    forced = acc = prop = 0
    for seed in range(4000):
        g = GenerationConfig(max_new_tokens=6, draft_len=3, seed=seed, sampling=cfg, grammar=Grammar("regex", "fake"))
        out, reason, st = _fake_run(target, draft, prompt, g, 3, auto=auto)
        assert len(out) == 6 and reason == "length"
        assert all(b in rule(a) for a, b in zip(prompt[-1:] + out, out))  # every token the grammar's
        obs[sequence_index(out[:3], V)] += 1
        forced += st.rounds_by_drafter.get("grammar", 0)
        acc, prop = acc + st.accepted, prop + st.proposed
    assert forced >= 10 and 0.2 < acc / prop < 0.99  # the grammar drafted, and some drafts were rejected
    p = chi2_pvalue(obs, exact)
    assert p > P_MIN, f"p={p:.2e}"


@pytest.mark.parametrize("auto", [False, True])
def test_greedy_constrained_speculation_equals_constrained_target_only_on_fake_engines(auto):
    V = 5
    for seed in range(12):
        prompt = [int(x) for x in np.random.default_rng(seed).integers(0, V, size=3)]
        target, other = FakeEngine(seed, V, max_len=80), FakeEngine(seed + 100, V, max_len=80)
        g = GenerationConfig(max_new_tokens=20, draft_len=3, grammar=Grammar("regex", "fake"))
        alone, _, _ = _fake_run(target, None, prompt, GenerationConfig(max_new_tokens=20, draft_len=0,
                                                                          grammar=Grammar("regex", "fake")), 0)
        for draft in (other, FakeEngine(seed, V, max_len=80)):
            out, _, st = _fake_run(target, draft, prompt, g, 3, auto=auto)
            assert out == alone
        assert all(b in rule(a) for a, b in zip(prompt[-1:] + alone, alone))


def test_a_lookup_proposal_that_leaves_the_grammar_is_cut_before_the_target_pass():
    V, prompt = 5, [2, 3, 2, 3, 2, 3, 2, 3, 2]  # lookup proposes 3, 2, 3, ...: allowed; and then
    target = FakeEngine(4, V, max_len=80)
    c = Constraint(FakeMatcher(rule, V, prompt[-1]), ByteTokens, V)
    assert c.cut(np.array([3, 3, 1])) == 1  # 3 after 3 is forbidden
    assert c.cut(np.array([0, 1, 3])) == 3 and c.cut(np.array([0, 1, 0])) == 2 and c.forced(8) == []
    c.commit([0])
    assert c.forced(8) == [1, 3] and c.allowed(()).sum() == 1
    policy = Forced(Fixed(4, [LookupProposer()]), GrammarProposer(Constraint(FakeMatcher(rule, V, 2), ByteTokens, V)), 2)
    g = GenerationConfig(max_new_tokens=12, draft_len=4, grammar=Grammar("regex", "fake"))
    out, _, _ = decode(target, policy, prompt, g, V, frozenset(), constraint=policy.forced.constraint)
    assert all(b in rule(a) for a, b in zip(prompt[-1:] + out, out))


def test_a_grammar_limit_met_while_decoding_ends_the_request_with_length_and_says_why(qwen_pair):
    # 3000 optional keys: the parser's row limit is met at the first key (llguidance's bound on its work)
    many = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(3000)}}
    for k in (0, 4):
        r = qwen_pair.generate(PROMPTS[0], max_new_tokens=20, draft_len=k, drafter="model", json_schema=many)
        assert r.finish_reason == "length" and "max is 2000" in r.stats["grammar_error"]
        assert r.stats["grammar_complete"] is False


def test_a_grammar_that_allows_nothing_ends_the_request_with_length_and_says_why():
    V, prompt = 5, [1, 2]

    def dead(prev):
        return set() if prev == 4 else {4}

    c = Constraint(FakeMatcher(dead, V, prompt[-1]), ByteTokens, V)
    g = GenerationConfig(max_new_tokens=10, draft_len=2, grammar=Grammar("regex", "fake"))
    out, reason, st = decode(FakeEngine(0, V), Forced(Fixed(2, []), GrammarProposer(c), 2), prompt, g, V, frozenset(),
                             constraint=c)
    assert out == [4] and reason == "length" and "allows no token" in st.grammar_error


# ------------------------------------------------------------------------------- the real library, tiny pair

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["name", "n", "ok", "kind"], "additionalProperties": False}
PROMPTS = ["def add(a, b):", "import numpy as np", "class Stack:"]


def _valid(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == set(SCHEMA["properties"]) and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and type(obj["n"]) is int and 0 <= obj["n"] <= 99 and type(obj["ok"]) is bool and obj["kind"] in ("cat", "dog"))


@pytest.mark.parametrize("constraint", [{"json_schema": SCHEMA}, {"regex": r"(yes|no): [a-z]{2,12}\."}])
def test_greedy_constrained_speculation_equals_target_only_for_every_drafter(qwen_pair, constraint):
    for prompt in PROMPTS:
        alone = qwen_pair.generate(prompt, max_new_tokens=80, draft_len=0, drafter="model", **constraint)
        assert alone.finish_reason == "eos" and alone.stats["grammar_complete"] is True
        if "json_schema" in constraint:
            assert _valid(alone.text), alone.text
        for drafter in ("model", "ngram", "suffix", "hybrid"):
            for k in (2, "auto"):
                r = qwen_pair.generate(prompt, max_new_tokens=80, draft_len=k, drafter=drafter, **constraint)
                assert r.tokens == alone.tokens, (drafter, k)
                assert r.stats["target_passes"] < alone.stats["target_passes"]


def test_forced_tokens_draft_for_free_and_are_accepted(qwen_pair):
    r = qwen_pair.generate(PROMPTS[0], max_new_tokens=80, draft_len="auto", drafter="ngram", json_schema=SCHEMA)
    st = r.stats
    assert st["rounds_by_drafter"].get("grammar", 0) >= 4 and st["accepted_by_drafter"]["grammar"] >= 12
    assert st["draft_passes"] == 0 and r.tokens == qwen_pair.generate(PROMPTS[0], max_new_tokens=80, draft_len=0,
                                                                       json_schema=SCHEMA).tokens
    assert st["mask_ms"] > 0


def test_coupled_sampling_under_a_constraint_is_the_target_only_sample(qwen_pair):
    for seed in range(3):
        kw = dict(max_new_tokens=60, temperature=1.0, seed=seed, json_schema=SCHEMA)
        alone = qwen_pair.generate(PROMPTS[1], draft_len=0, **kw)
        assert alone.stats["grammar_complete"] is False or _valid(alone.text)
        for drafter in ("model", "hybrid"):
            assert qwen_pair.generate(PROMPTS[1], draft_len="auto", drafter=drafter, **kw).tokens == alone.tokens


def test_batch_rows_under_constraints_equal_requests_alone(qwen_pair):
    from specrt.api.pair import generate_batch

    alone = {p: qwen_pair.generate(p, max_new_tokens=60, draft_len=0, json_schema=SCHEMA).tokens for p in PROMPTS}
    for drafter, k in (("model", 3), ("ngram", 2), ("hybrid", "auto")):
        kw = dict(max_new_tokens=60, draft_len=k, drafter=drafter)
        rows = generate_batch(qwen_pair, PROMPTS * 2, batch_size=3, json_schema=SCHEMA, **kw)
        for p, row in zip(PROMPTS * 2, rows):
            assert row.tokens == alone[p] and _valid(row.text), (drafter, k)


def test_max_new_tokens_before_the_grammar_ends_is_length_and_said(qwen_pair):
    r = qwen_pair.generate(PROMPTS[0], max_new_tokens=5, json_schema=SCHEMA)
    assert r.finish_reason == "length" and r.stats["grammar_complete"] is False and len(r.tokens) == 5


@pytest.mark.parametrize("kw, param, says", [
    ({"json_schema": {"type": "strin"}}, "json_schema", "Invalid type"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"json_schema": [1, 2]}, "json_schema", "must be a JSON schema"),
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"grammar": "start: foo"}, "grammar", "unknown name"),
    ({"regex": "a", "grammar": "start: \"a\""}, "grammar", "give one of"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
])
def test_a_bad_constraint_is_one_line_before_decoding(qwen_pair, kw, param, says):
    with pytest.raises(ConfigError) as e:
        qwen_pair.generate(PROMPTS[0], max_new_tokens=4, **kw)
    assert e.value.param == param and says in str(e.value) and "\n" not in str(e.value)


def test_the_cli_takes_each_constraint_and_refuses_bad_ones(qwen_dir, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    r = cli("generate", str(qwen_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "80", "--json-schema", str(schema),
            "--json")
    assert r.exit_code == 0, r.output
    assert _valid(json.loads(r.stdout)["text"])
    r = cli("generate", str(qwen_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "30", "--regex", "(yes|no)")
    assert r.exit_code == 0 and r.stdout.strip() in ("yes", "no")
    lark = tmp_path / "g.lark"
    lark.write_text('start: "x" DIGIT DIGIT\n%import common.DIGIT\n')
    r = cli("generate", str(qwen_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "30", "--grammar", str(lark))
    assert r.exit_code == 0 and len(r.stdout.strip()) == 3 and r.stdout.startswith("x"), r.output
    r = cli("generate", str(qwen_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "20", "--json-object")
    assert r.exit_code == 0 and r.stdout.startswith("{")
    r = cli("generate", str(qwen_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "3", "--regex", "[a-z]{40}")
    assert r.exit_code == 0 and "not a complete match of the constraint: max_new_tokens (3)" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "strin"}')
    assert "invalid JSON schema" in one_line_error(cli("generate", str(qwen_dir), "--prompt", "x", "--json-schema", str(bad)))
    assert "give one of" in one_line_error(cli("generate", str(qwen_dir), "--prompt", "x", "--regex", "a", "--json-object"))
    assert "cannot read" in one_line_error(cli("generate", str(qwen_dir), "--prompt", "x", "--grammar", str(tmp_path / "no")))


def test_batch_records_take_their_own_constraint_or_the_jobs(qwen_dir, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in [
        {"id": 1, "prompt": PROMPTS[0]},
        {"id": 2, "prompt": PROMPTS[1], "regex": "(yes|no)"},
        {"id": 3, "prompt": PROMPTS[2], "json_schema": {"type": "strin"}},
        {"id": 4, "prompt": PROMPTS[2], "response_format": {"type": "json_object"}},
        {"id": 5, "prompt": PROMPTS[2], "regex": "[a-z]{40}", "max_new_tokens": 4},
    ]) + "\n")
    r = cli("batch", str(qwen_dir), "--input", str(inp), "--output", str(out), "--json-schema", str(schema),
            "--max-new-tokens", "80", "--no-progress", "--batch-size", "2")
    assert r.exit_code == 0, r.output
    got = {rec["id"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert _valid(got[1]["text"]) and got[2]["text"] in ("yes", "no")
    assert "invalid JSON schema" in got[3]["error"] and isinstance(json.loads(got[4]["text"]), dict)
    assert got[4]["text"].startswith("{") and got[4]["stats"]["grammar_complete"] is True
    assert got[5]["finish_reason"] == "length" and got[5]["stats"]["grammar_complete"] is False
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "strin"}')
    r = cli("batch", str(qwen_dir), "--input", str(inp), "--output", str(tmp_path / "o2.jsonl"), "--json-schema", str(bad))
    assert "invalid JSON schema" in one_line_error(r) and not (tmp_path / "o2.jsonl").exists()


# ------------------------------------------------------------------------------- tool calls, parsed

def _tools(parallel=True):
    from specrt.apps.serve.tools import Tools

    return Tools(None, frozenset({"get", "put"}), None, parallel)


def test_a_reply_is_parsed_into_tool_calls_and_content():
    from specrt.apps.serve.tools import parse

    text = 'Sure.\n<tool_call>\n{"name": "get", "arguments": {"k": 1}}\n</tool_call>\n<tool_call>\n{"name": "nope"}\n</tool_call>'
    content, calls = parse(text, _tools())
    assert [c["function"]["name"] for c in calls] == ["get"] and json.loads(calls[0]["function"]["arguments"]) == {"k": 1}
    assert content.startswith("Sure.") and '"nope"' in content
    assert parse("no calls here", _tools()) == ("no calls here", [])
    two = '<tool_call>{"name": "get", "arguments": {}}</tool_call><tool_call>{"name": "put", "arguments": {}}</tool_call>'
    assert len(parse(two, _tools())[1]) == 2 and len(parse(two, _tools(parallel=False))[1]) == 1
    # a reply that is one call's JSON alone, bare or fenced, is a call (how the default pair's model answers)
    for bare in ('```json\n{"name": "put", "arguments": {"a": [1]}}\n```', ' {"name": "get", "arguments": {}}'):
        content, calls = parse(bare, _tools())
        assert content is None and [c["function"]["name"] for c in calls] == [bare.count("put") and "put" or "get"]
    assert parse('{"name": "other"}', _tools()) == ('{"name": "other"}', [])


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_a_streamed_bare_call_is_held_to_its_end(cut):
    from specrt.apps.serve.tools import StreamedCalls

    for text, n_calls, content in (('```json\n{"name": "get", "arguments": {"k": 2}}\n```', 1, ""),
                                   ('{"a": 1} is not a call', 0, '{"a": 1} is not a call'),
                                   ("plain text", 0, "plain text")):
        s, items = StreamedCalls(_tools()), []
        for i in range(0, len(text), cut):
            items += s.feed(text[i:i + cut])
        items += s.finish()
        assert "".join(x for x in items if isinstance(x, str)) == content
        assert len([x for x in items if isinstance(x, dict)]) == n_calls


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_a_streamed_reply_gives_the_same_content_and_calls_whatever_its_chunks(cut):
    from specrt.apps.serve.tools import StreamedCalls

    text = 'ok <tool_c then\n<tool_call>\n{"name": "put", "arguments": {"x": "<tool_call>"}}\n</tool_call> end <tool'
    s, items = StreamedCalls(_tools()), []
    for i in range(0, len(text), cut):
        items += s.feed(text[i:i + cut])
    items += s.finish()
    content = "".join(x for x in items if isinstance(x, str))
    calls = [x for x in items if isinstance(x, dict)]
    assert content == "ok <tool_c then\n end <tool"
    assert [c["function"]["name"] for c in calls] == ["put"] and calls[0]["index"] == 0


# ------------------------------------------------------------------------------- the server, through OpenAI's client

PICK = [{"type": "function", "function": {"name": "pick", "description": "choose",
                                          "parameters": {"properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "count", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "pick"}]


@pytest.fixture(scope="module")
def server(long_qwen_dir):
    from test_server import Server

    s = Server(long_qwen_dir, "--batch-size", "2", "--model-name", "pair-qwen2")
    yield s
    assert s.stop() == 0


def _streamed(c, **kw):
    content, calls, finish = "", {}, None
    for ch in c.chat.completions.create(model="pair-qwen2", messages=MSGS, stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, {"name": "", "arguments": ""})
            calls[tc.index]["name"] += tc.function.name or ""
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_through_the_openai_client(server, stream):
    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    kw = dict(max_tokens=80, temperature=0, response_format=fmt)
    if stream:
        text, _, finish = _streamed(c, **kw)
    else:
        r = c.chat.completions.create(model="pair-qwen2", messages=MSGS, **kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop" and _valid(text)
    r = c.chat.completions.create(model="pair-qwen2", messages=MSGS, max_tokens=40, temperature=0.8, seed=2,
                                  response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    whole = c.completions.create(model="pair-qwen2", prompt="x", max_tokens=30, temperature=0,
                                 extra_body={"regex": "(yes|no)"})
    assert whole.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "count"}}])
def test_required_and_named_tool_calls_are_constrained_to_the_schemas(server, stream, choice):
    c = server.client()
    kw = dict(tools=PICK, tool_choice=choice, parallel_tool_calls=False, max_tokens=100, temperature=0.7, seed=5)
    if stream:
        content, calls, finish = _streamed(c, **kw)
    else:
        r = c.chat.completions.create(model="pair-qwen2", messages=MSGS, **kw)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        content = m.content or ""
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or []]
    assert finish == "tool_calls" and content == "" and len(calls) == 1, (content, calls)
    args = json.loads(calls[0]["arguments"])
    if calls[0]["name"] == "pick":
        assert choice == "required" and args in ({"x": "a"}, {"x": "b"})
    else:
        assert calls[0]["name"] == "count" and set(args) == {"n"} and 0 <= args["n"] <= 9


def test_tools_auto_and_none_and_the_conversation_after_a_call(server):
    c = server.client()
    r = c.chat.completions.create(model="pair-qwen2", messages=MSGS, tools=PICK, max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)
    r = c.chat.completions.create(model="pair-qwen2", messages=MSGS, tools=PICK, tool_choice="none", max_tokens=12,
                                  temperature=0)
    plain = c.chat.completions.create(model="pair-qwen2", messages=MSGS, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content  # the tools are not shown
    after = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": '{"x": "a"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = c.chat.completions.create(model="pair-qwen2", messages=after, tools=PICK, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": PICK, "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": PICK, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": PICK, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"regex": "a(b"}, "regex"),
])
def test_bad_structured_requests_are_400_naming_the_field(server, body, param):
    import httpx

    r = httpx.post(server.url("/v1/chat/completions"), json={"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "Traceback" not in r.text
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 4, "tools": PICK})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_a_draft_that_ends_the_output_leaves_the_grammar_where_the_output_ends(same_pair):
    # the draft is the target: it drafts the end (EOS) too, which the grammar state must never take in (its
    # matcher does not roll back past an end)
    for constraint in ({"regex": "(yes|no)"}, {"json_schema": SCHEMA}):
        for prompt in PROMPTS:
            alone = same_pair.generate(prompt, max_new_tokens=80, draft_len=0, **constraint)
            for k in (4, "auto"):
                r = same_pair.generate(prompt, max_new_tokens=80, draft_len=k, drafter="model", **constraint)
                assert r.tokens == alone.tokens and r.finish_reason == alone.finish_reason == "eos"
                assert r.stats["grammar_complete"] is True
