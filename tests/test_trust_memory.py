"""The memory budget check before loading (specrt.api.memory, Pair(check_memory=...))."""
from __future__ import annotations

import json

import pytest

import specrt
from specrt.api import memory
from specrt.errors import ConfigError, PairError
from specrt.manifest import read_manifest

ENV = memory.ENV_AVAILABLE


def test_estimate_adds_up_from_the_manifest(qwen_dir):
    """Weights as onnxruntime holds them (prepacked matmul weights, an allowance for the memory-mapped
    embedding's touched rows), caches for max_len positions, logits buffers, and the workspace."""
    m = read_manifest(qwen_dir)
    est = memory.estimate(qwen_dir, m)
    for role, e in (("target", m.target), ("draft", m.draft)):
        w = e.weights
        assert w["packed"] > 0 and w["mapped"] > 0 and w["row"] > 0  # recorded at export
        assert w["packed"] + w["mapped"] + w["other"] <= sum((qwen_dir / f).stat().st_size for f in e.files)
        assert est.weights[role] == int(memory.PACKED_FACTOR * w["packed"]) + w["other"] + min(w["mapped"],
                                                                                               memory.MAPPED_ALLOWANCE)
        assert est.kv_cache[role] == e.num_layers * 2 * m.max_len * 1 * e.num_kv_heads * e.head_dim * 4
        assert est.kv_per_token[role] * m.max_len == est.kv_cache[role]
    assert est.logits["target"] == 2 * (m.max_draft_len + 1) * m.target.logits_width * 4
    assert est.logits["draft"] == 2 * 1 * m.draft.logits_width * 4
    tok = int(memory.TOKENIZER_FACTOR * (qwen_dir / "tokenizer.json").stat().st_size)
    act = sum(memory.activation_bytes(e, memory.PREFILL_CHUNK["cpu"]) for e in (m.target, m.draft))
    assert est.workspace == memory.RUNTIME_BYTES + tok + 2 * memory.SESSION_BYTES + act
    assert est.total == sum(est.weights.values()) + sum(est.kv_cache.values()) + sum(est.logits.values()) + est.workspace
    two = memory.estimate(qwen_dir, m, batch=2)
    assert two.kv_cache["target"] == 2 * est.kv_cache["target"]
    short = memory.estimate(qwen_dir, m, tokens=40)
    assert short.kv_cache["target"] == 40 * est.kv_per_token["target"] and short.tokens == 40
    on_gpu = memory.estimate(qwen_dir, m, device="cuda")  # every weight is copied to the device
    assert on_gpu.weights["target"] == sum(m.target.weights[k] for k in ("packed", "mapped", "other"))


def test_an_older_manifest_is_estimated_from_file_sizes(qwen_dir, tmp_path):
    """A pair exported before the manifest said how the weights are held: counted at their size on disk."""
    import dataclasses

    m = read_manifest(qwen_dir)
    old = dataclasses.replace(m, target=dataclasses.replace(m.target, weights=None))
    est = memory.estimate(qwen_dir, old)
    assert est.weights["target"] == sum((qwen_dir / f).stat().st_size for f in m.target.files)


def test_budgets(qwen_dir):
    from click.testing import CliRunner

    from specrt.cli.info import info
    from specrt.apps.info import pair_info

    assert memory.parse_budget("orin-nano-8gb") == ("orin-nano-8gb", 8 << 30, memory.OS_RESERVE)
    assert memory.parse_budget(" 123456 ") == ("123456 bytes", 123456, 0)
    for bad, msg in (("orin-nano", r"unknown budget 'orin-nano': a board \(orin-nano-8gb, orin-nx-16gb, agx-orin-64gb\)"),
                     ("-5", "positive integer"), ("0", "positive integer"), ("lots", "unknown budget")):
        with pytest.raises(ConfigError, match=msg):
            memory.parse_budget(bad)
    d = pair_info(qwen_dir, "orin-nano-8gb")
    b = d["budget"]
    assert b["fits"] and b["for_specrt"] == (8 << 30) - memory.OS_RESERVE and b["cuda_context"] == 0  # a CPU pair
    need = d["memory"]["total"]
    tight = pair_info(qwen_dir, str(need - 1))["budget"]
    assert not tight["fits"] and tight["max_len_that_fits"] and tight["max_len_that_fits"] < d["max_len"]
    r = CliRunner().invoke(info, [str(qwen_dir), "--budget", str(need - 1)])
    assert r.exit_code == 0 and "DOES NOT FIT (re-export with --max-len" in r.stdout
    r = CliRunner().invoke(info, [str(qwen_dir), "--budget", "jetson"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "unknown budget 'jetson'" in r.stderr


def test_info_measure_puts_the_estimate_beside_the_peak(qwen_dir):
    from click.testing import CliRunner

    from specrt.cli.info import info

    r = CliRunner().invoke(info, [str(qwen_dir), "--measure", "--json"])
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)["measured"]
    assert m["peak_rss"] > 0 and m["estimate"] > 0 and m["new_tokens"] > 0
    assert m["ratio"] == pytest.approx(m["estimate"] / m["peak_rss"])


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
    from specrt.cli.info import info

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


def test_info_says_an_older_int4_pair_could_be_smaller(int4_dir, tmp_path):
    """An int4 pair exported before quantized embeddings still loads; info says a re-export shrinks it."""
    from click.testing import CliRunner

    from _helpers import copy_pair
    from specrt.cli.info import info

    d = copy_pair(int4_dir, tmp_path / "old")
    raw = json.loads((d / "manifest.json").read_text())
    assert "embeddings 4-bit, block 32" in CliRunner().invoke(info, [str(d)]).stdout
    for role in ("target", "draft"):
        raw[role].pop("embedding")
        raw[role].pop("weights")
    (d / "manifest.json").write_text(json.dumps(raw))
    out = CliRunner().invoke(info, [str(d)]).stdout
    assert "the target and draft embeddings are not quantized (exported by an older specrt): a re-export" in out
    with specrt.load(d) as pair:
        assert pair.generate("def f(x):", max_new_tokens=4).tokens
