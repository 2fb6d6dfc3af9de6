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

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("quick", [False, True])
def test_driver_runs_every_hopper_kernel(quick):
    """The driver's calls, routed as on an H200 (no GPU needed), reach every Hopper
    forward and backward kernel, at lengths that are whole 64-token tiles (the Gluon
    backward) and lengths that are not (the Triton one), at both head dims."""
    out = subprocess.run([sys.executable, str(ROOT / "tools/sanitize_driver.py"), "--list"] + ["--quick"] * quick,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    for kernel in ("hopper.forward_gluon_ws", "hopper.forward_triton", "hopper.backward_gluon.dkdv",
                   "hopper.backward_gluon.dq", "backward_triton.dkdv"):
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
    if tool == "racecheck":  # Triton's warp-specialize dispatch is a false report: see below
        log = _without_dispatch_hazards(log)
    summary = re.findall(r"(?:ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: (\d+) hazards?)", log)
    assert summary and all(int(a or b) == 0 for a, b in summary), log[-3000:]


def _dispatch_loads() -> set[int]:
    """The SASS offsets of the worker warps' dispatch-byte loads in the routed
    warp-specialized forward builds (`machine_code.warp_specialize_dispatch`)."""
    from dev.machine_code import _cuobjdump, compile_forward_ws, warp_specialize_dispatch
    from fp4attn.routing import forward_launch

    loads = set()
    for qk_fp8 in (True, False):
        for causal in (False, True):
            kernel = compile_forward_ws(qk_fp8, 0, causal, 128, overlap=forward_launch(128, qk_fp8, causal).ws_overlap)
            loads |= warp_specialize_dispatch(_cuobjdump(kernel, "--dump-sass"))[0]
    return loads


def _without_dispatch_hazards(log: str) -> str:
    """The racecheck log with its summary recounted without the hazards whose read is the
    warp-specialize dispatch byte of `attn_fwd_ws_kernel`: a race pairs two accesses to
    one address, so the write of each such report is the dispatch word, which only
    Triton's dispatch writes and which named barrier 1 orders (test below)."""
    loads = _dispatch_loads()
    blocks = re.split(r"(?m)^=+ Error: Race reported", log)
    kept = 0
    for block in blocks[1:]:
        read = re.match(r" between Read access at attn_fwd_ws_kernel\+0x([0-9a-f]+)", block)
        if read is None or int(read.group(1), 16) not in loads:
            kept += sum(int(n) for n in re.findall(r"\[(\d+) hazards?\]", block)) or 1
    return re.sub(r"RACECHECK SUMMARY: \d+ hazards?", f"RACECHECK SUMMARY: {kept} hazards", log)


@pytest.mark.compile
def test_racecheck_reports_are_the_warp_specialize_dispatch():
    """Every hazard racecheck reported on the H200 (benchmarks/results/h200-sanitize.txt)
    is in `attn_fwd_ws_kernel` and reads at the worker warps' first shared-memory
    instruction, the byte of Triton's warp-specialize dispatch (`LDS.U8`), never at the
    kernel's own code; the dispatch word is the last 4 bytes of the kernel's shared
    memory, above every mbarrier and ring the kernel allocates, and the default partition
    stores it (before `BAR.SYNC 1` at the start, after the partitions join at the end)
    where the reported writes are. So these hazards are the dispatch protocol, ordered by
    named barrier 1, not a race of the kernel's barriers."""
    pytest.importorskip("triton")
    from dev.machine_code import _cuobjdump, compile_forward_ws, warp_specialize_dispatch
    from fp4attn.routing import forward_launch

    log = (ROOT / "benchmarks/results/h200-sanitize.txt").read_text()
    reads = {int(x, 16) for x in re.findall(r"Read access at attn_fwd_ws_kernel\+0x([0-9a-f]+)", log)}
    assert reads and re.findall(r"Read access at (\w+)\+", log) == ["attn_fwd_ws_kernel"] * len(
        re.findall(r"Read access at", log))
    loads, stores = set(), set()
    for qk_fp8 in (True, False):
        for causal in (False, True):
            kernel = compile_forward_ws(qk_fp8, 0, causal, 128, overlap=forward_launch(128, qk_fp8, causal).ws_overlap)
            sass = _cuobjdump(kernel, "--dump-sass")
            load, store = warp_specialize_dispatch(sass)
            assert len(load) == 1 and len(store) == 2, (load, store)  # one dispatch read, start and exit stores
            offset = int(re.search(r"LDS\.U8 R\d+, \[R\d+\+UR\d+\+0x([0-9a-f]+)\]", sass).group(1), 16)
            assert offset + 4 + 4 == kernel.metadata.shared  # byte of warp w at offset + w, w in 4..7: the last word
            first_shared = re.search(r"/\*([0-9a-f]{4,})\*/\s+(LDS|STS|SYNCS|LDSM|STSM)\S*", sass)
            assert int(first_shared.group(1), 16) in load  # the workers' first shared-memory access
            loads |= load
            stores |= store
    assert reads <= loads
    writes = {int(x, 16) for x in re.findall(r"Write access at attn_fwd_ws_kernel\+0x([0-9a-f]+)", log)}
    assert writes & stores  # those of the builds compiled here are the dispatch stores
    recounted = re.findall(r"RACECHECK SUMMARY: (\d+) hazards", _without_dispatch_hazards(log))
    assert recounted and set(recounted) == {"0"}
