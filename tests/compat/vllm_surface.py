"""A static view of one vLLM release's interfaces, read from its source with ``ast``.

vLLM is never imported: the source comes from the installed ``vllm`` package directory or
from a wheel (a zip file), so any release can be checked on any machine without its
dependencies. :func:`extract` turns the modules lmcache depends on
(:mod:`lmcache.integration.vllm.vllm_compat`) into plain data (a JSON-able dict, cached
next to a wheel):

* per module: its top-level names (definitions and imports, with where imports come
  from), literal constants, and per class its resolved bases, fields (annotated class
  attributes), attributes (class-level and ``self.x =`` assignments), and methods with
  kind, parameters (name, kind, default or not), return annotation and abstractness;
* the connectors vLLM's factories register (``register_connector`` calls);
* how vLLM's built-in ``LMCacheConnectorV1`` drives lmcache's implementation object: what
  it imports from lmcache, the calls and attribute probes on it, the event fields it reads;
* the ``kv_transfer_params`` keys vLLM's own code reads or writes, and the API classes
  with a ``kv_transfer_params`` field.

:func:`wheel_for` finds a wheel in the cache directory (``$LMCACHE_WHEEL_CACHE``, default
``~/.cache/lmcache-wheels``) or downloads it there once with ``pip download --no-deps``.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache.integration.vllm import vllm_compat

EXTRACTOR_VERSION = 4
"""Bump when the extracted data changes shape (invalidates the JSON caches)."""
CACHE_ENV = "LMCACHE_WHEEL_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "lmcache-wheels"
DOWNLOAD_TIMEOUT_S = 900

TRANSFER_PARAM_MODULES = (
    "vllm.v1.request",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.engine.core",
    "vllm.v1.engine.output_processor",
    "vllm.v1.engine.async_llm",
)
"""vLLM's own (not a connector's) code that may read or write ``kv_transfer_params`` keys;
the OpenAI protocol modules (``vllm/entrypoints/openai/**/protocol.py``) are added by glob."""
PROTOCOL_GLOBS = ("vllm/entrypoints/openai/protocol.py", "vllm/entrypoints/openai/*/protocol.py")
FACTORY_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.ec_transfer.ec_connector.factory",
)
BUILTIN_WRAPPER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
BUILTIN_ENGINE_ATTR = "_lmcache_engine"
"""The attribute holding lmcache's implementation object in vLLM's built-in wrapper."""

PARAM_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")


# ============================================================================ sources
class Source:
    """Where a vLLM release's ``.py`` files are read from."""

    label: str
    version: str

    def read(self, path: str) -> str | None:
        raise NotImplementedError

    def paths(self) -> list[str]:
        raise NotImplementedError

    def module_text(self, module: str) -> tuple[str, bool] | None:
        """(source, is_package) of ``module``, or None when the release has no such module."""
        base = module.replace(".", "/")
        for path, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            text = self.read(path)
            if text is not None:
                return text, package
        return None

    def glob(self, pattern: str) -> list[str]:
        return sorted(p for p in self.paths() if fnmatch.fnmatchcase(p, pattern))


class TreeSource(Source):
    """The installed ``vllm`` package (found without importing it)."""

    def __init__(self, package_dir: Path, version: str, label: str = "installed") -> None:
        self.root = package_dir.parent
        self.version = version
        self.label = f"{label} vllm {version}"

    def read(self, path: str) -> str | None:
        p = self.root / path
        return p.read_text(encoding="utf-8", errors="replace") if p.is_file() else None

    @functools.cache
    def paths(self) -> list[str]:  # type: ignore[override]
        return [str(p.relative_to(self.root)) for p in (self.root / "vllm").rglob("*.py")]


class WheelSource(Source):
    """A vLLM wheel, read as a zip file."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self._zip = zipfile.ZipFile(wheel)
        self._names = set(self._zip.namelist())
        self.version = wheel.name.split("-")[1]
        self.label = f"{wheel.name.split('-')[0]} {self.version} wheel"

    def read(self, path: str) -> str | None:
        if path not in self._names:
            return None
        return self._zip.read(path).decode("utf-8", errors="replace")

    def paths(self) -> list[str]:
        return [n for n in self._names if n.endswith(".py")]

    def entry_points(self) -> str | None:
        for name in self._names:
            if name.endswith(".dist-info/entry_points.txt"):
                return self._zip.read(name).decode()
        return None


def installed_source() -> TreeSource | None:
    """The installed vLLM, or None (no vLLM, or one whose source is not on disk)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    found = vllm_compat.installed_vllm()
    if spec is None or not spec.submodule_search_locations or found is None:
        return None
    return TreeSource(Path(list(spec.submodule_search_locations)[0]), found[1])


