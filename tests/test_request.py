"""One request, one round: a request's settings and prompt are parsed by one rule whatever the front end,
and a request alone runs the round and the end of request of a batch (decoding/decode.Decoder)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from specrt.api import requests
from specrt.api.pair import generate_batch
from specrt.apps import jobs
from specrt.apps.jobs import ray as jobs_ray, run as jobs_run
from specrt.apps.serve import http
from specrt.config import MAX_NEW_TOKENS, GenerationConfig, SamplingConfig
from specrt.decoding.decode import Decoder, Request
from specrt.errors import ConfigError

SETTINGS = dict(max_new_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=11, stop=["\n\n"], draft_len=3,
                drafter="model", draft_window=7, confidence_stop=0.25, ngram_max=5)
WANT = GenerationConfig(max_new_tokens=9, sampling=SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, method="coupled"), seed=11,
                        stop=("\n\n",), draft_len=3, drafter="model", draft_window=7, confidence_stop=0.25, ngram_max=5)


def test_every_setting_reaches_the_request_from_every_python_front_end(qwen_pair, monkeypatch):
    got = []
    run = type(qwen_pair)._run

    def spy(self, prompt, cfg, *a, **kw):
        got.append(cfg)
        return run(self, prompt, cfg, *a, **kw)

    monkeypatch.setattr(type(qwen_pair), "_run", spy)
    qwen_pair.generate("def f(x):", **SETTINGS)
    with qwen_pair.stream("def f(x):", **SETTINGS) as s:
        s.text()
    assert got == [WANT, WANT]
    seen = []
    start = Decoder._start

    def spy_start(self, r, req):
        seen.append(req.cfg)
        return start(self, r, req)

    monkeypatch.setattr(Decoder, "_start", spy_start)
    generate_batch(qwen_pair, ["def f(x):", "def g(y):"], batch_size=2, **SETTINGS)
    assert seen == [WANT, WANT]


def test_unset_settings_take_the_one_default(qwen_pair):
    cfg = qwen_pair.settings({})
    assert cfg.max_new_tokens == MAX_NEW_TOKENS and cfg.sampling == SamplingConfig() and cfg.seed == 0
    assert qwen_pair.settings({"temperature": None, "stop": None}) == cfg


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", "hot", "temperature must be a number"),
    ("top_k", 1.5, "top_k must be an integer"),
    ("max_new_tokens", True, "max_new_tokens must be an integer"),
    ("stop", [1], "stop must be a string or a list of strings"),
    ("draft_len", "long", "draft_len must be an integer or 'auto'"),
    ("drafter", 3, "drafter must be a string"),
    ("top_p", 0, "top_p must be in (0, 1]"),  # a range: GenerationConfig's own check, named the same way
    ("ngram_max", 40, "ngram_max must be in 1..16"),
])
def test_a_bad_setting_is_one_line_naming_its_field(qwen_pair, field, value, needle):
    with pytest.raises(ConfigError) as e:
        qwen_pair.settings({field: value})
    assert needle in str(e.value) and "\n" not in str(e.value) and e.value.param == field


def test_one_prompt_rule_for_the_api_the_server_and_jobs(qwen_pair):
    m, codec = qwen_pair.manifest, qwen_pair.codec
    parts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                                        {"type": "text", "text": "there"}]}]
    flat = [parts[0], {"role": "user", "content": "hi there"}]
    want = codec.encode(codec.apply_chat_template(flat))
    assert jobs._encode(codec, m, {"messages": parts}, chat=False) == want
    assert http.prompt_ids(qwen_pair, {"messages": parts}, chat=True) == want
    assert requests.prompt_ids(codec, m.vocab_size, messages=flat) == want
    text = codec.encode(codec.apply_chat_template([{"role": "user", "content": "hello"}]))
    assert qwen_pair.encode("hello", chat=True) == jobs._encode(codec, m, {"prompt": "hello"}, chat=True) == text
    assert qwen_pair.encode([5, 6]) == jobs._encode(codec, m, {"prompt": [5, 6]}, chat=False) == \
        http.prompt_ids(qwen_pair, {"prompt": [[5, 6]]}, chat=False) == [5, 6]
    for bad in ([m.vocab_size], [True], "", {"a": 1}):
        with pytest.raises(ConfigError):
            qwen_pair.encode(bad)
        with pytest.raises(ConfigError):
            jobs._encode(codec, m, {"prompt": bad}, chat=False)
        with pytest.raises(http.APIError):
            http.prompt_ids(qwen_pair, {"prompt": bad}, chat=False)


def test_a_job_record_takes_the_same_settings_as_a_request(qwen_pair):
    s = jobs.resolve_settings(qwen_pair.manifest, jobs.JobSettings(draft_len=3, drafter="model"))
    rec = {"max_new_tokens": 9, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "stop": "\n\n", "seed": None}
    cfg = jobs._config(qwen_pair.manifest, s, rec, seed=11)
    assert cfg.sampling == WANT.sampling and cfg.stop == ("\n\n",) and cfg.seed == 11 and cfg.max_new_tokens == 9
    with pytest.raises(ConfigError, match="temperature must be a number"):
        jobs._config(qwen_pair.manifest, s, {"temperature": "x"}, seed=1)


def test_a_request_alone_and_as_a_batch_row_end_alike(qwen_pair):
    """Same tokens, text and finish reason, and the same output added to the suffix history: cut at the
    stop string (the tokens after it are not output), whichever way it ran."""
    pair = qwen_pair
    prompt = pair.encode("def add(a, b):")
    full = pair.generate(prompt, max_new_tokens=24, draft_len=0)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cfg = pair.settings({"max_new_tokens": 24, "draft_len": 3, "drafter": "model", "stop": stop}, prompt=prompt)
    history = pair.state.history
    history.clear()
    alone = pair.run(prompt, cfg)
    kept_alone = history.buf.copy()
    history.clear()
    with pair.runner(2) as dec:
        (_, row), = dec.run([Request(0, prompt, cfg)])
    kept_batch = history.buf.copy()
    history.clear()
    assert alone.finish_reason == row.finish_reason == "stop"
    assert (alone.tokens, alone.text) == (row.tokens, row.text)
    assert len(alone.tokens) < full.stats["new_tokens"]
    np.testing.assert_array_equal(kept_alone, kept_batch)
    np.testing.assert_array_equal(kept_alone[:-1], alone.tokens)  # the output, then the separator
    assert alone.stats["batch_size"] == 1 and row.stats["batch_size"] == 2


def test_a_request_cancelled_before_it_starts_reads_nothing(qwen_pair):
    prompt = qwen_pair.encode("def f(x):")
    res = qwen_pair.generate(prompt, max_new_tokens=8, cancel=lambda: True)
    assert res.finish_reason == "cancelled" and res.tokens == [] and res.stats["target_passes"] == 0
    with qwen_pair.runner(2) as dec:
        cfg = qwen_pair.settings({"max_new_tokens": 8, "draft_len": 2}, batched=True, prompt=prompt)
        (_, row), = dec.run([Request(0, prompt, cfg, cancel=lambda: True)])
    assert row.finish_reason == "cancelled" and row.tokens == [] and dec.totals.prefills == 0


class _Ref:
    def __init__(self, value):
        self.value = value


class _FakeRay:
    """Just enough of Ray's API for jobs.ray.run_on_ray, with the actors made in this process."""

    def __init__(self):
        self.made = []

    def cluster_resources(self):
        return {"CPU": 1}

    def remote(self, num_cpus):
        def wrap(cls):
            def make(*args):
                self.made.append(args)
                actor = cls(*args)
                return SimpleNamespace(run=SimpleNamespace(remote=lambda shard: _Ref(actor.run(shard))))
            return SimpleNamespace(remote=make)
        return wrap

    def wait(self, refs, num_returns):
        return refs[:1], refs[1:]

    def get(self, ref):
        return ref.value


