"""MXFP4 (OCP MX v1.0): E2M1 elements, one E8M0 scale per 32 elements.

Section 6.3 of the spec: the shared exponent is floor(log2(amax)) - emax_elem with
emax_elem = 2 for E2M1, elements are x / 2**e rounded to nearest even and saturated at
+-6. That rule maps amax = 7 * 2**k to 6 * 2**k (a known weakness); `scale_rule="rceil"`
uses e = ceil(log2(amax / 6)) instead, which never saturates.

Edge blocks (stated and tested):
- an all-zero block gets the smallest scale, E8M0 code 0 (2**-127), and zero elements;
- a block holding NaN or +-Inf gets the NaN scale 0xFF (spec 6.3: the block is NaN);
  its elements are stored as if the non-finite values were absent;
- exponents below -127 clamp to -127 (elements then round towards zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4attn.formats.blocks import BlockLayout, from_blocks, nonfinite_blocks, to_blocks
from fp4attn.formats.checks import check_block_input
from fp4attn.formats.constants import E2M1_EMAX, E8M0_BIAS, E8M0_EMAX, E8M0_EMIN, E8M0_NAN, MX_BLOCK
from fp4attn.formats.minifloat import (
    decode_e2m1,
    decode_e8m0,
    encode_e2m1,
    floor_log2,
    pack_e2m1,
    pow2,
    unpack_e2m1,
)

SCALE_RULES = ("floor", "rceil")


@dataclass(frozen=True)
class MXFP4Tensor:
    """MXFP4 payload: `data` packs two E2M1 codes a byte along the quantized dim (moved
    last, padded to a multiple of 32); `scale` holds E8M0 codes, one per block."""

    data: torch.Tensor  # uint8 (..., padded // 2); .view(torch.float4_e2m1fn_x2) works
    scale: torch.Tensor  # uint8 (..., padded // 32); .view(torch.float8_e8m0fnu) works
    layout: BlockLayout

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, (..., n_blocks, 32), quantized dim last."""
        c = unpack_e2m1(self.data)
        return c.reshape(*c.shape[:-1], -1, self.layout.block)

    def block_values(self) -> torch.Tensor:
        """Represented values, (..., n_blocks, 32), quantized dim last."""
        return decode_e2m1(self.codes()) * decode_e8m0(self.scale).unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        """float32 values in the input's shape."""
        return from_blocks(self.block_values(), self.layout)


def mx_exponent(amax: torch.Tensor, scale_rule: str = "floor") -> torch.Tensor:
    """Shared E8M0 exponent (int32) of blocks with absolute maximum `amax` (finite, >= 0)."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown scale_rule {scale_rule!r}; accepted: {SCALE_RULES}")
    positive = amax > 0
    k = floor_log2(torch.where(positive, amax, torch.ones_like(amax)))
    if scale_rule == "floor":
        e = k - E2M1_EMAX
    else:
        # ceil(log2(amax / 6)), exactly: with amax = f * 2**k, f in [1, 2), the answer is
        # k - 2 when f <= 1.5 (6 * 2**(k-2) = 1.5 * 2**k >= amax) and k - 1 otherwise.
        f = amax / pow2(k)
        e = torch.where(f <= 1.5, k - 2, k - 1)
    e = torch.where(positive, e, torch.full_like(e, E8M0_EMIN))
    return e.clamp(E8M0_EMIN, E8M0_EMAX)


def quantize_mxfp4(x: torch.Tensor, dim: int = -1, scale_rule: str = "floor") -> MXFP4Tensor:
    """Quantize `x` to MXFP4 along `dim` (blocks of 32; a ragged tail is zero-padded).

    Args:
        x: float32, bfloat16 or float16 tensor, any device.
        dim: the dim cut into blocks of 32 (the contraction dim of the product that
            consumes the operand).
        scale_rule: "floor" (OCP MX v1.0: floor(log2 amax) - 2) or "rceil"
            (ceil(log2(amax / 6)), no saturation).
    """
    check_block_input("quantize_mxfp4", x, dim)
    xb, layout = to_blocks(x, dim, MX_BLOCK)
    bad = nonfinite_blocks(xb)
    finite = torch.where(torch.isfinite(xb), xb, torch.zeros_like(xb))
    e = mx_exponent(finite.abs().amax(dim=-1), scale_rule)
    codes = encode_e2m1(finite * pow2(-e).unsqueeze(-1))
    scale = (e + E8M0_BIAS).to(torch.uint8).masked_fill(bad, E8M0_NAN)
    return MXFP4Tensor(pack_e2m1(codes.flatten(-2)), scale, layout)
