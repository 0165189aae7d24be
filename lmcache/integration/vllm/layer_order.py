"""vLLM's attention layers in model order, from their module names.

Stateless.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_INT = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The layer number in a module name like ``model.layers.3.self_attn.attn`` (first integer)."""
    m = _INT.search(name)
    return int(m.group(1)) if m else None


def ordered_layers(names: Iterable[str]) -> list[str]:
    """Layer names in model order (by layer number; names without one keep their order, last)."""
    names = list(names)
    keyed = [(layer_index(n), i, n) for i, n in enumerate(names)]
    keyed.sort(key=lambda t: (t[0] is None, t[0] if t[0] is not None else 0, t[1]))
    return [n for _, _, n in keyed]