def test_ray_actors_get_the_jobs_history_cap(qwen_dir, qwen_pair, tmp_path, monkeypatch):
    caps = []
    load = jobs_ray.load

    def spy(*a, history_cap, **kw):
        caps.append(history_cap)
        return load(*a, history_cap=history_cap, **kw)

    monkeypatch.setattr(jobs_ray, "load", spy)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"x = {i}"}) + "\n" for i in range(3)))
    monkeypatch.setattr(jobs_run, "start_ray", lambda address, init: (_FakeRay(), False))
    summary = jobs.run_job(qwen_dir, inp, tmp_path / "out.jsonl", jobs.JobSettings(max_new_tokens=4, draft_len=2),
                           batch_size=1, ray_address="local", progress=False, log=lambda s: None, history_cap=123)
    assert summary["written"] == 3 and caps == [123]


def test_a_seeded_request_samples_coupled_unless_it_names_a_method():
    """The default method follows the seed (docs/drafting.md): coupled for a request that gives one (its tokens
    are the target-only sample of that seed), rejection for one that does not; a method given wins."""
    def method(**fields):
        return requests.parse(fields).get("sampling", SamplingConfig()).method
    assert method(temperature=0.8, seed=3) == "coupled"
    assert method(temperature=0.8) == "rejection"
    assert method(temperature=0.8, seed=3, sampling="rejection") == "rejection"
    assert method(temperature=0.8, sampling="coupled") == "coupled"
