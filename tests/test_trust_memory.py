"""The memory budget check before loading (specrt.runtime.memory, Pair(check_memory=...))."""
from __future__ import annotations

import json

import pytest

import specrt
from specrt.config import read_manifest
from specrt.errors import ConfigError, PairError
from specrt.runtime import memory

ENV = memory.ENV_AVAILABLE


def test_estimate_adds_up_from_the_manifest(qwen_dir):
    m = read_manifest(qwen_dir)
    est = memory.estimate(qwen_dir, m)
    for role, e in (("target", m.target), ("draft", m.draft)):
        assert est.weights[role] == sum((qwen_dir / f).stat().st_size for f in e.files) > 0
        assert est.kv_cache[role] == e.num_layers * 2 * m.max_len * 1 * e.num_kv_heads * e.head_dim * 4
        assert est.kv_per_token[role] * m.max_len == est.kv_cache[role]
    assert est.logits["target"] == 2 * (m.max_draft_len + 1) * m.target.logits_width * 4
    assert est.logits["draft"] == 2 * 1 * m.draft.logits_width * 4
    assert est.workspace == int(0.15 * sum(est.weights.values())) + (64 << 20)
    assert est.total == sum(est.weights.values()) + sum(est.kv_cache.values()) + sum(est.logits.values()) + est.workspace
    two = memory.estimate(qwen_dir, m, batch=2)
    assert two.kv_cache["target"] == 2 * est.kv_cache["target"]


def test_available_reads_meminfo_and_the_override(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    avail = memory.available_bytes()
    assert avail is None or avail > 0  # Linux: MemAvailable
    monkeypatch.setenv(ENV, "12345")
    assert memory.available_bytes() == 12345
    for bad in ("lots", "-5", "1.5e9"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError, match=ENV):
            memory.available_bytes()


def test_load_refuses_with_numbers_and_a_max_len_that_fits(qwen_dir, monkeypatch):
    m = read_manifest(qwen_dir)
    est = memory.estimate(qwen_dir, m)
    per = sum(est.kv_per_token.values())
    avail = est.fixed() + 100 * per + 7  # room for 100 positions of KV cache, not 256
    monkeypatch.setenv(ENV, str(avail))
    with pytest.raises(PairError) as e:
        specrt.load(qwen_dir)
    msg = str(e.value)
    assert "\n" not in msg
    assert "not enough memory" in msg and memory.fmt(est.total) in msg and memory.fmt(avail) in msg
    assert "max_len 256" in msg and "re-export with --max-len 100" in msg
    assert est.max_len_that_fits(avail) == 100
    # the suggestion really fits, one more position would not
    assert est.fixed() + 100 * per <= avail < est.fixed() + 101 * per
    # rounding to a multiple of 64 once there is room for >= 128 positions
    assert est.max_len_that_fits(est.fixed() + 200 * per) == 192


def test_weights_alone_too_big(qwen_dir, monkeypatch):
    monkeypatch.setenv(ENV, str(10 << 20))
    with pytest.raises(PairError, match="the weights alone do not fit"):
        specrt.load(qwen_dir)


def test_check_memory_false_loads_anyway_and_keeps_the_estimate(qwen_dir, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    with specrt.load(qwen_dir, check_memory=False) as pair:
        assert pair.memory.total == memory.estimate(qwen_dir, pair.manifest).total
        assert len(pair.generate("def", max_new_tokens=2, draft_len=1).tokens) == 2


def test_enough_memory_loads(qwen_dir, monkeypatch):
    est = memory.estimate(qwen_dir, read_manifest(qwen_dir))
    monkeypatch.setenv(ENV, str(est.total))  # exactly enough
    specrt.load(qwen_dir).close()


def test_cli_generate_and_info_report_it(qwen_dir, monkeypatch):
    from click.testing import CliRunner

    from specrt.cli import main
    from specrt.cli_trust import info

    est = memory.estimate(qwen_dir, read_manifest(qwen_dir))
    avail = est.fixed() + 50 * sum(est.kv_per_token.values())
    monkeypatch.setenv(ENV, str(avail))
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "x"])
    assert r.exit_code == 2 and r.stderr.startswith("Error: not enough memory") and len(r.stderr.splitlines()) == 1
    r = CliRunner().invoke(info, [str(qwen_dir)])
    assert r.exit_code == 0, r.output
    assert "DOES NOT FIT (re-export with --max-len" in r.stdout
    d = json.loads(CliRunner().invoke(info, [str(qwen_dir), "--json"]).stdout)
    assert d["memory"]["fits"] is False and d["memory"]["available"] == avail
    assert d["memory"]["max_len_that_fits"] == 50
