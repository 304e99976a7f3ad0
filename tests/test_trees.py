"""Trees of drafts (decoding/tree.py, sampling.accept_tree): the walk emits what the target alone emits
(greedy, coupled) or an exact sample (rejection over siblings, chi-square), on trees of several shapes; a
request whose rounds verify trees gives target-only's text; a tree is only what pays, or a probe; bad
settings are refused in one line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specrt.config import GenerationConfig, Grammar, SamplingConfig
from specrt.decoding import sampling
from specrt.decoding.constraint import Constraint
from specrt.decoding.controller import CostModel, PolicyConfig
from specrt.decoding.decode import Request, decode
from specrt.decoding.policy import Auto, Fixed, Forced, PolicyState
from specrt.decoding.proposers import GrammarProposer, LookupProposer, ModelProposer, Proposal
from specrt.decoding.tree import Grower, Tree
from specrt.errors import ConfigError

from _helpers import (KERNELS_RUN, P_MIN, ByteTokens, FakeEngine, FakeMatcher, FakeTreeEngine, FrozenCosts, chi2_pvalue,
                      cli, fake_exact_joint, one_line_error, rule, sequence_index)

# parents of trees of several shapes: a chain, a root with three children, a chain with a sibling at each
# depth, a branch leaving the chain's middle and going deeper than it
SHAPES = [[-1, 0, 1, 2], [-1, -1, -1], [-1, 0, 1, -1, 0, 1], [-1, 0, 1, 1, 3, 4, -1]]


def _tokens(parents, rng, V):
    """Tokens for `parents`, siblings distinct."""
    out = []
    for i, p in enumerate(parents):
        taken = {out[j] for j in range(i) if parents[j] == p}
        out.append(int(rng.choice([t for t in range(V) if t not in taken])))
    return np.array(out, np.int64)


def _chain_to_leaf(parents, node):
    """The nodes from the root down to `node`, then on through each node's first child to a leaf."""
    path = []
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    while (kids := [i for i, p in enumerate(parents) if p == (path[-1] if path else -1)]):
        path.append(kids[0])
    return path


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_tree_walk_emits_what_the_chain_along_its_path_emits(shape, coupled):
    """Whatever the tree, the walk's tokens are what verifying the chain through its last node emits: the
    target's picks (greedy argmax, coupled noise) along that path and the pick after it."""
    rng, V, parents = np.random.default_rng(3), 6, np.array(shape)
    cfg = SamplingConfig(temperature=0.9, method="coupled") if coupled else SamplingConfig()
    left_the_chain = 0
    for seed in range(200):
        tokens = _tokens(shape, rng, V)
        logits = rng.normal(size=(len(shape) + 1, V)) * 2
        # make the target agree with the tree often, so that walks go deep
        for i, p in enumerate(shape):
            logits[p + 1, tokens[i]] += rng.choice([0.0, 6.0])
        noise = sampling.Coupled(seed)
        path, t = sampling.accept_tree(tokens, parents, None, logits, cfg, noise, 40)
        chain = _chain_to_leaf(shape, path[-1] if path else -1)
        rows = logits[[0] + [c + 1 for c in chain]]
        if coupled:
            want = sampling.accept_coupled(tokens[chain], sampling.warp(rows, cfg), noise, 40)
        else:
            want = sampling.accept_greedy(tokens[chain], rows)
        assert (len(path), t) == want and path == chain[:len(path)]
        left_the_chain += any(c != j for j, c in enumerate(path))
    assert left_the_chain > 0 or shape == SHAPES[0]  # the walk took branches, not only the first child


def _sample_tree(kind, rng, V, q_root, q1):
    """One round's tree: 'sampled' a 2-token chain drawn from the draft (q) with the draft's runner-up at each
    depth as a point-mass sibling; 'points' point masses only, a root with three children, one with two."""
    if kind == "points":
        return np.array([1, 4, 0, 2, 5]), np.array([-1, -1, -1, 0, 0]), None
    a = int(sampling.draw(q_root, rng.random()))
    b = int(sampling.draw(q1[a], rng.random()))
    alt0 = int(np.argmax(np.where(np.arange(V) == a, -1, q_root)))
    alt1 = int(np.argmax(np.where(np.arange(V) == b, -1, q1[a])))
    return np.array([a, b, alt0, alt1]), np.array([-1, 0, -1, 0]), np.stack([q_root, q1[a]])


