"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one float32 tensor scale.

The operations and their order are those of TransformerEngine's reference quantizer
(`NVFP4QuantizerRef._quantize_blockwise_reference`), so the bytes agree with it:

    S_enc   = min(448 * 6 / amax(|x|), FP32_MAX);  S_enc = 1 if that is 0
    S_dec   = 1 / S_enc                                      (the tensor scale kept)
    d_blk   = e4m3(clamp(min(amax_blk * (S_enc * (1/6)), FP32_MAX), -448, 448))
    enc_blk = min(1 / (float(d_blk) * S_dec), FP32_MAX)
    q       = e2m1_rne(clamp(x * enc_blk, -6, 6))

and the value of an element is e2m1(q) * d_blk * S_dec.

Edge cases, as that order makes them (stated and tested):
- all-zero tensor: S_enc = FP32_MAX (448*6/0 = Inf, clamped), every block scale 0, every
  element 0, and it dequantizes to zeros;
- all-zero block in a non-zero tensor: block scale 0, elements 0;
- +-Inf: amax is Inf so S_enc = 0, replaced by 1; the Inf's block scale saturates to
  448 and the Inf itself to +-6;
- NaN: the tensor amax is NaN, so every block scale is NaN (E4M3 0x7F) and the whole
  tensor dequantizes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4attn.formats.blocks import BlockLayout, from_blocks, to_blocks
from fp4attn.formats.checks import check_block_input
from fp4attn.formats.constants import E2M1_MAX, E4M3_MAX, FP32_MAX, NVFP4_BLOCK
from fp4attn.formats.minifloat import decode_e2m1, encode_e2m1, encode_fp8, exact_div, pack_e2m1, unpack_e2m1


@dataclass(frozen=True)
class NVFP4Tensor:
    """NVFP4 payload: `data` packs two E2M1 codes a byte along the quantized dim (moved
    last, padded to a multiple of 16), `scale` the E4M3 block decode scales and
    `global_scale` the float32 tensor decode scale S_dec."""

    data: torch.Tensor  # uint8 (..., padded // 2)
    scale: torch.Tensor  # float8_e4m3fn (..., padded // 16)
    global_scale: torch.Tensor  # float32 scalar
    layout: BlockLayout

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, (..., n_blocks, 16), quantized dim last."""
        c = unpack_e2m1(self.data)
        return c.reshape(*c.shape[:-1], -1, self.layout.block)

    def block_values(self) -> torch.Tensor:
        """e2m1 value x block scale, (..., n_blocks, 16): exact in bfloat16 (at most six
        significant bits), without the tensor scale."""
        return decode_e2m1(self.codes()) * self.scale.float().unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        """float32 values in the input's shape."""
        return from_blocks(self.block_values() * self.global_scale, self.layout)


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc of a tensor with absolute maximum `amax` (TransformerEngine's rule)."""
    s = torch.clamp(exact_div(E4M3_MAX * E2M1_MAX, amax.float()), max=FP32_MAX)
    return torch.where(s == 0, torch.ones_like(s), s)


def quantize_nvfp4(x: torch.Tensor, dim: int = -1) -> NVFP4Tensor:
    """Quantize `x` to NVFP4 along `dim` (blocks of 16; a ragged tail is zero-padded).

    One tensor scale covers the whole of `x`. Accepts float32, bfloat16 and float16.
    """
    check_block_input("quantize_nvfp4", x, dim)
    xb, layout = to_blocks(x, dim, NVFP4_BLOCK)
    s_enc = nvfp4_global_encode_scale(xb.abs().amax())
    s_dec = exact_div(1.0, s_enc)
    multiplier = s_enc * exact_div(torch.ones_like(s_enc), E2M1_MAX)
    d = torch.clamp(xb.abs().amax(dim=-1, keepdim=True) * multiplier, max=FP32_MAX)
    d = encode_fp8(torch.clamp(d, -E4M3_MAX, E4M3_MAX), "e4m3")
    enc = torch.clamp(exact_div(1.0, d.float() * s_dec), max=FP32_MAX)
    codes = encode_e2m1(torch.clamp(xb * enc, -E2M1_MAX, E2M1_MAX))
    return NVFP4Tensor(pack_e2m1(codes.flatten(-2)), d.squeeze(-1), s_dec, layout)
