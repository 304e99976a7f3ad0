"""Helpers shared by the tests (plain functions; the fixtures live in conftest.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from specrt.decoding.policy import CostModel
from specrt.engines import int4

# Tests of what specrt's own kernels give (exact rows) skip where onnxruntime's run instead: the library is
# not built, the CPU has no SIMD path for it, or SPECRT_INT4_KERNEL=off.
KERNELS_RUN = int4.unavailable() is None and int4.setting() != "off"
needs_kernels = pytest.mark.skipif(not KERNELS_RUN, reason="specrt's kernels do not run here: "
                                   f"{int4.unavailable() or 'SPECRT_INT4_KERNEL=off'}")

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]  # + 3 specials = 11 ids
EOS_ID = 2  # "<|im_end|>" in every tiny tokenizer


def _quiet(_msg):
    pass


def export(target, draft, out, **kw):
    """export_pair with test defaults (fp32, max_len 256, max_draft_len 8)."""
    from specrt.export.pair import ExportConfig, export_pair

    kw.setdefault("max_len", 256)
    kw.setdefault("max_draft_len", 8)
    return export_pair(ExportConfig(target=str(target), draft=None if draft is None else str(draft), out=Path(out),
                                    **kw), log=_quiet)


def copy_pair(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*.verified"))
    return dst


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


P_MIN = 1e-4  # p-value threshold of every goodness-of-fit test here


def chi2_pvalue(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """Chi-square p-value of counts vs probabilities; bins with expected < 5 are merged.

    A count in a bin of probability exactly 0 is an outright failure (returns 0).
    """
    observed = np.asarray(observed, float)
    expected_p = np.asarray(expected_p, float)
    if observed[expected_p == 0].sum() > 0:
        return 0.0
    n = observed.sum()
    exp = expected_p * n
    keep = exp >= 5
    obs_b, exp_b = list(observed[keep]), list(exp[keep])
    if (~keep).any() and exp[~keep].sum() > 0:
        obs_b.append(observed[~keep].sum())
        exp_b.append(exp[~keep].sum())
    exp_b = np.array(exp_b)
    exp_b *= sum(obs_b) / exp_b.sum()  # exact same total (float rounding)
    if len(exp_b) < 2:
        return 1.0
    return float(stats.chisquare(obs_b, exp_b).pvalue)


def binom_pvalue(successes: int, n: int, p: float) -> float:
    return float(stats.binomtest(successes, n, p).pvalue)


class FakeEngine:
    """A fake model whose logits depend on everything in its cache: T[last] + U[sum(cache) % 4].

    Any stale or missing cache slot changes its output, so distribution tests through it also check
    the loop's cache bookkeeping.
    """

    def __init__(self, seed, V, scale=1.5, max_len=64, like=None):
        r = np.random.default_rng(seed)
        self.T, self.U = r.normal(scale=scale, size=(V, V)), r.normal(scale=scale, size=(4, V))
        if like is not None:  # a draft that resembles `like`: partial agreement
            self.T, self.U = like.T + self.T / 2, like.U + self.U / 2
        self.max_len, self.batch, self.length = max_len, 1, 0
        self.cache = np.full(max_len, -1, np.int64)
        self.calls = 0

    def logits_for(self, ctx):
        return self.T[ctx[-1]] + self.U[int(np.sum(ctx)) % 4]

    def forward(self, tokens, logit_positions):
        P, S = self.length, tokens.shape[1]
        assert tokens.shape[0] == 1 and P + S <= self.max_len
        self.cache[P:P + S] = tokens[0]
        self.length = P + S
        self.calls += 1
        return np.stack([self.logits_for(self.cache[:P + j + 1]) for j in logit_positions])[None].astype(np.float32)

    def truncate(self, n):
        assert 0 <= n <= self.length
        self.length = n

    def close(self):
        pass


class FakeTreeEngine(FakeEngine):
    """FakeEngine taking trees (engines.base.Engine's `trees`): a token with parent pointers reads the cache and
    its ancestors only; `move` copies cache slots. Its logits depend on every token read, so a wrong ancestor,
    a stale slot or a missed move changes them."""

    trees = True

    def forward_ragged(self, tokens, counts, logit_index, parents=None):
        P, S = self.length, tokens.shape[1]
        assert tokens.shape[0] == 1 and counts[0] == S and P + S <= self.max_len
        par = np.arange(-1, S - 1) if parents is None else np.asarray(parents)[0]
        self.cache[P:P + S] = tokens[0]
        self.length = P + S
        self.calls += 1

        def read(j):  # the cache, then j's ancestors from the root down, then j
            path = []
            while j >= 0:
                path.insert(0, j)
                j = par[j]
            return np.concatenate([self.cache[:P], tokens[0][path]])

        return np.stack([self.logits_for(read(j)) for j in logit_index]).astype(np.float32)

    def move(self, r, src, dst):
        self.cache[list(dst)] = self.cache[list(src)]


class FakeMatcher:
    """A grammar for fake engines: llguidance's matcher interface over a rule on the last token (`rule(prev)`
    is the set of tokens allowed after token `prev`; a token's bytes are its id, one byte)."""

    def __init__(self, rule, V: int, last: int):
        self.rule, self.V, self.seq = rule, V, [last]

    def _ok(self, prev):
        return self.rule(prev)

    def consume_token(self, t):
        if t not in self._ok(self.seq[-1]):
            return False
        self.seq.append(t)
        return True

    def rollback(self, n):
        del self.seq[len(self.seq) - n:]
        return True

    def deep_copy(self):
        m = FakeMatcher(self.rule, self.V, 0)
        m.seq = list(self.seq)
        return m

    def validate_tokens(self, tokens):
        prev, n = self.seq[-1], 0
        for t in tokens:
            if t not in self._ok(prev):
                break
            prev, n = t, n + 1
        return n

    def compute_bitmask(self):
        bits = np.zeros(self.V + (-self.V) % 8, np.uint8)
        bits[list(self._ok(self.seq[-1]))] = 1
        return np.packbits(bits, bitorder="little").tobytes()

    def compute_ff_bytes(self):
        out, prev = [], self.seq[-1]
        while len(ok := self._ok(prev)) == 1 and len(out) < 4:
            prev = next(iter(ok))
            out.append(prev)
        return bytes(out)

    def is_stopped(self):
        return False

    def is_accepting(self):
        return True

    def is_error(self):
        return False

    def get_error(self):
        return ""


class ByteTokens:
    @staticmethod
    def tokenize_bytes(b):
        return list(b)


def rule(prev):
    """After 0 only 1 may come, after 1 only 3 (0 forces 1, 3); else any token but the same again."""
    return {1} if prev == 0 else {3} if prev == 1 else {t for t in range(5) if t != prev}


def fake_exact_joint(target: FakeEngine, prompt: list[int], cfg, n: int = 3, allowed=None) -> np.ndarray:
    """Exact probability of every first-n-token sequence under `target` warped by `cfg`, flat [V**n];
    `allowed(prev)`: the tokens a grammar allows after token `prev` (the others masked before warping)."""
    from specrt.decoding.sampling import warp

    V = target.T.shape[0]

    def dist(seq):
        lg = target.logits_for(np.array(seq)).astype(np.float32)
        if allowed is not None:
            ok = np.zeros(V, bool)
            ok[list(allowed(seq[-1]))] = True
            lg = np.where(ok, lg, -np.inf)
        return warp(lg[None], cfg)[0]

    probs = np.ones(1)
    seqs = [list(prompt)]
    for _ in range(n):
        probs = np.concatenate([p * dist(s) for p, s in zip(probs, seqs)])
        seqs = [s + [v] for s in seqs for v in range(V)]
    return probs


def sequence_index(tokens, V: int) -> int:
    i = 0
    for t in tokens:
        i = i * V + int(t)
    return i



class FrozenCosts(CostModel):
    """A cost model that ignores measurements, so auto's choices are deterministic."""

    def observe_draft(self, seconds, passes):
        pass

    def observe_target(self, width, seconds):
        pass

    def observe_catchup(self, seconds, tokens):
        pass


def cli(*args, env=None):
    """`specrt ARGS...` in-process (click's CliRunner); stderr apart from stdout."""
    from click.testing import CliRunner

    from specrt.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def one_line_error(r, code: int = 2) -> str:
    """The message of a run that ended with `code` and one `Error:` line, no traceback."""
    assert r.exit_code == code, (r.exit_code, r.output)
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit), r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, r.output
    return lines[0]