@pytest.mark.parametrize("kind", ["sampled", "points"])
def test_rejection_over_siblings_emits_exact_samples(kind):
    """Unseeded sampling on a tree (recursive rejection over siblings): the first token is distributed as the
    target's root row, and the second, given a first token the tree holds, as that node's row."""
    rng, V, N = np.random.default_rng(7), 6, 20000
    p = rng.dirichlet(np.ones(V) * 0.7, size=V + 1)  # p[0]: the root's; p[1 + x]: after token x
    q_root, q1 = rng.dirichlet(np.ones(V), size=1)[0], rng.dirichlet(np.ones(V), size=V)
    cfg = SamplingConfig(temperature=1.0)
    first, second = [], {x: [] for x in range(V)}
    for _ in range(N):
        tokens, parents, q = _sample_tree(kind, rng, V, q_root, q1)
        # the target's logits per node: the root's row, then each node's by its token (a Markov target)
        rows = np.log(np.stack([p[0]] + [p[1 + t] for t in tokens]))
        path, t = sampling.accept_tree(tokens, parents, q, rows, cfg, rng, 0)
        out = [int(tokens[i]) for i in path] + [t]
        first.append(out[0])
        if len(out) > 1:
            second[out[0]].append(out[1])
    assert chi2_pvalue(np.bincount(first, minlength=V), p[0]) > P_MIN
    tested = 0
    for x, ys in second.items():
        if len(ys) > 300:
            assert chi2_pvalue(np.bincount(ys, minlength=V), p[1 + x]) > P_MIN
            tested += 1
    assert tested >= 2


def test_the_grower_adds_what_pays_and_probes_the_rest():
    costs = CostModel(draft_s=0.01, target_s={1: 0.030, 2: 0.031, 3: 0.032, 4: 0.033, 5: 0.034, 6: 0.035, 7: 0.060})
    chain = Proposal(np.array([5, 6, 7]), runner_up=np.array([[8], [9], [-1]]), runner_up_p=np.array([[0.4], [0.3], [0.0]]))
    reach, E = [1.0, 0.7, 0.49, 0.34], 1 + 0.7 + 0.49 + 0.34
    g = Grower({}, probe_every=0)
    t = g.grow(chain, reach, None, (), E, 3 * 0.01 + 0.033, costs.target, limit=8)
    # two runner-ups (the third has none); each adds a millisecond for 0.4 and 0.21 tokens
    assert t.tokens.tolist() == [5, 6, 7, 8, 9] and t.parents.tolist() == [-1, 0, 1, -1, 0]
    assert t.family == ("runner_up", "runner_up") and t.feed_parents() == [-1, 0, 1, 2, 0, 1]
    # no room: the chain alone
    assert g.grow(chain, reach, None, (), E, 0.063, costs.target, limit=3) is None
    # a pass that costs double past width 5: the second runner-up does not pay
    costs.target_s[6] = 0.066
    assert len(g.grow(chain, reach, None, (), E, 0.063, costs.target, limit=8)) == 4
    # a lookup's continuation parting from the chain at its second token: a branch under node 0
    t = Grower({}, probe_every=0).grow(Proposal(np.array([5, 6])), [1.0, 0.9, 0.5], np.array([5, 3, 4]),
                                       [0.9, 0.9, 0.9], 2.4, 0.05, lambda w: 0.03 + 0.001 * w, 8)
    assert t.tokens.tolist() == [5, 6, 3, 4] and t.parents.tolist() == [-1, 0, 0, 2] and t.depth() == 3
    # a batch's pass (3 rows, 5 wide so far): the node that fits within that width costs nothing and goes in; the
    # next widens every row, and pays only against a slow enough batch
    batch = lambda w: 0.02 * 3 * max(w, 5)  # noqa: E731
    assert len(Grower({}, probe_every=0).grow(chain, reach, None, (), E, 0.063, batch, 8, rate=500.0)) == 4
    assert len(Grower({}, probe_every=0).grow(chain, reach, None, (), E, 0.063, batch, 8, rate=2.0)) == 5
    # the draft's third choices too, best first: the root's (0.25 tokens) goes in before the second position's
    # runner-up (0.21), which would then widen the pass to 7 (60 ms): only the first two pay
    two = Proposal(chain.tokens, runner_up=np.array([[8, 11], [9, 12], [-1, -1]]),
                   runner_up_p=np.array([[0.4, 0.25], [0.3, 0.05], [0.0, 0.0]]))
    costs.target_s[6] = 0.035
    t = Grower({}, probe_every=0).grow(two, reach, None, (), E, 3 * 0.01 + 0.033, costs.target, limit=8)
    assert t.tokens.tolist() == [5, 6, 7, 8, 11] and t.parents.tolist() == [-1, 0, 1, -1, -1]
    # learned: a family whose nodes never hit is expected to add less, until a probe puts one in
    g = Grower({}, probe_every=4)
    for _ in range(80):
        t = g.grow(chain, reach, None, (), E, 0.063, costs.target, limit=8)
        if t is not None:
            g.observe(t, [0, 1])  # the chain's first two tokens: nothing from the branches
    assert g.scale("runner_up") < 0.1
    rounds = [g.grow(chain, reach, None, (), E, 0.063, costs.target, limit=8) for _ in range(8)]
    assert sum(r is not None for r in rounds) == 2 and all(len(r) == 4 for r in rounds if r is not None)


