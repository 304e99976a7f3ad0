"""Proposers: the draft model, prompt lookup (n-gram) and hybrid all keep speculative decoding lossless."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from _helpers import P_MIN, FakeEngine, chi2_pvalue, fake_exact_joint, sequence_index
from specrt.cli import main
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.decode import decode
from specrt.decoding.policy import Auto, PolicyConfig, Fixed, PolicyState
from specrt.decoding.proposers import LookupProposer, ModelProposer
from specrt.errors import ConfigError

REPETITIVE = ["def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
              "def fib(n):\n    a, b", list(range(3, 30)) * 2 + [3, 4], [40, 41, 42, 43]]


def test_ngram_lookup():
    ng = LookupProposer(max_ngram=3)

    def lookup(seq, k):
        return ng.match(seq, k)[0]

    assert lookup([1, 2, 3, 4, 1, 2], 3).tolist() == [3, 4, 1]  # 2-gram [1, 2] seen at 0
    assert lookup([1, 2, 9, 1, 2, 7, 1, 2], 2).tolist() == [9, 1]  # equally long matches: the first wins
    assert lookup([5, 6, 7, 8, 5, 6, 7], 4).tolist() == [8, 5, 6, 7]  # longest n first
    assert lookup([1, 2, 3], 4).tolist() == []  # no earlier occurrence
    assert lookup([7], 4).tolist() == []
    assert lookup([9, 9, 9], 2).tolist() == [9]  # continuation runs to the end of the sequence
    assert len(lookup(list(range(10)) * 3, 5)) == 5
    assert lookup([], 2).tolist() == []


def test_ngram_prefers_the_longest_match_over_the_first():
    """A later occurrence that matches more of the suffix beats an earlier, shorter one."""
    ng = LookupProposer()
    seq = [5, 1, 2, 3, 8, 4, 1, 2, 3, 9, 6, 4, 1, 2, 3]  # [1, 2, 3] twice; [4, 1, 2, 3] only before the 9
    d, n = ng.match(seq, 2)
    assert d.tolist() == [9, 6] and n == 4
    copy = list(range(100, 130))
    d, n = ng.match(copy + [7] + copy[:20], 4)  # 20 tokens into a copy of the first 30 (16: the default cap)
    assert d.tolist() == copy[20:24] and n == 16
    found = ng.find(copy + [7] + copy[:20], 4)
    assert found.tokens.tolist() == copy[20:24] and found.kind == "ngram8" and found.matched == 16
    assert LookupProposer(max_ngram=5).match(copy + [7] + copy[:20], 4)[1] == 5  # max_ngram caps the match length


def test_hybrid_uses_ngram_proposals_only_after_a_two_token_match():
    """After a 1-token match an n-gram proposal is right too rarely to pay: hybrid asks the model."""
    lookup, model = LookupProposer(max_ngram=3), ModelProposer(None, 10)
    hy = Fixed(3, [lookup, model])  # hybrid at a fixed draft length
    assert hy.plan([4, 8, 1, 2, 4], 3, 10) == (model, 3)  # only [4] matched
    assert hy.plan([1, 2, 3, 4, 1, 2], 3, 10) == (lookup, 3)  # [1, 2] matched, [3, 4, 1] proposed
    assert hy.plan([7, 1, 2, 7, 1, 2], 3, 10)[0] is lookup and lookup.find([7, 1, 2, 7, 1, 2], 3).kind == "ngram3"


def test_ngram_proposal_kind_is_the_matched_length():
    """auto keeps one controller per matched length (a 3-token match is right far more often than a
    1-token one); propose returns what find found for the same sequence, and names its kind."""
    ng = LookupProposer(max_ngram=5)
    cases = [([1, 2, 3, 4, 1, 2], "ngram2"), ([5, 6, 7, 8, 5, 6, 7], "ngram3"), ([1, 2, 3, 9, 1, 2, 3, 9], "ngram3"),
             ([4, 8, 1, 4], "ngram1"), ([1, 2, 3], "ngram")]
    for seq, kind in cases:
        found = ng.find(seq, 4)
        assert found.kind == kind and found.tokens.tolist() == ng.match(seq, 4)[0].tolist(), seq
        prop = ng.propose(seq, 3, SamplingConfig(), np.random.default_rng(0))
        assert prop.tokens.tolist() == ng.match(seq, 3)[0].tolist() and prop.p_draft is None and prop.passes == 0
        assert ng.kind == kind
    ng.find([1, 2, 1], 4)
    again = ng.propose([1, 2, 1, 2], 2, SamplingConfig(), np.random.default_rng(0))
    assert again.tokens.tolist() == [1, 2]  # not stale


def test_auto_keeps_a_controller_per_ngram_kind(same_pair, monkeypatch):
    """With drafter ngram + auto, the estimates come back per matched length; a tuned "ngram" prior seeds them."""
    prompt = list(range(3, 30)) * 2 + [3, 4]
    res = same_pair.generate(prompt, max_new_tokens=24, draft_len="auto", drafter="ngram")
    kinds = set(res.stats["acceptance_estimate"])
    assert kinds and kinds <= {"ngram1", "ngram2", "ngram3", "ngram8"}
    def always(self, seq, k):  # a 4-token match
        return np.full(k, 5, np.int64), 4

    monkeypatch.setattr(LookupProposer, "match", always)
    cfg = GenerationConfig(max_new_tokens=4, draft_len="auto", drafter="ngram")
    policy = Auto([LookupProposer()], 8, PolicyState(acceptance={"ngram": [0.123] * 8}))
    _, _, st = decode(same_pair.target, policy, [5, 6, 7, 8], cfg, same_pair.manifest.vocab_size, frozenset())
    est = st.acceptance_estimate
    assert "ngram3" in est and est["ngram3"][1:] == [0.123] * 7  # seeded by the "ngram" prior (position 0 observed)


@pytest.mark.parametrize("kw,match", [(dict(drafter="medusa"), "unknown drafter"), (dict(ngram_max=0), "ngram_max"),
                                      (dict(ngram_max=17), "ngram_max"), (dict(draft_window=-1), "draft_window"),
                                      (dict(draft_window=8.5), "draft_window")])
def test_generation_config_drafter_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(**kw)


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equals_target_only_for_every_drafter(qwen_pair, drafter, k):
    for prompt in REPETITIVE:
        base = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=0)
        res = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=k, drafter=drafter)
        assert res.tokens == base.tokens
        s = res.stats
        assert s["new_tokens"] == 1 + s["rounds"] + s["accepted"]
        assert s["target_passes"] == 1 + s["rounds"]
        assert sum(s["rounds_by_drafter"].values()) <= s["rounds"]
        if drafter == "ngram":
            assert s["draft_passes"] == 0 and set(s["rounds_by_drafter"]) <= {"ngram"}


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_a_draft_window_bounds_every_catch_up_and_stays_lossless(qwen_pair, drafter, monkeypatch):
    """With draft_window W the draft never reads more than W tokens in one pass (the prompt, what
    n-gram rounds emitted): it starts over from the last W tokens. What is generated does not change."""
    widths = []
    forward = qwen_pair.draft.forward
    monkeypatch.setattr(qwen_pair.draft, "forward", lambda t, p: (widths.append(t.shape[1]), forward(t, p))[1])
    for prompt in REPETITIVE[:2]:
        qwen_pair.draft_memory.forget()
        base = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=0)
        widths.clear()
        res = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=3, drafter=drafter, draft_window=6)
        assert res.tokens == base.tokens
        assert widths and max(widths) <= 6
        assert len(qwen_pair.encode(prompt)) > 6 and widths[0] == 6  # the prompt: only its last 6 tokens


def test_the_draft_window_defaults_to_the_devices_and_reaches_the_cli(qwen_dir, qwen_pair):
    from specrt.decoding.proposers import default_window

    assert default_window("cpu") == 32 and default_window("cuda") == 0
    assert qwen_pair.policy(GenerationConfig(draft_len=2)).model.window == 32  # this pair runs on the CPU
    assert qwen_pair.policy(GenerationConfig(draft_len=2, draft_window=0)).model.window is None
    assert qwen_pair.policy(GenerationConfig(draft_len=2, drafter="hybrid", draft_window=5)).model.window == 5
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", REPETITIVE[0], "--max-new-tokens", "16",
                                  "--draft-window", "4", "--draft-len", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == qwen_pair.generate(REPETITIVE[0], max_new_tokens=16, draft_len=0).tokens
    assert out["stats"]["draft_passes"] > 0


def test_a_windowed_draft_cache_holds_the_sequence_from_its_offset():
    """Cache bookkeeping after a start-over: the draft's slots hold seq[off:off + length] at every round
    and the next request reuses them through the memory when its prompt extends that sequence."""
    from specrt.decoding.proposers import DraftMemory

    V, memory = 6, DraftMemory()
    target = FakeEngine(0, V, max_len=96)
    model = ModelProposer(FakeEngine(1, V, max_len=96, like=target), V, memory=memory, window=4)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    out, _, st = decode(target, Fixed(2, [model]), prompt, GenerationConfig(max_new_tokens=20, draft_len=2), V,
                        frozenset())
    seq = prompt + out
    assert st.draft_passes and model.off >= len(prompt) - 4
    eng = model.engine
    assert list(eng.cache[:eng.length]) == seq[model.off:model.off + eng.length]
    assert memory.off == model.off
    # the next turn extends the sequence: the windowed slots are offered, but a fresh request longer than
    # the window reads its last 4 tokens whatever was kept, as a draft without memory would
    nxt = seq + [3, 4]
    model.start(nxt)
    assert model.off == memory.off and eng.length > 0
    model.propose(nxt, 1, SamplingConfig(), np.random.default_rng(0))
    assert model.off == len(nxt) - 4 and list(eng.cache[:4]) == nxt[-4:]
    model.commit(len(nxt))
    # a prompt that differs inside the window keeps only the part before the difference
    other = list(seq)
    other[model.off + 1] = (other[model.off + 1] + 1) % V
    model.memory.seq = seq
    model.start(other)
    assert eng.length == 1
    # one that is shorter than the offset keeps nothing
    model.memory.seq = seq
    model.start(seq[:model.memory.off])
    assert (model.off, eng.length) == (0, 0)


def test_a_skipping_draft_reads_only_the_last_tokens_it_missed():
    """`skip`: once the draft's cache holds part of the request, a catch-up reads only the last `skip`
    tokens it missed; the slots before them are kept (a gap), the offset moves past the skipped ones,
    and the draft cache is no longer offered to the next request (it is not a prefix of the sequence)."""
    from specrt.decoding.proposers import DraftMemory

    V, memory = 6, DraftMemory()
    eng = FakeEngine(1, V, max_len=64)
    model = ModelProposer(eng, V, memory=memory, window=16, skip=3)
    seq = [1, 2, 3, 4, 5, 1, 2]
    model.start(seq)
    assert model.behind(seq) == 7  # a fresh cache: the whole prompt (within the window)
    cfg, rng = SamplingConfig(), np.random.default_rng(0)
    d = model.propose(seq, 2, cfg, rng).tokens
    model.commit(len(seq))  # both drafts rejected: the slots of the 7 prompt tokens stay
    assert eng.length == 7 and model.off == 0
    seq = seq + [3, 4, 5, 0, 1, 2, 3, 4]  # emitted without the model (n-gram rounds): 8 tokens unread
    assert model._unread(seq) == 8 and model.behind(seq) == 3
    kept = list(eng.cache[:7])
    d = model.propose(seq, 1, cfg, rng).tokens
    assert list(eng.cache[:7]) == kept and list(eng.cache[7:10]) == seq[-3:]  # the gap: 5 tokens skipped
    assert model.off == 5 and model._unread(seq) == 0
    model.commit(len(seq) + 1)  # its draft accepted
    assert eng.length == 10 and model.behind(seq + [int(d[0]), 2]) == 2
    assert model.memory is None and memory.seq == []  # the next request starts from an empty draft cache
    # a request's first pass reads its prompt by the window rule (the last 16 of a longer one), even past a
    # prefix the memory kept: what the draft sees is the request's alone
    memory = DraftMemory()
    first = ModelProposer(eng, V, memory=memory, window=16, skip=3)
    first.start(seq)
    first.propose(seq, 1, cfg, rng)
    first.commit(len(seq))
    model = ModelProposer(eng, V, memory=memory, window=16, skip=3)
    longer = seq + [5, 4, 3, 2, 1, 0, 1, 2, 3, 4]
    model.start(longer)
    assert eng.length == len(seq) and model.behind(longer) == 10
    model.propose(longer, 1, cfg, rng)
    assert model.off == len(longer) - 16 and list(eng.cache[:16]) == longer[-16:]
    # within the window the kept prefix stands: the rest is read after it
    first = ModelProposer(eng, V, memory=memory, window=32, skip=3)
    first.start(seq)
    first.propose(seq, 1, cfg, rng)
    first.commit(len(seq))
    model = ModelProposer(eng, V, memory=memory, window=32, skip=3)
    model.start(longer)
    assert eng.length == len(seq) and model.behind(longer) == 10
    model.propose(longer, 1, cfg, rng)
    assert list(eng.cache[:len(longer)]) == longer and model.off == 0


def test_hybrid_skips_only_with_a_windowed_draft(qwen_pair):
    assert qwen_pair.policy(GenerationConfig(draft_len=2, drafter="hybrid")).model.skip == 8  # CPU: window 32
    assert qwen_pair.policy(GenerationConfig(draft_len=2, drafter="hybrid", draft_window=5)).model.skip == 5
    assert qwen_pair.policy(GenerationConfig(draft_len=2, drafter="hybrid", draft_window=0)).model.skip is None
    assert qwen_pair.policy(GenerationConfig(draft_len=2, drafter="model")).model.skip is None


def test_a_skipping_hybrid_is_greedy_exact(qwen_pair, monkeypatch):
    """hybrid's model catching up on the last token only: drafts differ, the output does not."""
    gaps = []
    steps = ModelProposer.steps

    def counted(self, seq, *a, **kw):
        gaps.append(self.engine.length > 0 and self._unread(seq) > self.skip)
        return steps(self, seq, *a, **kw)

    monkeypatch.setattr(ModelProposer, "steps", counted)
    monkeypatch.setattr(qwen_pair, "policy_config", replace(PolicyConfig(), skip=1))
    for prompt in REPETITIVE[:2]:
        base = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=0)
        for k in (3, "auto"):
            assert qwen_pair.generate(prompt, max_new_tokens=48, draft_len=k, drafter="hybrid").tokens == base.tokens
    assert any(gaps)


