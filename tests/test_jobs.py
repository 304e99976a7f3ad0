"""`specrt batch` (cli/batch.py, apps/jobs/): results, bad input, job identity, resume after SIGKILL."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from specrt.apps.jobs import record_seed
from specrt.cli.batch import batch

COUNTS = ("target_passes", "draft_passes", "rounds", "proposed", "accepted", "new_tokens")


def invoke(*args):
    return CliRunner().invoke(batch, [str(a) for a in args], color=True)


def write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_out(path) -> dict:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "torn last line"
    recs = [json.loads(line) for line in data.decode().splitlines()]
    # a line without a usable id has the error record {"id": null, "line": N, "error"}: keyed "line N"
    keys = [json.dumps(r["id"]) if r["id"] is not None else f"line {r['line']}" for r in recs]
    assert len(keys) == len(set(keys)), "an id written twice"
    return dict(zip(keys, recs))


def one_line_error(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_results_and_bad_records(qwen_dir, qwen_pair, tmp_path):
    pair = qwen_pair
    stop = pair.generate("The quick", max_new_tokens=30, draft_len=2, temperature=0.9, top_k=20, top_p=0.95,
                         seed=3).text[6:8]
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "def quicksort(xs):"},
        {"id": 7, "prompt": [40, 41, 42], "max_new_tokens": 5},
        {"id": "s", "prompt": "The quick", "temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 3, "stop": stop},
        {"id": "m", "messages": [{"role": "user", "content": "hello"}], "extra": "ignored"},
        '{"id": "broken", "prompt": ',
        "",
        {"prompt": "no id"},
        {"id": "np"},
        {"id": "neg", "prompt": "x", "temperature": -1},
        {"id": "long", "prompt": [5] * 300},
        [1, 2],
        {"id": "derived", "prompt": "class", "temperature": 1.0},
        {"id": "bad-mnt", "prompt": "x", "max_new_tokens": "5"},
        {"id": "bad-stop", "prompt": "x", "stop": [1]},
        {"id": 1.5, "prompt": "x"},
        {"id": "bad-ids", "prompt": [1, 99999]},
    ])
    out = tmp_path / "out.jsonl"
    r = invoke(qwen_dir, "--input", inp, "--output", out, "--batch-size", 2, "--max-new-tokens", 30, "--draft-len", 2,
               "--no-progress")
    assert r.exit_code == 0, r.output
    assert "wrote 15 records" in r.stderr and "(10 errors" in r.stderr
    recs = read_out(out)
    errors = {k: v["error"] for k, v in recs.items() if "error" in v}
    malformed = ["line 5", "line 7", "line 11", "line 15"]
    assert sorted(errors) == sorted(malformed + [json.dumps(x) for x in ["np", "neg", "long", "bad-mnt", "bad-stop",
                                                                         "bad-ids"]])
    assert len(recs) == 15
    assert all(set(recs[k]) == ({"id", "line", "error"} if k in malformed else {"id", "error"}) for k in errors)
    assert all(recs[k]["id"] is None and recs[k]["line"] == int(k.split()[1]) for k in malformed)
    assert all("\n" not in e and e.startswith("line ") for e in errors.values())
    assert "not JSON" in errors["line 5"] and 'no "id"' in errors["line 7"] and "object" in errors["line 11"]
    assert '"id" must be' in errors["line 15"] and '"prompt"' in errors['"np"']
    assert "temperature" in errors['"neg"'] and "max_len" in errors['"long"'] and "token ids" in errors['"bad-ids"']
    assert "max_new_tokens" in errors['"bad-mnt"'] and "stop" in errors['"bad-stop"']
    want = {
        '"a"': pair.generate("def quicksort(xs):", max_new_tokens=30, draft_len=2),
        "7": pair.generate([40, 41, 42], max_new_tokens=5, draft_len=2),
        '"s"': pair.generate("The quick", max_new_tokens=30, draft_len=2, temperature=0.9, top_k=20, top_p=0.95,
                             seed=3, stop=[stop]),
        '"m"': pair.generate("hello", chat=True, max_new_tokens=30, draft_len=2),
        '"derived"': pair.generate("class", max_new_tokens=30, draft_len=2, temperature=1.0,
                                   seed=record_seed(0, '"derived"')),
    }
    assert recs['"s"']["finish_reason"] == "stop"
    for key, res in want.items():
        rec = recs[key]
        assert set(rec) == {"id", "text", "tokens", "finish_reason", "stats"}
        assert (rec["tokens"], rec["text"], rec["finish_reason"]) == (res.tokens, res.text, res.finish_reason), key
        assert all(rec["stats"][c] == res.stats[c] for c in COUNTS), key
    # Rerun: nothing to do, output untouched.
    before = out.read_bytes()
    r = invoke(qwen_dir, "--input", inp, "--output", out, "--batch-size", 3, "--max-new-tokens", 30, "--draft-len", 2,
               "--no-progress")
    assert r.exit_code == 0 and "nothing to run" in r.stderr and out.read_bytes() == before


def test_duplicate_ids_stop_before_anything_runs(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"},
                                             {"id": "a", "prompt": "z"}])
    out = tmp_path / "out.jsonl"
    one_line_error(invoke(qwen_dir, "--input", inp, "--output", out), "duplicate id 'a' on lines 1 and 3")
    assert not out.exists()


def test_bad_invocations(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    one_line_error(invoke(qwen_dir, "--input", tmp_path / "missing.jsonl", "--output", out), "cannot read input")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"id": "\xe9"}\n')
    one_line_error(invoke(qwen_dir, "--input", tmp_path / "latin1.jsonl", "--output", out), "not UTF-8")
    write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    one_line_error(invoke(qwen_dir, "--input", tmp_path / "empty.jsonl", "--output", out), "no records")
    one_line_error(invoke(tmp_path / "nopair", "--input", inp, "--output", out), "pair folder not found")
    one_line_error(invoke(qwen_dir, "--input", inp, "--output", out, "--temperature", -1), "temperature")
    one_line_error(invoke(qwen_dir, "--input", inp, "--output", out, "--draft-len", 99), "max_draft_len")
    one_line_error(invoke(qwen_dir, "--input", inp, "--output", out, "--ray-actors", 0), "--ray-actors")
    one_line_error(invoke(qwen_dir, "--input", inp, "--output", tmp_path), "is a folder")
    for bad in ("0", "x", "-2"):
        r = invoke(qwen_dir, "--input", inp, "--output", out, "--batch-size", bad)
        assert r.exit_code == 2 and "batch-size" in r.stderr
    assert not out.exists()
    # An unreachable Ray address fails fast with one line (without Ray installed: one line saying so).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        t0 = time.monotonic()
        r = invoke(qwen_dir, "--input", inp, "--output", out, "--ray", f"127.0.0.1:{port}")
    one_line_error(r)
    assert "cannot reach the Ray cluster" in r.stderr or "needs Ray" in r.stderr
    assert time.monotonic() - t0 < 30
    assert not out.exists() or out.read_bytes() == b""


def _job(qwen_dir, inp, out, *extra):
    return invoke(qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 6, "--draft-len", 3, "--no-progress",
                  *extra)


def test_by_default_greedy_and_coupled_records_draft_auto_and_rejection_ones_a_fixed_length(qwen_dir, qwen_pair, tmp_path):
    """Without --draft-len, batch size auto times every size with the job's own lengths: a greedy record
    drafts auto (its tokens are exact whatever drafts them), and so does a sampled one, which samples
    coupled (every record has a seed): its tokens are the target-only sample of its seed. A record sampled
    with rejection drafts the pair's fixed length (its draws must not follow timings); an explicit
    --draft-len applies to all."""
    # 30 records go to the trials (sizes 1, 2, 4, 8); the rest run as chosen
    lines = [{"id": i, "prompt": f"y = {i} +", **({"temperature": 0.9} if i % 3 == 0 else {}),
              **({"sampling": "rejection"} if i % 6 == 0 else {})} for i in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    r = invoke(qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 6, "--no-progress")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stderr.splitlines() if x.startswith("batch size auto:"))
    for b in (1, 2, 4, 8):
        assert f" {b}: " in line and "plain" not in line
    recs = read_out(out)
    assert len(recs) == 40
    fixed = qwen_pair.manifest.max_draft_len if qwen_pair.manifest.max_draft_len < 4 else 4
    for i in range(40):
        st = recs[str(i)]["stats"]
        if i % 6 == 0:  # rejection
            assert st["draft_len"] == fixed and set(st["rounds_by_drafter"]) <= {"model"}, st
            continue
        assert st["draft_len"] == "auto", st
        sampled = dict(temperature=0.9, seed=record_seed(0, str(i))) if i % 3 == 0 else {}
        # greedy on fp32, or coupled: the same tokens whichever way a record ran
        assert recs[str(i)]["tokens"] == qwen_pair.generate(f"y = {i} +", max_new_tokens=6, draft_len=0, **sampled).tokens
    side = json.loads((tmp_path / "out.jsonl.job.json").read_text())["settings"]
    assert (side["draft_len"], side["greedy_draft_len"], side["greedy_drafter"]) == (fixed, "auto", "hybrid")
    assert side["sampling"] == "coupled"  # the default that ran is named, so a job of another default is another job
    out2 = tmp_path / "out2.jsonl"
    r = invoke(qwen_dir, "--input", inp, "--output", out2, "--max-new-tokens", 6, "--draft-len", 2,
               "--batch-size", 4, "--no-progress")
    assert r.exit_code == 0, r.output
    assert {rec["stats"]["draft_len"] for rec in read_out(out2).values()} == {2}


def test_a_sampled_record_depends_on_neither_its_place_nor_the_batch_size_nor_the_trial(qwen_dir, tmp_path):
    """batch size auto with its trials, then a fixed batch size over the records reversed: a sampled record
    gives the same tokens whichever way it ran: coupled (the default) drafting auto, or by rejection at the
    job's fixed length, so its draws are the same."""
    lines = [{"id": i, "prompt": f"y = {i} +", **({"temperature": 0.9} if i % 2 else {}),
              **({"sampling": "rejection"} if i % 4 == 1 else {})} for i in range(72)]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r = invoke(qwen_dir, "--input", write_jsonl(tmp_path / "in.jsonl", lines), "--output", first,
               "--max-new-tokens", 6, "--no-progress")
    assert r.exit_code == 0, r.output
    r = invoke(qwen_dir, "--input", write_jsonl(tmp_path / "rev.jsonl", lines[::-1]), "--output", second,
               "--max-new-tokens", 6, "--batch-size", 3, "--no-progress")
    assert r.exit_code == 0, r.output
    a, b = read_out(first), read_out(second)
    for i in range(1, 72, 2):
        assert a[str(i)]["tokens"] == b[str(i)]["tokens"], i
        assert a[str(i)]["stats"]["draft_len"] == b[str(i)]["stats"]["draft_len"], i
        assert a[str(i)]["stats"]["draft_len"] == "auto" if i % 4 == 3 else a[str(i)]["stats"]["draft_len"] > 0, i


