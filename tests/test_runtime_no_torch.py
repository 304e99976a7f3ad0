"""The runtime stays lean: loading a pair and generating never touch torch or transformers (imports alone:
tests/test_layout.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_load_and_generate_without_torch_installed(qwen_dir):
    """torch, transformers and onnx made unimportable: the API and the CLI's generate still work."""
    p = _python("""
        import sys
        for name in ("torch", "transformers", "onnx"):
            sys.modules[name] = None  # any import of it now raises ImportError
        import specrt
        with specrt.load(sys.argv[1]) as pair:
            assert "onnx package" in pair.target.kernel.why, pair.target.kernel  # onnxruntime's own kernels run
            res = pair.generate("def fib(n):", max_new_tokens=12, draft_len=4, temperature=0.7, seed=1)
            assert len(res.tokens) == 12, res
            assert len(pair.generate("x", max_new_tokens=4, chat=True).tokens) == 4
        from specrt.cli import main
        try:
            main(["generate", sys.argv[1], "--prompt", "class Stack:", "--max-new-tokens", "6", "--json"])
        except SystemExit as e:
            assert e.code in (0, None), e.code
        print("OK")
    """, qwen_dir)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("OK")
    assert '"tokens"' in p.stdout
