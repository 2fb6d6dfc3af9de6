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


def quantize_qk(x: torch.Tensor, fmt: str) -> QKOperand:
    """Q or K in `fmt` ("nvfp4", "fp8" or "bf16"); x is (B, H, S, D)."""
    if fmt == "nvfp4":
        q = quantize_nvfp4(x, dim=-1)
        return QKOperand(from_blocks(q.block_values(), q.layout), q.global_scale.reshape(1, 1, 1, 1), q)
    if fmt == "fp8":
        q = quantize_fp8(x, dim=-1, block=None, fmt="e4m3")  # one scale per token
        return QKOperand(q.data.float().squeeze(-2), q.scale, q)
    if fmt == "bf16":
        return QKOperand(x.to(torch.bfloat16).float(), torch.ones((1, 1, 1, 1), device=x.device))
    raise ValueError(f"unknown Q/K format {fmt!r}")


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
    inside the e4m3 window of `encoding.V_WINDOW`. FP8 has one scale per channel.
    """
    if fmt == "mxfp4":
        return quantize_v_mxfp4(v)[0]
    if fmt == "fp8":
        return quantize_fp8(v, dim=-2, block=None, fmt="e4m3").dequantize()
    if fmt == "bf16":
        return v.to(torch.bfloat16).float()
    raise ValueError(f"unknown V format {fmt!r}")
