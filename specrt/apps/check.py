"""Is this pair lossless here? Agreement with target-only decoding, greedy and sampled, and a sampling test.

- `first_divergence`: speculative vs target-only, greedy or sampled with coupling (a seed's sample is
  the target-only one token for token); where they part, the target's logit margin between the two
  candidates (sampled: with the position's noise added) tells a near-tie (numerics) from a bug.
- `second_token_test`: the second generated token of speculative sampling (the first one that
  goes through draft-and-verify) against its exact distribution under the target, chi-square.
- `check_pair`: both, the way `specrt check` runs them (every prompt compared, then the sampling test).

Both use the target engine directly (they hold the Pair while they do, like a generation).
"""
from __future__ import annotations

import math

import numpy as np

from specrt.apps.bench import Prompt
from specrt.config import GenerationConfig, SamplingConfig
from specrt.decoding.sampling import Coupled, warp
from specrt.errors import ConfigError
from specrt.manifest import ModelEntry

P_MIN = 1e-4  # the statistical test fails below this p-value (about 1 false alarm in 10,000 runs)
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95, method="coupled")  # the sampled comparison's settings
MIN_EXPECTED = 5.0  # chi-square bins are merged until each expects at least this many samples


def first_divergence(pair, prompt: list[int], max_new_tokens: int, draft_len: int | str, drafter: str | None = None,
                     sampling: SamplingConfig | None = None, seed: int = 0, tree: str = "auto") -> dict:
    """Run both decodes (greedy, or `sampling` with coupling and `seed`); at the first differing token
    report the target's logit margin there.

    Returns {"equal", "index", "margin", "target_only", "speculative", "tree_rounds"} (rounds of the speculative
    run that verified a tree: `tree` auto at draft_len auto, where the target takes trees). `margin` is the target's
    logit of the target-only token minus that of the speculative one, from a fresh pass over the
    common prefix (an EOS choice counts as the best EOS id's logit); sampled, the difference of the two
    tokens' coupled scores (log p + the position's Gumbel noise) in logit units (times the temperature),
    infinite for a token the warped distribution excludes. A tiny margin (within numerical noise) means
    the one-token and multi-token target passes rounded differently at a near-tie, not a bug.
    """
    sampling = sampling or SamplingConfig()
    if not (sampling.greedy or sampling.method == "coupled"):
        raise ValueError("a rejection-sampled run follows its drafts: only coupled sampling compares token for token")
    drafter = drafter or ("model" if pair.draft is not None else "ngram")
    base = pair.run(prompt, GenerationConfig(max_new_tokens=max_new_tokens, draft_len=0, sampling=sampling,
                                             seed=seed)).tokens
    res = pair.run(prompt, GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len,
                                            drafter=drafter, sampling=sampling, seed=seed, tree=tree))
    spec, trees = res.tokens, res.stats.get("tree_rounds", 0)
    n = min(len(base), len(spec))
    i = next((j for j in range(n) if base[j] != spec[j]), None)
    if i is None and len(base) == len(spec):
        return {"equal": True, "index": None, "margin": None, "target_only": base, "speculative": spec,
                "tree_rounds": trees}
    if i is None:
        i = n  # one of them ended (EOS) where the other went on
    ids = prompt + base[:i]
    eos = [e for e in pair.manifest.eos_token_ids if e < pair.manifest.vocab_size]
    with pair.exclusive():
        pair.target.truncate(0)
        logits = pair.target.forward(np.array([ids]), np.array([len(ids) - 1]))[0, 0, : pair.manifest.vocab_size]

        def token(seq: list[int]) -> int:  # the choice a decode made at index i (EOS: the likeliest EOS id)
            return seq[i] if i < len(seq) else max(eos, key=lambda e: logits[e])

        if not eos and not (i < len(base) and i < len(spec)):
            margin = None
        elif sampling.greedy:
            margin = float(logits[token(base)]) - float(logits[token(spec)])
        else:
            p = warp(logits[None], sampling)[0]
            pick = np.array([token(base), token(spec)])
            with np.errstate(divide="ignore"):
                score = np.log(p[pick]) - np.log(Coupled(seed).exponential(len(ids), pick))
            margin = float(sampling.temperature * (score[0] - score[1])) if p[pick[1]] > 0 else math.inf
    return {"equal": False, "index": i, "margin": margin, "target_only": base, "speculative": spec, "tree_rounds": trees}


