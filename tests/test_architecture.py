"""The architecture rules that a reader cannot see in one file, checked on every `make test`.

* ruff finds nothing in ``lmcache``, ``tests``, ``benchmarks`` and ``harness`` (rules in pyproject.toml,
  the logging rules included);
* the import graph of ``lmcache/`` (module-level and function-level imports; imports
  under ``if TYPE_CHECKING:`` are not executed and do not count) has no cycle, between
  modules nor between packages: taken as one node with everything under it, no package
  (``lmcache.v1.gpu_connector``, ``lmcache.v1.storage_backend``, ``lmcache.integration.vllm``,
  ``lmcache.v1``, ...) sits on a cycle, so a lazy import inside a function cannot hide
  one (a module of ``lmcache.v1`` that a connector imports must not import a connector);
* nor has the static graph: the same one with the imports under ``if TYPE_CHECKING:``
  counted too (nothing left out), so every arrow points one way even for the type
  checker. A module that another imports names that one's types through a lower module
  (``lmcache.v1.chunk_span``) or a ``typing.Protocol`` of its own
  (``lmcache.v1.request.BoundKV``, ``lmcache.v1.storage_backend.disk_writer.DiskTier``),
  never by importing it back;
* the tiers (``storage_backend/``) and the copy connectors (``gpu_connector/``) never
  import upward (engine, transfer paths, hidden-state store, EC engine, vLLM adapter)
  nor each other, not even for types.
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


def _imports(
    tree: ast.AST,
    module: str,
    is_package: bool,
    modules: set[str],
    init_names: dict[str, set[str]] | None = None,
    type_checking: bool = False,
) -> set[str]:
    """lmcache modules imported anywhere in ``tree`` (module level and inside functions)
    except under ``if TYPE_CHECKING:``; with ``type_checking``, there too.

    ``from pkg import name`` is an import of ``pkg.name`` when that is a module, or when
    ``pkg``'s ``__init__`` does not define ``name`` (a compiled submodule such as
    ``lmcache._keyhash``, present only once built); else of ``pkg`` itself.
    """
    found: set[str] = set()
    defined = init_names or {}

    def resolve(base: str, name: str) -> str:
        full = f"{base}.{name}" if base else name
        if full in modules or (base in defined and name not in defined[base]):
            return full
        return base

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
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


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (assignments, defs, imports; any branch)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the lmcache modules it imports (see :func:`_imports`; ``type_checking``:
    the imports under ``if TYPE_CHECKING:`` count too, the static graph)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in files.items()}
    init_names = {name: _top_level_names(trees[name]) for name, path in files.items() if path.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found = _imports(trees[name], name, path.name == "__init__.py", modules, init_names, type_checking)
        graph[name] = {m for m in found if m != name}
    return graph


def packages(graph: dict[str, set[str]]) -> list[str]:
    """Every package of ``lmcache/`` but the root (a directory with an ``__init__.py``)."""
    return sorted(m for m in graph if m != "lmcache" and (ROOT / m.replace(".", "/") / "__init__.py").is_file())


def contract(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """``graph`` with ``package`` and every module under it merged into one node."""

    def node(module: str) -> str:
        return package if _within(module, package) else module

    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        here = node(module)
        out.setdefault(here, set()).update(node(d) for d in deps if node(d) != here)
    return out


def package_cycles(graph: dict[str, set[str]]) -> dict[str, list[list[str]]]:
    """For each package that sits on a cycle once contracted (:func:`contract`), the cycles."""
    found = {}
    for package in packages(graph):
        bad = [c for c in cycles(contract(graph, package)) if package in c]
        if bad:
            found[package] = bad
    return found


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


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the first module of ``component`` (a strongly connected component
    of ``graph``), as the modules along it, that module first and last (shortest, by BFS)."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise ValueError(f"{component} is not a cycle of the graph")


def describe_cycles(graph: dict[str, set[str]]) -> str:
    """Every module cycle and package cycle of ``graph``, one ``a -> b -> a`` a line ('' if none)."""
    lines = [" -> ".join(cycle_path(graph, c)) for c in cycles(graph)]
    for package, found in package_cycles(graph).items():
        contracted = contract(graph, package)
        lines += [f"[{package}] " + " -> ".join(cycle_path(contracted, sorted(c, key=lambda m: m != package))) for c in found]
    return "\n".join(lines)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_module_and_function_level_imports_but_not_type_checking_ones():
    graph = import_graph()
    assert "lmcache.v1.layerwise" in graph["lmcache.v1.cache_engine"]  # module level
    assert "lmcache.v1.hidden_state_store" in graph["lmcache.v1.cache_engine"]  # inside a method
    assert "lmcache.v1.gpu_connector.copy_ops" in graph["lmcache.v1.gpu_connector.paged"]  # from pkg import module
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lmcache.v1.cache_engine\n")
    assert _imports(tree, "lmcache.x", False, set(graph)) == set()
    assert _imports(tree, "lmcache.x", False, set(graph), type_checking=True) == {"lmcache.v1.cache_engine"}


def test_the_static_graph_adds_the_type_checking_imports():
    graph, static = import_graph(), import_graph(type_checking=True)
    assert all(graph[m] <= static[m] for m in graph)
    assert "lmcache.v1.config" in static["lmcache.v1.token_database"] - graph["lmcache.v1.token_database"]


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_found_cycle_is_printed_as_a_path():
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": {"a", "b"}, "d": set()}
    assert cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert cycle_path(graph, ["b", "c"]) == ["b", "c", "b"]
    assert describe_cycles(graph) == "a -> b -> c -> a"
    assert describe_cycles({"a": {"b"}, "b": set()}) == ""
    pkg = "lmcache.v1.gpu_connector"  # a package cycle: a real package's name (packages() reads the tree)
    graph = {pkg: set(), f"{pkg}.x": {"q"}, "q": {f"{pkg}.y"}, f"{pkg}.y": set()}
    assert describe_cycles(graph) == f"[{pkg}] {pkg} -> q -> {pkg}"


def test_a_compiled_submodule_is_not_its_package():
    """``from lmcache import _keyhash`` imports the extension, not ``lmcache/__init__.py``."""
    graph = import_graph()
    assert "lmcache._keyhash" in graph["lmcache.v1.keys"]
    assert "lmcache" not in graph["lmcache.v1.keys"]
    assert "lmcache" in graph["lmcache.cli"]  # ``from lmcache import __version__``


def test_package_cycle_finder_sees_a_cycle_that_no_module_cycle_shows():
    """A module of ``p`` imports a module of ``p.sub`` (lazily, say) which imports another
    module of ``p``: no module cycle, but ``p.sub`` sits on a package cycle."""
    graph = {"p.a": {"p.sub.x"}, "p.sub.x": set(), "p.sub.y": {"p.a"}, "p.b": set()}
    assert cycles(graph) == []
    assert cycles(contract(graph, "p.sub")) == [["p.a", "p.sub"]]


def test_lmcache_has_no_import_cycle():
    graph = import_graph()
    assert cycles(graph) == [], describe_cycles(graph)


def test_lmcache_has_no_import_cycle_counting_type_checking_imports():
    """The static graph (module-level, function-level and ``if TYPE_CHECKING:`` imports)
    has no module cycle nor package cycle; a failure prints each cycle as a path."""
    found = describe_cycles(import_graph(type_checking=True))
    assert not found, "import cycles (type-only imports counted):\n" + found


def test_lmcache_has_no_package_cycle():
    graph = import_graph()
    assert {"lmcache.v1", "lmcache.v1.gpu_connector", "lmcache.integration.vllm"} <= set(packages(graph))
    assert package_cycles(graph) == {}, describe_cycles(graph)


def test_tiers_and_connectors_never_import_upward_nor_each_other():
    bad = []
    for module, deps in sorted(import_graph(type_checking=True).items()):
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
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "lmcache", "tests", "benchmarks", "harness"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
