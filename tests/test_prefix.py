"""The target's prompt prefix kept across requests (decoding/prefix.py): reused in whole chunks, or all of it
on an engine whose rows are exact (specrt's kernels), so a request's cache, logits and output are bit for
bit those of a fresh read, whatever ran before."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.decode import Request
from specrt.decoding.prefix import PromptCache
from _helpers import KERNELS_RUN, needs_kernels


def _prompts(pair, shared: int, tails=(7, 11, 4), seed=0) -> list[list[int]]:
    """Prompts of `shared` common ids and a tail of their own."""
    rng = np.random.default_rng(seed)
    V = pair.manifest.vocab_size
    head = rng.integers(3, V, shared).tolist()
    return [head + rng.integers(3, V, n).tolist() for n in tails]


def _cache(engine, n: int) -> np.ndarray:
    """The first n slots of every layer's keys and values (a batch-1 lean engine)."""
    return np.stack([np.asarray(b)[:, :, :n] for b in (*engine.keys, *engine.values)]).copy()


def _passes(engine, monkeypatch) -> list[tuple[int, int]]:
    """(start position, width) of every pass the engine runs from now on."""
    log, run = [], engine._run

    def logged(tokens, counts, logit_index, *parents):
        log.append((int(engine.lengths[0]), int(counts[0])))
        return run(tokens, counts, logit_index, *parents)

    monkeypatch.setattr(engine, "_run", logged)
    return log


@pytest.mark.parametrize("which", ["qwen_pair", "int4_default_pair"])
def test_a_kept_prefix_reads_like_a_fresh_read(request, which, monkeypatch):
    pair = request.getfixturevalue(which)
    e, C = pair.target, pair.target.prefill_chunk
    # the fp32 pair's float MatMuls are onnxruntime's: whole chunks; the int4 pair runs specrt's kernels
    assert e.row_exact == (which == "int4_default_pair" and KERNELS_RUN), e.kernel
    a, b, _ = _prompts(pair, shared=2 * C + 5)
    cache = PromptCache()
    with pair.exclusive():
        log = _passes(e, monkeypatch)
        fresh_logits, kept = cache.read(e, b)
        fresh, fresh_log = (fresh_logits.copy(), _cache(e, len(b))), list(log)
        assert kept == 0 and cache.tokens == (b if e.row_exact else b[:len(b) // C * C])
        cache.read(e, a)
        e.forward(np.array([[5, 6, 7]]), np.array([2]))  # decoding past the prompt leaves the kept prefix alone
        del log[:]
        logits, kept = cache.read(e, b)
        if e.row_exact:  # all it shares is kept; one pass reads the rest, from where the prompts part
            assert kept == 2 * C + 5 and log == [(kept, len(b) - kept)]
        else:  # the whole chunks shared; the partial third is read again, in the fresh read's passes
            assert kept == 2 * C and log == fresh_log[-len(log):] and all(start % C == 0 for start, _ in log)
        np.testing.assert_array_equal(logits, fresh[0])
        np.testing.assert_array_equal(_cache(e, len(b)), fresh[1])


def _whole_and_split(pair, split: int):
    """Logits of a prompt's last position and its cache, read in one pass and in two (`split` tokens first)."""
    e = pair.target
    _, b, _ = _prompts(pair, shared=40)
    out = []
    with pair.exclusive():
        for first in (len(b), split):
            e.truncate(0)
            if first < len(b):
                e.forward(np.array([b[:first]]), np.array([first - 1]))
            logits = e.forward(np.array([b[first:] if first < len(b) else b]),
                               np.array([len(b) - (first if first < len(b) else 0) - 1]))[0, 0].copy()
            out.append((logits, _cache(e, len(b))))
    return out


@needs_kernels
@pytest.mark.parametrize("split", [1, 2, 33, 45])
def test_specrts_kernels_read_a_prompt_the_same_in_any_passes(int4_default_pair, split):
    """With specrt's kernels (engines/int4.py: every matmul and attention node) a row's numbers do not depend
    on the pass around it: a prompt read in two passes cut anywhere gives the one-pass read's logits and
    cache, bit for bit. (onnxruntime's own MatMulNBits and GroupQueryAttention round a row by the pass's
    width, and int8 activations carry a last-bit difference up to ~0.3 in a logit of the 1.5B target: what
    decoding/prefix.py's whole chunks guard against.)"""
    assert int4_default_pair.target.kernel.invariant, int4_default_pair.target.kernel
    (whole, whole_cache), (split_logits, split_cache) = _whole_and_split(int4_default_pair, split)
    np.testing.assert_array_equal(whole, split_logits)
    np.testing.assert_array_equal(whole_cache, split_cache)


def test_reusable_bounds():
    cache = PromptCache()
    cache.tokens = list(range(100))
    assert cache.reusable(list(range(100)), 32) == 96  # the same prompt: its last token is read again
    assert cache.reusable(list(range(64)), 32) == 32
    assert cache.reusable(list(range(65)), 32) == 64
    assert cache.reusable(list(range(40)) + [7] * 60, 32) == 32  # diverges at 40
    assert cache.reusable([1] + list(range(1, 100)), 32) == 0  # differs at once
    assert cache.reusable(list(range(100)), None) == 0  # an engine that reads a wide call in one pass
    assert cache.reusable(list(range(20)), 32) == 0
    cache.keep(50)
    assert cache.reusable(list(range(100)), 32) == 32
    assert cache.reusable(list(range(100)), 1) == 50  # an exact engine: all it shares
    assert cache.reusable(list(range(40)) + [7] * 60, 1) == 40
    assert cache.reusable(list(range(100)), 1, intact=17) == 17  # not past a slot someone else wrote
    assert cache.reusable(list(range(30)), 1) == 29  # its last token is read again
    cache.forget()
    assert cache.reusable(list(range(100)), 32) == 0


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_k=20)])
@pytest.mark.parametrize("draft_len", [0, 3, "auto"])
def test_output_does_not_depend_on_what_ran_before(int4_default_pair, sampling, draft_len):
    pair = int4_default_pair
    C = pair.target.prefill_chunk
    unit = 1 if pair.target.row_exact else C  # what is kept comes in units of this many tokens
    a, b, c = _prompts(pair, shared=C + 9, seed=1)
    cfg = GenerationConfig(max_new_tokens=24, draft_len=draft_len, sampling=sampling, seed=3, drafter="model")
    pair.forget_caches()
    alone = pair.run(b, cfg)
    assert alone.stats["prompt_cached"] == 0
    pair.run(a, cfg)
    after = pair.run(b, cfg)
    assert after.stats["prompt_cached"] == (C + 9) // unit * unit
    # auto's lengths follow measured timings: sampled, other lengths draw other numbers; and without exact
    # rows another verify width can round a near-tie the other way
    if draft_len != "auto" or (pair.target.row_exact and sampling.temperature == 0):
        assert after.tokens == alone.tokens
    other = pair.run(_prompts(pair, shared=C + 9, seed=2)[0], cfg)  # no prefix in common
    assert other.stats["prompt_cached"] == 0
    pair.run(c, cfg)
    assert pair.run(c, cfg).stats["prompt_cached"] == (len(c) - 1) // unit * unit  # the same prompt again


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.parametrize("which", ["qwen_pair", "int4_default_pair"])
def test_slots_written_by_other_code_are_read_again(request, which, held):
    """Code that drives the target itself (a check, tuning's timing passes, a test) writes over the slots:
    the next request reads them again, whether that code held the pair (`exclusive`) or not."""
    pair = request.getfixturevalue(which)
    C = pair.target.prefill_chunk
    a, _, _ = _prompts(pair, shared=C + 3)
    cfg = GenerationConfig(max_new_tokens=6, draft_len=0)
    pair.forget_caches()
    want = pair.run(a, cfg).tokens
    with pair.exclusive() if held else contextlib.nullcontext():
        pair.target.truncate(3)
        pair.target.forward(np.array([[9, 8, 7]]), np.array([0]))  # over slots 3..5 of the kept chunk
    res = pair.run(a, cfg)
    # holding the pair forgets what was kept; else what lies below the first slot written stays (exact rows)
    assert res.stats["prompt_cached"] == (3 if pair.target.row_exact and not held else 0) and res.tokens == want
    assert pair.run(a, cfg).stats["prompt_cached"] == (len(a) - 1 if pair.target.row_exact else C)


