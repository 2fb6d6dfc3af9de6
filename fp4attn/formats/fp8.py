"""FP8 (E4M3 or E5M2) with one float32 scale per block.

For a block with absolute maximum amax: scale = amax / fmax and the stored element is
fp8(x * (fmax / amax)), rounded to nearest even and saturating. The quantized value is
fp8 * scale. The FP8 recipes put one scale on each row of the contraction dim
(`block=None`: per token for Q/K, per channel for V), so scales factor out of the
matrix product.

Edge blocks (stated and tested): an all-zero block, or one whose amax is below
FP8_MIN_AMAX = 2**-112 (its inverse scale would overflow float32), gets scale 1 and
zero elements; a block holding NaN or +-Inf gets scale NaN and dequantizes to NaN.
With `finite_scale=True` (for a block that spans many tokens: V's channels, K's tiles)
the scale is that of the block's finite elements instead, and each NaN or +-Inf is
stored as NaN (0x7F in either format): only that element dequantizes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4attn.formats.blocks import BlockLayout, from_blocks, nonfinite_blocks, to_blocks
from fp4attn.formats.checks import check_block_input
from fp4attn.formats.constants import E4M3_MAX, E5M2_MAX, FP8_MIN_AMAX
from fp4attn.formats.minifloat import encode_fp8, exact_div

FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 payload with the quantized dim moved last and cut into blocks."""

    data: torch.Tensor  # float8 (..., n_blocks, block)
    scale: torch.Tensor  # float32 (..., n_blocks)
    layout: BlockLayout

    def block_values(self) -> torch.Tensor:
        return self.data.float() * self.scale.unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        """float32 values in the input's shape."""
        return from_blocks(self.block_values(), self.layout)


def fp8_scales(amax: torch.Tensor, nonfinite: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) of blocks with absolute maximum `amax`: amax / fmax and
    fmax / amax, both correctly rounded; 1 for blocks below FP8_MIN_AMAX (all-zero
    included); scale NaN where `nonfinite`."""
    fmax = FP8_MAX[fmt]
    zero = amax < FP8_MIN_AMAX
    scale = torch.where(zero, torch.ones_like(amax), exact_div(amax, fmax)).masked_fill(nonfinite, float("nan"))
    inv = torch.where(zero, torch.ones_like(amax), exact_div(fmax, amax))
    return scale, inv


def quantize_fp8(x: torch.Tensor, dim: int = -1, block: int | None = None, fmt: str = "e4m3",
                 finite_scale: bool = False) -> FP8Tensor:
    """Quantize `x` to FP8 with one float32 scale per `block` elements along `dim`.

    Args:
        x: float32, bfloat16 or float16 tensor.
        dim: the dim cut into blocks.
        block: elements per scale; None for one scale over the whole dim.
        fmt: "e4m3" (max 448) or "e5m2" (max 57344).
        finite_scale: each block's scale from its finite elements, and its NaN and +-Inf
            elements stored as NaN (a non-finite element spoils itself, not its block);
            False: a block holding one gets the NaN scale. The same bytes for finite x.
    """
    check_block_input("quantize_fp8", x, dim)
    if fmt not in FP8_MAX:
        raise ValueError(f"unknown fp8 format {fmt!r}; accepted: {tuple(FP8_MAX)}")
    xb, layout = to_blocks(x, dim, block)
    if finite_scale:
        finite = torch.isfinite(xb)
        scale, inv = fp8_scales(torch.where(finite, xb.abs(), 0.0).amax(dim=-1),
                                torch.zeros(xb.shape[:-1], dtype=torch.bool, device=xb.device), fmt)
        data = encode_fp8(torch.where(finite, xb * inv.unsqueeze(-1), float("nan")), fmt)
        return FP8Tensor(data, scale, layout)
    scale, inv = fp8_scales(xb.abs().amax(dim=-1), nonfinite_blocks(xb), fmt)
    data = encode_fp8(xb * inv.unsqueeze(-1), fmt)
    return FP8Tensor(data, scale, layout)
