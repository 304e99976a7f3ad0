"""The runtime stays lean: importing it, loading a pair and generating never touch torch or transformers."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_imports_do_not_pull_torch_or_transformers():
    p = _python("""
        import sys, specrt, specrt.runtime, specrt.runtime.pair, specrt.runtime.decode, specrt.runtime.sampling
        import specrt.runtime.text, specrt.engines.ort, specrt.config, specrt.cli
        heavy = sorted(m for m in ("torch", "transformers", "onnx") if m in sys.modules)
        assert not heavy, heavy
    """)
    assert p.returncode == 0, p.stderr


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


def test_engines_import_nothing_from_the_runtime():
    """engines/ are the backends under runtime/: the dependency runs one way."""
    import ast
    from pathlib import Path

    for f in sorted((Path(__file__).resolve().parents[1] / "specrt" / "engines").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not [n for n in names if n.startswith("specrt.runtime")], f"{f.name} imports {names}"