def test_output_of_another_job_is_refused(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"def f{i}():"} for i in range(6)])
    out = tmp_path / "out.jsonl"
    assert _job(qwen_dir, inp, out, "--batch-size", 2).exit_code == 0
    first = out.read_bytes()
    assert len(read_out(out)) == 6 and (tmp_path / "out.jsonl.job.json").is_file()
    one_line_error(_job(qwen_dir, inp, out, "--temperature", 0.5), "belongs to another job", "temperature", "--overwrite")
    one_line_error(_job(qwen_dir, inp, out, "--seed", 1), "belongs to another job", "seed")
    one_line_error(_job(qwen_dir, inp, out, "--sampling", "rejection"), "belongs to another job", "sampling")
    write_jsonl(inp, [{"id": i, "prompt": f"def g{i}():"} for i in range(6)])
    one_line_error(_job(qwen_dir, inp, out), "belongs to another job", "input file")
    assert out.read_bytes() == first  # refused jobs leave the output alone
    # The batch size is not part of the job: results do not depend on it.
    r = _job(qwen_dir, inp, out, "--overwrite", "--batch-size", 4)
    assert r.exit_code == 0, r.output
    recs = read_out(out)
    assert len(recs) == 6 and out.read_bytes() != first
    # An output with no sidecar is nobody's job: refused too.
    (tmp_path / "out.jsonl.job.json").unlink()
    one_line_error(_job(qwen_dir, inp, out), "not written by a specrt batch job")
    assert read_out(out) == recs


