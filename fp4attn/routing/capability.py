"""What this installation can build and run: the one probe of the CUDA C++ kernels, and Triton.

Every CUDA C++ kernel's route (the Hopper forward's and backward's plans, decode's split
kernel) asks `cuda_kernels_unavailable`, looked up through this module at each call: a
test that stands in for a GPU with the `cuda` extra, or for a machine without it,
patches it here once.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

# The CUDA C++ kernels' sources, compiled by NVRTC at first use (the wheel ships them:
# pyproject's package-data, tests/project/test_packaging.py)
CUDA_SOURCE_DIR = Path(__file__).resolve().parents[1] / "kernels" / "hopper" / "cuda"
CUDA_SOURCES = ("attn_fwd_fp8.cu", "attn_bwd_fp8.cu", "decode_split.cu")  # forward_cuda, backward_cuda, decode_cuda
_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)

# looked up once at import: torch.compile cannot trace importlib's spec search
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def missing_cuda_sources() -> list[str]:
    """The CUDA C++ sources, and the headers they include by quoted name, that are not
    installed under `CUDA_SOURCE_DIR`."""
    missing, seen, todo = [], set(), list(CUDA_SOURCES)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = CUDA_SOURCE_DIR / name
        if not path.is_file():
            missing.append(name)
            continue
        todo += _QUOTED_INCLUDE.findall(path.read_text(errors="replace"))
    return sorted(missing)


@functools.lru_cache(maxsize=1)
def cuda_kernels_unavailable() -> str | None:
    """Why the CUDA C++ kernels (the forward, the backward and decode's split kernel) cannot
    be built and loaded here, None where they can: the one probe each of their routes asks.
    They need NVRTC's Python bindings (cuda-bindings, the `cuda` extra), a CUDA 13 torch
    (NVRTC 13's cubins need a CUDA 13 driver, which such a torch already requires), and
    their sources (`missing_cuda_sources`)."""
    import torch

    try:
        found = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):  # no `cuda` package at all
        found = False
    if not found:
        return "cuda-bindings (NVRTC) is not installed"
    cuda = torch.version.cuda
    if cuda is None or int(cuda.split(".")[0]) < 13:
        return f"torch is not a CUDA 13 build (CUDA {cuda}), which NVRTC 13's kernels need"
    missing = missing_cuda_sources()
    if missing:
        return f"the kernel sources are not installed ({', '.join(missing)} missing in {CUDA_SOURCE_DIR})"
    return None
