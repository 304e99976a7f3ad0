"""The speculative decode loop: greedy equivalence, losslessness in distribution, stats, seeds, stop edges."""
from __future__ import annotations

import json

import numpy as np
import pytest

from _helpers import (EOS_ID, P_MIN, FakeEngine, chi2_pvalue, copy_pair, entropy, fake_exact_joint,
                      sequence_index)
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.decode import decode
from specrt.decoding.policy import Fixed
from specrt.decoding.proposers import ModelProposer
from specrt.decoding.sampling import warp
from specrt.engines.ort import ort_engine

TEXT_PROMPTS = ["def quicksort(xs):", "class Stack:\n    def push(self, x):", "The quick brown", "x"]
ID_PROMPTS = [[5], [40, 41, 42, 43], list(range(3, 60)), [0, 1, 2, 300, 319]]
KS = [1, 2, 4, 8]


def _run(pair, prompt, **kw):
    kw.setdefault("max_new_tokens", 48)
    kw.setdefault("drafter", "model")  # these tests are about the draft model's proposals
    return pair.generate(prompt, **kw)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("prompt", TEXT_PROMPTS + ID_PROMPTS, ids=lambda p: repr(p)[:20])
def test_greedy_speculative_equals_target_only(pairs, model_type, prompt):
    pair = pairs[model_type]
    base = _run(pair, prompt, draft_len=0)
    assert len(base.tokens) == 48 and base.finish_reason == "length"
    assert base.stats["proposed"] == 0 and base.stats["draft_passes"] == 0
    for k in KS:
        res = _run(pair, prompt, draft_len=k)
        assert res.tokens == base.tokens, f"draft_len {k} diverges at {_first_diff(res.tokens, base.tokens)}"
        assert res.text == base.text and res.finish_reason == base.finish_reason


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_greedy_target_only_equals_torch_greedy(pairs, torch_models, model_type):
    import torch

    pair = pairs[model_type]
    vocab = pair.manifest.vocab_size
    model = torch_models[model_type, "target"]
    for prompt in ([40, 41, 42, 43], pair.encode("def fib(n):")):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):
                logits = model(torch.tensor([ids])).logits[0, -1, :vocab]  # padding rows masked, as specrt does
                ids.append(int(logits.argmax()))
        want = ids[len(prompt):]
        assert _run(pair, prompt, max_new_tokens=24, draft_len=0).tokens == want
        assert _run(pair, prompt, max_new_tokens=24, draft_len=4).tokens == want


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_partial_acceptance_and_stats(pairs, model_type):
    pair = pairs[model_type]
    for k in KS:
        s = _run(pair, "def quicksort(xs):", max_new_tokens=64, draft_len=k).stats
        assert 0.0 < s["acceptance_rate"] < 1.0
        _check_stats(s, k, 64)


def _check_stats(s, k, n_tokens):
    assert s["draft_len"] == k
    assert s["new_tokens"] == n_tokens
    assert s["target_passes"] == 1 + s["rounds"]
    assert s["draft_passes"] == s["proposed"]  # one pass per drafted token (the first one reads the prompt too)
    assert s["proposed"] <= k * s["rounds"]
    assert 0 <= s["accepted"] <= s["proposed"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["proposed"] if s["proposed"] else 0.0)
    # each round emits its accepted drafts plus one target token
    assert s["new_tokens"] == 1 + s["rounds"] + s["accepted"]
    assert s["tokens_per_target_pass"] == pytest.approx(s["new_tokens"] / s["target_passes"])
    apos = s["accepted_per_position"]
    assert len(apos) == k and all(0.0 <= a <= 1.0 for a in apos)
    assert 0 < s["ttft_s"] <= s["wall_s"] and s["tokens_per_s"] > 0


@pytest.mark.parametrize("k", KS)
def test_same_model_as_draft_accepts_everything(same_pair, k):
    for prompt in ("def quicksort(xs):", [40, 41, 42, 43]):
        res = _run(same_pair, prompt, max_new_tokens=64, draft_len=k)
        s = res.stats
        assert s["acceptance_rate"] == 1.0
        assert s["accepted_per_position"] == [1.0] * k
        assert s["tokens_per_target_pass"] > 1.0
        _check_stats(s, k, 64)
        assert res.tokens == _run(same_pair, prompt, max_new_tokens=64, draft_len=0).tokens


