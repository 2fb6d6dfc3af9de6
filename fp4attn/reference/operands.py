"""Quantizing Q, K and V the way each recipe stores them.

Each operand is returned as exact grid values plus the scale that factors out of its
matrix product, because that is how a kernel consumes it: the tensor-core product runs
on the grid values and the scale is applied to the fp32 result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4attn.formats import FP8Tensor, NVFP4Tensor, quantize_fp8, quantize_mxfp4, quantize_nvfp4
from fp4attn.formats.blocks import from_blocks
from fp4attn.formats.constants import E8M0_BIAS, E8M0_NAN
from fp4attn.reference.encoding import V_TOP, V_WINDOW


@dataclass(frozen=True)
class QKOperand:
    """Q or K as the score product sees it: scores = (Qv Kv^T) * Qs * Ks^T."""

    values: torch.Tensor  # fp32 (B, H, S, D) on the format's grid (exact in bf16 or e4m3)
    scale: torch.Tensor  # fp32, broadcastable to (B, H, S, 1)
    payload: NVFP4Tensor | FP8Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return self.values * self.scale


def _inf_to_nan(x: torch.Tensor) -> torch.Tensor:
    """An unscaled operand's +-Inf as NaN, as the scaled formats' NaN scales make it: an
    Inf key would otherwise give a -inf score (a silently masked key) or a +-Inf output,
    where attention has no finite answer."""
    return x.masked_fill(torch.isinf(x), float("nan"))


def quantize_fp8_tiles(x: torch.Tensor, tile: int) -> QKOperand:
    """FP8 e4m3 of x (B, H, S, D) with one scale per `tile` tokens of each (batch, head)
    (`Recipe.k_scale="tile"`): `formats.quantize_fp8` of each tile's tile x D values as
    one block (a tile past S holds only the tokens there), the scale repeated per token.
    The scale is the tile's finite values' (`finite_scale`): a NaN or Inf is a NaN
    element, whose key alone has NaN scores."""
    B, H, S, D = x.shape
    n = -(-S // tile)
    xt = torch.nn.functional.pad(x, (0, 0, 0, n * tile - S)).reshape(B, H, n, tile * D)
    q = quantize_fp8(xt, dim=-1, block=None, fmt="e4m3", finite_scale=True)  # data (B, H, n, 1, tile * D)
    values = q.data.float().reshape(B, H, n * tile, D)[..., :S, :]
    scale = q.scale.reshape(B, H, n, 1).repeat_interleave(tile, dim=2)[..., :S, :]
    return QKOperand(values, scale)


def quantize_qk(x: torch.Tensor, fmt: str, four_over_six: bool = False, tile: int = 0) -> QKOperand:
    """Q or K in `fmt` ("nvfp4", "fp8" or "bf16"); x is (B, H, S, D). `tile`: FP8 with one
    scale per `tile` tokens instead of per token (`quantize_fp8_tiles`).

    NVFP4 has one tensor scale per (batch, head) (`quantize_nvfp4(scale_dims=2)`): no
    item's values move another's codes. The tensor scale is that of the head's finite
    values, and a NaN or +-Inf makes its block of 16 NaN (`formats.nvfp4`): the scores
    of its token, and the rows that read them, come out NaN, no other.
    `four_over_six`: NVFP4 blocks scaled to 4 or 6 (`quantize_nvfp4`).
    """
    if fmt == "nvfp4":
        q = quantize_nvfp4(x, dim=-1, scale_dims=2, four_over_six=four_over_six)
        s_dec = q.global_scale.reshape(*x.shape[:2], 1, 1)
        return QKOperand(from_blocks(q.block_values(), q.layout), s_dec, q)
    if fmt == "fp8" and tile:
        return quantize_fp8_tiles(x, tile)
    if fmt == "fp8":
        q = quantize_fp8(x, dim=-1, block=None, fmt="e4m3")  # one scale per token
        return QKOperand(q.data.float().squeeze(-2), q.scale, q)
    if fmt == "bf16":
        return QKOperand(_inf_to_nan(x.to(torch.bfloat16).float()), torch.ones((1, 1, 1, 1), device=x.device))
    raise ValueError(f"unknown Q/K format {fmt!r}")


def quantize_qk_fallback(x: torch.Tensor, fallback: torch.Tensor, four_over_six: bool = False) -> QKOperand:
    """NVFP4 Q or K, except the (batch, head)s where `fallback` (bool, (B, H)) is True,
    which are per-token FP8: values on either grid and per-row scales (B, H, S, 1), as
    the Hopper kernels read both formats (bf16 values times a float32 row scale)."""
    nv, f8 = quantize_qk(x, "nvfp4", four_over_six), quantize_qk(x, "fp8")
    pick = fallback.reshape(*fallback.shape, 1, 1)
    values = torch.where(pick, f8.values, nv.values)
    scale = torch.where(pick, f8.scale, nv.scale.expand(*x.shape[:-1], 1))
    return QKOperand(values, scale)


def v_window(e: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 window of MXFP4 V (`encoding.py`) from its block exponents e and
    finiteness, both (B, H, D, n_blocks): (shift c per head, int32 (B, H), flushed
    blocks). c is clamped into float32's normal exponents, which only an all-zero or
    subnormal-sized head reaches."""
    e_max = torch.where(finite, e, torch.full_like(e, -E8M0_BIAS)).flatten(-2).amax(-1)
    flushed = finite & (e < e_max[..., None, None] - V_WINDOW)
    return (e_max - V_TOP).clamp(-126, 126), flushed


def quantize_v_mxfp4(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 V along the sequence inside its e4m3 window: (represented values (B, H, S, D),
    shift c (int32, (B, H)) such that values * 2**-c are exact e4m3 values)."""
    q = quantize_mxfp4(v, dim=-2)
    c, flushed = v_window(q.scale.to(torch.int32) - E8M0_BIAS, q.scale != E8M0_NAN)
    values = q.block_values().masked_fill(flushed.unsqueeze(-1), 0.0)
    return from_blocks(values, q.layout), c


def quantize_v(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """V's represented values (fp32, (B, H, S, D)) in `fmt` ("mxfp4", "fp8" or "bf16").

    MXFP4 blocks run along the sequence (the PV contraction dim), 32 keys per block,
    inside the e4m3 window of `encoding.V_WINDOW` (a NaN or Inf makes its block NaN). FP8
    has one scale per channel, that of the channel's finite values; a NaN or Inf is a
    NaN element (`quantize_fp8(finite_scale=True)`).
    """
    if fmt == "mxfp4":
        return quantize_v_mxfp4(v)[0]
    if fmt == "fp8":
        return quantize_fp8(v, dim=-2, block=None, fmt="e4m3", finite_scale=True).dequantize()
    if fmt == "bf16":
        return _inf_to_nan(v.to(torch.bfloat16).float())
    raise ValueError(f"unknown V format {fmt!r}")
