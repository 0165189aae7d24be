"""scripts/gpu_check.sh --cpu-dry-run: the GPU check's logic, end to end, on this machine.

The real run needs a lent GPU machine; this keeps the script, bench_gpu.py and the CUDA
test selection from rotting in between. It checks the files a GPU run leaves
(at most 8 plain files with plain names directly under $OUT) and their contents.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STEPS = ["env", "build", "cuda-tests", "bench", "suite"]
EXPECTED_FILES = {
    "summary.txt", "summary.json", "setup.log", "cuda_tests.xml", "cuda_tests.log",
    "bench_gpu.json", "bench_gpu.log", "suite.log",
}
MIN_CUDA_TESTS = 54  # 32 kernel tests in test_native_kernels.py + 22 in test_cuda_paths.py


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    env = dict(os.environ)
    env.update(OUT=str(out), PYTHON=sys.executable, PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.pop("GPU_CHECK_BUDGET", None)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-dry-run"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    return proc, out


pytestmark = pytest.mark.slow


def test_dry_run_passes_and_prints_the_summary(dry_run):
    proc, _ = dry_run
    have_cxx = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    assert proc.returncode == (0 if have_cxx else 1), proc.stdout[-4000:] + proc.stderr[-2000:]
    tail = proc.stdout[proc.stdout.index("---- gpu_check summary"):]
    for step in STEPS:
        assert re.search(rf"^{re.escape(step)}\s+(OK|WARN|FAIL|TIMEOUT|NO-TIME|SKIP)\s+\d+\s", tail, re.M), tail
    assert "overall: OK (exit 0)" in tail or not have_cxx
    assert "---- bench_gpu.py results" in proc.stdout


def test_out_holds_what_the_device_tool_brings_back(dry_run):
    _, out = dry_run
    entries = list(out.iterdir())
    assert {p.name for p in entries} == EXPECTED_FILES
    assert len(entries) <= 8 and all(p.is_file() for p in entries)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in entries)


def test_summary_json_lists_every_step(dry_run):
    _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry"
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] in {"OK", "WARN", "FAIL", "TIMEOUT", "NO-TIME", "SKIP"} for s in summary["steps"])
    assert summary["ok"] == all(s["status"] in {"OK", "WARN", "SKIP"} for s in summary["steps"])
    assert (out / "summary.txt").read_text().rstrip().endswith(("overall: OK (exit 0)", "overall: FAILED (exit 1)"))


def test_every_cuda_test_is_selected_and_none_fails(dry_run):
    _, out = dry_run
    root = ET.parse(out / "cuda_tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    assert tests >= MIN_CUDA_TESTS
    assert failures == errors == 0
    if not torch.cuda.is_available():
        assert skipped == tests  # without CUDA every one of them skips cleanly


def test_bench_json_has_every_section_and_passing_checks(dry_run):
    _, out = dry_run
    bench = json.loads((out / "bench_gpu.json").read_text())
    assert bench["small"] is True and bench["device"] == "cpu"
    assert bench["ok"] is True and bench["checks_failed"] == 0 and bench["checks"]
    assert {r["section"] for r in bench["rows"]} == {"pool", "copy", "overlap", "hs_ec"}
    for r in bench["rows"]:
        assert isinstance(r["value"], float) and r["value"] >= 0 and r["unit"]
        assert r["met"] is None  # targets are only judged on a GPU at full size
    targets = [r for r in bench["rows"] if r["target"]]
    assert {r["section"] for r in targets} == {"pool", "copy", "overlap"}
