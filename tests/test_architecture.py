"""The architecture rules that a reader cannot see in one file, checked on every `make test`.

* ruff finds nothing in ``lmcache``, ``tests`` and ``benchmarks`` (rules in pyproject.toml,
  the logging rules included);
* the import graph of ``lmcache/`` (module-level and function-level imports; imports
  under ``if TYPE_CHECKING:`` are not executed and do not count) has no cycle;
* the tiers (``storage_backend/``) and the copy connectors (``gpu_connector/``) never
  import upward (engine, transfer paths, hidden-state store, EC engine, vLLM adapter)
  nor each other.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lmcache"

UPWARD = (
    "lmcache.v1.cache_engine",
    "lmcache.v1.transfer",
    "lmcache.v1.layerwise",
    "lmcache.v1.hidden_state_store",
    "lmcache.v1.ec_engine",
    "lmcache.integration",
)
LOW_LAYERS = ("lmcache.v1.storage_backend", "lmcache.v1.gpu_connector")


# ----------------------------------------------------------------------------- import graph
def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """lmcache modules imported anywhere in ``tree`` except under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def resolve(base: str, name: str) -> str:
        full = f"{base}.{name}" if base else name
        return full if full in modules else base

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{node.module}" if node.module else pkg
            else:
                base = node.module or ""
            for alias in node.names:
                found.add(resolve(base, alias.name))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m == "lmcache" or m.startswith("lmcache.")}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {m for m in _imports(tree, name, path.name == "__init__.py", modules) if m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_module_and_function_level_imports_but_not_type_checking_ones():
    graph = import_graph()
    assert "lmcache.v1.layerwise" in graph["lmcache.v1.cache_engine"]  # module level
    assert "lmcache.v1.hidden_state_store" in graph["lmcache.v1.cache_engine"]  # inside a method
    assert "lmcache.v1.gpu_connector.copy_ops" in graph["lmcache.v1.gpu_connector.paged"]  # from pkg import module
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lmcache.v1.cache_engine\n")
    assert _imports(tree, "lmcache.x", False, set(graph)) == set()


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lmcache_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_tiers_and_connectors_never_import_upward_nor_each_other():
    bad = []
    for module, deps in sorted(import_graph().items()):
        for low in LOW_LAYERS:
            if not _within(module, low):
                continue
            forbidden = UPWARD + tuple(other for other in LOW_LAYERS if other != low)
            bad += [f"{module} -> {dep}" for dep in sorted(deps) if any(_within(dep, f) for f in forbidden)]
    assert bad == []


# ----------------------------------------------------------------------------- lint
def test_ruff_finds_nothing():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode:
        pytest.fail("ruff is not installed: it is part of the test extra (pip install -e '.[test]')")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "lmcache", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
