"""Build the native kernels for tests with the compiler flags ``setup.py`` uses.

The package build (``setup.py``) owns the flags (``CXX_FLAGS``, ``NVCC_FLAGS``); tests
that need a variant build (bounds-checked, sanitized, scalar) read them from there and
add their own, so there is one compile command to maintain. Also the environment a
test's helper subprocess needs to import the test package (``tests.*``).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_SOURCE = REPO / "csrc" / "paged_copy.cpp"
CUDA_SOURCE = REPO / "csrc" / "paged_copy_cuda.cu"


def setup_flags(name: str) -> list[str]:
    """The list literal ``name`` assigned at the top of ``setup.py`` (read, not executed)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"setup.py {name}"
            return value
    raise AssertionError(f"setup.py defines no {name}")


def cxx() -> str | None:
    """The C++ compiler (``$CXX``, else ``c++``, else ``g++``), or None."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def build_cpu_kernels(out: Path, *extra: str) -> Path:
    """``csrc/paged_copy.cpp`` built with setup.py's flags plus ``extra`` (an ``-O`` level in
    ``extra`` replaces setup.py's) and debug info. Skips the test without a compiler."""
    compiler = cxx()
    if compiler is None:
        pytest.skip("no C++ compiler")
    flags = setup_flags("CXX_FLAGS")
    if any(f.startswith("-O") for f in extra):
        flags = [f for f in flags if not f.startswith("-O")]
    cmd = [compiler, *flags, "-g", *extra, str(CPU_SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def build_cuda_kernels(out: Path, arch: str) -> Path:
    """``csrc/paged_copy_cuda.cu`` built with setup.py's nvcc flags for one ``sm_XY`` arch
    (``arch`` = ``"90"``). Skips the test without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("the CUDA kernels are not built and nvcc is missing")
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    subprocess.run([nvcc, *setup_flags("NVCC_FLAGS"), gencode, str(CUDA_SOURCE), "-o", str(out)], check=True)
    return out


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus the repository on ``PYTHONPATH`` (a ``python -c``
    helper then imports ``tests.<subject>.<module>``) and ``extra``."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)