# ============================================================================ wheels
def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def find_wheel(dist: str, version: str, directory: Path | None = None) -> Path | None:
    directory = directory or cache_dir()
    if not directory.is_dir():
        return None
    for p in sorted(directory.glob("*.whl")):
        name, _, rest = p.name.partition("-")
        if _norm(name) == _norm(dist) and rest.startswith(f"{version}-"):
            return p
    return None


def wheel_for(dist: str, version: str) -> tuple[Path | None, str]:
    """The wheel of ``dist==version`` in the cache directory, downloaded there once
    (``pip download --no-deps``, any host: the Linux x86-64 wheel is asked for). Returns
    (path, "") or (None, why it could not be fetched)."""
    directory = cache_dir()
    found = find_wheel(dist, version, directory)
    if found is not None:
        return found, ""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"cannot create the wheel cache {directory} ({exc}); set ${CACHE_ENV}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--quiet", "--retries", "1", "--timeout", "30", "--platform", "manylinux_2_28_x86_64", "--python-version",
        "3.11", "--implementation", "cp",
        "-d", str(directory), f"{dist}=={version}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"pip download {dist}=={version} failed: {type(exc).__name__}: {exc}"
    found = find_wheel(dist, version, directory)
    if proc.returncode != 0 or found is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"pip download {dist}=={version} failed (exit {proc.returncode}): {' | '.join(tail)}"
    return found, ""


# ============================================================================ ast helpers
def _annotation(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def signature_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """Parameters as ``[name, kind, has_default]`` (``self``/``cls`` included), return annotation."""
    a = fn.args
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs] + [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    first_default = len(positional) - len(a.defaults)
    params: list[list[Any]] = [[p.arg, kind, i >= first_default] for i, (p, kind) in enumerate(positional)]
    if a.vararg is not None:
        params.append([a.vararg.arg, "VAR_POSITIONAL", False])
    params += [[p.arg, "KEYWORD_ONLY", d is not None] for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg is not None:
        params.append([a.kwarg.arg, "VAR_KEYWORD", False])
    return {"params": params, "returns": _annotation(fn.returns)}


def _decorator_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(ast.unparse(target).split(".")[-1] if not isinstance(target, ast.Attribute) else target.attr)
        if isinstance(target, ast.Attribute) and target.attr in ("setter", "deleter"):
            names.add("accessor")
    return names


def _method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any] | None:
    decorators = _decorator_names(fn)
    if "overload" in decorators or "accessor" in decorators:
        return None
    kind = "method"
    if "classmethod" in decorators:
        kind = "classmethod"
    elif "staticmethod" in decorators:
        kind = "staticmethod"
    elif {"property", "cached_property"} & decorators:
        kind = "property"
    out = signature_of(fn)
    out.update(kind=kind, abstract="abstractmethod" in decorators)
    return out


def _literal(node: ast.expr) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, (str, int, float, bool)) else None


def _resolve_relative(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _class(node: ast.ClassDef, resolve: Any) -> dict[str, Any]:
    fields: dict[str, bool] = {}
    attrs: set[str] = set()
    methods: dict[str, Any] = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields[item.target.id] = item.value is not None
        elif isinstance(item, ast.Assign):
            attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info = _method(item)
            if info is not None:
                methods[item.name] = info
            for sub in ast.walk(item):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
                    sub, (ast.AnnAssign, ast.AugAssign)) else []  # fmt: skip
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        attrs.add(t.attr)
    return {
        "bases": [resolve(ast.unparse(b)) for b in node.bases],
        "fields": fields,
        "attrs": sorted(attrs),
        "methods": methods,
    }


