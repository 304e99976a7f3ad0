"""draft_len="auto" (the measured-cost controller) and confidence_stop: still lossless, still exact when greedy."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from _helpers import P_MIN, FakeEngine, FrozenCosts, chi2_pvalue, fake_exact_joint, sequence_index
from specrt.cli import main
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.decode import decode
from specrt.decoding.controller import DRAFT_EDGES, DraftStop
from specrt.decoding.policy import Batch, Auto, PolicyConfig, Calibration, Controller, CostModel, Fixed, PolicyState
from specrt.decoding.proposers import History, LookupProposer, ModelProposer
from specrt.errors import ConfigError


def config(**kw) -> PolicyConfig:
    """The default policy settings with some changed."""
    return replace(PolicyConfig(), **kw)


def cheap_drafts():
    return FrozenCosts(draft_s=1e-6, target_s={1: 1.0, 2: 1.0, 9: 1.0})


def dear_drafts():
    return FrozenCosts(draft_s=10.0, target_s={1: 1.0, 9: 5.0})


# ---------------------------------------------------------------- the controller


def test_auto_controller_choices():
    auto = Controller(8, cheap_drafts(), config(prior=0.9))
    assert auto.choose(8) == 8 and auto.choose(3) == 3 and auto.choose(0) == 0
    assert auto.expected_tokens(0) == 1.0
    assert auto.expected_tokens(2) == pytest.approx(1 + 0.9 + 0.81)
    dear = Controller(8, dear_drafts(), config(prior=0.7, probe_budget=100.0))  # the schedule alone (no cost floor)
    picks = [dear.choose(8) for _ in range(16 + 32 + 64)]
    # plain decoding, probing after 16 rounds, then after 32, then 64: each failed probe doubles the wait
    assert [i for i, k in enumerate(picks) if k] == [15, 47, 111] and set(picks) == {0, 1}
    assert dear.rounds_skipped == len(picks) - 3
    costs = FrozenCosts(draft_s=0.5, target_s={1: 1.0, 9: 1.0})
    turns = Controller(8, costs, config(prior=0.1, probe_budget=100.0))
    assert [turns.choose(8) for _ in range(40)].count(0) == 39 and turns._gap == 32
    turns.accept = [0.95] * 8  # the numbers now say drafting pays: it drafts, and the probe gap resets
    assert turns.choose(8) > 0 and turns._gap == turns.c.probe_every
    assert Controller(8, CostModel()).choose(8) == 2  # nothing measured yet: a short probe
    auto.observe(4, 1)  # position 0 accepted, position 1 rejected, 2.. not reached
    assert auto.accept[0] > 0.9 > auto.accept[1] and auto.accept[2] == 0.9


def test_probes_cost_at_most_their_budget():
    """Before a catch-up is measured a probe is priced at two draft steps and a wider verify; the wait
    keeps that under 1.5% of the plain rounds it waits for. GPU-like costs (H200: draft 6.4 ms, target
    7.4/8.0 ms) wait ~120 rounds, CPU-like ones (draft 10 ms, target 29/33 ms) ~55, a free n-gram
    proposal the base 16."""
    def first_probe(auto, behind=0):
        return next(i for i in range(5000) if auto.choose(8, behind))

    gpu = Controller(8, FrozenCosts(draft_s=6.4, target_s={1: 7.4, 2: 8.0, 9: 9.0}), config(prior=0.0))
    cpu = Controller(8, FrozenCosts(draft_s=10.0, target_s={1: 29.0, 2: 33.0, 9: 60.0}), config(prior=0.0))
    free = Controller(8, FrozenCosts(draft_s=6.4, target_s={1: 7.4, 2: 7.5, 9: 9.0}), config(prior=0.0),
                      free_draft=True)
    assert first_probe(gpu) == 120 and first_probe(cpu) == 55 and first_probe(free) == 15
    assert first_probe(gpu) == 241  # then the wait doubles
    for auto, gap in ((gpu, 121), (cpu, 56)):
        assert auto.probe_cost(0) <= 0.015 * gap * auto.costs.target(1)


def test_probes_wait_for_a_cheap_catch_up():
    """Once a catch-up is measured, a probe costs the draft's read of every token it skipped. CPU-like
    numbers (read 2.3 ms a token, target 29 ms): 1.5% of the plain rounds never covers a catch-up over
    those same rounds, so inside a request no probe comes before `max_probe_every`."""
    costs = FrozenCosts(draft_s=10.0, target_s={1: 29.0, 2: 33.0, 9: 60.0}, draft_read_s=2.3)
    auto = Controller(8, costs, config(prior=0.0, max_probe_every=600))
    prompt = 50
    picks = [auto.choose(8, behind=prompt + i) for i in range(500)]  # one long request, plain throughout
    assert not any(picks) and auto.rounds_skipped == 500
    assert auto.probe_cost(prompt) == pytest.approx(10.0 + 49 * 2.3 + 4.0)
    long = Controller(8, costs, config(prior=0.0, max_probe_every=600))
    picks = [long.choose(8, behind=prompt + i) for i in range(700)]
    assert [i for i, k in enumerate(picks) if k] == [599]  # at the latest after max_probe_every rounds


def test_cost_model_learns_the_catch_up_read():
    c = CostModel(draft_s=0.010)
    c.observe_catchup(0.010 + 49 * 0.002, 50)
    assert c.draft_read_s == pytest.approx(0.002)
    c.observe_catchup(0.5, 2)  # a two-token pass is a draft step, not a catch-up
    assert c.draft_read_s == pytest.approx(0.002)
    assert CostModel().observe_catchup(1.0, 50) is None and CostModel().draft_read_s is None


def test_hybrid_prices_the_draft_models_catch_up():
    """hybrid compares an n-gram round with a model round; leaving a caught-up draft model costs it a
    catch-up pass later (about a draft step), which the n-gram side's rate carries (policy.Auto.plan)."""
    costs = FrozenCosts(draft_s=0.4, target_s={1: 1.0, 2: 1.1, 5: 1.4})
    ngram = Controller(4, costs, config(prior=0.6), free_draft=True)
    model = Controller(4, costs, config(prior=0.9))
    free, switching, drafted = ngram.best(4)[1], ngram.best(4, extra_s=0.4)[1], model.best(4)[1]
    assert free > drafted > switching  # behind already: the n-gram round; caught up: the model round
    assert switching == pytest.approx(max(ngram.expected_tokens(k) / (ngram.cost(k) + 0.4) for k in range(1, 5)))