def noise_threshold(entry: ModelEntry, kernel=None) -> tuple[float, str]:
    """Largest |logit margin| at a divergence that numerics explain, for this target graph, and why.
    `kernel`: the target engine's int4 kernel (engines/int4.Kernel), when the CPU engine loaded it.

    One-token and multi-token target passes agree to ~1e-5 in fp32 and in int4 with fp32
    activations (accuracy level 0/1); int8 activations (level 4) measured up to ~0.5 apart on
    Qwen2.5; fp16/bf16 activations sit in between. The thresholds leave a margin above those, and
    stay far below the logit gaps a wrong acceptance produces.
    """
    q = entry.quantization or {}
    if kernel is not None and kernel.invariant:
        # every matmul and attention node is specrt's: a row's logits do not depend on the pass around it,
        # so target-only and speculative decoding compute the same numbers; only an exact tie may part them
        return 1e-6, "specrt's kernels (a row's numbers do not depend on the pass around it)"
    if entry.precision == "int4" or q:
        level = int(q.get("accuracy_level", 0))
        # specrt's kernels off (not built, refused, or not on every node): say so where the verdicts are read
        why = None if kernel is None else kernel.why or kernel.attention_why or "a float matmul stays onnxruntime's"
        off = "" if kernel is None else (f"; specrt's kernels are off ({why}), so greedy speculative equals "
                                         "target-only only up to near-ties")
        if level in (0, 1):
            return 0.05, f"int4 weights, accuracy level {level} (fp32 activations)" + off
        if level in (2, 3):
            return 0.5, f"int4 weights, accuracy level {level} (16-bit activations)" + off
        return 1.0, f"int4 weights, accuracy level {level} (int8 activations)" + off
    if entry.precision == "fp16" or entry.dtype == "float16":
        return 0.5, "fp16"
    return 0.05, "fp32"


def classify(div: dict, entry: ModelEntry, kernel=None) -> str:
    """"equal", "numerical" (a near-tie within the graph's noise) or "BUG"."""
    if div["equal"]:
        return "equal"
    if div["margin"] is None:
        return "BUG"
    return "numerical" if abs(div["margin"]) < noise_threshold(entry, kernel)[0] else "BUG"


