"""`specrt batch --ray`: the same job on a local Ray instance (actors load the pair, the driver writes)."""
from __future__ import annotations

import json

import pytest

import ray

from specrt.apps.jobs import JobError, JobSettings, run_job  # noqa: E402

pytestmark = pytest.mark.slow


RAY_INIT = {"num_cpus": 2, "include_dashboard": False, "object_store_memory": 200 * 1024 * 1024,
            "log_to_driver": False, "logging_level": "WARNING"}
SETTINGS = JobSettings(max_new_tokens=8, draft_len=3)
QUIET = dict(progress=False, log=lambda s: None)


def _read(path):
    data = path.read_bytes()
    assert data.endswith(b"\n")
    recs = [json.loads(line) for line in data.decode().splitlines()]
    assert len(recs) == len({json.dumps(r["id"]) for r in recs})
    return {json.dumps(r["id"]): r for r in recs}


@pytest.fixture(scope="module")
def job(qwen_dir, tmp_path_factory):
    """An input file and its result from a plain local run."""
    d = tmp_path_factory.mktemp("rayjob")
    inp = d / "in.jsonl"
    lines = [{"id": i, "prompt": f"def h{i}(a, b):", **({"temperature": 1.0} if i % 2 else {})} for i in range(24)]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    local = d / "local.jsonl"
    run_job(qwen_dir, inp, local, SETTINGS, batch_size=3, **QUIET)
    return inp, _read(local)


def _same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        for f in ("tokens", "text", "finish_reason", "error"):
            assert got[k].get(f) == want[k].get(f), (k, f)


def test_ray_job_equals_local_job(qwen_dir, tmp_path, job):
    """What `specrt batch --ray` does: start a local Ray instance, run actors, shut it down."""
    inp, want = job
    out = tmp_path / "ray.jsonl"
    logs = []
    s = run_job(qwen_dir, inp, out, SETTINGS, batch_size=4, ray_address="local", ray_actors=2, ray_init=RAY_INIT,
                progress=False, log=logs.append)
    assert any(x.startswith("ray: 2 actors") for x in logs), logs
    assert s["written"] == 25 and s["errors"] == 1
    _same(_read(out), want)
    assert not ray.is_initialized()  # the job started it, the job shut it down


def test_ray_resumes_torn_output_in_callers_ray(qwen_dir, tmp_path, job):
    """Inside a process already connected to Ray, the job uses that connection and leaves it on;
    the driver repairs a torn output and writes only what is missing."""
    inp, want = job
    ray.init(**RAY_INIT)
    try:
        out = tmp_path / "ray.jsonl"
        run_job(qwen_dir, inp, out, SETTINGS, batch_size=2, **QUIET)
        keep = out.read_bytes().splitlines(keepends=True)[:10]
        out.write_bytes(b"".join(keep) + b'{"id": 3, "te')
        s = run_job(qwen_dir, inp, out, SETTINGS, batch_size="auto", ray_address="local", ray_actors=1, **QUIET)
        assert s["skipped"] == 10 and s["written"] == 15
        _same(_read(out), want)
        assert ray.is_initialized()
    finally:
        ray.shutdown()


def test_unreachable_ray_address_is_one_clear_error(qwen_dir, tmp_path):
    import socket

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "x"}\n')
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
        for a in (addr, f"ray://{addr}"):
            with pytest.raises(JobError, match=f"cannot reach the Ray cluster at {a}"):
                run_job(qwen_dir, inp, tmp_path / "o.jsonl", ray_address=a, progress=False, log=lambda s: None)
    with pytest.raises(JobError, match="bad Ray address"):
        run_job(qwen_dir, inp, tmp_path / "o.jsonl", ray_address="nohostport", progress=False, log=lambda s: None)


def test_ray_draft_len_auto_runs_in_batches(qwen_dir, qwen_pair, tmp_path):
    """--ray takes --draft-len auto as a local job does, at any batch size: greedy output is the target's."""
    inp = tmp_path / "in.jsonl"
    prompts = [f"def h{i}(a, b):" for i in range(4)]
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "ray.jsonl"
    auto = JobSettings(max_new_tokens=8, draft_len="auto")
    s = run_job(qwen_dir, inp, out, auto, batch_size=2, ray_address="local", ray_actors=1, ray_init=RAY_INIT,
                **QUIET)
    assert s["written"] == 4 and s["batch_size"] == 2
    got = _read(out)
    for i, p in enumerate(prompts):
        assert got[str(i)]["tokens"] == qwen_pair.generate(p, max_new_tokens=8, draft_len=0).tokens
        assert got[str(i)]["stats"]["draft_len"] == "auto" and got[str(i)]["stats"]["batch_size"] == 2