def test_auto_re_measures_positions_past_its_choice():
    """A pessimistic estimate at position 2 must not stick: every 8 rounds one more token is drafted,
    and once position 2 is seen accepted again, k=2 wins back."""
    costs = FrozenCosts(draft_s=0.34, target_s={1: 1.0, 2: 1.15, 3: 1.3})
    auto = Controller(4, costs, accept=[0.9, 0.3, 0.3, 0.3])
    picks = [auto.choose(4) for _ in range(16)]
    assert picks.count(2) == 2 and set(picks) == {1, 2} and picks[7] == picks[15] == 2
    for _ in range(12):
        auto.observe(2, 2)  # the wider rounds see position 2 accepted
    assert auto.choose(4) >= 2


def test_cost_model_interpolates():
    c = CostModel()
    assert c.target(3) is None
    c.observe_target(1, 1.0)
    assert c.target(1) == 1.0 and c.target(3) == pytest.approx(1.2)
    c.observe_target(5, 2.0)
    assert c.target(3) == pytest.approx(1.5) and c.target(9) == pytest.approx(3.0)
    c.observe_target(1, 2.0)
    assert c.target(1) == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)


def test_a_narrow_pass_is_never_priced_above_a_wider_one():
    """A slow spike in the one-token cost (60 ms against 38 ms measured at width 2) would make a draft
    that is never accepted look cheaper than plain decoding (10 + 38 < 60 ms a token), and auto, no
    longer decoding plainly, would not measure width 1 again: it drafted a whole request of a
    mismatched draft at 0.71x (bench/RESULTS.md at commit 4275f84)."""
    costs = FrozenCosts(draft_s=0.010, target_s={1: 0.060, 2: 0.038, 3: 0.047})
    assert costs.target(1) == 0.038 and costs.target(2) == 0.038 and costs.target(3) == 0.047
    assert Controller(8, costs, accept=[0.0] * 8).best(8)[0] == 0


@pytest.mark.parametrize("kw,match", [(dict(draft_len="fast"), "draft_len"), (dict(draft_len=2.5), "draft_len"),
                                      (dict(confidence_stop=1.0), "confidence_stop"),
                                      (dict(confidence_stop=-0.1), "confidence_stop")])
def test_generation_config_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(**kw)


