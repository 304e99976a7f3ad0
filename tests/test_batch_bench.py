"""bench/batch_bench.py runs end to end on the tiny pair (numbers are not checked, only their shape)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "batch_bench.py"


def _module():
    spec = importlib.util.spec_from_file_location("batch_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_batch_bench_table_and_json(qwen_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}():", "chat": False}) + "\n" for i in range(5)))
    out = tmp_path / "b.json"
    bench = _module()
    assert bench.main([str(qwen_dir), "--prompts", str(prompts), "--batch-sizes", "1,2,4", "--draft-lens", "0,3",
                       "--max-new-tokens", "8", "--threads", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["draft_len", "batch", "tok/s"] and len(table) == 2 + 6
    res = json.loads(out.read_text())
    assert [(r["draft_len"], r["batch_size"]) for r in res["rows"]] == [(k, b) for k in (0, 3) for b in (1, 2, 4)]
    assert all(r["tokens"] == 5 * 8 and r["tokens_per_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["speedup"] == 1.0 and 0 < res["rows"][4]["acceptance_rate"] < 1
    assert bench.main([str(qwen_dir), "--prompts", str(tmp_path / "missing.jsonl")]) == 2
