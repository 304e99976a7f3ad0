"""bench/policy/oracle.py: the bound on what a draft-length policy could make of the drafters (docs/drafting.md)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("oracle", ROOT / "bench" / "policy" / "oracle.py")
oracle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oracle)

TARGET = {w: 1.0 + 0.1 * w for w in range(1, 10)}  # seconds of a target pass of w tokens
OUT = list(range(100, 110))  # out[0] comes with the prefill: 9 tokens to emit


def test_the_cheapest_rounds_by_hand():
    right, wrong = list(OUT), [0] * len(OUT)
    no_lookups = [[] for _ in OUT]
    # a draft model right everywhere: one round of 8 drafts emits all 9 (8 x 0.1 + a pass of 9 tokens)
    assert oracle.cheapest(OUT, right, no_lookups, TARGET, 0.1, 8) == pytest.approx(0.8 + 1.9)
    assert oracle.fixed(OUT, right, TARGET, (0.1, 0.15), 8) == pytest.approx(0.8 + 1.9)
    # always wrong: plain decoding is the cheapest, and a fixed k pays its drafts for nothing
    assert oracle.cheapest(OUT, wrong, no_lookups, TARGET, 0.1, 8) == pytest.approx(9 * 1.1)
    assert oracle.fixed(OUT, wrong, TARGET, (0.1, 0.15), 2) == pytest.approx(9 * (0.2 + 1.3))
    # right for 3 then wrong: k = 3 emits 4, then each of the 5 left takes a round that accepts nothing; the
    # first after the round that accepted all reads two tokens (0.15)
    three = OUT[:4] + [0] * 6
    assert oracle.fixed(OUT, three, TARGET, (0.1, 0.15), 3) == pytest.approx(
        (0.3 + 1.4) + (0.15 + 0.2 + 1.4) + 4 * (0.3 + 1.4))
    # where the rounds may choose: one round of 3 drafts, then 5 plain passes
    assert oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8) == pytest.approx((0.3 + 1.4) + 5 * 1.1)
    # a lookup proposal right for 8 tokens at position 1: one pass of 9 tokens, no draft passes
    lookups = [[] for _ in OUT]
    lookups[1] = [OUT[1:9]]
    assert oracle.cheapest(OUT, wrong, lookups, TARGET, 0.1, 8) == pytest.approx(1.9)
    assert oracle.cheapest(OUT, None, lookups, TARGET, 0.1, 8) == pytest.approx(1.9)


def test_the_tree_bound_by_hand():
    no_lookups = [[] for _ in OUT]
    # the chain right for 3, then its runner-up right where it fails: a round of 4 drafts (the fourth's pass
    # gives the runner-up) verifying 5 nodes emits 5 (3 + the runner-up + the bonus), then 4 plain passes
    three, second = OUT[:4] + [0] * 6, [[1]] * 4 + [[OUT[4]]] + [[1]] * 5
    chain = oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8)
    tree = oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8, second)
    assert tree == pytest.approx(min(chain, (0.4 + 1.6) + 4 * 1.1)) and tree < chain
    # the same where the right token is the draft's third choice, with two alternatives a position
    third = [[1, 2]] * 4 + [[1, OUT[4]]] + [[1, 2]] * 5
    assert oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8, third) == pytest.approx(tree)
    assert oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8, [[1]] * 10) == pytest.approx(chain)
    # a lookup right for 6 from where the chain fails at 1: one tree of the chain's 1 and its 5 others
    lookups = [[] for _ in OUT]
    lookups[1] = [OUT[1:7]]
    one = OUT[:2] + [0] * 8
    assert oracle.cheapest(OUT, one, lookups, TARGET, 0.1, 8, [[0]] * 10) <= 0.1 + TARGET[7] + 2 * 1.1 + 1e-9
    # never worse than chains: the trees only add options
    assert oracle.cheapest(OUT, three, lookups, TARGET, 0.1, 8, second) <= oracle.cheapest(OUT, three, lookups, TARGET, 0.1, 8)


def test_the_deep_tree_bound_by_hand():
    """A runner-up the draft model continues: its teacher-forced tokens past the branch are the output's."""
    no_lookups = [[] for _ in OUT]
    # five to emit, the draft wrong at 2 only (its runner-up right there): a chain of 2 (1 right), the runner-up
    # and 2 more on it (draft steps 3-4 the branch's alone; 5 nodes) emit 1 + 1 + 2 + the bonus, everything, in
    # one round; as leaves the best is two rounds
    out = list(range(100, 106))
    gap, runner_up = out[:2] + [0] + out[3:], [[1]] * 2 + [[out[2]]] + [[1]] * 3
    none = [[] for _ in out]
    deep = oracle.cheapest(out, gap, none, TARGET, 0.1, 8, runner_up, 0.15)
    assert deep == pytest.approx(4 * 0.1 + TARGET[6])
    assert oracle.cheapest(out, gap, none, TARGET, 0.1, 8, runner_up) == pytest.approx((0.1 + TARGET[2]) + (0.2 + TARGET[3]))
    # a continuation that is wrong from its first token adds nothing over the leaf
    three, second = OUT[:4] + [0] * 6, [[1]] * 4 + [[OUT[4]]] + [[1]] * 5
    assert oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8, second, 0.15) == pytest.approx(
        oracle.cheapest(OUT, three, no_lookups, TARGET, 0.1, 8, second))


def test_the_bound_runs_on_a_pair(tmp_path, int4_default_dir):
    """On a tiny pair: it runs end to end, and the bound is above plain decoding and every fixed draft
    length it prints (the dynamic program has each of their schedules among its choices)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "class": c, "prompt": t}) for i, (c, t) in enumerate(
        [("code", "def add(a, b):"), ("chat", "Say hello twice."), ("code", "def add(a, b):")])) + "\n")
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "policy" / "oracle.py"), str(int4_default_dir), "--prompts",
                        str(prompts), "--max-new-tokens", "24", "--past", "16", "--repeats", "2", "--trees", "--deep", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["summary"]) == {"code", "chat", "all"} and len(d["prompts"]) == 3
    for s in d["summary"].values():
        assert s["ratio"] >= 1.0 - 1e-9 and s["deep_tree_ratio"] >= s["tree_ratio"] - 1e-9 >= s["ratio"] - 2e-9
        assert all(s["ratio"] >= r - 1e-9 for r in s["model_fixed_k"].values())