def parse_module(module: str, text: str, is_package: bool) -> dict[str, Any]:
    tree = ast.parse(text)
    imports: dict[str, str] = {}
    names: set[str] = set()
    constants: dict[str, Any] = {}
    for node in ast.walk(tree):  # imports anywhere at top level or under TYPE_CHECKING/try
        if isinstance(node, ast.ImportFrom):
            src = _resolve_relative(module, is_package, node)
            for alias in node.names:
                imports.setdefault(alias.asname or alias.name, f"{src}.{alias.name}")
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if (value := _literal(node.value)) is not None:
                        constants[t.id] = value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
            if node.value is not None and (value := _literal(node.value)) is not None:
                constants[node.target.id] = value
        elif isinstance(node, (ast.If, ast.Try)):  # conditional imports and definitions
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    names.update(a.asname or a.name for a in sub.names)
                elif isinstance(sub, (ast.ClassDef, ast.FunctionDef)):
                    names.add(sub.name)
    local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}

    def resolve(name: str) -> str:
        head, _, rest = name.partition(".")
        if head in local and not rest:
            return f"{module}.{head}"
        if head in imports:
            return imports[head] + (f".{rest}" if rest else "")
        return name

    classes = {n.name: _class(n, resolve) for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = {
        n.name: signature_of(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return {"names": sorted(names), "imports": imports, "constants": constants, "classes": classes,
            "functions": functions}  # fmt: skip


# ============================================================================ special readers
def _registrations(tree: ast.AST) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_connector" and len(node.args) >= 3):  # fmt: skip
            args = [_literal(a) for a in node.args[:3]]
            if all(isinstance(a, str) for a in args):
                out[args[0]] = args[1:]
    return out


def _is_engine(node: ast.expr, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (isinstance(node, ast.Attribute) and node.attr == BUILTIN_ENGINE_ATTR
            and isinstance(node.value, ast.Name) and node.value.id == "self")  # fmt: skip


def builtin_wrapper_usage(text: str, class_name: str) -> dict[str, Any] | None:
    """How vLLM's built-in wrapper class drives lmcache's implementation object."""
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        return None
    calls: dict[str, list[dict[str, Any]]] = {}
    probes: set[str] = set()
    sets: set[str] = set()
    imports: list[list[str]] = []
    ctor: list[dict[str, Any]] = []
    event_attrs: set[str] = set()
    overrides = sorted(n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))

    def call_shape(call: ast.Call) -> dict[str, Any]:
        return {"nargs": len(call.args), "keywords": sorted(k.arg for k in call.keywords if k.arg),
                "star": any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)}

    for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        aliases: set[str] = set()
        bound: dict[str, str] = {}  # local name -> method fetched with getattr(engine, "m")
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value, target = node.value, node.targets[0].id
                if _is_engine(value, aliases):
                    aliases.add(target)
                elif (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr"
                      and value.args and _is_engine(value.args[0], aliases)):  # fmt: skip
                    name = _literal(value.args[1]) if len(value.args) > 1 else None
                    if isinstance(name, str):
                        bound[target] = name
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmcache"):
                imports += [[node.module, a.name] for a in node.names]
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and _is_engine(func.value, aliases):
                    calls.setdefault(func.attr, []).append(call_shape(node))
                elif isinstance(func, ast.Name) and func.id in bound:
                    calls.setdefault(bound[func.id], []).append(call_shape(node))
                elif isinstance(func, ast.Name) and func.id in ("hasattr", "getattr") and node.args \
                        and _is_engine(node.args[0], aliases):
                    name = _literal(node.args[1]) if len(node.args) > 1 else None
                    if isinstance(name, str):
                        probes.add(name)
                elif isinstance(func, ast.Name) and func.id == "cls":
                    ctor.append(call_shape(node))
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and _is_engine(t.value, aliases):
                        sets.add(t.attr)
        if fn.name == "get_kv_connector_kv_cache_events":  # the fields it reads off each event
            loop_vars = {g.target.id for n in ast.walk(fn) if isinstance(n, (ast.ListComp, ast.GeneratorExp))
                         for g in n.generators if isinstance(g.target, ast.Name)}  # fmt: skip
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in loop_vars:
                    event_attrs.add(node.attr)
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                        and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in loop_vars):  # fmt: skip
                    name = _literal(node.args[1])
                    if isinstance(name, str):
                        event_attrs.add(name)
    return {"calls": calls, "probes": sorted(probes), "sets": sorted(sets), "imports": imports, "ctor": ctor,
            "event_attrs": sorted(event_attrs), "overrides": overrides}  # fmt: skip


def _mentions_params(node: ast.expr) -> bool:
    return "kv_transfer_params" in ast.unparse(node)


def transfer_param_keys(text: str) -> tuple[set[str], set[str]]:
    """(keys of ``kv_transfer_params`` read or written by this code, keys of ``extra_args`` it reads)."""
    keys: set[str] = set()
    extra: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            key = _literal(node.args[0])
            if node.func.attr in ("get", "pop", "setdefault") and isinstance(key, str):
                receiver = node.func.value
                if _mentions_params(receiver):
                    keys.add(key)
                elif "extra_args" in ast.unparse(receiver):
                    extra.add(key)
        elif isinstance(node, ast.Subscript) and _mentions_params(node.value):
            key = _literal(node.slice)
            if isinstance(key, str):
                keys.add(key)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = _literal(node.left)
            if isinstance(key, str) and _mentions_params(node.comparators[0]):
                keys.add(key)
    return keys, extra


def _protocol_classes(text: str) -> list[str]:
    out = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name) and i.target.id == "kv_transfer_params"
            for i in node.body
        ):
            out.append(node.name)
    return out


