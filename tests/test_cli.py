"""The `specrt` command through click's CliRunner (stdout and stderr are captured apart, click >= 8.2)."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

import specrt
from specrt.cli import main

from _helpers import needs_kernels

STATS_KEYS = {"target_passes", "draft_passes", "proposed", "accepted", "acceptance_rate", "accepted_per_position",
              "tokens_per_target_pass", "ttft_s", "tokens_per_s", "wall_s"}
SUMMARY = re.compile(r"^\[(\d+) tokens, [\d.]+ tok/s, draft_len (\d+), acceptance \d+%, [\d.]+ tokens/target pass, "
                     r"ttft \d+ ms\]$")


def invoke(*args, **kw):
    # color=True: click would otherwise strip ANSI-looking bytes from the (random) generated text
    return CliRunner().invoke(main, [str(a) for a in args], color=True, **kw)


def test_main_help_lists_commands():
    r = invoke("--help")
    assert r.exit_code == 0, r.output
    for cmd in ("export", "generate", "fetch", "bench", "tune", "info", "check", "batch"):
        assert cmd in r.stdout
    assert invoke("-h").stdout == r.stdout


@pytest.mark.parametrize("cmd", sorted(main.commands))
def test_subcommand_help(cmd):
    r = invoke(cmd, "--help")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Usage:") and "--help" in r.stdout


@pytest.mark.parametrize("cmd,options", [
    ("export", ["--target", "--draft", "--out", "--precision", "--max-draft-len", "--max-len", "--overwrite"]),
    ("generate", ["--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--draft-len",
                  "--stop", "--chat", "--json"]),
    ("fetch", ["--out"]),
])
def test_subcommand_options_documented(cmd, options):
    out = invoke(cmd, "--help").stdout
    for o in options:
        assert o in out


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and specrt.__version__ in r.stdout


def test_export_command(hf_tiny, tmp_path):
    target, draft = hf_tiny["llama"]
    out = tmp_path / "pair"
    r = invoke("export", "--target", target, "--draft", draft, "--out", out, "--max-len", 128, "--max-draft-len", 4)
    assert r.exit_code == 0, r.output
    assert r.stdout == ""  # progress and the summary go to stderr
    assert "exporting target" in r.stderr and "exporting draft" in r.stderr
    assert f"wrote {out} (vocab 320, max_len 128, max_draft_len 4)" in r.stderr
    with specrt.load(out) as pair:
        m = pair.manifest
        assert (m.max_len, m.max_draft_len, m.target.model_type) == (128, 4, "llama")
        # the default --draft-vocab is larger than this vocabulary: no restriction
        assert m.draft.output_ids is None and m.draft.logits_width == 352  # every row, the padding too
    assert "keeping them all" in r.stderr
    r = invoke("generate", out, "--prompt", "def fib(n):", "--max-new-tokens", 8, "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"]) == 8


def test_generate_streams_text_and_prints_stats(qwen_dir, qwen_pair):
    want = qwen_pair.generate("def quicksort(xs):", max_new_tokens=40, draft_len=4)
    r = invoke("generate", qwen_dir, "--prompt", "def quicksort(xs):", "--max-new-tokens", 40, "--draft-len", 4)
    assert r.exit_code == 0, r.output
    assert r.stdout == want.text + "\n"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    m = SUMMARY.match(lines[0])
    assert m, lines[0]
    assert (int(m.group(1)), int(m.group(2))) == (40, 4)


def test_generate_json(qwen_dir, qwen_pair):
    args = ["--prompt", "class Stack:", "--max-new-tokens", 24, "--draft-len", 3, "--temperature", 0.8,
            "--top-k", 40, "--top-p", 0.9, "--seed", 7]
    r = invoke("generate", qwen_dir, *args, "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    out = json.loads(r.stdout)
    assert {"tokens", "text", "stats"} <= set(out)
    assert STATS_KEYS <= set(out["stats"])
    want = qwen_pair.generate("class Stack:", max_new_tokens=24, draft_len=3, temperature=0.8, top_k=40, top_p=0.9,
                              seed=7)
    assert out["tokens"] == want.tokens and out["text"] == want.text
    assert out["finish_reason"] == want.finish_reason
    s = out["stats"]
    assert s["proposed"] >= s["accepted"] >= 0 and len(s["accepted_per_position"]) == 3
    assert s["tokens_per_target_pass"] == pytest.approx(len(out["tokens"]) / s["target_passes"])


def test_generate_chat(qwen_dir, qwen_pair):
    r = invoke("generate", qwen_dir, "--prompt", "hello", "--chat", "--max-new-tokens", 12, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == qwen_pair.generate("hello", chat=True, max_new_tokens=12).tokens
    r2 = invoke("generate", qwen_dir, "--prompt", "hello", "--max-new-tokens", 12, "--json")
    assert json.loads(r2.stdout)["tokens"] != json.loads(r.stdout)["tokens"]


def test_generate_stop_and_target_only(qwen_dir, qwen_pair):
    full = qwen_pair.generate("def quicksort(xs):", max_new_tokens=40, draft_len=0)
    stop = next(full.text[i:i + 2] for i in range(10, 38) if "\ufffd" not in full.text[i:i + 2])
    r = invoke("generate", qwen_dir, "--prompt", "def quicksort(xs):", "--max-new-tokens", 40, "--draft-len", 0,
               "--stop", stop, "--stop", "\x01\x02never")
    assert r.exit_code == 0, r.output
    assert r.stdout == full.text[: full.text.find(stop)] + "\n"
    assert "draft_len 0" in r.stderr


# ---------------------------------------------------------------- defaults and the command's layout


@pytest.mark.parametrize("args,draft_vocab", [
    (["--draft", "D"], 49152),  # the default with a draft
    (["--draft", "D", "--draft-vocab", "0"], 0),  # 0: the full vocabulary
    (["--draft", "D", "--draft-vocab", "300"], 300),
    ([], 0),  # no draft: nothing to restrict
])
def test_export_draft_vocab_default(monkeypatch, tmp_path, args, draft_vocab):
    from types import SimpleNamespace

    from specrt.cli.export import DEFAULT_DRAFT_VOCAB

    seen = []

    def export_pair(cfg, log, progress):
        seen.append(cfg)
        return SimpleNamespace(vocab_size=1, max_len=16, max_draft_len=1)

    monkeypatch.setattr("specrt.export.pair.export_pair", export_pair)
    r = invoke("export", "--target", "T", *args, "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert seen[0].draft_vocab == draft_vocab
    assert DEFAULT_DRAFT_VOCAB == 49152 and "default: 49152" in invoke("export", "--help").stdout


def test_every_command_module_is_registered():
    import pkgutil

    import specrt.cli

    modules = {m.name for m in pkgutil.iter_modules(specrt.cli.__path__)} - {"common", "__main__"}
    assert {c.callback.__module__ for c in main.commands.values()} == {f"specrt.cli.{m}" for m in modules}


def test_bad_input_exits_2_without_patching_click(tmp_path):
    import click

    assert click.ClickException.exit_code == 1  # click's own, left alone
    r = invoke("info", tmp_path / "nope")
    assert r.exit_code == 2 and r.stderr == f"Error: pair folder not found: {tmp_path / 'nope'}\n"
    r = invoke("generate", tmp_path / "nope", "--prompt", "x", "--draft-len", "zz")  # click's usage error
    assert r.exit_code == 2 and "Invalid value for '--draft-len'" in r.stderr



@needs_kernels
def test_info_says_when_the_targets_rows_are_exact(int4_default_dir, qwen_dir):
    """specrt's kernels on every matmul and attention node: the target's rows are exact, and info says what
    that buys; the fp32 pair's float MatMuls are onnxruntime's, so it says nothing of the kind."""
    r = invoke("info", int4_default_dir)
    assert r.exit_code == 0, r.output
    exact = "rows exact: a token's logits are the same in any pass"
    assert r.output.count(exact) == 1  # the target's line only
    r = invoke("info", qwen_dir)
    assert r.exit_code == 0 and exact not in r.output and "kernels are off" not in r.output, r.output


def test_info_says_what_is_lost_without_specrts_kernels(int4_default_dir, monkeypatch):
    monkeypatch.setenv("SPECRT_INT4_KERNEL", "off")
    r = invoke("info", int4_default_dir)
    assert r.exit_code == 0, r.output
    assert "SPECRT_INT4_KERNEL=off" in r.output and "rows exact" not in r.output
    assert r.output.count("specrt's kernels are off") == 1 and "only up to near-ties" in r.output
