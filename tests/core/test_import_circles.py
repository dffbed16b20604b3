"""No import circle inside a distribution: every module only looks down.

Read from the source (no import runs): an ``import`` or ``from ... import`` of a
module of the same distribution, anywhere in a module (also inside a function),
is an edge; ``from package import name`` is an edge to the module ``name`` when
there is one, else to the package. Imports under ``if TYPE_CHECKING:`` never run
and do not count, nor does the compiled ``_native``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kvcached-core": ROOT / "kvcached_core",
            "kvcached-vllm": ROOT / "kvcached_vllm" / "src" / "kvcached_vllm",
            "kvcached-sglang": ROOT / "kvcached_sglang" / "src" / "kvcached_sglang",
            "kvcached-serve": ROOT / "kvcached_serve" / "src" / "kvcached_serve"}


def _modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: None if path.name == "__init__.py" else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                if not alias.name.startswith("_native"):
                    sub = f"{base}.{alias.name}"
                    names.add(sub if sub in modules else base)
    edges = set()
    for target in names:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def circles(package: Path) -> list[list[str]]:
    """The import circles (strongly connected groups of two or more modules) of ``package``."""
    modules = _modules(package)
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_no_import_circle_inside_a_distribution(dist):
    assert circles(PACKAGES[dist]) == [], f"{dist} has import circles"


def test_the_check_finds_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def x():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import a\nfrom pkg import b\n")
    assert circles(pkg) == [["pkg.a", "pkg.b"]]
