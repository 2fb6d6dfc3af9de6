"""compute-sanitizer over every routed Hopper kernel (tools/sanitize_driver.py): no
memory error, shared-memory race or barrier misuse."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("quick", [False, True])
def test_driver_runs_every_hopper_kernel(quick):
    """The driver's calls, routed as on an H200 (no GPU needed), reach every Hopper
    forward and backward kernel, at lengths that are whole 64-token tiles (the Gluon
    backward) and lengths that are not (the Triton one), at both head dims."""
    out = subprocess.run([sys.executable, str(ROOT / "tools/sanitize_driver.py"), "--list"] + ["--quick"] * quick,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    for kernel in ("hopper.forward_gluon_ws", "hopper.forward_triton", "hopper.backward_gluon.dkdv",
                   "hopper.backward_gluon.dq", "hopper.backward_triton.dkdv"):
        assert kernel in out, kernel
    shapes = [ast.literal_eval(line.split(" | ")[1]) for line in out.splitlines() if line.startswith("train |")]
    trained = {(sq % 64 == 0 and sk % 64 == 0, max(d, 64)) for _, _, _, sq, sk, d in shapes}
    assert {(True, 64), (False, 64), (True, 128)} <= trained, trained


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_routed_kernels_are_sanitizer_clean(tool):
    """Every routed kernel once (`--quick`; `PART=sanitize bash tools/gpu_suite.sh` runs
    the whole driver): no error, no shared-memory hazard."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["compute-sanitizer", "--tool", tool, sys.executable, str(ROOT / "tools/sanitize_driver.py"),
                           "--quick"], capture_output=True, text=True, env=env, timeout=280)
    log = proc.stdout + proc.stderr
    assert re.search(r"sanitize_driver: \d+ calls ran", log), log[-3000:]
    summary = re.findall(r"(?:ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: (\d+) hazards?)", log)
    assert summary and all(int(a or b) == 0 for a, b in summary), log[-3000:]