# ============================================================================ extraction
def _wanted() -> dict[str, set[str]]:
    """``{module: names}`` of every vLLM name in the interface tables."""
    out: dict[str, set[str]] = {}
    for i in vllm_compat.INTERFACES:
        out.setdefault(i.module, set()).add(i.target)
    for f in vllm_compat.FIELDS_READ:
        out.setdefault(f.module, set()).add(f.cls)
    return out


def extract(source: Source) -> dict[str, Any]:
    """The surface of ``source`` (see the module docstring). Parses the modules of the
    interface tables and follows, for the names wanted only, re-exports and base classes
    into further vLLM modules."""
    modules: dict[str, Any] = {}
    missing: set[str] = set()
    queue = [(m, n) for m, names in sorted(_wanted().items()) for n in sorted(names)]
    done: set[tuple[str, str]] = set()
    while queue:
        module, name = queue.pop()
        if (module, name) in done or module in missing:
            continue
        done.add((module, name))
        if module not in modules:
            found = source.module_text(module)
            if found is None:
                missing.add(module)
                continue
            modules[module] = parse_module(module, *found)
        data = modules[module]
        if name in data["classes"]:
            for base in data["classes"][name]["bases"]:
                if base.startswith("vllm.") and base.count(".") >= 2:
                    queue.append(tuple(base.rsplit(".", 1)))  # type: ignore[arg-type]
        elif name in data["imports"] and name in data["names"]:
            origin = data["imports"][name]
            if origin.startswith("vllm.") and origin.count(".") >= 2:
                queue.append(tuple(origin.rsplit(".", 1)))  # type: ignore[arg-type]
    registrations: dict[str, list[str]] = {}
    for module in FACTORY_MODULES:
        found = source.module_text(module)
        if found is not None:
            registrations.update(_registrations(ast.parse(found[0])))
    wrapper = None
    found = source.module_text(BUILTIN_WRAPPER_MODULE)
    if found is not None:
        wrapper = builtin_wrapper_usage(found[0], vllm_compat.BUILTIN_CONNECTOR)
    param_keys: dict[str, list[str]] = {}
    extra_keys: set[str] = set()
    protocol: dict[str, list[str]] = {}
    texts = [(m.replace(".", "/") + ".py", source.module_text(m)) for m in TRANSFER_PARAM_MODULES]
    for pattern in PROTOCOL_GLOBS:
        texts += [(p, (source.read(p) or "", False)) for p in source.glob(pattern)]
    for path, found in texts:
        if found is None:
            continue
        keys, extra = transfer_param_keys(found[0])
        extra_keys |= extra
        for key in keys:
            param_keys.setdefault(key, []).append(path)
        if "entrypoints" in path:
            classes = _protocol_classes(found[0])
            if classes:
                protocol[path] = classes
    entry_points = source.entry_points() if isinstance(source, WheelSource) else None
    return {
        "extractor": EXTRACTOR_VERSION,
        "version": source.version,
        "label": source.label,
        "modules": modules,
        "missing_modules": sorted(missing),
        "registrations": registrations,
        "builtin_wrapper": wrapper,
        "transfer_param_keys": {k: sorted(v) for k, v in sorted(param_keys.items())},
        "extra_args_keys": sorted(extra_keys),
        "transfer_param_api": protocol,
        "entry_points": entry_points,
    }