def test_same_model_as_draft_sampling_accepts_nearly_everything(same_pair):
    # p_draft and p_target agree up to float noise (verify pass vs single steps), so rejections are ~never.
    res = _run(same_pair, [40, 41, 42, 43], max_new_tokens=96, draft_len=4, temperature=1.0, seed=3)
    assert res.stats["acceptance_rate"] >= 0.99


# ---------------------------------------------------------------- seeds


@pytest.mark.parametrize("k", [0, 4])
def test_seed_reproduces_and_seeds_differ(qwen_pair, k):
    kw = dict(max_new_tokens=32, draft_len=k, temperature=1.0, top_k=50, top_p=0.95)
    runs = {seed: _run(qwen_pair, "def fib(n):", seed=seed, **kw).tokens for seed in range(4)}
    for seed in range(4):
        assert _run(qwen_pair, "def fib(n):", seed=seed, **kw).tokens == runs[seed]
    assert len({tuple(t) for t in runs.values()}) > 1


def test_seed_reproduces_across_loads(qwen_dir, qwen_pair):
    import specrt

    kw = dict(max_new_tokens=32, draft_len=3, temperature=0.9, seed=11)
    with specrt.load(qwen_dir) as other:
        assert other.generate("def fib(n):", **kw).tokens == qwen_pair.generate("def fib(n):", **kw).tokens


def test_generations_do_not_leak_state(qwen_pair):
    """A Pair is reused across requests: a generation is independent of what ran before it."""
    first = _run(qwen_pair, "class Stack:", draft_len=4, temperature=0.7, seed=5)
    _run(qwen_pair, list(range(3, 100)), max_new_tokens=100, draft_len=8)
    again = _run(qwen_pair, "class Stack:", draft_len=4, temperature=0.7, seed=5)
    assert (again.tokens, again.text, again.finish_reason) == (first.tokens, first.text, first.finish_reason)
    assert again.stats["accepted"] == first.stats["accepted"]


# ---------------------------------------------------------------- max_new_tokens, EOS, stop strings


@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
def test_max_new_tokens_is_exact(qwen_pair, k):
    greedy_full = _run(qwen_pair, [40, 41, 42], max_new_tokens=12, draft_len=k).tokens
    for m in range(1, 13):
        res = _run(qwen_pair, [40, 41, 42], max_new_tokens=m, draft_len=k)
        assert res.tokens == greedy_full[:m] and res.finish_reason == "length"
        assert res.stats["new_tokens"] == m
        samp = _run(qwen_pair, [40, 41, 42], max_new_tokens=m, draft_len=k, temperature=1.5, seed=m)
        assert len(samp.tokens) <= m
        assert len(samp.tokens) == m or samp.finish_reason == "eos"


def test_max_new_tokens_one_with_drafts(qwen_pair):
    res = _run(qwen_pair, "def fib(n):", max_new_tokens=1, draft_len=4)
    assert len(res.tokens) == 1
    assert res.stats["target_passes"] == 1 and res.stats["proposed"] == 0


@pytest.fixture(scope="module")
def eos_case(qwen_dir, tmp_path_factory):
    """A copy of the Qwen2 pair whose manifest EOS is the 5th greedy token of a prompt."""
    import specrt

    prompt = [40, 41, 42, 43]
    with specrt.load(qwen_dir) as pair:
        greedy = pair.generate(prompt, max_new_tokens=24, draft_len=0).tokens
    eos = greedy[4]
    d = copy_pair(qwen_dir, tmp_path_factory.mktemp("eos") / "pair")
    m = json.loads((d / "manifest.json").read_text())
    m["eos_token_ids"] = [eos]
    (d / "manifest.json").write_text(json.dumps(m))
    pair = specrt.load(d, threads=1)
    yield pair, prompt, greedy[: greedy.index(eos)]
    pair.close()


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 8])
def test_eos_ends_generation_exactly(eos_case, k):
    pair, prompt, want = eos_case
    assert 1 <= len(want) <= 4
    chunks = []
    res = pair.generate(prompt, max_new_tokens=24, draft_len=k, on_text=chunks.append)
    assert res.tokens == want  # nothing after EOS, EOS itself not included
    assert res.finish_reason == "eos"
    assert res.text == "".join(chunks)
    _assert_text_of(pair, res)
    assert res.stats["new_tokens"] == len(want)


