"""bench/ab.py's Meter: every pass of the pair's engines logged once, at its width, and priced from the table."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ab():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("ab", ROOT / "bench" / "ab.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_a_prompt_read_in_chunks_is_one_pass_of_its_width(ab, qwen_pair, tmp_path):
    pair = qwen_pair
    chunk = pair.target.prefill_chunk
    assert chunk, "the tiny pair's target reads wide passes in chunks"
    table = tmp_path / "prices.json"  # a price per width: 1 ms a token
    table.write_text(json.dumps({n: [w * 1e-3 for w in ab.Meter.WIDTHS] for n in ("target", "draft")}))
    meter = ab.Meter(pair, table)
    try:
        n = 2 * chunk + 5
        pair.target.truncate(0)
        pair.target.forward(np.zeros((1, n), np.int64), np.array([n - 1]))
        pair.target.forward(np.zeros((1, 3), np.int64), np.arange(3))
        assert meter.log == [("target", n), ("target", 3)]
        assert meter.take() == pytest.approx((n + 3) * 1e-3)
        assert meter.log == []
    finally:
        for e in (pair.target, pair.draft):
            e.truncate(0)
            del e.forward_ragged  # the meter wrapped the instance's method: the class's again