# int4 at accuracy level 4 rounds batched passes apart from batch-1 ones (docs/batch.md): B > 1 on fp32
@pytest.mark.parametrize("which,B", [("int4_default_pair", 1), ("qwen_pair", 2)])
def test_batch_rows_keep_their_previous_prompt_exactly(request, which, B):
    pair = request.getfixturevalue(which)
    C = pair.target.prefill_chunk
    prompts = _prompts(pair, shared=C + 6, tails=(5, 9, 3, 12, 8), seed=4)
    cfg = GenerationConfig(max_new_tokens=10, draft_len=2, drafter="model")
    alone = {}
    for i, p in enumerate(prompts):
        pair.forget_caches()
        alone[i] = pair.run(p, cfg)
    with pair.runner(B) as dec:
        out = dict(dec.run([Request(i, p, cfg) for i, p in enumerate(prompts)]))
    for i in range(len(prompts)):
        assert out[i].tokens == alone[i].tokens
    cached = [out[i].stats["prompt_cached"] for i in range(len(prompts))]
    kept = C + 6 if pair.target.row_exact else C  # all the prompts share, or its whole chunk
    assert cached[:B] == [0] * B and all(n == kept for n in cached[B:])  # each row kept its last prompt's


@pytest.mark.parametrize("draft_len", [0, 3])
@pytest.mark.parametrize("which", ["qwen_pair", "int4_default_pair"])
def test_a_conversations_next_turn_keeps_the_answer_on_exact_rows(request, which, draft_len):
    """A chat's next prompt repeats the previous prompt and answer: with exact rows the slots decoding wrote
    (verified drafts included) are a fresh read's, so they are kept too, and the next answer is the one a
    fresh read gives; elsewhere only the previous prompt's whole chunks are."""
    pair = request.getfixturevalue(which)
    C, exact = pair.target.prefill_chunk, pair.target.row_exact
    first, _, _ = _prompts(pair, shared=C + 9, seed=5)
    cfg = GenerationConfig(max_new_tokens=12, draft_len=draft_len, drafter="model")
    pair.forget_caches()
    answer = pair.run(first, cfg).tokens
    turn = first + answer + [7, 8, 9]
    pair.forget_caches()
    fresh = pair.run(turn, cfg)
    pair.forget_caches()
    pair.run(first, cfg)
    again = pair.run(turn, cfg)
    if exact:  # the answer's last token may have been emitted without being fed: then its slot is empty
        assert len(first) + len(answer) - 1 <= again.stats["prompt_cached"] <= len(first) + len(answer)
    else:
        assert again.stats["prompt_cached"] == len(first) // C * C
    assert again.tokens == fresh.tokens