def test_eos_by_sampling(qwen_pair):
    """High temperature: some seed samples EOS (id 2) before max_new_tokens."""
    hits = 0
    for seed in range(300):
        res = _run(qwen_pair, [40, 41, 42, 43], max_new_tokens=40, draft_len=4, temperature=3.0, seed=seed)
        assert EOS_ID not in res.tokens
        if res.finish_reason == "eos":
            hits += 1
            assert len(res.tokens) < 40
            assert res.stats["new_tokens"] == len(res.tokens)
        else:
            assert res.finish_reason == "length" and len(res.tokens) == 40
        if hits >= 3:
            break
    assert hits >= 3


def _substring(text, start, n):
    """A substring of `text` at or after `start` made of whole characters (no U+FFFD)."""
    for i in range(start, len(text) - n):
        if "\ufffd" not in text[i:i + n]:
            return text[i:i + n]
    raise AssertionError(f"no clean substring of length {n} in {text!r}")


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("where,length", [(3, 1), (10, 3), (25, 6)])
def test_stop_string(pairs, model_type, k, where, length):
    pair = pairs[model_type]
    prompt = "def quicksort(xs):"
    full = _run(pair, prompt, max_new_tokens=64, draft_len=k)
    stop = _substring(full.text, where, length)
    chunks = []
    res = _run(pair, prompt, max_new_tokens=64, draft_len=k, stop=[stop], on_text=chunks.append)
    assert res.finish_reason == "stop"
    assert res.text == full.text[: full.text.find(stop)]
    assert full.text.startswith(res.text) and stop not in res.text
    assert "".join(chunks) == res.text  # the stop string (or its start) never reaches the stream
    assert res.tokens == full.tokens[: len(res.tokens)]
    assert stop in pair.codec.decode(res.tokens)  # tokens end with the one that completed the stop string


def test_stop_string_stats_count_returned_tokens(qwen_pair):
    full = _run(qwen_pair, "def quicksort(xs):", max_new_tokens=64, draft_len=8)
    for i in range(5, 40, 3):
        stop = _substring(full.text, i, 2)
        res = _run(qwen_pair, "def quicksort(xs):", max_new_tokens=64, draft_len=8, stop=[stop])
        assert res.stats["new_tokens"] == len(res.tokens), (stop, res.stats["new_tokens"], len(res.tokens))


def test_earliest_of_several_stop_strings_wins(qwen_pair):
    full = _run(qwen_pair, "def quicksort(xs):", max_new_tokens=64, draft_len=4)
    late, early = _substring(full.text, 30, 2), _substring(full.text, 8, 2)
    res = _run(qwen_pair, "def quicksort(xs):", max_new_tokens=64, draft_len=4, stop=[late, early, "\x00never"])
    assert res.finish_reason == "stop"
    assert res.text == full.text[: min(full.text.find(late), full.text.find(early))]


def test_stop_string_never_seen(qwen_pair):
    full = _run(qwen_pair, "def quicksort(xs):", draft_len=4)
    chunks = []
    res = _run(qwen_pair, "def quicksort(xs):", draft_len=4, stop=["\x00not there"], on_text=chunks.append)
    assert res.finish_reason == "length" and res.tokens == full.tokens and res.text == full.text
    assert "".join(chunks) == full.text


@pytest.mark.parametrize("k", [0, 2, 8])
def test_streamed_text_equals_result_text(qwen_pair, k):
    for prompt in TEXT_PROMPTS:
        chunks = []
        res = _run(qwen_pair, prompt, draft_len=k, temperature=1.0, seed=1, on_text=chunks.append)
        assert "".join(chunks) == res.text
        assert all(chunks)
        _assert_text_of(qwen_pair, res)


def _assert_text_of(pair, res):
    """res.text is the decoded tokens; only an incomplete UTF-8 sequence at the very end may be held back."""
    full = pair.codec.decode(res.tokens)
    assert full.startswith(res.text) and set(full[len(res.text):]) <= {"\ufffd"}, (full, res.text)


