"""Fixtures of the blending adapter tests without vLLM (``test_blend_connector``, ``test_blend_bounds``):
the tiny in-memory Llama as the blender's model, and both connector roles around a real engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def hermetic_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``LMCACHE_*`` variable of the caller's environment reaches the config."""
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def model() -> Any:
    from lmcache.v1.blend.hf_llama import HFLlamaBlendModel
    from tests.blend.helpers import tiny_llama
    from tests.blend.test_blend_connector import LAYERS

    return HFLlamaBlendModel(tiny_llama(LAYERS))


@pytest.fixture
def mini(tmp_path, model, monkeypatch, hermetic_env) -> Iterator[Any]:
    from tests.blend.test_blend_connector import MiniBlendVLLM

    m = MiniBlendVLLM(str(tmp_path), model, monkeypatch)
    yield m
    m.close()