# ---------------------------------------------------------------- greedy: exact whatever the controller does


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_auto_greedy_equals_target_only(pairs, model_type):
    pair = pairs[model_type]
    for prompt in ("def quicksort(xs):", [40, 41, 42, 43], list(range(3, 60))):
        base = pair.generate(prompt, max_new_tokens=64, draft_len=0).tokens
        res = pair.generate(prompt, max_new_tokens=64, draft_len="auto")
        assert res.tokens == base
        s = res.stats
        assert s["draft_len"] == "auto"
        assert sum(s["draft_len_hist"].values()) == s["rounds"]
        assert all(0 <= int(k) <= pair.manifest.max_draft_len for k in s["draft_len_hist"])
        assert s["new_tokens"] == 1 + s["rounds"] + s["accepted"]


def test_hybrid_auto_has_one_controller_per_drafter(qwen_pair, monkeypatch):
    """hybrid + auto: the n-gram and the model proposals are judged on their own acceptance and cost
    (a free n-gram proposal that is rarely right must not make the model draft look bad, or vice versa);
    the pair carries each drafter's learned acceptance to its next request separately."""
    monkeypatch.setattr(qwen_pair, "policy_config", config(min_match=1))  # the random tiny model rarely repeats 2 tokens
    prompt = list(range(3, 40)) + list(range(3, 20))  # repeats: the n-gram drafter has proposals
    monkeypatch.setattr(qwen_pair.state, "history", None)  # (with one, the base run's output would draft too)
    base = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=0).tokens
    monkeypatch.setattr(qwen_pair.state, "acceptance", {})
    res = qwen_pair.generate(prompt, max_new_tokens=48, draft_len="auto", drafter="hybrid")
    assert res.tokens == base
    est = res.stats["acceptance_estimate"]
    ngram_kinds = set(est) - {"model"}
    assert "model" in est and ngram_kinds and ngram_kinds <= {"ngram1", "ngram2", "ngram3", "ngram8"}
    assert all(len(v) == qwen_pair.manifest.max_draft_len for v in est.values())
    learned = qwen_pair.state.acceptance
    assert all(learned[kind] == pytest.approx(v, abs=1e-4) for kind, v in est.items())  # first seen: as learned
    after = qwen_pair.generate(prompt, max_new_tokens=16, draft_len="auto", drafter="ngram").stats
    assert set(after["acceptance_estimate"]) <= {"ngram1", "ngram2", "ngram3", "ngram8"}
    assert qwen_pair.state.acceptance["model"] == pytest.approx(est["model"], abs=1e-4)


def test_the_next_request_starts_from_what_the_last_one_learned(qwen_pair, monkeypatch):
    """A request starts from the estimate the last request of its kind ended with."""
    monkeypatch.setattr(qwen_pair.state, "acceptance", {"model": [0.9] * 8})
    monkeypatch.setattr(qwen_pair.state, "calibration", Calibration())
    monkeypatch.setattr(qwen_pair.state, "costs", FrozenCosts(draft_s=0.05, target_s={1: 1.0, 9: 1.0}))  # drafting pays
    res = qwen_pair.generate([7, 8, 9, 10, 11], max_new_tokens=24, draft_len="auto", drafter="model")
    qwen_pair.draft_memory.forget()
    est = res.stats["acceptance_estimate"]["model"]
    assert est != pytest.approx([0.9] * 8, abs=1e-3)  # it learned something of its own
    assert qwen_pair.state.acceptance["model"] == pytest.approx(est, abs=1e-4)


def test_hybrid_ngram_rounds_count_toward_the_models_probe(qwen_pair, monkeypatch):
    """Rounds that hybrid gives to an n-gram proposal are rounds without the model too: the model's
    controller counts them toward its next probe, as it counts its own plain rounds."""
    auto = Controller(8, dear_drafts(), config(prior=0.0, probe_budget=100.0))  # the schedule alone
    for _ in range(10):
        auto.wait()
    assert [auto.choose(8) for _ in range(6)] == [0, 0, 0, 0, 0, 1]  # 16 rounds since the last probe

    waits = []
    monkeypatch.setattr(qwen_pair, "policy_config", config(min_match=1))
    monkeypatch.setattr(Controller, "wait", lambda self: waits.append(1))
    # deterministic choices: n-gram proposals look worth verifying, the model draft costs more than it brings
    monkeypatch.setattr(qwen_pair.state, "costs", FrozenCosts(draft_s=1.5, target_s={1: 1.0, 9: 1.0}))
    monkeypatch.setattr(qwen_pair.state, "acceptance", {"ngram": [0.9] * 8, "model": [0.5] * 8})
    monkeypatch.setattr(qwen_pair.state, "history", None)  # lookup rounds from the request alone
    prompt = list(range(3, 40)) + list(range(3, 20))
    res = qwen_pair.generate(prompt, max_new_tokens=48, draft_len="auto", drafter="hybrid")
    assert res.stats["rounds_by_drafter"].get("ngram", 0) == len(waits) > 0