def test_torn_tail_is_cut_and_resumed(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"x = {i}", "temperature": 0.8 * (i % 2)}
                                             for i in range(9)])
    ref_path = tmp_path / "ref.jsonl"
    assert _job(qwen_dir, inp, ref_path, "--batch-size", 3).exit_code == 0
    ref = read_out(ref_path)
    lines = ref_path.read_bytes().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.job.json").write_bytes((tmp_path / "ref.jsonl.job.json").read_bytes())
    for tail in (lines[3][:17], b"\x00" * 40, lines[3][:-1]):  # half a line, a crash's zero fill, no newline
        out.write_bytes(b"".join(lines[:3]) + tail)
        r = _job(qwen_dir, inp, out, "--batch-size", 2)
        assert r.exit_code == 0, r.output
        assert "torn last line" in r.stderr and "3 of 9 records already" in r.stderr
        got = read_out(out)
        assert got.keys() == ref.keys()
        for k in ref:
            assert (got[k]["tokens"], got[k]["text"]) == (ref[k]["tokens"], ref[k]["text"]), k
    # Damage in the middle is not ours to guess about: refused, file untouched.
    bad = b"".join(lines[:2]) + b'{"id": "r9", "te\n' + b"".join(lines[2:])
    out.write_bytes(bad)
    one_line_error(_job(qwen_dir, inp, out), "corrupt at line 3")
    assert out.read_bytes() == bad


