"""The folder layout is the architecture (docs/design.md, "Layout"): each package imports only the rooms below
it, the algorithm imports nothing but numpy and the engine protocols, modules import one another at the top
(no cycles, no imports hidden in functions), and the runtime never pulls torch."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "specrt"

# what each room may import of specrt (itself included); a module is in the room of its first package level
ALLOWED = {
    "errors": set(),
    "host": {"errors"},
    "config": {"errors"},
    "manifest": {"errors"},
    "engines": {"engines", "errors", "config", "manifest"},
    "decoding": {"decoding", "errors", "config", "engines.base"},
    "api": {"api", "decoding", "engines", "errors", "config", "manifest", "host"},
    "export": {"export", "engines", "errors", "config", "manifest", "host"},
    "apps": {"apps", "api", "decoding", "engines", "errors", "config", "manifest", "export", "host"},
    "cli": {"cli", "apps", "api", "decoding", "engines", "errors", "config", "manifest", "export", "host"},
    "__init__": {"api", "errors"},
    "__main__": {"cli"},
}
# the algorithm's third-party imports: numpy alone
DECODING_THIRD_PARTY = {"numpy"}


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).with_suffix("")
        yield f, ".".join(("specrt", *rel.parts)).removesuffix(".__init__")


def _imports(tree: ast.AST, module: str):
    """(node, imported module, at the module's top level) for each import of `tree`."""
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against the importing module's package
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            for a in node.names:
                yield node, _module_of(base, a.name), id(node) in top


def _module_of(base: str, name: str) -> str:
    """`from base import name`: the module base.name when that is a module, else base."""
    path = PKG.parent.joinpath(*f"{base}.{name}".split("."))
    return f"{base}.{name}" if path.with_suffix(".py").exists() or path.is_dir() else base


def _room(name: str) -> str:
    parts = name.split(".")[1:]
    return parts[0] if parts else "__init__"


def _allowed(room: str, target: str) -> bool:
    rest = target.split(".", 1)[1] if "." in target else ""
    return any(rest == a or rest.startswith(a + ".") for a in ALLOWED[room])


def test_each_room_imports_only_the_rooms_below_it():
    bad = []
    for f, mod in _modules():
        room = _room(mod) if mod != "specrt" else "__init__"
        for node, name, _ in _imports(ast.parse(f.read_text()), mod):
            if name.startswith("specrt") and name != "specrt" and not _allowed(room, name):
                bad.append(f"{mod} imports {name} (line {node.lineno})")
            top_name = name.split(".")[0]
            if room == "decoding" and top_name not in ("specrt", *DECODING_THIRD_PARTY, *sys.stdlib_module_names):
                bad.append(f"{mod} imports {name}: the algorithm uses numpy alone")
    assert bad == []


def test_the_algorithm_takes_no_session():
    """decoding/ is typed on engines and rows: no function of it takes a pair (the session, api/pair.Pair) or
    reads one's members; the session wires the round (api/runner.py)."""
    bad = []
    for f, mod in _modules():
        if _room(mod) != "decoding":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                names = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
                bad += [f"{mod} line {node.lineno}: parameter {n}" for n in names if "pair" in n.lower()]
            elif isinstance(node, ast.Attribute) and "pair" in node.attr.lower():
                bad.append(f"{mod} line {node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Name) and node.id in ("Pair", "pair"):
                bad.append(f"{mod} line {node.lineno}: {node.id}")
    assert bad == []


def test_no_specrt_imports_inside_functions_but_the_clis():
    """The CLI imports per command (keeps `specrt --help` fast); every other module imports specrt at its top,
    except the export's torch-bound graph module, imported when a model is exported (commented there)."""
    bad = []
    for f, mod in _modules():
        if _room(mod) == "cli":
            continue
        lines = f.read_text().splitlines()
        for node, name, top in _imports(ast.parse(f.read_text()), mod):
            if name.startswith("specrt") and not top and "(the trace extra)" not in lines[node.lineno - 1]:
                bad.append(f"{mod} line {node.lineno}: {lines[node.lineno - 1].strip()}")
    assert bad == []


def test_no_import_cycles():
    graph = {}
    for f, mod in _modules():
        graph[mod] = {name for _, name, top in _imports(ast.parse(f.read_text()), mod)
                      if top and name.startswith("specrt.")}
    seen, stack = {}, []

    def visit(m):
        seen[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            n = n if n in graph else n.rsplit(".", 1)[0]  # `from specrt.x import Name`: the module specrt.x
            if seen.get(n) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n in graph and n not in seen:
                visit(n)
        stack.pop()
        seen[m] = "done"

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def test_imports_do_not_pull_torch_or_transformers():
    code = textwrap.dedent("""
        import sys, specrt, specrt.cli
        import specrt.decoding.batch, specrt.decoding.decode, specrt.api.pair, specrt.apps.jobs, specrt.apps.bench
        import specrt.apps.tune, specrt.apps.check, specrt.apps.info, specrt.apps.serve.scheduler
        heavy = sorted(m for m in ("torch", "transformers", "onnx") if m in sys.modules)
        assert not heavy, heavy
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
