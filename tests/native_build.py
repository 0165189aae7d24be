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


def sanitizer_env(compiler: str) -> dict[str, str]:
    """:func:`child_env` for a child that loads an ASan + UBSan build made by ``compiler``:
    its libasan preloaded, halting on the first error. Skips the test without libasan."""
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    libasan = found.stdout.strip()
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        pytest.skip("libasan is not available")
    return child_env(LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1",
                     UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1")  # fmt: skip


def run_sanitized_extension(tmp_path: Path, source: str, module: str, driver: str, *args: str) -> None:
    """Build the C extension ``csrc/<source>`` as ``module`` with AddressSanitizer and UBSan,
    then run ``driver`` (Python source; ``sys.argv[1]`` is the built library's path, then
    ``args``) in a child interpreter with libasan preloaded; the child must exit 0 and print
    "ok" last. Skips without a C compiler, libasan or Python's C headers."""
    import sys
    import sysconfig

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    env = sanitizer_env(compiler)
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("Python's C headers are not installed")
    lib = tmp_path / f"{module}_asan.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-g", "-std=c11", "-Wall", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                    f"-I{include}", str(REPO / "csrc" / source), "-o", str(lib)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", driver, str(lib), *args], env=env, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-4000:]