def test_ngram_drafter_accepts_on_repetition(same_pair):
    """A prompt that repeats: prompt lookup proposes the continuation and the target accepts some of it."""
    prompt = list(range(3, 30)) * 3
    res = same_pair.generate(prompt, max_new_tokens=64, draft_len=4, drafter="ngram")
    assert res.stats["proposed"] > 0


def _lossless(proposers_factory, temperature, top_k, top_p, k, n=4000):
    V, prompt = 4, [1, 2, 1, 3, 1, 2]  # repetitive: the n-gram drafter has proposals
    cfg = SamplingConfig(temperature, top_k, top_p)
    target = FakeEngine(0, V, max_len=32)
    proposers = proposers_factory(target, V)
    exact = fake_exact_joint(target, prompt, cfg, 3)
    obs = np.zeros_like(exact)
    prop = 0
    for seed in range(n):
        g = GenerationConfig(max_new_tokens=4, draft_len=k, seed=seed, sampling=cfg)
        out, reason, st = decode(target, Fixed(k, proposers), prompt, g, V, frozenset())
        assert len(out) == 4
        obs[sequence_index(out[:3], V)] += 1
        prop += st.proposed
    assert prop > n  # drafts were actually proposed
    p = chi2_pvalue(obs, exact)
    assert p > P_MIN, f"p={p:.2e}"


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 3), (0.8, 3, 0.9, 2)])
def test_ngram_drafter_is_lossless(temperature, top_k, top_p, k):
    _lossless(lambda target, V: [LookupProposer(3)], temperature, top_k, top_p, k)


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 3)])
def test_hybrid_drafter_is_lossless(temperature, top_k, top_p, k):
    def make(target, V):
        return [LookupProposer(2), ModelProposer(FakeEngine(1, V, max_len=32, like=target), V)]

    _lossless(make, temperature, top_k, top_p, k)


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 3)])
def test_a_skipping_hybrid_is_lossless(temperature, top_k, top_p, k):
    made = []

    def make(target, V):  # its model reads 1 token of whatever n-gram rounds emitted
        made.append(ModelProposer(FakeEngine(1, V, max_len=32, like=target), V, window=4, skip=1))
        return [LookupProposer(2), made[-1]]

    _lossless(make, temperature, top_k, top_p, k)
    assert made[0].off > 0  # it did skip


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 3)])
def test_a_windowed_model_draft_is_lossless(temperature, top_k, top_p, k):
    def make(target, V):  # a 2-token window: the draft starts over almost every round
        return [ModelProposer(FakeEngine(1, V, max_len=32, like=target), V, window=2)]

    _lossless(make, temperature, top_k, top_p, k)