@pytest.mark.parametrize("better,draft_s", [("model", 0.05), ("ngram", 1.5)])
def test_hybrid_auto_uses_the_proposal_expected_to_pay_more(qwen_pair, monkeypatch, better, draft_s):
    """An n-gram proposal that pays (vs plain decoding) must still give way to the model draft when the
    model's expected tokens per second are higher (a cheap, mostly-right draft), and win when the model
    draft costs more than it brings."""
    prompt = list(range(3, 40))
    base = qwen_pair.generate(prompt, max_new_tokens=40, draft_len=0).tokens
    # an n-gram proposal at every round (a poor one: it must not crowd out a better model draft)
    monkeypatch.setattr(LookupProposer, "match", lambda self, seq, k: (np.full(k, 5, np.int64), 2))
    monkeypatch.setattr(qwen_pair.state, "costs", FrozenCosts(draft_s=draft_s, target_s={1: 1.0, 9: 1.0}))
    monkeypatch.setattr(qwen_pair.state, "acceptance", {"model": [0.99] * 8, "ngram": [0.3] * 8})
    monkeypatch.setattr(qwen_pair.state, "calibration", Calibration())
    qwen_pair.draft_memory.forget()  # what earlier tests left in the draft's cache must not steer this one
    res = qwen_pair.generate(prompt, max_new_tokens=40, draft_len="auto", drafter="hybrid")
    assert res.tokens == base
    used = res.stats["rounds_by_drafter"]
    worse = "ngram" if better == "model" else "model"
    assert used.get(better, 0) > 3 * used.get(worse, 0), used


def test_first_request_of_an_untuned_pair_adapts(qwen_pair, monkeypatch):
    """With no costs known at the start, the controllers follow the live measurements; planning with the
    empty snapshot would leave them on their opening guess (k=2) for the whole request."""
    monkeypatch.setattr(qwen_pair.state, "costs", CostModel())
    monkeypatch.setattr(qwen_pair.state, "acceptance", {})
    monkeypatch.setattr(qwen_pair.state, "calibration", Calibration())
    res = qwen_pair.generate(list(range(3, 40)), max_new_tokens=96, draft_len="auto", drafter="model")
    hist = res.stats["draft_len_hist"]
    assert sum(v for k, v in hist.items() if k != 2) > 2, hist  # more than the last round or two
    assert qwen_pair.state.costs.draft_s is not None and qwen_pair.state.costs.target_s


def test_catchup_pass_is_not_a_draft_step(qwen_pair):
    """After rounds without drafting the draft model catches up in one wide pass; its time must not
    be booked as the cost of a draft step (that would make auto skip more, and catch up more...)."""
    drafter = ModelProposer(qwen_pair.draft, qwen_pair.manifest.vocab_size)
    seq = list(range(3, 30))
    drafter.start(seq[:5])
    first = drafter.propose(seq, 2, SamplingConfig(), np.random.default_rng(0))
    assert first.catchup_s > 0 and first.catchup_tokens == len(seq)  # fed all 27 tokens in its first pass
    drafter.commit(len(seq) - 1)
    nxt = drafter.propose(seq, 2, SamplingConfig(), np.random.default_rng(0))
    assert nxt.catchup_s == 0.0 and nxt.catchup_tokens == 0  # one token: an ordinary draft step


def test_probe_is_priced_by_how_far_the_draft_is_behind(qwen_pair, monkeypatch):
    """The loop tells the controller how many tokens a probe's catch-up would read (the prompt, then
    one more per plain round), and books the catch-up's time per token into the shared cost model."""
    monkeypatch.setattr(qwen_pair.state, "costs", CostModel(draft_s=10.0, target_s={1: 1.0, 9: 5.0}))
    monkeypatch.setattr(qwen_pair.state, "acceptance", {})
    monkeypatch.setattr(qwen_pair.state, "calibration", Calibration())
    seen = []
    due = Controller.probe_due

    def spy(self, behind):
        seen.append(behind)
        return due(self, behind)

    monkeypatch.setattr(Controller, "probe_due", spy)
    monkeypatch.setattr(Controller, "probe_cost", lambda self, behind: 0.0)  # probe when the schedule says
    prompt = list(range(40, 52))
    res = qwen_pair.generate(prompt, max_new_tokens=30, draft_len="auto", drafter="model")
    assert res.stats["draft_len_hist"].get(1) == 1  # one probe, at round 16
    assert seen[:16] == list(range(len(prompt) + 1, len(prompt) + 17))  # the draft has read nothing yet
    assert seen[16] <= 2  # caught up by the probe
    assert qwen_pair.state.costs.draft_read_s is not None  # the probe's catch-up pass, per token