def test_batch_size_auto_reports_choice(qwen_dir, qwen_pair, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"y = {i} +"} for i in range(40)])
    out = tmp_path / "out.jsonl"
    r = _job(qwen_dir, inp, out)  # --batch-size auto is the default
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stderr.splitlines() if x.startswith("batch size auto:"))
    for b in (1, 2, 4, 8):
        assert f"{b}: " in line
    chosen = int(line.rsplit("-> ", 1)[1])
    assert f"batch size {chosen}" in r.stderr.splitlines()[-1]
    recs = read_out(out)
    assert len(recs) == 40
    for i in (0, 5, 39):  # calibration records and later ones alike
        assert recs[str(i)]["tokens"] == qwen_pair.generate(f"y = {i} +", max_new_tokens=6, draft_len=3).tokens


def test_progress_bar_on_stderr(qwen_dir, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "z"} for i in range(5)])
    r = invoke(qwen_dir, "--input", inp, "--output", tmp_path / "o.jsonl", "--max-new-tokens", 3, "--batch-size", 2)
    assert r.exit_code == 0 and r.stdout == ""
    assert "5/5" in r.stderr and "tok/s" in r.stderr and "acceptance" in r.stderr


# ------------------------------------------------------------------------------ --draft-len auto

AUTO_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return", "class Stack:",
                [40, 41, 40, 41, 40]]


@pytest.fixture(scope="module")
def target_only_dir(qwen_dir, tmp_path_factory):
    """The qwen pair's target alone: a pair without a draft model."""
    from _helpers import copy_pair

    d = copy_pair(qwen_dir, tmp_path_factory.mktemp("solo") / "pair")
    m = json.loads((d / "manifest.json").read_text())
    m["draft"] = None
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def _auto_job(pair_dir, tmp_path, *extra):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(AUTO_PROMPTS)]
                      + [{"id": "bad", "prompt": "x", "temperature": -1}])
    out = tmp_path / "out.jsonl"
    r = invoke(pair_dir, "--input", inp, "--output", out, "--max-new-tokens", 16, "--draft-len", "auto",
               "--no-progress", *extra)
    return r, out