def cached_extract(source: Source) -> dict[str, Any]:
    """:func:`extract`, cached as JSON: beside a wheel, or in the cache directory for the
    installed vLLM. The key holds the extractor version and the interface tables (editing them
    re-reads the source) and the wheel's size or the installed package's path and mtime."""
    tables = repr((vllm_compat.INTERFACES, vllm_compat.FIELDS_READ)).encode()
    if isinstance(source, WheelSource):
        stamp = f"{source.wheel.stat().st_size}"
    elif isinstance(source, TreeSource):
        init = source.root / "vllm" / "__init__.py"
        stamp = f"{source.root}:{source.version}:{init.stat().st_mtime_ns if init.exists() else 0}"
    else:
        return extract(source)
    key = hashlib.sha1(tables + f"{EXTRACTOR_VERSION}:{stamp}".encode()).hexdigest()[:16]
    if isinstance(source, WheelSource):
        path = source.wheel.with_name(f"{source.wheel.name}.surface-{key}.json")
    else:
        path = cache_dir() / f"installed-vllm-{source.version}.surface-{key}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    data = extract(source)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache still works, just slower
    return data


# ============================================================================ queries
@dataclass(frozen=True)
class Surface:
    """Queries over :func:`extract`'s data."""

    data: dict[str, Any]

    @property
    def version(self) -> str:
        return self.data["version"]

    @property
    def label(self) -> str:
        return self.data["label"]

    @property
    def minor(self) -> tuple[int, int]:
        return vllm_compat.minor_of(self.version)

    def module(self, name: str) -> dict[str, Any] | None:
        return self.data["modules"].get(name)

    def locate(self, module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        """(defining module, name) of ``module.name``, following re-exports."""
        data = self.module(module)
        if data is None or depth > 5:
            return None
        if name in data["classes"] or name in data["functions"] or name in data["constants"]:
            return module, name
        origin = data["imports"].get(name)
        if origin is not None and name in data["names"]:
            src, _, attr = origin.rpartition(".")
            return self.locate(src, attr, depth + 1) or (src, attr)
        return (module, name) if name in data["names"] else None

    def has_name(self, module: str, name: str) -> bool:
        return self.locate(module, name) is not None

    def cls(self, module: str, name: str) -> dict[str, Any] | None:
        where = self.locate(module, name)
        if where is None:
            return None
        data = self.module(where[0])
        return None if data is None else data["classes"].get(where[1])

    def constant(self, module: str, name: str) -> Any:
        where = self.locate(module, name)
        data = self.module(where[0]) if where else None
        return None if data is None else data["constants"].get(where[1])

    def chain(self, module: str, name: str) -> list[tuple[str, dict[str, Any]]]:
        """The class and its vLLM base classes, nearest first (``(qualified name, class data)``)."""
        out: list[tuple[str, dict[str, Any]]] = []
        todo = [(module, name)]
        while todo:
            mod, cname = todo.pop(0)
            where = self.locate(mod, cname)
            if where is None:
                continue
            data = self.module(where[0])
            cdata = None if data is None else data["classes"].get(where[1])
            qual = ".".join(where)
            if cdata is None or any(q == qual for q, _ in out):
                continue
            out.append((qual, cdata))
            for base in cdata["bases"]:
                if base.startswith("vllm.") and "." in base:
                    todo.append(tuple(base.rsplit(".", 1)))  # type: ignore[arg-type]
        return out

    def methods(self, module: str, name: str) -> dict[str, dict[str, Any]]:
        """Every method of the class, inherited ones included (the nearest definition wins)."""
        out: dict[str, dict[str, Any]] = {}
        for _, cdata in self.chain(module, name):
            for m, info in cdata["methods"].items():
                out.setdefault(m, info)
        return out

    def members(self, module: str, name: str) -> set[str]:
        """Fields, attributes and methods of the class, inherited ones included."""
        out: set[str] = set()
        for _, cdata in self.chain(module, name):
            out |= set(cdata["fields"]) | set(cdata["attrs"]) | set(cdata["methods"])
        return out

    def fields(self, module: str, name: str) -> dict[str, bool]:
        """Annotated fields (dataclass / msgspec), inherited ones first: ``{name: has_default}``."""
        out: dict[str, bool] = {}
        for _, cdata in reversed(self.chain(module, name)):
            out.update(cdata["fields"])
        return out