def test_auto_greedy_is_independent_of_costs(qwen_pair, monkeypatch):
    prompt = [40, 41, 42, 43]
    base = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=0).tokens
    hists = []
    for costs in (cheap_drafts(), dear_drafts()):
        monkeypatch.setattr(qwen_pair.state, "costs", costs)
        res = qwen_pair.generate(prompt, max_new_tokens=48, draft_len="auto")
        assert res.tokens == base
        hists.append(res.stats["draft_len_hist"])
    assert hists[0] != hists[1]  # the two cost models really did choose differently


def test_auto_sampling_seed_reproduces_for_the_same_cost_snapshot(qwen_pair, monkeypatch):
    """auto plans each request with the costs known at its start: same snapshot + seed = same tokens.

    (Across machines or after more measurements the snapshot differs, and so may the tokens: each
    run is still an exact sample of the target's distribution; a fixed draft_len reproduces anywhere.)
    """
    runs, hists = [], []
    for costs in (cheap_drafts(), cheap_drafts(), dear_drafts()):
        monkeypatch.setattr(qwen_pair.state, "costs", costs)
        monkeypatch.setattr(qwen_pair.state, "history", History())  # the pair's state includes its history
        res = qwen_pair.generate([40, 41, 42, 43], max_new_tokens=32, draft_len="auto", temperature=1.0, seed=3)
        runs.append(res.tokens)
        hists.append(res.stats["draft_len_hist"])
    assert runs[0] == runs[1]
    assert hists[0] != hists[2]  # a different snapshot really plans differently


def test_cli_draft_len_auto(qwen_dir):
    r = CliRunner().invoke(main, ["generate", str(qwen_dir), "--prompt", "def fib(n):", "--max-new-tokens", "16",
                                  "--draft-len", "auto", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 16 and out["stats"]["draft_len"] == "auto"


# ---------------------------------------------------------------- sampling: lossless (fake engines)


def _joint3(drafter, costs, cfg, k, n=4000, confidence_stop=0.0, calibration=None):
    V, prompt = 5, [1, 2]
    target = drafter.target
    obs = np.zeros(V ** 3)
    proposed = rounds = 0
    for seed in range(n):
        g = GenerationConfig(max_new_tokens=4, draft_len=k, seed=seed, sampling=cfg, confidence_stop=confidence_stop)
        # a fresh state per request (nothing learned carried over) but the given costs and calibration
        state = PolicyState(costs=CostModel() if costs is None else costs,
                            calibration=Calibration() if calibration is None else calibration)
        policy = Auto([drafter.model], 4, state) if k == "auto" else Fixed(k, [drafter.model], state)
        out, _, st = decode(target, policy, prompt, g, V, frozenset())
        assert len(out) == 4
        obs[sequence_index(out[:3], V)] += 1
        proposed, rounds = proposed + st.proposed, rounds + st.rounds
    return obs, fake_exact_joint(target, prompt, cfg, 3), proposed, rounds


class _Drafter:
    def __init__(self, V=5):
        self.target = FakeEngine(0, V)
        self.model = ModelProposer(FakeEngine(1, V, like=self.target), V)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 3, 0.9)])
def test_auto_sampling_is_lossless(temperature, top_k, top_p, monkeypatch):
    costs = FrozenCosts(draft_s=0.3, target_s={1: 1.0, 5: 1.2})
    follow, followed = Controller.follow, []
    monkeypatch.setattr(Controller, "follow", lambda self, p: followed.append(p) or follow(self, p))
    ask, stops = DraftStop.__call__, []  # the rounds' drafts stop by the draft's confidence in its sampled tokens
    monkeypatch.setattr(DraftStop, "__call__", lambda self, top: stops.append(ask(self, top)) or stops[-1])
    calibration = Calibration()  # carried from request to request, as a Pair does: plain rounds follow it
    obs, exact, proposed, rounds = _joint3(_Drafter(), costs, SamplingConfig(temperature, top_k, top_p), "auto",
                                           calibration=calibration)
    assert 0 < proposed < 3 * rounds  # the controller both drafted and held back
    assert len(followed) > 100  # and plain rounds followed the target's confidence
    assert 0 < sum(stops) < len(stops)  # and its drafts both went on and stopped where their tokens said
    p = chi2_pvalue(obs, exact)
    assert p > P_MIN, f"p={p:.2e}"


