"""Suite-wide settings and shared fixtures.

Settings: offline Hugging Face, one torch thread, vLLM tests skipped without vLLM, and no
hypothesis deadline (the suite runs beside vLLM engines under xdist on 2 cores: a 0.4 ms
example once took 545 ms; a slow example is not a failure, a wrong one is).
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
from hypothesis import settings as hypothesis_settings

from harness.vllm_utils import tiny_model_path, vllm_available
from tests.redis_fixtures import redis_cluster, redis_cluster_module, redis_server, redis_server_factory
from tests.remote_fixtures import remote_manager

hypothesis_settings.register_profile("lmcache", deadline=None)
hypothesis_settings.load_profile("lmcache")


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
# vLLM servers and multiprocess engines of the suite fork their engine-core and worker
# processes (vLLM's default on GPU) instead of vllm-cpu's spawn, which imports torch and vLLM
# again in each (about 24 s of CPU per server start on 2 cores); harness/forkserver.py.
# tests/vllm_adapter/test_real_model_e2e.py keeps vllm-cpu's spawn.
os.environ.setdefault("HARNESS_VLLM_PROCESSES", "fork")
# One OpenMP thread per vLLM engine, not bound to a core: the suite runs one test process per
# core, and two engines with a thread per core each spin-wait against each other (a file of
# engine tests took twice as long beside another one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


LONGEST_FIRST = (
    "tests/vllm_adapter/test_vllm_recurrent_hybrids.py",
    "tests/vllm_adapter/test_pd_e2e.py",
    "tests/vllm_adapter/test_vllm_gemma3_mla.py",
    "tests/blend/test_blend_real_model_e2e.py",
    "tests/vllm_adapter/test_vllm_e2e.py",
    "tests/vllm_adapter/test_vllm_sliding_window.py",
    "tests/vllm_adapter/test_vllm_block_reuse.py",
    "tests/vllm_adapter/test_real_model_e2e.py",
    "tests/vllm_adapter/test_pd_real_model_e2e.py",
)
"""The files that take longest (1-2 minutes each on 2 cores), run first: pytest-xdist hands whole
files (``--dist loadfile``) to its processes in collection order, so a long file collected last
would run alone at the end. In-process engines alternate with vLLM servers (two servers at once
on 2 cores slow each other down)."""


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    if _HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (make test installs vllm-cpu)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
