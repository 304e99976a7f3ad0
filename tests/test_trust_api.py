"""The embedding API: stream, cancel, close, one generation at a time, and the edge app example."""
from __future__ import annotations

import importlib.util
import signal
import threading
import time
from pathlib import Path

import pytest

import specrt
from specrt.errors import ConfigError, PairError

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def quicksort(xs):"


def _slow_rounds():  # a cancel hook that never cancels but slows each round: the consumer stays ahead
    time.sleep(0.005)
    return False


def _no_stream_threads():
    return not [t for t in threading.enumerate() if t.name == "specrt-stream"]


@pytest.fixture
def own_pair(qwen_dir):
    """A Pair of its own, for tests that close it."""
    pair = specrt.load(qwen_dir, threads=1)
    yield pair
    pair.close()


@pytest.mark.parametrize("kw", [
    dict(draft_len=3),
    dict(draft_len=0),
    dict(draft_len=2, temperature=0.9, top_k=40, seed=7),
    dict(draft_len=4, drafter="ngram"),
    dict(draft_len=2, stop=["\n"]),
], ids=str)
def test_stream_yields_the_text_of_generate(qwen_pair, kw):
    want = qwen_pair.generate(PROMPT, max_new_tokens=24, **kw)
    s = qwen_pair.stream(PROMPT, max_new_tokens=24, **kw)
    chunks = []
    with pytest.raises(StopIteration) as stop:
        while True:
            chunks.append(next(s))
    res = stop.value.value  # the generator-style return value
    assert (res.tokens, res.text, res.finish_reason) == (want.tokens, want.text, want.finish_reason)
    assert res.stats["new_tokens"] == want.stats["new_tokens"] and res.stats["rounds"] == want.stats["rounds"]
    assert "".join(chunks) == want.text and all(chunks)
    assert s.result is res and qwen_pair.last_result is res
    assert _no_stream_threads()


def test_stream_text_helper_and_for_loop(qwen_pair):
    want = qwen_pair.generate(PROMPT, max_new_tokens=12, draft_len=2)
    assert qwen_pair.stream(PROMPT, max_new_tokens=12, draft_len=2).text() == want.text
    with qwen_pair.stream(PROMPT, max_new_tokens=12, draft_len=2) as s:
        text = "".join(chunk for chunk in s)
    assert text == want.text and s.result.tokens == want.tokens


def test_closing_a_stream_early_cancels_it(qwen_pair):
    full = qwen_pair.generate(PROMPT, max_new_tokens=120, draft_len=1)
    with qwen_pair.stream(PROMPT, max_new_tokens=120, draft_len=1, cancel=_slow_rounds) as s:
        next(s)
    res = s.result
    assert res.finish_reason == "cancelled" and qwen_pair.last_result == res
    assert 0 < len(res.tokens) < 120 and full.tokens[: len(res.tokens)] == res.tokens
    assert full.text.startswith(res.text)
    assert _no_stream_threads()
    assert qwen_pair.generate(PROMPT, max_new_tokens=3).finish_reason == "length"  # free again


def test_break_out_of_an_unnamed_stream_frees_the_pair(qwen_pair):
    for _ in qwen_pair.stream(PROMPT, max_new_tokens=120, draft_len=1, cancel=_slow_rounds):
        break
    assert qwen_pair.last_result.finish_reason == "cancelled"
    assert qwen_pair.generate(PROMPT, max_new_tokens=3).tokens  # no "already generating"
    assert _no_stream_threads()


def test_a_stream_never_iterated_holds_nothing(qwen_pair):
    s = qwen_pair.stream(PROMPT, max_new_tokens=8)
    assert qwen_pair.generate(PROMPT, max_new_tokens=2).tokens
    s.close()
    assert s.result is None
    with pytest.raises(StopIteration):
        next(s)


@pytest.mark.parametrize("kw,match", [
    (dict(draft_len=99), "max_draft_len"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=250), "exceeds max_len"),
    (dict(top_p=0.0), "top_p"),
    (dict(drafter="magic"), "unknown drafter"),
    (dict(cancel="soon"), "cancel must be"),
])
def test_stream_rejects_bad_settings_at_once(qwen_pair, kw, match):
    with pytest.raises(ConfigError, match=match):
        qwen_pair.stream(PROMPT, **{"max_new_tokens": 8, **kw})


