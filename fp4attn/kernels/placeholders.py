"""Zero-size tensors the launchers pass for the pointers a kernel does not read (its
constexpr switch off: no dot products, no channel maxima, no debug tiles), made once
per device, dtype and rank. Allocating one per launch cost a tensor allocation each,
about 3 us of host on the GPU, on calls whose host time is the bound (short forward
calls, docs/notes/hopper-forward.md). A zero-size tensor holds no storage: its pointer
is 0, which the JIT specializes as 16-byte aligned, as it did the allocations these
replace, so each kernel compiles to the same code."""

from __future__ import annotations

import torch

_MADE: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def nothing(device: torch.device, dtype: torch.dtype, ndim: int = 1) -> torch.Tensor:
    """A zero-size tensor of shape (0, 1, ..., 1) with `ndim` dims (its strides all 1)."""
    key = (device, dtype, ndim)
    t = _MADE.get(key)
    if t is None:
        t = _MADE[key] = torch.empty((0,) + (1,) * (ndim - 1), device=device, dtype=dtype)
    return t
