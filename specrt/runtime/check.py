"""Greedy speculative vs greedy target-only: where they part, and whether numerics explain it."""
from __future__ import annotations

import numpy as np

from specrt.config import GenerationConfig


def first_divergence(pair, prompt: list[int], max_new_tokens: int, draft_len: int) -> dict:
    """Run both greedy decodes; at the first differing token report the target's logit margin there.

    A tiny margin (the two candidates' logits within numerical noise of each other) means the
    one-token and multi-token target passes rounded differently at a near-tie, not a bug.
    """
    base = pair.run(prompt, GenerationConfig(max_new_tokens=max_new_tokens, draft_len=0)).tokens
    spec = pair.run(prompt, GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len)).tokens
    n = min(len(base), len(spec))
    i = next((j for j in range(n) if base[j] != spec[j]), None)
    if i is None:
        same = len(base) == len(spec)
        return {"equal": same, "index": None if same else n, "margin": None, "target_only": base, "speculative": spec}
    ids = prompt + base[:i]
    pair.target.truncate(0)
    logits = pair.target.forward(np.array([ids]), np.array([len(ids) - 1]))[0, 0, : pair.manifest.vocab_size]
    margin = float(logits[base[i]] - logits[spec[i]])
    return {"equal": False, "index": i, "margin": margin, "target_only": base, "speculative": spec}