def test_stop_accepts_one_string(qwen_pair):
    text = qwen_pair.generate(PROMPT, max_new_tokens=30, draft_len=2).text
    stop = text[5:7]  # two characters that do occur
    one = qwen_pair.generate(PROMPT, max_new_tokens=30, draft_len=2, stop=stop)
    assert one.finish_reason == "stop" and one.text == text[: text.index(stop)]
    assert one.tokens == qwen_pair.generate(PROMPT, max_new_tokens=30, draft_len=2, stop=[stop]).tokens
    assert qwen_pair.generate(PROMPT, max_new_tokens=30, draft_len=2, stop=None).text == text


def test_cancel_event_set_before_start(qwen_pair):
    ev = threading.Event()
    ev.set()
    res = qwen_pair.generate(PROMPT, max_new_tokens=8, cancel=ev)
    assert (res.tokens, res.text, res.finish_reason) == ([], "", "cancelled")
    assert res.stats["new_tokens"] == 0
    s = qwen_pair.stream(PROMPT, max_new_tokens=8, cancel=ev)
    assert list(s) == [] and s.result.finish_reason == "cancelled"


def test_cancel_callable_is_checked_once_per_round(qwen_pair):
    full = qwen_pair.generate(PROMPT, max_new_tokens=60, draft_len=0)
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 5  # calls: before the decode, after the prefill's token, after rounds 1..4

    res = qwen_pair.generate(PROMPT, max_new_tokens=60, draft_len=0, cancel=cancel)
    assert res.finish_reason == "cancelled"
    assert len(calls) == 6
    # draft_len 0: one token per round; the first token comes from the prefill, before any round
    assert res.tokens == full.tokens[:5] and res.stats["rounds"] == 4


def test_cancel_that_fires_on_the_last_round_reports_length(qwen_pair):
    n = []  # calls: before the decode, after the prefill's token, after rounds 1..4 (the 5th token)
    res = qwen_pair.generate(PROMPT, max_new_tokens=5, draft_len=0, cancel=lambda: n.append(1) or len(n) > 5)
    assert res.finish_reason == "length" and len(res.tokens) == 5


def test_cancel_from_another_thread_with_a_timeout(qwen_pair):
    ev = threading.Event()
    chunks = []

    def slow(chunk):
        chunks.append(chunk)
        time.sleep(0.01)

    timer = threading.Timer(0.1, ev.set)
    timer.start()
    res = qwen_pair.generate(PROMPT, max_new_tokens=200, draft_len=0, on_text=slow, cancel=ev)
    timer.join()
    assert res.finish_reason == "cancelled" and 0 < len(res.tokens) < 200
    assert "".join(chunks) == res.text


def test_second_thread_gets_a_clear_error_not_a_wait(qwen_pair):
    started, release = threading.Event(), threading.Event()
    out = {}

    def on_text(_):
        started.set()
        release.wait(5)

    def worker():
        out["res"] = qwen_pair.generate(PROMPT, max_new_tokens=6, draft_len=0, on_text=on_text)

    t = threading.Thread(target=worker)
    t.start()
    assert started.wait(5)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="one Pair per thread, or your own lock"):
            qwen_pair.generate(PROMPT, max_new_tokens=2)
        s = qwen_pair.stream(PROMPT, max_new_tokens=2)
        with pytest.raises(ConfigError, match="already generating"):
            next(s)
        assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
        t.join()
    assert out["res"].finish_reason == "length"
    assert qwen_pair.generate(PROMPT, max_new_tokens=2).tokens  # free again


def test_reentrant_call_from_a_callback_is_refused(qwen_pair):
    def on_text(_):
        qwen_pair.generate("x", max_new_tokens=1)

    with pytest.raises(ConfigError, match="already generating"):
        qwen_pair.generate(PROMPT, max_new_tokens=4, on_text=on_text)
    assert qwen_pair.generate(PROMPT, max_new_tokens=2).tokens


def test_an_error_in_a_callback_propagates_and_frees_the_pair(qwen_pair):
    def on_text(_):
        raise ValueError("display unplugged")

    with pytest.raises(ValueError, match="display unplugged"):
        qwen_pair.generate(PROMPT, max_new_tokens=4, on_text=on_text)
    assert qwen_pair.generate(PROMPT, max_new_tokens=2).tokens


def test_an_error_while_streaming_reaches_the_consumer(qwen_pair, monkeypatch):
    import specrt.api.runner as runner_mod

    def boom(*a, **kw):
        raise RuntimeError("engine fell over")

    monkeypatch.setattr(runner_mod, "Decoder", boom)
    with pytest.raises(RuntimeError, match="engine fell over"):
        list(qwen_pair.stream(PROMPT, max_new_tokens=4))
    monkeypatch.undo()
    assert _no_stream_threads()
    assert qwen_pair.generate(PROMPT, max_new_tokens=2).tokens


