"""One table of request settings (api/requests.TABLE): every front end takes exactly the settings it declares,
each checked and resolved by the one resolver; a new field (min_tokens) reaches all of them from the table."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from specrt.api import requests
from specrt.apps import jobs
from specrt.apps.serve.params import generation_config
from specrt.apps.serve.settings import ServeSettings
from specrt.apps.serve.shapes import APIError
from specrt.cli import main
from specrt.cli.batch import batch
from specrt.cli.generate import generate
from specrt.errors import ConfigError

# a value of each kind that a pair takes, and one of the wrong kind
GOOD = {"max_new_tokens": 6, "min_tokens": 2, "temperature": 0.5, "top_k": 3, "top_p": 0.5, "seed": 3,
        "stop": ["\n\n"], "draft_len": 2, "drafter": "ngram", "draft_window": 5, "confidence_stop": 0.25,
        "ngram_max": 4, "tree": "off", "sampling": "rejection", "json_schema": {"type": "object"}, "regex": "[a-z]+",
        "grammar": 'start: "a"', "response_format": {"type": "json_object"}}
BAD = {"int": "x", "num": "x", "str": 5, "stops": 5, "draft_len": "x", "schema": 5, "grammar": 5,
       "response_format": {"type": "x"}}


def _seen(cfg, name):
    """What a GenerationConfig holds of setting `name` (compared with GOOD's value)."""
    if name in ("temperature", "top_k", "top_p"):
        return getattr(cfg.sampling, name)
    if name == "sampling":
        return cfg.sampling.method
    if name in requests.CONSTRAINTS:
        return GOOD[name] if cfg.grammar is not None else None
    if name == "stop":
        return list(cfg.stop)
    return getattr(cfg, name)


def test_the_table_covers_every_setting_of_a_request():
    from dataclasses import fields

    from specrt.config import GenerationConfig
    cfg_fields = {f.name for f in fields(GenerationConfig)} - {"sampling"}
    assert set(GOOD) == set(requests.TABLE)
    assert cfg_fields <= set(requests.TABLE) | {"grammar"}
    assert set(BAD) == {f.kind for f in requests.TABLE.values()}


@pytest.mark.parametrize("name", requests.fields_of("api"))
def test_the_api_takes_every_setting(qwen_pair, name):
    assert _seen(qwen_pair.settings({name: GOOD[name]}), name) == GOOD[name]
    with pytest.raises(ConfigError, match=name):
        qwen_pair.settings({name: BAD[requests.TABLE[name].kind]})


def test_the_api_refuses_a_setting_it_does_not_know(qwen_pair):
    with pytest.raises(ConfigError, match="unknown setting 'max_tokens'"):
        qwen_pair.generate([5, 6], max_tokens=3)


@pytest.mark.parametrize("name", requests.FIELDS)
def test_the_server_reads_the_settings_it_declares(qwen_pair, name):
    body = {"prompt": "x", name: GOOD[name]}
    read = name in requests.fields_of("server")
    cfg = generation_config(qwen_pair, body, [5, 6], ServeSettings(model="m"))
    assert (_seen(cfg, name) == GOOD[name]) == read
    body[name] = BAD[requests.TABLE[name].kind]
    if read:
        with pytest.raises(APIError) as e:
            generation_config(qwen_pair, body, [5, 6], ServeSettings(model="m"))
        assert e.value.status == 400 and e.value.param == name
    else:  # not the server's (max_new_tokens: OpenAI's max_tokens): ignored
        generation_config(qwen_pair, body, [5, 6], ServeSettings(model="m"))


@pytest.mark.parametrize("name", requests.FIELDS)
def test_a_job_record_takes_the_settings_it_declares(qwen_pair, name):
    m = qwen_pair.manifest
    s = jobs.resolve_settings(m, jobs.JobSettings())
    read = name in requests.fields_of("record")
    cfg = jobs._config(m, s, {name: GOOD[name]}, seed=1)
    assert (_seen(cfg, name) == GOOD[name]) == read or name == "seed"  # a record's seed is its own or derived
    if read:
        with pytest.raises(ConfigError, match=name):
            jobs._config(m, s, {name: BAD[requests.TABLE[name].kind]}, seed=1)


@pytest.mark.parametrize("name", [f for f in requests.fields_of("job") if f != "seed"])
def test_a_job_takes_the_job_wide_settings_it_declares(qwen_pair, name):
    m = qwen_pair.manifest
    s = jobs.resolve_settings(m, jobs.JobSettings(**{name: GOOD[name]}))
    assert _seen(jobs._config(m, s, {}, seed=1), name) == GOOD[name]
    assert set(requests.fields_of("job")) <= {f.name for f in __import__("dataclasses").fields(jobs.JobSettings)}


@pytest.mark.parametrize("command,front", [(generate, "cli"), (batch, "job")])
def test_the_command_lines_have_an_option_for_each_setting_they_declare(command, front):
    options = {p.name for p in command.params if p.name in requests.TABLE}
    # constraints come from files (--json-schema, --grammar), --regex, or --json-object (a response_format)
    assert options == set(requests.fields_of(front)) - {"response_format"}


def test_min_tokens_reaches_the_command_line(qwen_dir):
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x", "--max-new-tokens", "4",
                                  "--min-tokens", "5"])
    assert r.exit_code == 2 and "min_tokens must be an integer in 0..max_new_tokens (4)" in r.stderr
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x", "--max-new-tokens", "4",
                                  "--min-tokens", "4", "--json"])
    assert r.exit_code == 0, r.stderr
