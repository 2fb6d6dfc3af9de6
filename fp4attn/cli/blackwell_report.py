"""`fp4attn blackwell-report`: everything a Blackwell owner sends back, from one command.

    fp4attn blackwell-report --out fp4attn-blackwell

writes, in that folder and as one archive beside it (`fp4attn-blackwell.tar.gz`, the
file to send):

    environment.json     GPU, compute capability, driver, torch, CUDA, Triton, fp4attn
                         version and commit
    selftest.json/.txt   `fp4attn selftest`: every routed kernel against the reference,
                         each case under the watchdog (a hang or a crash is a failed row)
    compile-report.json  `fp4attn compile-report` for this GPU's architecture with this
                         machine's Triton and ptxas (registers, spills, MMA kinds)
    bench.json/.txt      `fp4attn bench` on the Blackwell kernels: every recipe whose
                         selftest cases all passed, against SDPA cuDNN bf16 (each shape
                         under the watchdog)
    summary.json         what passed, what failed, how long each part took

About 10-20 minutes on a B200 (most of it compiling); `--quick` benches two shapes.
Nothing is uploaded: the archive is for the owner to attach to an issue.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from fp4attn.cli.output import exit_no_gpu, write_json

QUICK_SHAPES = [(8, 16, 4096, 128), (16, 16, 2048, 64)]
# the compile-report architecture of each Blackwell compute capability
ARCH_OF_CAPABILITY = {(10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a", (12, 1): "sm_120a"}


class _Tee(io.TextIOBase):
    """Writes to the terminal and to a file at once."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)


@contextlib.contextmanager
def _tee(path: Path):
    with open(path, "w") as f, contextlib.redirect_stdout(_Tee(sys.stdout, f)):
        yield


def _commit() -> str | None:
    """The git commit of this fp4attn checkout, or None if it is not one."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import triton

    import fp4attn

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton.__version__, "fp4attn": fp4attn.__version__, "commit": _commit(),
           "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["driver"] = f"nvidia-smi failed: {e}"
    return env


def _passed_recipes(selftest_result: dict | None) -> list[str]:
    """Recipes none of whose kernel cases failed in the selftest (those the bench times)."""
    if not selftest_result:
        return []
    recs = selftest_result["records"]
    ran = {r["recipe"] for r in recs if r["status"] == "pass"}
    failed = {r["recipe"] for r in recs if r["status"] == "FAIL"}
    return sorted(ran - failed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("fp4attn-blackwell"), help="folder to write (and archive)")
    p.add_argument("--quick", action="store_true", help=f"bench only {QUICK_SHAPES}")
    p.add_argument("--case-timeout", type=float, default=None, metavar="S",
                   help="seconds a selftest case may take before it counts as hung (the selftest's default)")


def main(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        exit_no_gpu("blackwell-report", "run it on the Blackwell machine")
    from fp4attn.cli import bench_blackwell, compile_report, selftest

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    write_json(out / "environment.json", env)
    print("environment:", json.dumps(env))
    summary: dict = {"environment": env, "parts": {}}

    # 1. the selftest (its own watchdog per case)
    t0 = time.time()
    st_args = argparse.Namespace(json=out / "selftest.json", no_timing=False, no_watchdog=False,
                                 case_timeout=args.case_timeout or selftest.CASE_TIMEOUT_S)
    with _tee(out / "selftest.txt"):
        try:
            result, status = selftest.main(st_args), 0
        except SystemExit as e:
            result, status = None, e.code
    if result is None and (out / "selftest.json").exists():
        result = json.loads((out / "selftest.json").read_text())
    failed = [r for r in (result or {}).get("records", []) if r["status"] == "FAIL"]
    summary["parts"]["selftest"] = {"exit_status": status, "failed": len(failed), "seconds": round(time.time() - t0)}

    # 2. the compile report of this architecture with this machine's Triton
    t0 = time.time()
    arch = ARCH_OF_CAPABILITY.get(tuple(env["capability"]))
    if arch is None:
        summary["parts"]["compile_report"] = {"skipped": f"capability {env['capability']} is not a Blackwell one"}
    else:
        try:
            recs = compile_report.records(arch, key_bias=False)
            write_json(out / "compile-report.json", {"arch": arch, "records": recs})
            summary["parts"]["compile_report"] = {"arch": arch, "builds": len(recs), "seconds": round(time.time() - t0)}
        except Exception as e:  # a compiler that differs from CI's: its error is the finding
            summary["parts"]["compile_report"] = {"arch": arch, "error": f"{type(e).__name__}: {e}"}

    # 3. the bench of every recipe the selftest passed
    t0 = time.time()
    recipes = _passed_recipes(result)
    shapes = QUICK_SHAPES if args.quick else bench_blackwell.SHAPES
    with _tee(out / "bench.txt"):
        records, failures = bench_blackwell.run(shapes, (False, True), recipes, partial=out / "bench.json")
        from fp4attn.cli.bench import format_table

        if records:
            print(format_table(records))
    write_json(out / "bench.json", records)
    summary["parts"]["bench"] = {"recipes": recipes, "records": len(records), "failures": failures,
                                 "seconds": round(time.time() - t0)}
    write_json(out / "summary.json", summary)

    archive = out.with_name(out.name + ".tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(f"\nwrote {out}/ and {archive}: please send {archive} (attach it to an fp4attn issue)")
    return summary
