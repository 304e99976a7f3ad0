"""`min_tokens`: no end of text before N new tokens, honoured losslessly by masking the end tokens in the
target's logits and the draft's alike (decoding/constraint.MinTokens)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from _helpers import P_MIN, FakeEngine, chi2_pvalue, copy_pair, sequence_index
from specrt.api.pair import generate_batch
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.decode import decode
from specrt.decoding.policy import Fixed
from specrt.decoding.proposers import LookupProposer, ModelProposer
from specrt.decoding.sampling import warp
from specrt.errors import ConfigError

END = 0  # the fake engines' end token


def _exact(target, prompt, cfg, n, min_tokens):
    """Exact probability of each first-n-token output when the end token is masked before `min_tokens`."""
    V = target.T.shape[0]
    probs, seqs = np.ones(1), [list(prompt)]
    for i in range(n):
        nxt_p, nxt_s = [], []
        for p, s in zip(probs, seqs):
            lg = target.logits_for(np.array(s)).astype(np.float32).copy()
            if i < min_tokens:
                lg[END] = -np.inf
            if s[-1] == END and len(s) > len(prompt):  # an ended output: nothing follows, count it once
                d = np.zeros(V)
                d[END] = 1.0
            else:
                d = warp(lg[None], cfg)[0]
            nxt_p.append(p * d)
            nxt_s += [s + [v] for v in range(V)]
        probs, seqs = np.concatenate(nxt_p), nxt_s
    return probs


@pytest.mark.parametrize("method", ["rejection", "coupled"])
def test_min_tokens_sampled_speculation_is_distributed_as_the_masked_target(method):
    V, prompt, n = 5, [1, 2], 3
    cfg = SamplingConfig(1.0, method=method)
    target = FakeEngine(0, V)
    draft = FakeEngine(1, V, like=target)
    exact = _exact(target, prompt, cfg, n, min_tokens=2)
    obs = np.zeros_like(exact)
    for seed in range(4000):
        g = GenerationConfig(max_new_tokens=n, draft_len=2, seed=seed, sampling=cfg, min_tokens=2)
        out, reason, _ = decode(target, Fixed(2, [ModelProposer(draft, V)]), prompt, g, V, frozenset({END}))
        assert END not in out[:2] and len(out) >= 2
        padded = out + [END] * (n - len(out))  # ended early (after min_tokens): the rest counts as the end
        obs[sequence_index(padded, V)] += 1
    p = chi2_pvalue(obs[exact > 0], exact[exact > 0])
    assert p > P_MIN, f"p={p:.2e}"
    assert (obs[exact == 0] == 0).all()


def test_min_tokens_cuts_a_lookup_proposal_at_an_early_end_token():
    V = 5
    prompt = [3, 0, 3, 0, 3, 0, 3]  # lookup proposes 0 (the end) first
    target = FakeEngine(4, V, max_len=80)
    g = GenerationConfig(max_new_tokens=10, draft_len=3, min_tokens=6)
    alone, _, _ = decode(target, Fixed(0, []), prompt, GenerationConfig(max_new_tokens=10, draft_len=0, min_tokens=6),
                         V, frozenset({END}))
    out, _, st = decode(target, Fixed(3, [LookupProposer(4)]), prompt, g, V, frozenset({END}))
    assert out == alone and END not in out[:6]


@pytest.fixture(scope="module")
def eos_pair(qwen_dir, tmp_path_factory):
    """A copy of the Qwen2 pair whose EOS is the 5th greedy token of a prompt."""
    import specrt

    prompt = [40, 41, 42, 43]
    with specrt.load(qwen_dir) as pair:
        greedy = pair.generate(prompt, max_new_tokens=24, draft_len=0).tokens
    d = copy_pair(qwen_dir, tmp_path_factory.mktemp("eos") / "pair")
    m = json.loads((d / "manifest.json").read_text())
    m["eos_token_ids"] = [greedy[4]]
    (d / "manifest.json").write_text(json.dumps(m))
    pair = specrt.load(d, threads=1)
    yield pair, prompt, greedy[4]
    pair.close()


def test_min_tokens_greedy_alone_and_batched_equals_the_target_alone(eos_pair):
    pair, prompt, eos = eos_pair
    assert pair.generate(prompt, max_new_tokens=24, draft_len=0).finish_reason == "eos"  # it would end at 4
    want = pair.generate(prompt, max_new_tokens=24, draft_len=0, min_tokens=12)
    assert len(want.tokens) >= 12 and eos not in want.tokens[:12]
    for k in (1, 2, 4, "auto"):
        for drafter in ("model", "ngram", "hybrid"):
            res = pair.generate(prompt, max_new_tokens=24, draft_len=k, drafter=drafter, min_tokens=12)
            assert res.tokens == want.tokens, (k, drafter)
    rows = generate_batch(pair, [prompt, prompt[:3], prompt], batch_size=2, max_new_tokens=24, draft_len=3,
                          min_tokens=12)
    assert rows[0].tokens == rows[2].tokens == want.tokens
    assert pair.generate(prompt, max_new_tokens=24, min_tokens=12, stop=pair.codec.decode(want.tokens[2:4])).finish_reason == "stop"


@pytest.mark.parametrize("value,needle", [(-1, "min_tokens must be an integer in 0..max_new_tokens"),
                                          (9, "min_tokens must be an integer in 0..max_new_tokens \\(8\\)"),
                                          (1.5, "min_tokens must be an integer")])
def test_bad_min_tokens_is_refused(qwen_pair, value, needle):
    with pytest.raises(ConfigError, match=needle):
        qwen_pair.generate([40, 41], max_new_tokens=8, min_tokens=value)