def test_confidence_stop_is_lossless():
    obs, exact, proposed, rounds = _joint3(_Drafter(), None, SamplingConfig(1.0), 3, confidence_stop=0.6)
    assert proposed < 3 * rounds  # some drafts stopped early
    p = chi2_pvalue(obs, exact)
    assert p > P_MIN, f"p={p:.2e}"


def test_confidence_stop_greedy_is_exact(qwen_pair):
    prompt = [40, 41, 42, 43]
    base = qwen_pair.generate(prompt, max_new_tokens=48, draft_len=0).tokens
    res = qwen_pair.run(prompt, GenerationConfig(max_new_tokens=48, draft_len=8, confidence_stop=0.9))
    assert res.tokens == base
    assert res.stats["proposed"] < 8 * res.stats["rounds"]


def test_a_draft_goes_on_while_its_next_token_pays():
    """DraftStop: after each drafted token, one more goes on while the tokens so far (by the draft's confidence
    in each) make some further ones worth their cost at the round's own rate."""
    costs = FrozenCosts(draft_s=0.1, target_s={1: 1.0, 9: 1.8})  # a draft step 0.1, a pass 0.1 more a token

    def drafted(tops, cal=None, cap=8, widen=False, also=0.0, accept=0.9, c=costs):
        stop = DraftStop(Controller(8, c, accept=[accept] * 8), cal or Calibration(DRAFT_EDGES), cap, widen, also)
        return next((i + 1 for i, t in enumerate(tops) if stop(t)), None)

    assert drafted([0.99] * 8) == 8  # sure of every token: to the cap
    assert drafted([0.99] * 8, cap=5) == 5
    assert drafted([0.1] * 8) == 1  # unsure of the first: one more is not worth 0.2 s at ~0.9 tokens/s
    assert drafted([0.99, 0.99, 0.99, 0.2, 0.99]) == 4  # the reach falls at the fourth
    assert drafted([0.1] * 8, widen=True) == 2  # a widened round drafts one past the rule's stop
    assert drafted([0.99, 0.99, 0.99, 0.2, 0.99, 0.1, 0.1], widen=True) == 5
    assert drafted([0.99] * 8, also=0.995) == 1  # the request's own confidence_stop
    assert drafted([0.99] * 8, accept=0.05) == 1  # tokens after these are rarely accepted: none pays
    assert drafted([0.99] * 8, c=dear_drafts()) == 1  # a draft step dearer than a pass
    learned = Calibration(DRAFT_EDGES)
    for _ in range(8):
        learned.observe(0.1, True)  # this draft is right even where it is unsure
    assert drafted([0.1] * 8, cal=learned) == 8


def test_a_sure_draft_drafts_past_the_controllers_k():
    """The controller's estimate (0.7 a position) makes 3 drafts the best k; a draft sure of each token (and
    right) goes on to the pass's room with the stop, in fewer rounds than without it. Either way, target-only's
    text."""
    V = 16
    cfg = GenerationConfig(max_new_tokens=40, draft_len="auto", sampling=SamplingConfig(temperature=0.0))
    costs = FrozenCosts(draft_s=0.1, target_s={1: 1.0, 9: 1.4})
    assert Controller(8, costs, accept=[0.7] * 8).best(8)[0] == 3
    runs, states = {}, {}
    for draft_stop in (True, False):
        state = states[draft_stop] = PolicyState(costs=costs, acceptance={"model": [0.7] * 8})
        policy = Auto([ModelProposer(_Cycle(V), V)], 8, state, config(draft_stop=draft_stop))
        out, _, runs[draft_stop] = decode(_Cycle(V), policy, [3, 4, 5], cfg, V, frozenset())
        assert out == [3 + (t - 3) % 10 for t in range(6, 46)]
    assert runs[True].draft_len_hist.get(8, 0) >= 2 and 8 not in runs[False].draft_len_hist, \
        (runs[True].draft_len_hist, runs[False].draft_len_hist)
    assert runs[True].rounds < runs[False].rounds
    assert states[True].draft_calibration.predict(0.9999) == 1.0  # it learned that its sure tokens are accepted


def test_calibration_learns_acceptance_by_the_targets_confidence():
    """The draft's first-token acceptance per bin of the target's top probability: a bin predicts once
    it has seen 4 rounds' worth (older rounds count a little less), and old rounds fade."""
    c = Calibration()
    for _ in range(3):
        c.observe(0.995, True)
    assert c.predict(0.999) is None and not c.ready  # three rounds: too few
    c.observe(0.999, True)
    c.observe(0.999, False)
    assert c.ready
    assert c.predict(0.9999) == pytest.approx(0.8, abs=0.01) and c.predict(0.3) is None  # one bin, not another
    for _ in range(1000):
        c.observe(0.3, False)
    assert c.predict(0.3) == 0.0 and c.predict(0.999) is None  # 1000 rounds later the first four have faded


