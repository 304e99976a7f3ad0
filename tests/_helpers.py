"""Helpers shared by the tests (plain functions; the fixtures live in conftest.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

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
