"""Build script: the pure-Python package plus the optional native copy kernels in csrc/.

Metadata comes from pyproject.toml; this file only adds the native libraries:

* ``lmcache/_c_ops_cpu.so`` from ``csrc/paged_copy.cpp`` with the system C++ compiler
  (``$CXX``, else ``c++``/``g++``/``clang++``);
* ``lmcache/_keyhash.*.so`` from ``csrc/keyhash.c``: a CPython extension module that
  hashes a token list into chunk keys in one pass (the pure-Python path in
  lmcache/v1/token_database.py gives identical keys when it is missing);
* ``lmcache/_sockread.*.so`` from ``csrc/sockread.c``: a CPython extension module that
  reads a remote-tier value from its socket with the GIL released (the Python
  ``recv_into`` loop in lmcache/v1/storage_backend/connector/resp.py when it is missing);
* ``lmcache/_c_ops_cuda.so`` from ``csrc/paged_copy_cuda.cu`` with nvcc, only when nvcc
  exists and the build environment's torch is a CUDA build (``LMCACHE_BUILD_CUDA=1``
  forces the attempt, ``=0`` skips it; ``LMCACHE_CUDA_ARCHS="80;90"`` picks the GPUs).

Both are plain C-ABI shared libraries loaded through ctypes
(lmcache/v1/gpu_connector/native.py), so the build needs neither Python nor torch
headers, and pip's isolated build environment never downloads torch. The native
libraries are optional: any failure prints one line and installation still succeeds;
lmcache then uses the torch copy path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HEADER = "csrc/paged_copy.h"
CXX_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-pthread", "-Wall"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
DEFAULT_CUDA_ARCHS = "75;80;86;89;90"


class NativeLibrary(Extension):
    """A C-ABI shared library (not a Python module) written to ``<package>/<name>.so``."""

    def __init__(self, name: str, source: str, *, cuda: bool) -> None:
        super().__init__(name, sources=[source], depends=[HEADER], optional=True)
        self.cuda = cuda


def _say(msg: str) -> None:
    print(f"lmcache: {msg}", flush=True)


def _find_cxx() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    return None


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _torch_cuda_version() -> str | None:
    """CUDA version of the build environment's torch, or None (no torch, or a CPU build)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch  # only present with --no-build-isolation or a CUDA-aware build env

    return torch.version.cuda


class BuildNative(build_ext):
    """build_ext that compiles NativeLibrary entries and never fails the installation."""

    def get_ext_filename(self, fullname: str) -> str:
        if isinstance(self.ext_map.get(fullname), NativeLibrary):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NativeLibrary):
            super().build_extension(ext)
            return
        kind = "CUDA" if ext.cuda else "CPU"
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = self._cuda_command(ext, out) if ext.cuda else self._cpu_command(ext, out)
            if cmd is None:
                return
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            _say(f"built native {kind} copy kernels -> {out.name}")
        except subprocess.CalledProcessError as exc:
            first = (exc.stderr or exc.stdout or "").strip().splitlines()
            _say(f"native {kind} copy kernels not built ({first[0] if first else exc}); using the torch fallback")
        except Exception as exc:  # noqa: BLE001 - a native build failure must never fail the install
            _say(f"native {kind} copy kernels not built ({type(exc).__name__}: {exc}); using the torch fallback")

    def _cpu_command(self, ext: NativeLibrary, out: Path) -> list[str] | None:
        cxx = _find_cxx()
        if cxx is None:
            _say("native CPU copy kernels not built (no C++ compiler found); using the torch fallback")
            return None
        return [*cxx.split(), *CXX_FLAGS, *ext.sources, "-o", str(out)]

    def _cuda_command(self, ext: NativeLibrary, out: Path) -> list[str] | None:
        mode = os.environ.get("LMCACHE_BUILD_CUDA", "auto")
        if mode == "0":
            _say("CUDA copy kernels skipped (LMCACHE_BUILD_CUDA=0)")
            return None
        nvcc = _find_nvcc()
        if nvcc is None:
            _say("CUDA copy kernels skipped (no nvcc)")
            return None
        if mode != "1" and _torch_cuda_version() is None:
            _say("CUDA copy kernels skipped (no CUDA torch in the build environment; LMCACHE_BUILD_CUDA=1 forces)")
            return None
        archs = [a.strip() for a in os.environ.get("LMCACHE_CUDA_ARCHS", DEFAULT_CUDA_ARCHS).split(";") if a.strip()]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        return [nvcc, *NVCC_FLAGS, *gencode, *ext.sources, "-o", str(out)]


setup(
    ext_modules=[
        # A real CPython extension (needs Python headers): native chunk hashing for keys.
        # optional=True: a failed build leaves the hashlib path (identical keys).
        Extension(
            "lmcache._keyhash",
            sources=["csrc/keyhash.c"],
            optional=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall"],
        ),
        # Another CPython extension: a remote-tier value read from its socket with the GIL
        # released (a Python recv_into loop when it is missing).
        Extension(
            "lmcache._sockread",
            sources=["csrc/sockread.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c11", "-Wall"],
        ),
        NativeLibrary("lmcache._c_ops_cpu", "csrc/paged_copy.cpp", cuda=False),
        NativeLibrary("lmcache._c_ops_cuda", "csrc/paged_copy_cuda.cu", cuda=True),
    ],
    cmdclass={"build_ext": BuildNative},
)