def test_cli_drafter_option(qwen_dir, qwen_pair):
    runner = CliRunner()
    r = runner.invoke(main, ["generate", str(qwen_dir), "--prompt", "def fib(n):", "--max-new-tokens", "16",
                             "--drafter", "ngram", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == qwen_pair.generate("def fib(n):", max_new_tokens=16, draft_len=0).tokens
    assert out["stats"]["draft_passes"] == 0
    r = runner.invoke(main, ["generate", str(qwen_dir), "--prompt", "x", "--drafter", "medusa"])
    assert r.exit_code == 2 and "Traceback" not in r.output and "Invalid value for '--drafter'" in r.stderr


def test_draft_cache_prefix_is_reused_across_requests(qwen_pair, monkeypatch):
    """A prompt that extends the previous request's sequence (the next turn of a conversation) or
    shares its start (a system prompt) keeps those draft cache entries; the rest is read as usual,
    and what is generated is exactly what a cold draft cache gives. (No catch-up window here: the
    windowed cache's reuse is tested above.)"""
    pair, draft = qwen_pair, qwen_pair.draft
    cuts = []
    truncate = draft.truncate
    monkeypatch.setattr(draft, "truncate", lambda n: (cuts.append(n), truncate(n))[1])
    first = list(range(3, 40))
    pair.draft_memory.forget()
    a = pair.generate(first, max_new_tokens=24, draft_len=3, draft_window=0)
    assert cuts[0] == 0  # nothing to reuse yet
    turn = first + a.tokens + [5, 6, 7]  # the conversation goes on
    read = draft.length  # the draft has not read the last emitted tokens yet
    assert len(first) + len(a.tokens) - 4 <= read <= len(first) + len(a.tokens)
    cuts.clear()
    warm = pair.generate(turn, max_new_tokens=24, draft_len=3, draft_window=0, temperature=0.8, seed=3)
    assert cuts[0] == read  # all of the previous sequence the draft had read
    pair.draft_memory.forget()
    cuts.clear()
    cold = pair.generate(turn, max_new_tokens=24, draft_len=3, draft_window=0, temperature=0.8, seed=3)
    assert cuts[0] == 0 and cold.tokens == warm.tokens
    # a different prompt that shares only the start
    cuts.clear()
    pair.generate(first[:10] + [50, 51, 52], max_new_tokens=8, draft_len=2, draft_window=0)
    assert cuts[0] == 10
    # code that drives the engines itself (batch, checks) makes the Pair forget
    with pair.exclusive():
        pass
    cuts.clear()
    pair.generate(first[:10] + [50, 51, 52], max_new_tokens=8, draft_len=2, draft_window=0)
    assert cuts[0] == 0


def test_draft_cache_reuse_never_trusts_slots_past_the_sequence(qwen_pair):
    """Slots past the committed sequence may hold rejected drafts: they are never reused."""
    pair = qwen_pair
    pair.draft_memory.forget()
    prompt = list(range(3, 30))
    res = pair.generate(prompt, max_new_tokens=16, draft_len=8, draft_window=0, temperature=1.0, seed=1)
    seq = prompt + res.tokens
    assert pair.draft.length <= len(pair.draft_memory.seq) <= len(seq) + 1
    policy = pair.policy(GenerationConfig(draft_len=2, draft_window=0))
    policy.start(seq + [999])  # the next prompt: everything generated, then a token never seen
    assert pair.draft.length == min(len(pair.draft_memory.seq), len(seq))


def test_bench_measures_each_run_as_a_new_prompt(qwen_pair, monkeypatch):
    """bench runs a prompt under every setting back to back: each run must find in the draft's cache
    only what following the previous prompt would leave there (their shared prefix), not itself."""
    import statistics

    from specrt.apps.bench import Prompt, run_bench

    a = Prompt("a", [3, 4, 5, 6, 7] + list(range(20, 30)), "code")
    b = Prompt("b", [3, 4, 5, 6, 7] + list(range(40, 52)), "chat")
    seen, run = [], qwen_pair.run

    def spy(ids, cfg):
        seen.append(len(qwen_pair.draft_memory.seq))
        return run(ids, cfg)

    monkeypatch.setattr(qwen_pair, "run", spy)
    res = run_bench(qwen_pair, [a, b], [0, 2], max_new_tokens=4, repeats=2)
    assert seen[2:] == [5] * 8  # after the two warm-ups: the shared prefix only, every time
    base, spec = res["rows"]
    assert spec["speedup"] == pytest.approx(statistics.median(x / y for x, y in zip(spec["rates"], base["rates"])))
    assert set(spec["speedup_by_class"]) == {"code", "chat"}
    assert [(x["repeat"], x["prompt"]) for x in spec["runs"]] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert all(x["new_tokens"] == 4 and x["wall_s"] > 0 for x in spec["runs"])
    seen.clear()
    run_bench(qwen_pair, [a], [0, 2], max_new_tokens=4, repeats=2)
    assert seen[2:] == [0] * 4  # one prompt: read afresh each time
