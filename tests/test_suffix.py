"""The suffix proposer: drafting from the request and from earlier requests' outputs (History)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner

import specrt
from specrt.api.pair import generate_batch
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.decode import decode
from specrt.decoding.policy import Fixed
from specrt.decoding.proposers import History, LookupProposer, SuffixProposer
from specrt.errors import ConfigError

from _helpers import P_MIN, FakeEngine, chi2_pvalue, fake_exact_joint, sequence_index


def brute(docs: list[list[int]], seq: list[int], k: int, max_ngram: int, min_share: float = 0.0) -> tuple[list[int], int]:
    """The definition, by hand: the longest n <= max_ngram such that seq's last n tokens occur in one of
    `docs` followed by a token; then token by token the most frequent next token among the occurrences
    that agree so far (ties: the one whose last occurrence comes latest), while it follows at least
    `min_share` of them."""
    best, occ = 0, []
    for n in range(1, min(max_ngram, len(seq)) + 1):
        here = [(d, e) for d, doc in enumerate(docs) for e in range(n - 1, len(doc) - 1)
                if doc[e - n + 1:e + 1] == seq[-n:]]
        if not here:
            break
        best, occ = n, here
    out = []
    for j in range(1, k + 1):
        nxt = [(docs[d][e + j], (d, e)) for d, e in occ if e + j < len(docs[d])]
        if not nxt:
            break
        counts = Counter(t for t, _ in nxt)
        top = max(counts.values())
        if top < min_share * len(nxt):
            break
        latest = {t: max(pos for tt, pos in nxt if tt == t) for t in counts if counts[t] == top}
        t = max(latest, key=latest.get)
        out.append(t)
        occ = [pos for tt, pos in nxt if tt == t]
    return out, best


@pytest.mark.parametrize("seed", range(40))
def test_the_index_finds_what_a_brute_force_search_finds(seed):
    r = np.random.default_rng(seed)
    V = int(r.integers(2, 6))
    docs = [r.integers(0, V, int(r.integers(1, 40))).tolist() for _ in range(int(r.integers(1, 8)))]
    h = History(10_000)
    for d in docs:
        h.add(d)
    seq = r.integers(0, V, int(r.integers(1, 12))).tolist()
    k, max_ngram = int(r.integers(1, 8)), int(r.integers(1, 10))
    share = [0.0, 0.4, 0.6][seed % 3]
    p = SuffixProposer(h, max_ngram=max_ngram, min_share=share)
    want, n = brute(docs, seq, k, max_ngram, share)
    own, n_own = LookupProposer(max_ngram).match(seq, k)
    got = p.find(seq, k)
    if n > n_own and want:  # the history's longer match proposes (where earlier outputs agree enough)
        assert (got.tokens.tolist(), got.matched, got.name) == (want, n, "suffix")
        assert got.kind == ("suffix8" if n >= 8 else f"suffix{min(n, 3)}")
    else:  # else what prompt lookup proposes
        assert (got.tokens.tolist(), got.matched, got.name) == (own.tolist(), n_own, "ngram")
    assert (p.name, p.kind) == ("ngram", "ngram")  # a query: the proposer's last proposal is still none
    p.propose(seq, k, SamplingConfig(), np.random.default_rng(0))
    assert (p.name, p.kind) == (got.name, got.kind)


def test_the_history_drafts_only_where_earlier_outputs_agree_enough():
    h = History()
    for d in ([1, 2, 3, 9, 4], [1, 2, 3, 8, 4], [1, 2, 3, 9, 5]):
        h.add(d)
    seq = [7, 1, 2, 3]
    assert SuffixProposer(h, min_share=0.0).find(seq, 3).tokens.tolist() == [9, 5]  # 9 after 2 of 3; a tie, the latest
    found = SuffixProposer(h, min_share=0.6).find(seq, 3)
    assert found.tokens.tolist() == [9] and found.name == "suffix"  # 1 of 2 agree on what follows 9
    p = SuffixProposer(h, min_share=0.7)
    found = p.find(seq, 3)
    assert found.tokens.tolist() == [] and found.name == "ngram"  # the request's own lookup (nothing here)
    assert p.find([1, 2, 3, 6, 1, 2, 3], 2).tokens.tolist() == [6, 1]  # ... which proposes when it has a match


def test_the_history_keeps_at_most_its_cap_dropping_the_oldest_requests():
    r = np.random.default_rng(0)
    h, added = History(500), []
    for _ in range(300):
        out = r.integers(0, 50, int(r.integers(1, 60))).tolist()
        h.add(out)
        added.append(out)
        assert len(h) <= 500
        # what it holds is the newest requests, whole, each followed by a separator
        kept = added[-h.requests:]
        assert h.buf.tolist() == [t for o in kept for t in (*o, -1)]
        assert h.requests == len(added) or len(h) + len(added[-h.requests - 1]) + 1 > 500
    h.add(list(range(2000)))  # longer than the cap: its last tokens
    assert h.requests == 1 and h.buf.tolist() == list(range(2000 - 499, 2000)) + [-1]
    h.clear()
    assert len(h) == 0 and h.requests == 0
    tiny = History(1)  # room for nothing but a separator: keeps nothing
    tiny.add([1, 2, 3])
    assert len(tiny) == 0 and tiny.requests == 0
    two = History(2)
    two.add([1, 2, 3])
    two.add([4])
    assert two.buf.tolist() == [4, -1] and two.requests == 1


@pytest.mark.parametrize("cap", [0, -5, 1.5, True, "10"])
def test_a_bad_cap_is_refused(cap):
    with pytest.raises(ConfigError, match="cap"):
        History(cap)


def test_the_pair_keeps_a_history_and_suffix_drafts_from_it_losslessly(qwen_pair, monkeypatch):
    monkeypatch.setattr(qwen_pair.state, "history", History())
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11], [5, 6, 7, 8, 9, 12]]
    base = [qwen_pair.generate(p, max_new_tokens=40, draft_len=0).tokens for p in prompts]
    assert qwen_pair.state.history.requests == 3  # every request's output is kept, whatever its drafter
    # the same requests again: their continuations are in the history now
    for p, want in zip(prompts, base):
        res = qwen_pair.generate(p, max_new_tokens=40, draft_len=4, drafter="suffix")
        assert res.tokens == want
        st = res.stats
        assert st["rounds_by_drafter"].get("suffix", 0) > 0 and st["accepted_by_drafter"]["suffix"] > 0
    # auto too, and without a history it is prompt lookup
    for p, want in zip(prompts, base):
        assert qwen_pair.generate(p, max_new_tokens=40, draft_len="auto", drafter="suffix").tokens == want
    monkeypatch.setattr(qwen_pair.state, "history", None)
    res = qwen_pair.generate(prompts[0], max_new_tokens=40, draft_len=4, drafter="suffix")
    assert res.tokens == base[0] and "suffix" not in res.stats["rounds_by_drafter"]


def test_a_pair_without_history_keeps_none(qwen_dir):
    with specrt.load(qwen_dir, history=False) as pair:
        pair.generate("x", max_new_tokens=4)
        assert pair.state.history is None
    with pytest.raises(ConfigError, match="cap"):
        specrt.load(qwen_dir, history_cap=0)


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 3), (0.8, 3, 0.9, 2)])
def test_suffix_drafts_are_lossless(temperature, top_k, top_p, k):
    V, prompt = 4, [1, 2, 1, 3, 1, 2]
    h = History()
    r = np.random.default_rng(3)
    for _ in range(20):  # earlier "outputs" that continue the prompt's suffix in many ways
        h.add([1, 3, 1, 2, *r.integers(0, V, 6).tolist()])
    cfg = SamplingConfig(temperature, top_k, top_p)
    target = FakeEngine(0, V, max_len=32)
    exact = fake_exact_joint(target, prompt, cfg, 3)
    obs, suffix_rounds = np.zeros_like(exact), 0
    for seed in range(4000):
        g = GenerationConfig(max_new_tokens=4, draft_len=k, seed=seed, sampling=cfg, drafter="suffix")
        out, _, st = decode(target, Fixed(k, [SuffixProposer(h, 8)]), prompt, g, V, frozenset())
        obs[sequence_index(out[:3], V)] += 1
        suffix_rounds += st.rounds_by_drafter.get("suffix", 0)
    assert suffix_rounds > 4000  # the history drafted
    p = chi2_pvalue(obs, exact)
    assert p > P_MIN, f"p={p:.2e}"


def test_batch_rows_equal_their_lone_runs(qwen_pair, monkeypatch):
    """Greedy, a row's text is its lone text whatever the history holds. (Sampled, a row's draws follow
    its proposals, and so the outputs the rows before it left in the history: "alone" then means a lone
    run on a pair whose history holds the same earlier outputs.)"""
    prompts = [[5, 6, 7, 8, 9, 10 + i % 3] for i in range(6)]
    monkeypatch.setattr(qwen_pair.state, "history", History())
    alone = [qwen_pair.generate(p, max_new_tokens=24, draft_len=0).tokens for p in prompts]
    res = generate_batch(qwen_pair, prompts, batch_size=3, max_new_tokens=24, draft_len=3, drafter="suffix")
    assert [r.tokens for r in res] == alone
    assert sum(r.stats["rounds_by_drafter"].get("suffix", 0) for r in res) > 0
    assert qwen_pair.state.history.requests == 12  # the batch's outputs joined it


def test_suffix_without_a_draft_model_and_bad_caps_on_the_command_line(qwen_dir, hf_tiny, tmp_path):
    from specrt.cli import main

    from _helpers import export

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": "def f(x): return x"}) + "\n" for i in range(4)))
    out = tmp_path / "o.jsonl"
    r = CliRunner().invoke(main, ["batch", str(qwen_dir), "--input", str(inp), "--output", str(out), "--history-cap", "0"])
    assert r.exit_code == 2 and "cap" in r.output and "Traceback" not in r.output and not out.exists()
    # a pair without a draft model: suffix needs none
    solo = tmp_path / "solo"
    export(hf_tiny["qwen2"][0], None, solo, max_len=128)
    r = CliRunner().invoke(main, ["batch", str(solo), "--input", str(inp), "--output", str(out), "--drafter", "suffix",
                                  "--draft-len", "3", "--batch-size", "1", "--max-new-tokens", "16", "--no-progress"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and len({row["text"] for row in rows}) == 1  # the same record four times
    assert sum(row["stats"]["rounds_by_drafter"].get("suffix", 0) for row in rows[1:]) > 0  # drafted from record 1
    r = CliRunner().invoke(main, ["generate", str(solo), "--prompt", "x", "--drafter", "suffix", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output


def test_a_resumed_job_drafts_from_the_outputs_already_written(qwen_dir, tmp_path):
    """A job killed after 5 of 10 records and rerun starts from the history the uninterrupted run held:
    its later records draft, accept and (sampled) draw exactly as they did uninterrupted."""
    from specrt.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": f"def f{i % 2}(x): return x", "temperature": 0.7,
                                       "seed": i}) + "\n" for i in range(10)))
    args = ["--drafter", "suffix", "--draft-len", "3", "--batch-size", "1", "--max-new-tokens", "24", "--no-progress"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert CliRunner().invoke(main, ["batch", str(qwen_dir), "--input", str(inp), "--output", str(ref), *args]).exit_code == 0
    lines = ref.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]))
    (tmp_path / "out.jsonl.job.json").write_bytes((tmp_path / "ref.jsonl.job.json").read_bytes())
    r = CliRunner().invoke(main, ["batch", str(qwen_dir), "--input", str(inp), "--output", str(out), *args])
    assert r.exit_code == 0 and "5 of 10 records already" in r.output, r.output
    want = [json.loads(x) for x in lines[5:]]
    got = [json.loads(x) for x in out.read_text().splitlines()[5:]]
    keys = ("rounds_by_drafter", "accepted_by_drafter", "target_passes")
    assert [(g["id"], g["tokens"], [g["stats"][k] for k in keys]) for g in got] == \
        [(w["id"], w["tokens"], [w["stats"][k] for k in keys]) for w in want]
    assert sum(w["stats"]["accepted_by_drafter"].get("suffix", 0) for w in want) > 0
    # an output whose tokens are not this pair's ids is not drafted from (and still counts as done)
    out.write_text("".join(lines[:4]) + json.dumps({**json.loads(lines[4]), "tokens": [10 ** 9, "x"]}) + "\n")
    r = CliRunner().invoke(main, ["batch", str(qwen_dir), "--input", str(inp), "--output", str(out), *args])
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 10, r.output


def test_bench_gives_each_setting_its_own_history_per_repeat(qwen_pair, monkeypatch):
    from specrt.apps.bench import Prompt, run_bench

    monkeypatch.setattr(qwen_pair.state, "history", History())
    seen, run = [], qwen_pair.run

    def spy(ids, cfg, *a, **kw):
        seen.append((cfg.draft_len, qwen_pair.state.history.requests, id(qwen_pair.state.history)))
        return run(ids, cfg, *a, **kw)

    monkeypatch.setattr(qwen_pair, "run", spy)
    p = Prompt("p", [5, 6, 7, 8, 9, 10], "code")
    run_bench(qwen_pair, [p, p, p], [0, 3], max_new_tokens=8, repeats=2, drafters=["suffix"])
    timed = seen[2:]  # after the two warm-ups
    for r in range(2):
        rep = timed[r * 6:(r + 1) * 6]
        for k in (0, 3):
            mine = [(n, h) for kk, n, h in rep if kk == k]
            assert [n for n, _ in mine] == [0, 1, 2]  # its own earlier prompts of this repeat, nothing else
            assert len({h for _, h in mine}) == 1
    assert len({h for _, _, h in timed}) == 2  # one history per setting
    assert qwen_pair.state.history is not None and id(qwen_pair.state.history) not in {h for _, _, h in timed}