@pytest.mark.parametrize("k", [0, 8])
def test_generation_up_to_cache_limit(qwen_pair, k):
    from specrt.errors import ConfigError

    m = qwen_pair.manifest
    prompt = list(range(3, 103))
    limit = m.max_len - len(prompt) - k - 1
    res = _run(qwen_pair, prompt, max_new_tokens=limit, draft_len=k)
    assert len(res.tokens) == limit
    with pytest.raises(ConfigError, match="max_len"):
        _run(qwen_pair, prompt, max_new_tokens=limit + 1, draft_len=k)


def test_chat_prompt(qwen_pair, hf_tiny):
    ids = qwen_pair.encode("hello there", chat=True)
    assert ids[0] == 1  # <|im_start|>, an added token, is one id
    rendered = qwen_pair.codec.apply_chat_template([{"role": "user", "content": "hello there"}])
    assert rendered == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_tiny["qwen2"][0])
    want = tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert rendered == want
    assert ids == tok.encode(want, add_special_tokens=False)
    res = qwen_pair.generate("hello there", chat=True, max_new_tokens=8)
    assert res.tokens == qwen_pair.generate(ids, max_new_tokens=8).tokens


# ---------------------------------------------------------------- losslessness end to end (tiny vocabulary)


def _target_dist(eng, vocab, seq, cfg):
    eng.truncate(0)
    logits = eng.forward(np.array([seq], np.int64), np.array([len(seq) - 1]))[0, :, :vocab]
    return warp(logits, cfg)[0]


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 2), (0.8, 5, 0.9, 3)])
def test_speculative_sampling_is_distributed_as_target(stat_pair, temperature, top_k, top_p, k):
    """First three tokens of speculative sampling vs the exact warped target distribution.

    The first token comes from the target prefill alone; tokens 2 and 3 pass through the draft/verify
    rounds (max_new_tokens=4 lets round one draft k tokens). Checks the joint of tokens (1, 2) and the
    marginal of token 3, with EOS as its own outcome.
    """
    check_distributed_as_target(stat_pair, temperature, top_k, top_p, k)


def check_distributed_as_target(pair, temperature, top_k, top_p, k):
    m = pair.manifest
    V, E = m.vocab_size, EOS_ID
    cfg = SamplingConfig(temperature, top_k, top_p)
    prompt = pair.encode("alpha beta")
    eng = ort_engine(pair.dir, m.target, m.max_len, 1, threads=1)
    p1 = _target_dist(eng, V, prompt, cfg)
    assert entropy(p1) > 0.7  # not a degenerate first step
    p2 = {a: _target_dist(eng, V, prompt + [a], cfg) for a in range(V) if a != E and p1[a] > 0}
    joint = np.zeros(V * V)  # cell a*V+b; (E, 0) = EOS first
    joint[E * V] = p1[E]
    third = np.zeros(V + 1)  # z, or V = ended (EOS) before a third token
    for a, pa in p2.items():
        joint[a * V:(a + 1) * V] = p1[a] * pa
        for b in range(V):
            if b != E and pa[b] > 0:
                third[:V] += p1[a] * pa[b] * _target_dist(eng, V, prompt + [a, b], cfg)
    third[E] = 0.0  # an EOS third token ends the generation: counted as "ended"
    third[V] = 1.0 - third.sum()
    eng.close()

    n = 3000
    obs_joint, obs_third = np.zeros_like(joint), np.zeros_like(third)
    acc = prop = 0
    gcfg = dict(max_new_tokens=4, draft_len=k, sampling=cfg)
    for seed in range(n):
        res = pair.run(prompt, GenerationConfig(seed=seed, **gcfg))
        t = res.tokens
        assert E not in t
        if not t:
            obs_joint[E * V] += 1
        else:
            obs_joint[t[0] * V + (t[1] if len(t) > 1 else E)] += 1
        obs_third[t[2] if len(t) > 2 else V] += 1
        acc += res.stats["accepted"]
        prop += res.stats["proposed"]
    assert 0.05 < acc / prop < 0.95  # the draft really is a different model
    pj, pt3 = chi2_pvalue(obs_joint, joint), chi2_pvalue(obs_third, third)
    assert pj > P_MIN, f"joint of tokens 1-2: p={pj:.2e}"
    assert pt3 > P_MIN, f"token 3: p={pt3:.2e}\nobs {obs_third}\nexp {np.round(third * n, 1)}"


