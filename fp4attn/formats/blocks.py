"""Moving the quantized dim last and cutting it into blocks, and back.

Every block quantizer works on a float32 view of shape (..., n_blocks, block) with the
quantized dim last; a length that is not a multiple of the block is padded with zeros
(zeros never change a block's amax) and the padding is cut off again on dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    """Where the quantized dim came from, so a payload can be put back in place."""

    shape: tuple[int, ...]  # the input's shape
    dim: int  # the quantized dim, normalised to be non-negative
    block: int

    @property
    def length(self) -> int:
        return self.shape[self.dim]

    @property
    def padded(self) -> int:
        return -(-self.length // self.block) * self.block


def to_blocks(x: torch.Tensor, dim: int, block: int | None) -> tuple[torch.Tensor, BlockLayout]:
    """float32 (..., n_blocks, block) view of `x` with `dim` moved last.

    `block=None` makes one block of the whole dim.
    """
    if x.ndim == 0:
        raise ValueError("block quantization needs a tensor with at least one dim")
    dim = dim % x.ndim
    length = x.shape[dim]
    block = length if block is None else block
    if block <= 0:
        raise ValueError(f"block size must be positive, got {block}")
    layout = BlockLayout(tuple(x.shape), dim, block)
    xt = x.float().movedim(dim, -1)
    if layout.padded != length:
        xt = F.pad(xt, (0, layout.padded - length))
    return xt.reshape(*xt.shape[:-1], layout.padded // block, block), layout


def from_blocks(xb: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Inverse of `to_blocks` for float values: cut the padding, put the dim back."""
    x = xb.reshape(*xb.shape[:-2], layout.padded)[..., : layout.length]
    return x.movedim(-1, layout.dim)


def nonfinite_blocks(xb: torch.Tensor) -> torch.Tensor:
    """True for every block holding a NaN or an Inf."""
    return ~torch.isfinite(xb).all(dim=-1)
