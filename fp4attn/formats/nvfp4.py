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
- NaN and +-Inf (where this departs from TransformerEngine, whose NaN amax spreads NaN
  over the whole tensor and whose Inf saturates to a finite 6 * 448): amax(|x|), the
  tensor's and each block's, is taken over the finite elements, and a block holding a
  NaN or an Inf gets the NaN block scale (E4M3 0x7F) and codes 0. Only that block
  dequantizes to NaN; every other block's bytes are those of the same tensor with the
  non-finite elements set to 0. Finite tensors are quantized exactly as
  TransformerEngine quantizes them.

"Tensor" is whatever shares one tensor scale: the whole input by default, as
TransformerEngine quantizes a weight or activation; `scale_dims=n` gives each index of
the first n dims its own (attention quantizes Q and K with `scale_dims=2`, one tensor
scale per (batch, head), so one item's values never move another item's codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4attn.formats.blocks import BlockLayout, from_blocks, nonfinite_blocks, to_blocks
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
    global_scale: torch.Tensor  # float32, () or x.shape[:scale_dims] + (1,) * (ndim - scale_dims + 1)
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


def quantize_nvfp4(x: torch.Tensor, dim: int = -1, scale_dims: int = 0, four_over_six: bool = False) -> NVFP4Tensor:
    """Quantize `x` to NVFP4 along `dim` (blocks of 16; a ragged tail is zero-padded).

    Args:
        x: float32, bfloat16 or float16 tensor.
        dim: the dim cut into blocks of 16.
        scale_dims: how many leading dims get their own tensor scale. 0 (default): one
            tensor scale over the whole of `x` (TransformerEngine's rule). n > 0: one per
            index of x.shape[:n], computed from that slice alone, so the payload of one
            slice does not depend on any other's values; `dim` must lie after them.
            `global_scale` then has shape x.shape[:n] + (1,) * (x.ndim - n + 1), which
            broadcasts against `block_values()`.
        four_over_six: scale each block so that its amax maps to 6 (the rule above) or
            to 4, whichever gives the smaller largest error max |e2m1 * d - x * S_enc|
            (ties to 6); 4 holds values near 5 (between 4 and 6 E2M1 has no point)
            better ("Four Over Six", Cook et al., 2025, with the largest error as the
            criterion, which any implementation computes identically).
    """
    check_block_input("quantize_nvfp4", x, dim)
    ndim = x.ndim
    if not 0 <= scale_dims < max(ndim, 1) or (ndim and dim % ndim < scale_dims):
        raise ValueError(f"quantize_nvfp4: scale_dims={scale_dims} must be in [0, x.ndim) and leave the blocked "
                         f"dim after the scaled ones; got x.ndim={ndim}, dim={dim}")
    xb, layout = to_blocks(x, dim, NVFP4_BLOCK)
    # statistics over the finite elements; a block holding a NaN or an Inf is NaN alone
    bad = nonfinite_blocks(xb).unsqueeze(-1)
    xb = torch.where(torch.isfinite(xb), xb, torch.zeros_like(xb))
    if scale_dims:
        # the blocked layout keeps the leading dims in place: reduce everything after them
        amax = xb.abs().flatten(scale_dims).amax(-1).reshape(*xb.shape[:scale_dims], *(1,) * (xb.ndim - scale_dims))
    else:
        amax = xb.abs().amax()
    s_enc = nvfp4_global_encode_scale(amax)
    s_dec = exact_div(1.0, s_enc)
    block_amax = xb.abs().amax(dim=-1, keepdim=True)
    d, codes = _blocks_scaled_to(xb, block_amax, s_enc, s_dec, E2M1_MAX)
    if four_over_six:
        d4, codes4 = _blocks_scaled_to(xb, block_amax, s_enc, s_dec, 4.0)
        better = _block_error(xb, d4, codes4, s_enc) < _block_error(xb, d, codes, s_enc)
        d, codes = torch.where(better, d4, d), torch.where(better, codes4, codes)
    d = torch.where(bad, encode_fp8(torch.full_like(block_amax, float("nan")), "e4m3"), d)
    codes = codes.masked_fill(bad, 0)
    return NVFP4Tensor(pack_e2m1(codes.flatten(-2)), d.squeeze(-1), s_dec, layout)


def _blocks_scaled_to(xb, block_amax, s_enc, s_dec, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 block decode scales, E2M1 codes) of blocks whose amax is mapped to `top`
    (6: TransformerEngine's rule)."""
    multiplier = s_enc * exact_div(torch.ones_like(s_enc), top)
    d = torch.clamp(block_amax * multiplier, max=FP32_MAX)
    d = encode_fp8(torch.clamp(d, -E4M3_MAX, E4M3_MAX), "e4m3")
    enc = torch.clamp(exact_div(1.0, d.float() * s_dec), max=FP32_MAX)
    return d, encode_e2m1(torch.clamp(xb * enc, -E2M1_MAX, E2M1_MAX))


def _block_error(xb, d, codes, s_enc) -> torch.Tensor:
    """max |e2m1 * d - x * S_enc| over each block, float32: each term is a fixed sequence
    of IEEE operations and a maximum has no order, so any implementation agrees."""
    return (decode_e2m1(codes) * d.float() - xb * s_enc).abs().amax(dim=-1, keepdim=True)