# ---------------------------------------------------------------- the loop alone, on numpy fake engines


def _spec(draft, k, V):
    """A fixed draft length over a draft model on `draft` (None: target only)."""
    return Fixed(k, [] if draft is None else [ModelProposer(draft, V)])


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 2), (0.8, 3, 0.9, 3)])
def test_decode_loop_is_lossless_on_fake_engines(temperature, top_k, top_p, k):
    V, prompt = 5, [1, 2]
    cfg = SamplingConfig(temperature, top_k, top_p)
    target = FakeEngine(0, V)
    draft = FakeEngine(1, V, like=target)
    exact = fake_exact_joint(target, prompt, cfg, 3)
    obs = np.zeros_like(exact)
    acc = prop = 0
    for seed in range(5000):
        g = GenerationConfig(max_new_tokens=4, draft_len=k, seed=seed, sampling=cfg)
        out, reason, st = decode(target, _spec(draft, k, V), prompt, g, V, frozenset())
        assert len(out) == 4 and reason == "length"
        obs[sequence_index(out[:3], V)] += 1
        acc, prop = acc + st.accepted, prop + st.proposed
    assert 0.2 < acc / prop < 0.9
    p = chi2_pvalue(obs, exact)
    assert p > P_MIN, f"p={p:.2e}"


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_decode_loop_cache_invariants(greedy, k):
    """After every commit: the target cache holds exactly seq[:-1]; the draft cache a prefix of seq."""
    V, prompt = 7, [3, 1, 4]
    target, draft = FakeEngine(2, V, max_len=80), FakeEngine(3, V, max_len=80)
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.0)
    for seed in range(5):
        for m in (1, 2, 5, 17, 40):
            seq = list(prompt)

            def check(new):
                seq.extend(new)
                assert list(target.cache[: target.length]) == seq[:-1]
                assert list(draft.cache[: draft.length]) == seq[: draft.length]
                return False

            g = GenerationConfig(max_new_tokens=m, draft_len=k, seed=seed, sampling=sampling)
            out, reason, st = decode(target, _spec(draft, k, V), prompt, g, V, frozenset(), check)
            assert len(out) == m and seq == prompt + out
            assert target.length <= target.max_len and draft.length <= draft.max_len


def test_decode_loop_greedy_equivalence_and_full_acceptance_on_fake_engines():
    V = 6
    for seed in range(10):
        prompt = list(np.random.default_rng(seed).integers(0, V, size=3))
        target, other = FakeEngine(seed, V, max_len=80), FakeEngine(seed + 100, V, max_len=80)
        twin = FakeEngine(seed, V, max_len=80)
        base, _, _ = decode(target, _spec(None, 0, V), prompt, GenerationConfig(max_new_tokens=30, draft_len=0), V,
                            frozenset())
        for k in (1, 2, 3, 6):
            cfg = GenerationConfig(max_new_tokens=30, draft_len=k)
            assert decode(target, _spec(other, k, V), prompt, cfg, V, frozenset())[0] == base
            out, _, st = decode(target, _spec(twin, k, V), prompt, cfg, V, frozenset())
            assert out == base and st.accepted == st.proposed > 0


def test_decode_loop_eos_inside_accepted_drafts():
    """EOS proposed by the draft and accepted mid-round: output stops right before it."""
    V = 6
    target = FakeEngine(4, V, max_len=80)
    base, _, _ = decode(target, _spec(None, 0, V), [1, 2], GenerationConfig(max_new_tokens=30, draft_len=0), V,
                        frozenset())
    eos = base[6]
    want = base[: base.index(eos)]
    for k in (1, 2, 4, 7):
        twin = FakeEngine(4, V, max_len=80)  # accepts everything, so EOS arrives inside a block of drafts
        out, reason, st = decode(target, _spec(twin, k, V), [1, 2], GenerationConfig(max_new_tokens=30, draft_len=k), V,
                                 frozenset({eos}))
        assert out == want and reason == "eos" and st.new_tokens == len(want)