def test_a_plain_round_moves_the_first_positions_estimate_to_the_prediction():
    auto = Controller(8, dear_drafts(), accept=[0.2] * 8)
    auto.follow(0.9)
    assert auto.accept[0] == pytest.approx(0.2 + 0.7 * 0.15) and auto.accept[1:] == [0.2] * 7


class _Cycle:
    """A target whose greedy next token follows a cycle 3, 4, ..., 12, 3, ...: an n-gram proposal that
    continues an earlier lap is always right."""

    def __init__(self, V=16):
        self.V, self.length, self.max_len, self.batch = V, 0, 256, 1

    def forward(self, tokens, logit_positions):
        out = np.zeros((1, len(logit_positions), self.V), np.float32)
        for j, p in enumerate(logit_positions):
            out[0, j, 3 + (int(tokens[0, p]) - 2) % 10] = 10.0
        self.length += tokens.shape[1]
        return out

    def truncate(self, length):
        self.length = length


def test_an_unverified_ngram_proposal_is_scored_for_free():
    """A plain round (or a hybrid round the model drafted) still tells how the n-gram proposal would
    have fared: the target's emitted tokens either continue it or not. So an estimate that says "never
    draft" recovers as soon as the text starts repeating, instead of waiting 16 rounds for a probe, and
    a round that verified k tokens of a longer proposal also scores token k + 1 against the target's own."""
    cfg = GenerationConfig(max_new_tokens=60, draft_len="auto", sampling=SamplingConfig(temperature=0.0))
    prompt = list(range(3, 13)) + [3, 4]  # one lap and a bit: the n-gram drafter matches from the start
    state = PolicyState(costs=FrozenCosts(target_s={1: 1.0, 9: 1.2}), acceptance={"ngram": [0.0] * 8})
    out, _, stats = decode(_Cycle(), Auto([LookupProposer()], 8, state), prompt, cfg, 16, frozenset())
    assert out == [3 + (t - 3) % 10 for t in range(5, 65)]  # 5, 6, ... as target-only would give
    # plain only until the estimate recovers (scoring only what was verified: 20 plain rounds, 36 in all)
    assert stats.draft_len_hist.get(0, 0) <= 4, stats.draft_len_hist
    # and deeper positions are measured past what was drafted (the target's extra token checks the next one)
    assert stats.rounds <= 20 and min(stats.acceptance_estimate["ngram8"][:4]) > 0.5, stats


@pytest.mark.parametrize("laps,model_rounds", [(10, 0), (1, 1)])
def test_hybrid_charges_the_model_its_catch_up(laps, model_rounds):
    """At the start of a request the draft model has read nothing: its first draft step also reads the
    prompt. hybrid charges that to the model's proposal, so after a long prompt a fair n-gram proposal
    wins the first rounds (and the model, never needed, never reads the prompt), after a short one the
    better model draft does."""
    V = 16
    cfg = GenerationConfig(max_new_tokens=40, draft_len="auto", sampling=SamplingConfig(temperature=0.0))
    prompt = list(range(3, 13)) * laps + [3, 4]
    proposers = [LookupProposer(), ModelProposer(_Cycle(V), V)]  # hybrid
    costs = FrozenCosts(draft_s=0.1, target_s={1: 1.0, 9: 1.2}, draft_read_s=0.05)
    state = PolicyState(costs=costs, acceptance={"ngram": [0.7] * 8, "model": [0.99] * 8})
    out, _, stats = decode(_Cycle(V), Auto(proposers, 8, state), prompt, cfg, V, frozenset())
    assert out == [3 + (t - 3) % 10 for t in range(5, 45)]
    assert min(stats.rounds_by_drafter.get("model", 0), 1) == model_rounds, stats.rounds_by_drafter


def test_a_draft_that_must_read_the_prompt_first_drafts_only_if_that_pays():
    """At the start of a request the draft model has not read the prompt. Drafting then costs a
    catch-up pass over it (here 200 tokens at 2 ms: 0.4 s), worth paying only if drafting saves that
    much over the tokens left: 100 tokens at ~9 ms saved each do, 20 do not. A caught-up draft
    drafts whatever is left."""
    costs = FrozenCosts(draft_s=0.010, target_s={1: 0.030, 2: 0.034, 9: 0.060}, draft_read_s=0.002)

    def k(behind, remaining):
        return Controller(8, costs, accept=[0.9] * 8).choose(8, behind, remaining)

    assert k(200, 100) > 0 and k(200, 20) == 0
    assert k(2, 20) > 0 and k(2, 5) > 0