# ---------------------------------------------------------------- chi-square without scipy


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with integer `dof` degrees of freedom (exact, no scipy).

    Uses the closed forms of the regularized upper incomplete gamma function Q(dof/2, x/2) for
    integer and half-integer shapes: a finite sum of positive terms, each computed in log space
    (no overflow, no cancellation).
    """
    if dof < 1 or int(dof) != dof:
        raise ValueError(f"dof must be a positive integer, got {dof}")
    if not x > 0:
        return 1.0
    h = x / 2.0
    lh = math.log(h)
    if dof % 2 == 0:
        total = sum(math.exp(-h + i * lh - math.lgamma(i + 1)) for i in range(dof // 2))
    else:
        total = math.erfc(math.sqrt(h)) + sum(math.exp(-h + (i - 0.5) * lh - math.lgamma(i + 0.5))
                                              for i in range(1, (dof - 1) // 2 + 1))
    return min(1.0, total)


def chi_square(observed, probs, min_expected: float = MIN_EXPECTED) -> tuple[float, int, float]:
    """(statistic, dof, p-value) of counts against probabilities; bins expecting fewer than
    `min_expected` samples are merged into one (and that into the smallest other bin if it is still
    short). A count in a bin of probability 0 is an outright failure (p = 0)."""
    obs = np.asarray(observed, float)
    p = np.asarray(probs, float)
    if obs[p <= 0].sum() > 0:
        return math.inf, max(len(obs) - 1, 1), 0.0
    n = obs.sum()
    exp = p / p.sum() * n
    keep = exp >= min_expected
    o, e = list(obs[keep]), list(exp[keep])
    if (~keep).any():
        ro, re = obs[~keep].sum(), exp[~keep].sum()
        if re >= min_expected or not e:
            o.append(ro), e.append(re)
        elif re > 0 or ro > 0:
            j = int(np.argmin(e))
            o[j] += ro
            e[j] += re
    if len(e) < 2:
        return 0.0, 0, 1.0
    o, e = np.array(o), np.array(e)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(e) - 1
    return stat, dof, chi2_sf(stat, dof)


# ---------------------------------------------------------------- sampling test


def second_token_test(pair, prompt: list[int], samples: int = 400, draft_len: int = 2, mass: float = 0.99,
                      drafter: str | None = None, max_first: int = 512) -> dict:
    """Sample `samples` speculative generations (temperature 1, seeds 0..samples-1) and test the
    second token against its exact distribution under the target.

    The first token comes straight from the target's prefill, so it is trivially right; the second
    is the first one drafted and verified (accepted draft, or resampled from the residual). Its
    exact law is p(y) = sum_x p(x | prompt) p(y | prompt, x), computed with the target for the most
    likely first tokens x covering `mass` of the probability (at most `max_first` of them). The
    bins are: first token EOS, first token outside those x, and each second token y (EOS, which
    ends the output, is one bin). max_new_tokens is draft_len + 2, so the round after the first
    token drafts the full draft_len.
    """
    m = pair.manifest
    V = m.vocab_size
    eos = sorted({e for e in m.eos_token_ids if e < V})
    warm = SamplingConfig(temperature=1.0)
    k = max(1, min(draft_len, m.max_draft_len))
    drafter = drafter or ("model" if pair.draft is not None else "ngram")
    cfg = GenerationConfig(max_new_tokens=k + 2, draft_len=k, drafter=drafter, sampling=warm)
    pair.check(prompt, cfg)
    with pair.exclusive():
        pair.target.truncate(0)
        p1 = warp(pair.target.forward(np.array([prompt]), np.array([len(prompt) - 1]))[0, 0, :V][None], warm)[0]
        eos_first = float(p1[eos].sum()) if eos else 0.0
        top, covered = [], eos_first
        for x in np.argsort(-p1, kind="stable"):
            if covered >= mass or len(top) >= max_first:
                break
            if int(x) in eos:
                continue
            top.append(int(x))
            covered += float(p1[x])
        second = np.zeros(V)
        for x in top:
            pair.target.truncate(len(prompt))
            second += p1[x] * warp(pair.target.forward(np.array([[x]]), np.array([0]))[0, 0, :V][None], warm)[0]
    # bins: 0 first token EOS, 1 first token outside `top`, 2 second token EOS, 3+y second token y
    probs = np.concatenate([[eos_first, max(0.0, 1.0 - covered), second[eos].sum() if eos else 0.0], second])
    probs[3 + np.array(eos, dtype=np.int64)] = 0.0
    counts = np.zeros(len(probs))
    in_top = set(top)
    for seed in range(samples):
        toks = pair.run(prompt, GenerationConfig(max_new_tokens=k + 2, draft_len=k, drafter=drafter,
                                                 sampling=warm, seed=seed)).tokens
        if not toks:
            counts[0] += 1
        elif toks[0] not in in_top:
            counts[1] += 1
        elif len(toks) == 1:
            counts[2] += 1
        else:
            counts[3 + toks[1]] += 1
    stat, dof, p = chi_square(counts, probs)
    return {"samples": samples, "draft_len": k, "drafter": drafter, "first_tokens": len(top),
            "mass_covered": covered, "chi2": stat, "dof": dof, "p_value": p, "ok": p >= P_MIN}


# ---------------------------------------------------------------- the whole check

BUILTIN_PROMPTS = (
    "def quicksort(xs):",
    "def fib(n):\n    ",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
)


def builtin_prompts(pair, limit: int | None = None) -> list:
    """A few short code and text prompts (apps/bench.Prompt), for a check without a prompt file."""
    return [Prompt(str(i), pair.encode(p), "builtin") for i, p in enumerate(BUILTIN_PROMPTS, 1)][:limit]


def check_pair(pair, prompts: list, max_new_tokens: int = 48, draft_len: int | str = 4, samples: int = 400,
               on_event=None, tree: str = "auto") -> dict:
    """Is `pair` lossless here: per prompt (apps/bench.Prompt), speculative vs target-only, greedy and sampled
    with coupling (SAMPLED, seed = the prompt's place) (`first_divergence`, `classify`); then, unless
    `samples` is 0, `second_token_test` on the first prompt.

    Returns {"draft_len", "drafter", "max_new_tokens", "threshold", "numerics", "sampled_with", "prompts":
    [{"id", "verdict", "index", "margin", "tokens", "sampled": {"verdict", "index", "margin", "tokens"}}],
    "sampling": {"prompt", ...second_token_test's result} or None, "ok"}.
    `on_event(kind, data)` as it goes: ("start", the result so far) once every request is found valid,
    before anything runs; ("prompt", a prompt's row) after each comparison; ("sampling", {"prompt",
    "samples", "draft_len", "drafter"}) before the sampling test; ("sampled", its result) after it.
    """
    on_event = on_event or (lambda kind, data: None)
    # not a request's defaults: the check verifies the draft model's rounds when there is one, without early stops
    drafter = "model" if pair.draft is not None else "ngram"
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len, drafter=drafter, tree=tree)
    for p in prompts:  # every bad setting is reported before anything runs
        try:
            pair.check(p.ids, cfg)
        except ConfigError as e:
            raise ConfigError(f"prompt {p.id}: {e}") from None
    kernel = getattr(pair.target, "kernel", None)
    threshold, why = noise_threshold(pair.manifest.target, kernel)
    out = {"draft_len": draft_len, "drafter": drafter, "tree": tree, "max_new_tokens": max_new_tokens, "threshold": threshold,
           "numerics": why, "sampled_with": {"temperature": SAMPLED.temperature, "top_p": SAMPLED.top_p},
           "prompts": [], "sampling": None}
    on_event("start", out)
    for n, p in enumerate(prompts):
        rows = []
        for sampling in (None, SAMPLED):
            d = first_divergence(pair, p.ids, max_new_tokens, draft_len, drafter, sampling, seed=n, tree=tree)
            rows.append({"verdict": classify(d, pair.manifest.target, kernel), "index": d["index"],
                         "margin": d["margin"], "tokens": len(d["target_only"]), "tree_rounds": d["tree_rounds"]})
        row = {"id": p.id, **rows[0], "sampled": rows[1]}
        out["prompts"].append(row)
        on_event("prompt", row)
    if samples:
        k = min(2 if draft_len == "auto" else draft_len, 2, pair.manifest.max_draft_len)
        on_event("sampling", {"prompt": prompts[0].id, "samples": samples, "draft_len": k, "drafter": drafter})
        s = second_token_test(pair, prompts[0].ids, samples=samples, draft_len=k, drafter=drafter)
        out["sampling"] = {"prompt": prompts[0].id, **s}
        on_event("sampled", out["sampling"])
    bugs = sum(r["verdict"] == "BUG" or r["sampled"]["verdict"] == "BUG" for r in out["prompts"])
    out["ok"] = not bugs and (out["sampling"] is None or out["sampling"]["ok"])
    return out