def test_draft_len_auto_at_batch_size_1_gives_what_generate_gives(qwen_dir, qwen_pair, tmp_path):
    r, out = _auto_job(qwen_dir, tmp_path, "--batch-size", 1)
    assert r.exit_code == 0, r.output
    assert "wrote 4 records" in r.stderr and "(1 errors" in r.stderr
    assert r.stderr.splitlines()[-1].endswith("batch size 1")
    recs = read_out(out)
    assert set(recs) == {"0", "1", "2", '"bad"'} and "temperature" in recs['"bad"']["error"]
    for i, p in enumerate(AUTO_PROMPTS):
        rec, res = recs[str(i)], qwen_pair.generate(p, max_new_tokens=16, draft_len="auto")
        assert set(rec) == {"id", "text", "tokens", "finish_reason", "stats"}
        assert (rec["tokens"], rec["text"], rec["finish_reason"]) == (res.tokens, res.text, res.finish_reason), i
        assert rec["tokens"] == qwen_pair.generate(p, max_new_tokens=16, draft_len=0).tokens  # lossless
        assert rec["stats"]["draft_len"] == "auto" and rec["stats"]["batch_size"] == 1
    # generate's default drafter, named in the job's identity
    settings = json.loads((tmp_path / "out.jsonl.job.json").read_text())["settings"]
    assert (settings["draft_len"], settings["drafter"]) == ("auto", qwen_pair.default_drafter) == ("auto", "hybrid")
    # Resumable as any job: a rerun finds every id written; a lost record runs again.
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]))
    r = _auto_job(qwen_dir, tmp_path, "--batch-size", 1)[0]
    assert r.exit_code == 0 and "2 of 4 records already" in r.stderr
    got = read_out(out)
    assert got.keys() == recs.keys()
    for k, want in recs.items():
        assert all(got[k].get(f) == want.get(f) for f in ("tokens", "text", "error")), k


@pytest.mark.parametrize("size", ["auto", 3])
def test_draft_len_auto_runs_in_batches(qwen_dir, qwen_pair, tmp_path, size):
    """Rows at draft_len auto choose their lengths in a batch, at any batch size; greedy output is lossless."""
    lines = [{"id": i, "prompt": f"def g{i}(a, b):"} for i in range(20)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    r = invoke(qwen_dir, "--input", inp, "--output", out, "--max-new-tokens", 12, "--draft-len", "auto",
               "--batch-size", size, "--no-progress")
    assert r.exit_code == 0, r.output
    recs = read_out(out)
    sizes = {rec["stats"]["batch_size"] for rec in recs.values()}
    assert sizes == {3} if size == 3 else max(sizes) > 1, sizes
    drafted = 0
    for line in lines:
        rec = recs[str(line["id"])]
        assert rec["tokens"] == qwen_pair.generate(line["prompt"], max_new_tokens=12, draft_len=0).tokens
        assert rec["stats"]["draft_len"] == "auto"
        drafted += rec["stats"]["proposed"]
    assert drafted > 0


@pytest.mark.parametrize("drafter,solo", [("model", False), ("hybrid", False), ("ngram", False), ("suffix", False),
                                          ("ngram", True), ("suffix", True)])
def test_draft_len_auto_takes_every_drafter(qwen_dir, target_only_dir, qwen_pair, tmp_path, drafter, solo):
    """Each drafter at batch size 1; prompt lookup (ngram, suffix) needs no draft model."""
    r, out = _auto_job(target_only_dir if solo else qwen_dir, tmp_path, "--batch-size", 1, "--drafter", drafter)
    assert r.exit_code == 0, r.output
    recs = read_out(out)
    used = set()
    for i, p in enumerate(AUTO_PROMPTS):
        st = recs[str(i)]["stats"]
        assert recs[str(i)]["tokens"] == qwen_pair.generate(p, max_new_tokens=16, draft_len=0).tokens, i
        assert st["draft_len"] == "auto"
        used |= set(st["rounds_by_drafter"])
        if drafter in ("ngram", "suffix"):
            assert st["draft_passes"] == 0
    allowed = {"model": {"model"}, "hybrid": {"model", "ngram", "suffix"}}.get(drafter, {"ngram", "suffix"})
    assert used <= allowed, used
    assert json.loads((tmp_path / "out.jsonl.job.json").read_text())["settings"]["drafter"] == drafter


def test_draft_len_auto_default_drafter_without_a_draft_model(target_only_dir, qwen_pair, tmp_path):
    r, out = _auto_job(target_only_dir, tmp_path, "--batch-size", 1)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out.jsonl.job.json").read_text())["settings"]["drafter"] == "ngram"
    assert read_out(out)["0"]["tokens"] == qwen_pair.generate(AUTO_PROMPTS[0], max_new_tokens=16, draft_len=0).tokens


def test_draft_len_auto_refusals(qwen_dir, target_only_dir, tmp_path):
    for drafter in ("model", "hybrid"):
        r, out = _auto_job(target_only_dir, tmp_path, "--batch-size", 1, "--drafter", drafter)
        one_line_error(r, "no draft model", drafter)
        assert not out.exists()
    r = invoke(qwen_dir, "--input", tmp_path / "in.jsonl", "--output", tmp_path / "o.jsonl", "--draft-len", "sometimes")
    assert r.exit_code == 2 and "--draft-len" in r.stderr and "Traceback" not in r.output


# ------------------------------------------------------------------------------ SIGKILL and resume


def _cli():
    """`python -m specrt.cli batch`, and `batch` is what the `specrt` command registers."""
    from specrt.cli import main

    assert main.commands["batch"] is batch
    return [sys.executable, "-m", "specrt.cli", "batch"]


def _complete_lines(path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_sigkill_three_times_then_complete(qwen_dir, tmp_path):
    """A 1000-record job killed with SIGKILL at three random moments, then completed: every id exactly
    once, each record what an uninterrupted run wrote, no torn line (batch sizes differ per run)."""
    n = 1000
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": i if i % 2 else f"s{i}", "prompt": f"def f{i}(x):" if i % 3 else f"class C{i}:",
         **({"temperature": 0.9, "top_k": 30} if i % 4 == 1 else {}), **({"max_new_tokens": 2} if i % 5 == 0 else {})}
        for i in range(n)])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--input", str(inp), "--max-new-tokens", "4", "--draft-len", "3", "--no-progress"]

    def start(out, b):
        return subprocess.Popen([*_cli(), str(qwen_dir), *common, "--output", str(out), "--batch-size", str(b)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    ref_path = tmp_path / "ref.jsonl"
    p = start(ref_path, 4)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()
    ref = read_out(ref_path)
    assert len(ref) == n

    out = tmp_path / "out.jsonl"
    rng = random.Random(0)
    for b in (3, 8, "auto"):
        before = _complete_lines(out)
        target = before + rng.randint(40, 250)
        p = start(out, b)
        deadline = time.monotonic() + 60
        while _complete_lines(out) < target and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.03))
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, "the job finished before it could be killed"
        assert before < _complete_lines(out) < n
    p = start(out, 2)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()
    got = read_out(out)
    assert len(got) == n and got.keys() == ref.keys()
    for k, want in ref.items():
        g = got[k]
        assert (g["tokens"], g["text"], g["finish_reason"]) == (want["tokens"], want["text"], want["finish_reason"]), k
        assert all(g["stats"][c] == want["stats"][c] for c in COUNTS), k