def test_tree_on_chain_and_depth():
    t = Tree(np.array([1, 2, 3, 4]), np.array([-1, 0, -1, 2]), 2, ("lookup", "lookup"), {})
    assert t.on_chain([0, 1]) == 2 and t.on_chain([2, 3]) == 0 and t.on_chain([]) == 0 and t.depth() == 2


def test_bad_tree_settings_are_refused():
    with pytest.raises(ConfigError, match="tree must be one of auto, off"):
        GenerationConfig(tree="yes")


class _Drafting(Auto):
    """Auto that always drafts 2 tokens with its model (every such round verifies a tree, its nodes probed
    every round): what a tree round does, whatever auto would have chosen."""

    def plan(self, seq, limit, left, batch=None):
        super().plan(seq, limit, left, batch)
        self._plan = (self.model, self.controller(self.model.kind), True, self._plan[3])
        return self.model, min(2, limit)


def _fake_policy(target, V, lookup=False, state=None, always=False):
    state = state or PolicyState(costs=FrozenCosts(draft_s=0.3, target_s={1: 1.0, 9: 1.02}))
    proposers = ([LookupProposer()] if lookup else []) + [ModelProposer(FakeTreeEngine(1, V, like=target), V)]
    return (_Drafting if always else Auto)(proposers, 4, state, PolicyConfig(tree_probe_every=1), trees=True)


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=1.0, method="coupled")])
def test_rounds_verifying_trees_emit_target_only_tokens(cfg):
    """Greedy and coupled through a fake target whose logits read every cached token: with trees (the draft's
    runner-ups, the lookup's branches), the tokens are target-only's, and walks did leave the chain."""
    V, branch_tokens, tree_rounds = 8, 0, 0
    for seed in range(12):
        prompt = [1, 2, 3, 4, 1, 2, 3][seed % 3:] + [seed % V]
        g = GenerationConfig(max_new_tokens=24, draft_len="auto", seed=seed, sampling=cfg)
        want, _, _ = decode(FakeEngine(seed, V), Fixed(0, []), prompt, dataclasses.replace(g, draft_len=0), V,
                            frozenset())
        target = FakeTreeEngine(seed, V)
        got, _, st = decode(target, _fake_policy(target, V, lookup=seed % 2 == 1, always=seed >= 6), prompt, g, V,
                            frozenset())
        assert got == want
        tree_rounds += st.tree_rounds
        branch_tokens += sum(st.accepted_by_branch.values())
    assert tree_rounds > 20 and branch_tokens > 0


