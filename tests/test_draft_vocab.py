"""A draft with a restricted output vocabulary (export --draft-vocab): cheaper draft steps, same output."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from _helpers import WORDS, FrozenCosts, copy_pair, export
from specrt.engines.ort import ort_engine
from specrt.errors import ExportError, PairError
from specrt.export.pair import ExportConfig
from specrt.export.vocab import select_ids
from specrt.manifest import read_manifest, sha256_file

PROMPTS = ["def add(a, b):", "hello world", "for i in range(10):"]


def test_select_ids_by_count_then_lower_id():
    counts = np.array([0, 5, 0, 9, 1, 5, 0])
    assert select_ids(counts, 3, always=[]).tolist() == [1, 3, 5]  # 9, then the 5s
    assert select_ids(counts, 4, always=[6]).tolist() == [1, 3, 5, 6]  # always kept, then by count
    assert select_ids(counts, 6, always=[]).tolist() == [0, 1, 2, 3, 4, 5]  # unseen ids: lower id first


@pytest.fixture(scope="module")
def vocab_dir(work, hf_tiny):
    text = work / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 50 + "hello world, the quick brown fox\n" * 20)
    export(*hf_tiny["qwen2"], work / "pair-vocab", draft_vocab=200, draft_vocab_texts=(text,))
    return work / "pair-vocab"


@pytest.fixture(scope="module")
def vocab_pair(vocab_dir):
    import specrt

    with specrt.load(vocab_dir, threads=1) as pair:
        yield pair


def test_manifest_and_rows(vocab_dir, qwen_dir):
    m, full = read_manifest(vocab_dir), read_manifest(qwen_dir)
    d = m.draft
    assert d.output_ids == "draft/output_ids.npy" and d.logits_width == 200
    assert sha256_file(vocab_dir / d.output_ids) == d.files[d.output_ids]
    ids = np.load(vocab_dir / d.output_ids)
    assert len(ids) == 200 and (np.diff(ids) > 0).all() and set(m.eos_token_ids) <= set(ids.tolist())
    assert m.target.logits_width == full.target.logits_width and m.target.output_ids is None
    # The kept rows are exactly the full draft's logits at those ids.
    prompt = np.array([[5, 17, 33, 9, 100]])
    a = ort_engine(vocab_dir, d, 64, 1, threads=1).forward(prompt, np.array([4]))[0, 0]
    b = ort_engine(qwen_dir, full.draft, 64, 1, threads=1).forward(prompt, np.array([4]))[0, 0]
    np.testing.assert_allclose(a, b[ids], atol=1e-5)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_target_only(vocab_pair, prompt, k):
    base = vocab_pair.generate(prompt, max_new_tokens=24, draft_len=0)
    spec = vocab_pair.generate(prompt, max_new_tokens=24, draft_len=k, drafter="model")
    assert spec.tokens == base.tokens
    assert spec.stats["proposed"] > 0


def test_draft_never_proposes_a_dropped_id(vocab_pair, vocab_dir):
    from specrt.config import SamplingConfig
    from specrt.decoding.proposers import ModelProposer

    ids = set(np.load(vocab_dir / "draft/output_ids.npy").tolist())
    drafter = ModelProposer(vocab_pair.draft, vocab_pair.manifest.vocab_size, vocab_pair.draft_ids)
    rng = np.random.default_rng(0)
    seq = vocab_pair.encode("hello")
    drafter.start(seq[:-1])
    for cfg in (SamplingConfig(), SamplingConfig(temperature=1.5)):
        for _ in range(20):
            prop = drafter.propose(seq, 4, cfg, rng)
            d, p_draft = prop.tokens, prop.p_draft
            assert set(d.tolist()) <= ids
            if p_draft is not None:
                outside = np.ones(p_draft.shape[1], bool)
                outside[list(ids)] = False
                assert p_draft[:, outside].sum() == 0 and np.allclose(p_draft.sum(1), 1)
            drafter.commit(len(seq) - 1)  # the last token is always the next input


def test_batch_equals_alone(vocab_pair):
    from specrt.decoding.decode import Request

    cfg = vocab_pair.config(max_new_tokens=16, draft_len=3, drafter="model")
    ids = [vocab_pair.encode(p) for p in PROMPTS]
    alone = [vocab_pair.run(p, cfg).tokens for p in ids]
    with vocab_pair.runner(2) as dec:
        got = dict(dec.run([Request(i, p, cfg) for i, p in enumerate(ids)]))
    assert [got[i].tokens for i in range(len(ids))] == alone


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["draft"].update(output_ids="draft/missing.npy"), "not among the draft's hashed files"),
    (lambda d: d["draft"].update(logits_width=d["draft"]["logits_width"] + 1), "must list"),
])
def test_bad_output_ids_are_refused(vocab_dir, tmp_path, edit, match):
    import specrt

    d = copy_pair(vocab_dir, tmp_path / "p")
    raw = json.loads((d / "manifest.json").read_text())
    edit(raw)
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(PairError, match=match):
        specrt.load(d, threads=1, check_memory=False)


@pytest.mark.parametrize("kw,match", [
    (dict(draft_vocab=-1), "draft_vocab must be 0"),
    (dict(draft_vocab=100, draft=None), "no draft is given"),
    (dict(draft_vocab_texts=("x.txt",)), "give draft_vocab too"),
    (dict(draft_vocab=100, draft_vocab_texts=("/nonexistent/calib.txt",)), "calibration text not found"),
])
def test_export_config_validation(tmp_path, kw, match):
    base = dict(target="t", draft="d", out=tmp_path / "o")
    with pytest.raises(ExportError, match=match):
        ExportConfig(**{**base, **kw})


def test_cli_flag(hf_tiny, tmp_path):
    from specrt.cli import main

    text = tmp_path / "c.txt"
    text.write_text("def f(x): return x\n" * 20)
    out = tmp_path / "pair"
    r = CliRunner().invoke(main, ["export", "--target", str(hf_tiny["qwen2"][0]), "--draft", str(hf_tiny["qwen2"][1]),
                                  "--out", str(out), "--max-len", "64", "--draft-vocab", "150",
                                  "--draft-vocab-text", str(text)])
    assert r.exit_code == 0, r.output
    assert "draft vocabulary: 150 of 320 ids" in r.output and read_manifest(out).draft.logits_width == 150
    bad = CliRunner().invoke(main, ["export", "--target", str(hf_tiny["qwen2"][0]), "--out", str(tmp_path / "x"),
                                    "--draft-vocab", "150"])
    assert bad.exit_code == 2 and "no draft is given" in bad.output


# ---------------------------------------------------------------- losslessness with a restricted draft


@pytest.fixture(scope="module")
def stat_vocab_pair(work):
    """The statistical word pair whose draft keeps 7 of 11 ids (3 specials + the 4 most frequent words)."""
    import specrt

    src = work / "hf-stat"  # made by the stat_dir fixture
    text = work / "stat-calib.txt"
    text.write_text(" ".join(WORDS[:4] * 10))
    export(src / "target", src / "draft", work / "pair-stat-vocab", max_len=64, max_draft_len=4, draft_vocab=7,
           draft_vocab_texts=(text,))
    with specrt.load(work / "pair-stat-vocab", threads=1) as pair:
        yield pair


@pytest.mark.parametrize("temperature,top_k,top_p,k", [(1.0, 0, 1.0, 2), (0.8, 5, 0.9, 3)])
def test_restricted_draft_sampling_is_distributed_as_target(stat_dir, stat_vocab_pair, temperature, top_k, top_p, k):
    from test_decode import check_distributed_as_target

    assert stat_vocab_pair.manifest.draft.logits_width == 7
    check_distributed_as_target(stat_vocab_pair, temperature, top_k, top_p, k)


def test_empty_calibration_text_is_refused(hf_tiny, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ExportError, match="hold no tokens"):
        export(*hf_tiny["qwen2"], tmp_path / "pair", draft_vocab=100, draft_vocab_texts=(empty,))
    assert not (tmp_path / "pair").exists()


def test_mismatched_draft_script_and_guard(vocab_dir, vocab_pair, tmp_path):
    """bench/policy/make_mismatched.py (the guard's benchmark pair) shifts every draft row to the wrong id:
    the copy loads (hashes updated), output is unchanged, acceptance collapses, and auto stops drafting."""
    import subprocess
    import sys
    from pathlib import Path

    import specrt

    script = Path(__file__).resolve().parents[1] / "bench" / "policy" / "make_mismatched.py"
    dst = tmp_path / "mis"
    r = subprocess.run([sys.executable, str(script), str(vocab_dir), str(dst)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (np.load(dst / "draft/output_ids.npy") == np.load(vocab_dir / "draft/output_ids.npy") + 1).all()
    good = vocab_pair.generate("def f(x):", max_new_tokens=40, draft_len=2, drafter="model").stats
    with specrt.load(dst, threads=1) as mis:
        base = mis.generate("def f(x):", max_new_tokens=40, draft_len=0).tokens
        fixed = mis.generate("def f(x):", max_new_tokens=40, draft_len=2, drafter="model")
        assert fixed.tokens == base
        assert fixed.stats["acceptance_rate"] < good["acceptance_rate"]
        # auto's choices follow measured pass times, which for this tiny model are noise-level: plan with
        # the int4 real pair's (a draft step ~0.3 of a target step, a 2-wide verify ~1.1x a 1-wide one)
        mis.state.costs = FrozenCosts(draft_s=0.010, target_s={1: 0.035, 2: 0.039, 9: 0.092}, draft_read_s=0.002)
        auto = mis.generate("def f(x):", max_new_tokens=40, draft_len="auto", drafter="model")
        assert auto.tokens == base
        assert auto.stats["rounds_skipped"] >= auto.stats["rounds"] / 2, auto.stats["draft_len_hist"]
    r = subprocess.run([sys.executable, str(script), str(dst / "nowhere"), str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr


@pytest.mark.parametrize("regex", ["[ぁ-ん]{4}", "(ñ|é|ü|ß|ø|Ω|中){6}"])
def test_a_constraint_the_draft_vocabulary_cannot_spell_drafts_nothing_there_and_stays_exact(vocab_pair, regex):
    # the restricted draft vocabulary lacks most non-ASCII bytes: where the grammar allows only tokens it lacks,
    # its draft stops there instead of drafting from a distribution without mass (NaN)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            alone = vocab_pair.generate("hello", max_new_tokens=30, draft_len=0, regex=regex, **kw)
            r = vocab_pair.generate("hello", max_new_tokens=30, draft_len=3, drafter="model", regex=regex, **kw)
            assert r.tokens == alone.tokens and r.stats["grammar_complete"]