def test_closed_pair_refuses(own_pair):
    with own_pair as pair:
        assert pair.generate(PROMPT, max_new_tokens=2).tokens
    assert pair.closed and pair.target.session is None and pair.draft.session is None
    for call in (lambda: pair.generate(PROMPT), lambda: pair.stream(PROMPT),
                 lambda: pair.run([5, 6], pair.config(max_new_tokens=2))):
        with pytest.raises(PairError, match="closed"):
            call()
    pair.close()  # idempotent


def test_close_from_another_thread_cancels_and_waits(own_pair):
    started = threading.Event()
    out = {}

    def on_text(_):
        started.set()
        time.sleep(0.005)

    def worker():
        out["res"] = own_pair.generate(PROMPT, max_new_tokens=200, draft_len=0, on_text=on_text)

    t = threading.Thread(target=worker)
    t.start()
    assert started.wait(5)
    own_pair.close()  # returns once the generation has stopped
    assert own_pair.target.session is None
    t.join(5)
    assert out["res"].finish_reason == "cancelled" and len(out["res"].tokens) < 200
    with pytest.raises(PairError, match="closed"):
        own_pair.generate(PROMPT)


def test_close_from_inside_a_callback_or_a_stream_loop(qwen_dir):
    pair = specrt.load(qwen_dir, threads=1)
    res = pair.generate(PROMPT, max_new_tokens=100, draft_len=0, on_text=lambda _: pair.close())
    assert res.finish_reason == "cancelled" and pair.target.session is None
    pair = specrt.load(qwen_dir, threads=1)
    with pair.stream(PROMPT, max_new_tokens=100, draft_len=0, cancel=_slow_rounds) as s:
        for _ in s:
            pair.close()
    assert s.result.finish_reason == "cancelled" and pair.target.session is None
    assert _no_stream_threads()


def test_one_pair_per_thread_runs_concurrently(qwen_dir, qwen_pair):
    want = {k: qwen_pair.generate(PROMPT, max_new_tokens=20, draft_len=k).tokens for k in (0, 3)}
    pairs = [specrt.load(qwen_dir, threads=1) for _ in range(2)]
    got, errors = {}, []

    def worker(i, pair):
        try:
            for _ in range(5):
                for k in (0, 3):
                    got.setdefault((i, k), []).append(pair.generate(PROMPT, max_new_tokens=20, draft_len=k).tokens)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in pairs:
        p.close()
    assert not errors
    assert all(run == want[k] for (_, k), runs in got.items() for run in runs)


# ---------------------------------------------------------------- examples/edge_app.py


@pytest.fixture
def edge_app():
    spec = importlib.util.spec_from_file_location("edge_app", ROOT / "examples" / "edge_app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    handler = signal.getsignal(signal.SIGINT)
    yield mod
    signal.signal(signal.SIGINT, handler)


def test_edge_app_streams_an_answer(edge_app, qwen_dir, qwen_pair, capsys):
    want = qwen_pair.generate(PROMPT, max_new_tokens=10, chat=True)
    assert edge_app.main([str(qwen_dir), "--prompt", PROMPT, "--max-new-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    assert out == want.text
    assert f"[{want.finish_reason}: {len(want.tokens)} tokens" in err


def test_edge_app_timeout_cancels(edge_app, qwen_dir, capsys):
    assert edge_app.main([str(qwen_dir), "--prompt", PROMPT, "--timeout", "0"]) == 0
    assert "[cancelled: 0 tokens" in capsys.readouterr().err


def test_edge_app_reads_prompts_rejects_bad_ones_and_keeps_serving(edge_app, qwen_dir, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("def fib(n):\n" + "def x " * 300 + "\n\nclass A:\n"))
    assert edge_app.main([str(qwen_dir), "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert err.count("[length: 4 tokens") + err.count("[eos:") == 2
    assert "[rejected: " in err and "max_len" in err


def test_edge_app_bad_pair_is_one_line(edge_app, tmp_path, capsys):
    assert edge_app.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"cannot start: pair folder not found: {tmp_path / 'nope'}"


def test_exclusive_holds_the_pair_for_direct_engine_use(qwen_pair):
    import numpy as np

    with qwen_pair.exclusive() as pair:
        pair.target.truncate(0)
        pair.target.forward(np.array([[5, 6, 7]]), np.array([2]))
        with pytest.raises(ConfigError, match="already generating"):
            qwen_pair.generate(PROMPT, max_new_tokens=2)
        with pytest.raises(ConfigError, match="already generating"):
            with qwen_pair.exclusive():
                pass
    assert qwen_pair.generate(PROMPT, max_new_tokens=2).tokens