def test_a_job_written_before_min_tokens_and_a_job_wide_stop_resumes(qwen_dir, tmp_path):
    """An output whose job identity has no "min_tokens" and no "stop" (written before the job took them) resumes
    with the same settings; asking for a min_tokens now is another job."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"def f{i}():"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    assert _job(qwen_dir, inp, out).exit_code == 0
    side = tmp_path / "out.jsonl.job.json"
    identity = json.loads(side.read_text())
    del identity["settings"]["min_tokens"], identity["settings"]["stop"]
    side.write_text(json.dumps(identity))
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # two records still to do
    one_line_error(_job(qwen_dir, inp, out, "--min-tokens", "2"), "belongs to another job", "min_tokens (0 -> 2)")
    r = _job(qwen_dir, inp, out)
    assert r.exit_code == 0, r.output
    assert sorted(read_out(out)) == ["0", "1", "2", "3"]


def test_a_job_written_before_its_identity_named_the_sampling_default_resumes_with_rejection(qwen_dir, tmp_path):
    """An output whose job identity has "sampling": null (the default then was rejection) is refused as another
    job by a plain rerun, naming the sampling, and resumes with --sampling rejection."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"def f{i}():"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    assert _job(qwen_dir, inp, out, "--sampling", "rejection").exit_code == 0
    side = tmp_path / "out.jsonl.job.json"
    identity = json.loads(side.read_text())
    identity["settings"]["sampling"] = None
    side.write_text(json.dumps(identity))
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # two records still to do
    one_line_error(_job(qwen_dir, inp, out), "belongs to another job", "sampling ('rejection' -> 'coupled')")
    r = _job(qwen_dir, inp, out, "--sampling", "rejection")
    assert r.exit_code == 0, r.output
    assert sorted(read_out(out)) == ["0", "1", "2", "3"]