def test_rejection_sampled_trees_are_exact_samples():
    """Unseeded sampling, every round a tree: the joint distribution of the first three tokens is the target's
    (chi-square against the exact joint)."""
    V, cfg, obs = 4, SamplingConfig(temperature=1.0), None
    prompt = [1, 2, 3]
    target = FakeTreeEngine(0, V)
    obs = np.zeros(V ** 3)
    left = 0
    for seed in range(3000):
        g = GenerationConfig(max_new_tokens=8, draft_len="auto", seed=seed, sampling=cfg)
        target.truncate(0)
        out, _, st = decode(target, _fake_policy(target, V, always=True), prompt, g, V, frozenset())
        obs[sequence_index(out[:3], V)] += 1
        left += sum(st.accepted_by_branch.values())
    assert left > 100  # walks went through branches
    p = chi2_pvalue(obs, fake_exact_joint(target, prompt, cfg, 3))
    assert p > P_MIN, f"p={p:.2e}"


def _constrained(target, V, prompt, always=True):
    """A tree policy under the fake grammar (`rule`), its forced tokens drafted as a constrained request's are,
    and the constraint."""
    c = Constraint(FakeMatcher(rule, V, prompt[-1]), ByteTokens, V)
    return Forced(_fake_policy(target, V, always=always), GrammarProposer(c), PolicyConfig().forced_first), c


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=1.0, method="coupled")])
@pytest.mark.parametrize("kind", ["grammar", "min_tokens"])
def test_constrained_rounds_verifying_trees_emit_the_constrained_target_only_tokens(cfg, kind):
    """Under a grammar (each tree node masked after the tokens down to it, branches it refuses not grown) and under
    min_tokens (no end before it, at every depth): greedy and coupled give the constrained target-only tokens,
    and walks did leave the chain."""
    V, END, tree_rounds, branch_tokens = 5, 4, 0, 0
    for seed in range(12):
        prompt = [int(x) for x in np.random.default_rng(seed).integers(0, V, size=3)]
        g = GenerationConfig(max_new_tokens=20, draft_len="auto", seed=seed, sampling=cfg)
        if kind == "grammar":
            g = dataclasses.replace(g, grammar=Grammar("regex", "fake"))
        else:
            g = dataclasses.replace(g, min_tokens=12)
        eos = frozenset({END} if kind == "min_tokens" else ())
        want, _, _ = decode(FakeEngine(seed, V, max_len=80), Fixed(0, []), prompt, dataclasses.replace(g, draft_len=0),
                            V, eos, constraint=Constraint(FakeMatcher(rule, V, prompt[-1]), ByteTokens, V))
        target = FakeTreeEngine(seed, V, max_len=80)
        if kind == "grammar":
            policy, c = _constrained(target, V, prompt, always=seed % 2 == 0)
        else:
            policy, c = _fake_policy(target, V, lookup=seed % 2 == 1, always=seed >= 6), None
        got, _, st = decode(target, policy, prompt, g, V, eos, constraint=c)
        assert got == want
        if kind == "grammar":
            assert all(b in rule(a) for a, b in zip(prompt[-1:] + got, got))
        else:
            assert END not in got[:12]
        tree_rounds += st.tree_rounds
        branch_tokens += sum(st.accepted_by_branch.values())
    assert tree_rounds > 20 and branch_tokens > 0


def test_rejection_sampled_trees_under_a_grammar_are_exact_samples():
    """Unseeded sampling under the fake grammar, every round a tree: the first three tokens are distributed as
    constrained sampling from the target alone (chi-square), and no output breaks the grammar."""
    V, cfg, prompt = 5, SamplingConfig(temperature=1.0), [1, 2]
    target = FakeTreeEngine(0, V)
    obs, left = np.zeros(V ** 3), 0
    for seed in range(3000):
        g = GenerationConfig(max_new_tokens=8, draft_len="auto", seed=seed, sampling=cfg, grammar=Grammar("regex", "f"))
        target.truncate(0)
        policy, c = _constrained(target, V, prompt)
        out, _, st = decode(target, policy, prompt, g, V, frozenset(), constraint=c)
        assert all(b in rule(a) for a, b in zip(prompt[-1:] + out, out))
        obs[sequence_index(out[:3], V)] += 1
        left += sum(st.accepted_by_branch.values())
    assert left > 100
    exact = fake_exact_joint(target, prompt, cfg, 3, rule)
    assert (obs[exact == 0] == 0).all()
    p = chi2_pvalue(obs[exact > 0], exact[exact > 0])
    assert p > P_MIN, f"p={p:.2e}"


