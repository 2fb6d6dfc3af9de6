"""The package as a wheel ships every file it reads at run time (the CUDA C++ sources NVRTC
compiles at first use, the `eval` sentences), and the one probe every CUDA C++ kernel's
route asks (`routing.cuda_kernels_unavailable`) checks that those sources are installed.
scripts/wheel_smoke.sh installs the wheel into a fresh environment and runs it (CI)."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fp4attn import routing
from fp4attn.routing import decode as decode_routing

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fp4attn"
# what the build needs besides the package (pyproject's readme, the license file)
BUILD_FILES = ("pyproject.toml", "README.md", "LICENSE")


def _package_files() -> set[str]:
    """Every file under fp4attn/ in the checkout, as the wheel names it (no bytecode)."""
    return {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The file names in a wheel built from a copy of the checkout (a build in the checkout
    would leave build/ behind, whose stale files a later build ships)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(PACKAGE, src / "fp4attn", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, src / name)
    # no build isolation: the environment's setuptools builds it, without an index
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp / "dist")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp / "dist").glob("fp4attn-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_ships_every_package_file(wheel_names):
    missing = sorted(_package_files() - wheel_names)
    assert not missing, f"the wheel lacks files of the package (pyproject's package-data): {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_names), sorted(wheel_names)


def test_wheel_ships_the_sources_read_at_run_time(wheel_names):
    from fp4attn.kernels.hopper import decode_cuda, forward_cuda

    read = [forward_cuda.SOURCE, decode_cuda.SOURCE, PACKAGE / "data" / "sentences.txt"]
    read += [routing.CUDA_SOURCE_DIR / name for name in routing.CUDA_SOURCES]
    read += list(routing.CUDA_SOURCE_DIR.iterdir())  # headers too
    for path in read:
        name = path.resolve().relative_to(ROOT).as_posix()
        assert name in wheel_names, f"{name} is read at run time and not in the wheel"


def test_the_cuda_probe_knows_every_source():
    from fp4attn.kernels.hopper import decode_cuda, forward_cuda

    assert routing.missing_cuda_sources() == []
    for source in (forward_cuda.SOURCE, decode_cuda.SOURCE):
        assert source.resolve().parent == routing.CUDA_SOURCE_DIR
        assert source.name in routing.CUDA_SOURCES, f"{source.name}: add it to routing.CUDA_SOURCES"


def test_the_cuda_probe_refuses_missing_sources(tmp_path, monkeypatch):
    (tmp_path / "attn_fwd_fp8.cu").write_text('#include "parts.cuh"\n  #  include "more.cuh"\n#include <cuda.h>\n')
    (tmp_path / "more.cuh").write_text("")
    monkeypatch.setattr(routing.capability, "CUDA_SOURCE_DIR", tmp_path)
    others = sorted(set(routing.CUDA_SOURCES) - {"attn_fwd_fp8.cu"})
    assert routing.missing_cuda_sources() == sorted([*others, "parts.cuh"])
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-bindings (NVRTC) not installed: the probe stops there")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    routing.cuda_kernels_unavailable.cache_clear()
    try:
        why = routing.cuda_kernels_unavailable()
        assert why is not None and "parts.cuh" in why, why
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        routing.cuda_kernels_unavailable.cache_clear()
        assert "CUDA 13" in routing.cuda_kernels_unavailable()
    finally:
        routing.cuda_kernels_unavailable.cache_clear()


def test_forward_and_decode_ask_the_same_probe(monkeypatch):
    args = ("fp8", "fp8", 128, 4, 1, 256)
    launch = routing.FORWARD_LAUNCH[64, True, False]
    keys = launch.cuda_keys(0)
    assert keys
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: None)
    assert decode_routing.split_kernel(*args, on_gpu=True) == "cuda"
    assert routing.use_cuda_forward(launch, 0, keys, on_cuda=True)
    monkeypatch.setattr(routing.capability, "cuda_kernels_unavailable", lambda: "not here")
    assert decode_routing.split_kernel(*args, on_gpu=True) == "triton"
    assert not routing.use_cuda_forward(launch, 0, keys, on_cuda=True)
    with pytest.raises(ValueError, match="not here"):
        decode_routing.split_kernel(*args, on_gpu=True, asked="cuda")


def test_every_routed_launcher_imports():
    """A launcher that fails to import sends its route to the reference (api._route reads
    the ImportError as Triton missing): each one the routing names imports."""
    pytest.importorskip("triton")
    for family in routing.KERNEL_FAMILIES:
        module, name = family.launcher.split(":")
        assert callable(getattr(importlib.import_module(module), name)), family.launcher
