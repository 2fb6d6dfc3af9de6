"""What the public quantizers and encoders accept, checked before any work.

Without these checks torch would take an int or bool tensor as its float values, a
complex one as its real part (with only a warning), wrap an out-of-range `dim` around
(dim=3 of a 3-D tensor quantized along dim 0) and fail deep inside on an empty tensor.
"""

from __future__ import annotations

import torch

ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_input(name: str, x) -> None:
    """Raise TypeError unless `x` is a float32, bfloat16 or float16 tensor; `name` is
    the public function the message names."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACCEPTED_DTYPES:
        accepted = ", ".join(str(d).removeprefix("torch.") for d in ACCEPTED_DTYPES)
        raise TypeError(f"{name}: x has dtype {str(x.dtype).removeprefix('torch.')}; accepted: {accepted}")


def check_block_input(name: str, x, dim) -> None:
    """`check_float_input`, and `x` non-empty with `dim` one of its dims (an int in
    [-x.ndim, x.ndim)): what a block quantizer needs."""
    check_float_input(name, x)
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError(f"{name}: x of shape {tuple(x.shape)} has no elements to quantize; accepted: a "
                         "tensor with at least one dim and one element")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise IndexError(f"{name}: dim={dim!r} is not a dim of a {x.ndim}-D tensor; accepted: an int in "
                         f"[{-x.ndim}, {x.ndim - 1}]")