def test_a_branch_the_grammar_refuses_is_not_grown():
    """The grower asks the constraint of each branch's path: a runner-up or lookup token the grammar forbids
    there, or one after which it allows nothing, stays out (the chain's own tokens were cut before)."""
    chain = Proposal(np.array([2, 4]), runner_up=np.array([[3], [1]]), runner_up_p=np.array([[0.4], [0.3]]))
    c = Constraint(FakeMatcher(rule, 5, 4), ByteTokens, 5)  # the sequence ends in 4: anything but 4 next
    grow = Grower({}, probe_every=0).grow
    args = (chain, [1.0, 0.5, 0.25], np.array([2, 4, 4]), [0.9, 0.9, 0.9], 1.75, 0.05, lambda w: 0.03 + 0.0001 * w, 8)
    free = grow(*args)
    assert free.tokens.tolist() == [2, 4, 3, 4, 1] and free.parents.tolist() == [-1, 0, -1, 1, 0]
    # the runner-up 3 fits, and 1 after 2 (3 must follow it); the lookup's 4 after 4 is refused
    t = grow(*args, fits=c.fits)
    assert t.tokens.tolist() == [2, 4, 3, 1] and t.parents.tolist() == [-1, 0, -1, 0]
    assert t.prefixes() == [(), (2,), (2, 4), (3,), (2, 1)]
    assert Constraint(FakeMatcher(lambda prev: {1} if prev == 3 else set(), 5, 2), ByteTokens, 5).fits([3]) is False


@pytest.fixture
def exact(int4_default_pair):
    """The int4 pair whose every matmul and attention node is specrt's (rows exact whatever the pass)."""
    if not KERNELS_RUN:
        pytest.skip("specrt's kernels do not run here")
    assert int4_default_pair.target.trees
    return int4_default_pair


@pytest.mark.parametrize("sampled", [None, SamplingConfig(temperature=0.8, top_p=0.95, method="coupled")])
def test_real_kernels_trees_give_target_only_text(exact, sampled):
    """Through specrt's attention and slot moves on a real (tiny) int4 pair: rounds that each verify a tree give
    target-only's tokens, greedy and coupled."""
    V, rng, s = exact.manifest.vocab_size, np.random.default_rng(11), sampled or SamplingConfig()
    trees = 0
    with exact.exclusive():
        for n in range(3):
            prompt = rng.integers(3, V, 12 + 5 * n).tolist()
            g = GenerationConfig(max_new_tokens=30, draft_len="auto", sampling=s, seed=n)
            exact.target.truncate(0)
            want, _, _ = decode(exact.target, Fixed(0, []), prompt, dataclasses.replace(g, draft_len=0), V,
                                frozenset(exact.manifest.eos_token_ids))
            exact.target.truncate(0)
            exact.draft.truncate(0)
            policy = _Drafting([ModelProposer(exact.draft, V, exact.draft_ids)], exact.manifest.max_draft_len,
                               PolicyState(), PolicyConfig(tree_probe_every=1), trees=True)
            got, _, st = decode(exact.target, policy, prompt, g, V, frozenset(exact.manifest.eos_token_ids))
            assert got == want
            trees += st.tree_rounds
        exact.forget_caches()
    assert trees > 10


