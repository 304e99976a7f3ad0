"""A restricted output vocabulary for the draft model (issue 4): its output matrix keeps only the
token ids that are frequent on a calibration text, so each draft step reads a fraction of it.

Exactness does not depend on the choice: the draft's distribution is renormalised over the kept ids
(the others get probability 0, so the draft never proposes them) and the rejection test is exact for
any draft distribution. A poor choice only costs acceptance where the target wants a dropped id.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from specrt.errors import ExportError

DEFAULT_TEXT_BYTES = 16 << 20  # enough to rank the ids that matter; tokenizing it takes seconds


def default_corpus() -> list[Path]:
    """Python's own standard library sources: code with English comments and docstrings, present on
    every machine that runs the exporter (no download)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))


def calibration_counts(tokenizer_file: Path, texts: list[Path], vocab: int, max_bytes: int = DEFAULT_TEXT_BYTES,
                       strict: bool = True) -> np.ndarray:
    """Token id counts [vocab] over the texts (up to `max_bytes` of them, in order). `strict`: an
    unreadable text is an error (the user named it), else it is skipped."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    counts = np.zeros(vocab, np.int64)
    used = 0
    for path in texts:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            if strict:
                raise ExportError(f"cannot read calibration text {path}: {getattr(e, 'strerror', None) or e}") from None
            continue  # a stdlib file we cannot read is no loss
        ids = np.asarray(tok.encode(text).ids, np.int64)
        np.add.at(counts, ids[ids < vocab], 1)
        used += len(text)
        if used >= max_bytes:
            break
    return counts


def select_ids(counts: np.ndarray, n: int, always: list[int]) -> np.ndarray:
    """The `n` most frequent ids (ties, e.g. ids never seen, go to the lower id: byte-level BPE ids
    follow merge order, so lower ids are the more common pieces), plus `always`; sorted ascending."""
    keep = set(int(i) for i in always if 0 <= i < len(counts))
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    for i in order:
        if len(keep) >= n:
            break
        keep.add(int(i))
    return np.array(sorted(keep), np.int64)
