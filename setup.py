"""Build script: the pure-Python package plus the optional native copy kernels in csrc/.

The native extension is optional. If it cannot be built (no compiler, no torch headers),
installation still succeeds and lmcache falls back to the torch copy path; see
lmcache/v1/gpu_connector/native.py.
"""
from __future__ import annotations

from setuptools import setup

setup()