@pytest.mark.parametrize("sampled", [None, SamplingConfig(temperature=0.9, method="coupled")])
def test_real_kernels_constrained_trees_give_target_only_text(exact, sampled):
    """Under a regular expression (llguidance's masks, per node) on the real (tiny) int4 pair, rounds that each
    verify a tree give the constrained target-only tokens, greedy and coupled."""
    V, rng, s = exact.manifest.vocab_size, np.random.default_rng(5), sampled or SamplingConfig()
    grammar, eos = Grammar("regex", r"(yes|no): [a-z]{2,12}( [a-z]{2,12}){0,4}\."), frozenset(exact.manifest.eos_token_ids)
    trees = 0
    with exact.exclusive():
        for n in range(3):
            prompt = rng.integers(3, V, 10 + 4 * n).tolist()
            g = GenerationConfig(max_new_tokens=40, draft_len="auto", sampling=s, seed=n, grammar=grammar)
            exact.target.truncate(0)
            want, _, _ = decode(exact.target, Fixed(0, []), prompt, dataclasses.replace(g, draft_len=0), V, eos,
                                constraint=exact.grammars.start(grammar))
            exact.target.truncate(0)
            exact.draft.truncate(0)
            c = exact.grammars.start(grammar)
            policy = Forced(_Drafting([ModelProposer(exact.draft, V, exact.draft_ids)], exact.manifest.max_draft_len,
                                      PolicyState(), PolicyConfig(tree_probe_every=1), trees=True),
                            GrammarProposer(c), PolicyConfig().forced_first)
            got, _, st = decode(exact.target, policy, prompt, g, V, eos, constraint=c)
            assert got == want
            trees += st.tree_rounds
        exact.forget_caches()
    assert trees > 10


@pytest.mark.parametrize("sampled", [None, SamplingConfig(temperature=0.8, top_p=0.95, method="coupled")])
def test_batch_rows_verifying_trees_give_target_only_text(exact, sampled):
    """Rows of a batch (the ragged pass with parent pointers, slot moves within a row) whose rounds each verify a
    tree: every row's tokens are its request's target-only tokens, greedy and coupled."""
    V, rng, s = exact.manifest.vocab_size, np.random.default_rng(7), sampled or SamplingConfig()
    prompts = [rng.integers(3, V, 8 + 3 * i).tolist() for i in range(5)]
    cfgs = [GenerationConfig(max_new_tokens=24 + 4 * i, draft_len="auto", sampling=s, seed=i) for i in range(5)]
    with exact.runner(3) as runner:
        assert runner.decoder.target.trees

        def policy(r, cfg, constraint):
            return _Drafting([ModelProposer(runner.decoder.draft.e.row(r), V, exact.draft_ids)],
                             exact.manifest.max_draft_len, PolicyState(), PolicyConfig(tree_probe_every=1), trees=True)

        runner.decoder.policy_for = policy
        got = dict(runner.run(Request(i, p, c) for i, (p, c) in enumerate(zip(prompts, cfgs))))
    with exact.exclusive():
        for i, (p, c) in enumerate(zip(prompts, cfgs)):
            exact.target.truncate(0)
            want, _, _ = decode(exact.target, Fixed(0, []), p, dataclasses.replace(c, draft_len=0), V,
                                frozenset(exact.manifest.eos_token_ids))
            assert got[i].tokens == want, i
        exact.forget_caches()
    assert sum(r.stats["tree_rounds"] for r in got.values()) > 10
    assert sum(sum(r.stats["accepted_by_branch"].values()) for r in got.values()) > 0


def test_the_server_fields_and_clis_take_tree(exact, tmp_path):
    r = cli("info", exact.dir)
    assert r.exit_code == 0 and "trees: a round may verify a tree of drafts" in r.output
    cfg = exact.settings({"tree": "off"})
    assert cfg.tree == "off" and exact.settings({}).tree == "auto"
    with pytest.raises(ConfigError, match="tree must be"):
        exact.settings({"tree": 1})
    r = cli("generate", exact.dir, "--prompt", "hi", "--tree", "maybe")
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = cli("bench", exact.dir, "--prompt", "hi", "--trees", "auto,sometimes")
    assert "--trees must be comma-separated values of auto, off" in one_line_error(r)
    out = tmp_path / "b.json"
    r = cli("bench", exact.dir, "--prompt", "hi", "--draft-lens", "0,auto", "--trees", "off,auto", "--repeats", "1",
            "--max-new-tokens", "8", "--json", out)
    assert r.exit_code == 0, r.output
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [(row["draft_len"], row["tree"]) for row in rows] == [(0, "off"), ("auto", "off"), ("auto", "auto")]
