"""Typed option groups: frozen dataclasses parsed from their own field definitions.

Each tier (and the adapter) keeps its ``extra_config`` options as one frozen dataclass
whose fields say everything about a key:

    write_threads: int = option(2, "local_disk_write_threads", "writer threads", ge=1)

* the config key (``extra_config.<key>``; names and file format are unchanged),
* the type, from the annotation (``bool``, ``int``, ``float``, ``str``, ``str | None``),
  parsed with the same rules as the top-level keys (``"false"`` is False, NaN and
  infinities are rejected, ...),
* bounds (``ge``, ``gt``) or ``choices``,
* the one-line description, which is the source of the option tables in the docs
  (:func:`markdown_table`; ``tests/config/test_options.py`` checks the docs against it).

:func:`parse_options` builds an instance from ``extra_config``; a bad value raises
:class:`~lmcache.v1.config.ConfigError` naming the key, the value and the
expectation. Cross-field rules go into the dataclass's ``__post_init__``. Fields
without :func:`option` metadata (paths, sizes taken from top-level keys) are passed
by the caller as keyword arguments. Unknown ``extra_config`` keys are warned about,
with a "did you mean" hint, by :meth:`LMCacheEngineConfig.apply`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

from lmcache.v1.config import SCALAR_PARSERS, ConfigError

T = TypeVar("T")

_WHAT = {"int": "an integer", "float": "a number", "bool": "a boolean (true/false)"}


def option(
    default: Any,
    key: str,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    choices: tuple[str, ...] | None = None,
    default_doc: str | None = None,
) -> Any:
    """A dataclass field that is the ``extra_config`` option ``key``.

    ``default_doc`` replaces the default in the docs when the real default is computed
    at run time (the field's default is then None)."""
    meta = {"key": key, "doc": doc, "ge": ge, "gt": gt, "choices": choices, "default_doc": default_doc}
    return dataclasses.field(default=default, metadata=meta)


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are config options, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "key" in f.metadata]


def option_keys(cls: type) -> tuple[str, ...]:
    return tuple(f.metadata["key"] for f in option_fields(cls))


def parse_options(cls: type[T], extra: Mapping[str, Any] | None, **given: Any) -> T:
    """An instance of ``cls`` from the ``extra_config`` mapping (absent keys: defaults).

    ``given`` sets the non-option fields. Raises ConfigError for a bad value."""
    values = dict(given)
    extra = extra or {}
    for f in option_fields(cls):
        key = f.metadata["key"]
        if key in extra:
            values[f.name] = parse_value(f, extra[key])
    return cls(**values)


def parse_value(f: dataclasses.Field, value: Any) -> Any:
    """``value`` parsed and checked as option field ``f`` (ConfigError otherwise)."""
    meta = f.metadata
    name = f"extra_config.{meta['key']}"
    kind = _kind(f)
    optional = kind.endswith("| None")
    base = kind.split("|")[0].strip()
    if value is None and optional:
        return None
    parser = SCALAR_PARSERS.get(base, _as_str)
    out = parser(name, value)
    if out is None and not optional:
        raise ConfigError(f"{name}={value!r}: expected {_WHAT.get(base, 'a string')}")
    what = _WHAT.get(base, "a value")
    if meta["ge"] is not None and out < meta["ge"]:
        raise ConfigError(f"{name}={value!r}: expected {what} >= {meta['ge']}")
    if meta["gt"] is not None and out <= meta["gt"]:
        raise ConfigError(f"{name}={value!r}: expected {what} > {meta['gt']}")
    if meta["choices"] is not None and out not in meta["choices"]:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(meta['choices'])}")
    return out


def _kind(f: dataclasses.Field) -> str:
    t = f.type
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _as_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string")
    return value


def default_text(f: dataclasses.Field) -> str:
    """The default as the docs write it (YAML spelling)."""
    if f.metadata.get("default_doc"):
        return f.metadata["default_doc"]
    value = f.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def bounds_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    parts = []
    if meta["ge"] is not None:
        parts.append(f">= {meta['ge']:g}")
    if meta["gt"] is not None:
        parts.append(f"> {meta['gt']:g}")
    if meta["choices"] is not None:
        parts.append(" / ".join(meta["choices"]))
    return ", ".join(parts)


def markdown_table(cls: type) -> str:
    """The docs table of ``cls``'s options: key, type, default, allowed, meaning."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in option_fields(cls):
        kind = _kind(f).replace(" | None", " or null")
        rows.append(
            f"| `{f.metadata['key']}` | {kind} | `{default_text(f)}` | {bounds_text(f) or 'any'} | {f.metadata['doc']} |"
        )
    return "\n".join(rows)