class _Wrong(_Cycle):
    """A draft that always proposes the token after the one the target will pick."""

    def forward(self, tokens, logit_positions):
        return np.roll(super().forward(tokens, logit_positions), 1, axis=-1)


@pytest.mark.parametrize("draft,agrees", [(_Cycle, True), (_Wrong, False)])
def test_plain_rounds_follow_the_targets_confidence(draft, agrees):
    """An estimate that says "never draft" (0.0) sits out whole requests while probes wait. With a
    calibration that has seen this draft accepted wherever the target is this sure, plain rounds move
    the estimate up and drafting resumes after a round or two; with one that has seen it rejected,
    plain rounds keep it off. Either way the output is the target's own."""
    V = 16
    cfg = GenerationConfig(max_new_tokens=40, draft_len="auto", sampling=SamplingConfig(temperature=0.0))
    costs = FrozenCosts(draft_s=0.1, target_s={1: 1.0, 9: 1.2}, draft_read_s=0.01)
    top = float(np.exp(10.0) / (np.exp(10.0) + V - 1))  # the fake target's confidence at every position

    def run(calibration):  # None: the state's own, fresh
        state = PolicyState(costs=costs, acceptance={"model": [0.0] * 8},
                            **({} if calibration is None else {"calibration": calibration}))
        return decode(_Cycle(V), Auto([ModelProposer(draft(V), V)], 8, state), [3, 4, 5], cfg, V, frozenset())

    learned = Calibration()
    for _ in range(8):
        learned.observe(top, agrees)
    for calibration in (None, Calibration(), learned):
        out, _, stats = run(calibration)
        assert out == [3 + (t - 3) % 10 for t in range(6, 46)]
        plain = stats.draft_len_hist.get(0, 0)
        if calibration is learned and agrees:
            assert plain <= 2 and stats.accepted >= 20, stats.draft_len_hist  # half the tokens came from drafts
        elif agrees:  # nothing learned yet: plain until a probe (~20 rounds here) finds the draft right
            assert plain >= 15, stats.draft_len_hist
        else:
            assert plain >= stats.rounds - 2, stats.draft_len_hist


def test_a_busy_batch_drafts_while_a_draft_token_is_worth_its_cost_at_the_batchs_rate():
    """In a batch a row's k maximises E(k) - rate * (what widening the padded pass costs + its draft steps):
    a pass of 10 rows computes 10 x its widest row's tokens, 2 ms each here, a draft step costs 2 ms, and
    position i is accepted with 0.9^i."""
    costs = CostModel(draft_s=0.002, target_s={1: 0.05, 10: 0.06, 80: 0.20})
    c = Controller(8, costs, accept=[0.9] * 8)
    # every draft token widens the pass by 10 tokens: 22 ms, 0.22 tokens at 10 tok/s, 2.2 at 100
    assert c.best(8, batch=Batch(10, 1, 10.0))[0] == 8
    assert c.best(8, batch=Batch(10, 1, 100.0))[0] == 0
    # a row planned before it made the pass 5 wide: up to 4 drafts cost only their draft steps (0.2 tokens
    # at 100 tok/s, worth it while 0.9^i > 0.2), a fifth widens the pass again
    assert c.best(8, batch=Batch(10, 5, 100.0))[0] == 4
    assert c.best(8, batch=Batch(10, 5, 1000.0))[0] == 0  # 2 tokens a draft step: never
    assert c.choose(8, behind=1, remaining=100, batch=Batch(10, 5, 100.0)) == 4
    # 48 tokens behind: the draft's catch-up pass (~ one draft step while nothing else is measured, 0.2 tokens
    # at this rate) is charged to drafting (4 drafts: 4.10 - 0.8 - 0.2 = 3.1 > 1, still worth it; at 400 tok/s,
    # where 2 drafts pay without it, 2.71 - 1.6 - 0.8 = 0.31 < 1: not)
    assert c.choose(8, behind=48, remaining=100, batch=Batch(10, 5, 100.0)) == 4
    assert c.best(8, batch=Batch(10, 5, 400.0))[0] == 2
    assert c.choose(8, behind=48, remaining=100, batch=Batch(10, 5, 400.0)) == 0
