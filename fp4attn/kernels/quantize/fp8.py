"""FP8 e4m3 Q/K with one scale per token (`_fp8_rows_kernel`, `quantize_qk_fp8`, which also
makes the backward's delta = rowsum(dO * O) in the pass over dO) or per key tile
(`_fp8_tiles_kernel`, `quantize_k_fp8_tiles`), and a head's per-channel FP8 scales from
its recorded channel maxima (`_fp8_channel_scales`), which V's, dO's and the training's
channel views take. The numerics are `formats.fp8.quantize_fp8` and `fp8_scales` (scale
amax / 448, element e4m3(x * (448 / amax)), rows below FP8_MIN_AMAX scale 1), as
`reference.operands.quantize_qk` and `quantize_fp8_tiles` call them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp4attn.kernels.common import fp8_scale_inv
from fp4attn.kernels.placeholders import nothing
from fp4attn.kernels.quantize.elements import _e4m3_signed, _hw_cvt
from fp4attn.kernels.quantize.rows import (
    CHANNEL_BLOCKS,
    _abs_bits_max,
    _block_rows,
    _cdiv,
    _channel_amax_flush,
    _finite_channel_max,
    _row_grid,
)


@triton.jit
def _fp8_channel_scales(AMAX, SCALE, D: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Per-channel FP8 scales of one head from its channels' max |x| (D float32 bits at
    AMAX), as `formats.fp8.fp8_scales`: (scale, multiplier 448 / amax). The passes record
    the maxima over the finite values (`_abs_bits_max`, `_finite_channel_max`); a NaN or
    Inf maximum would give the NaN scale. With HAS_SCALE, of max |x| * SCALE, which is
    max |x * SCALE| (rounding is monotonic)."""
    amax = tl.load(AMAX + tl.arange(0, D)).to(tl.float32, bitcast=True)
    nonfinite = (amax != amax) | (amax == float("inf"))
    if HAS_SCALE:
        amax = amax * tl.load(SCALE)
    scale, inv = fp8_scale_inv(amax)
    return tl.where(nonfinite, float("nan"), scale), inv


@triton.jit
def _fp8_per_row(x, AXIS: tl.constexpr, HW_CVT: tl.constexpr):
    """FP8 e4m3 of a float32 tile with one scale per row along AXIS, as
    `formats.fp8.quantize_fp8`: (values on the e4m3 grid, as float32; scale). scale =
    amax / 448, element = e4m3(x * (448 / amax)); rows below FP8_MIN_AMAX get scale 1;
    a row holding NaN or Inf gets scale NaN."""
    bad = tl.sum((x != x).to(tl.int32), axis=AXIS) > 0
    amax = tl.max(tl.abs(x), axis=AXIS)
    amax = tl.where(bad, float("nan"), amax)
    scale, inv = fp8_scale_inv(amax)
    nonfinite = bad | (amax == float("inf"))
    y = _e4m3_signed(x * tl.expand_dims(inv, AXIS), HW_CVT)
    return y, tl.where(nonfinite, float("nan"), scale)


@triton.jit
def _fp8_rows_kernel(X, Y, S_OUT, O, DOT, CAMAX, S, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr,
                     WITH_DOT: tl.constexpr, CHANNEL_AMAX: tl.constexpr, HW_CVT: tl.constexpr, Y8=None,
                     SAVED: tl.constexpr = False):
    """Per-row FP8 of X (G, S, D), BLOCKS blocks of BLOCK_R rows a program, stored as Y's
    dtype (e4m3, or bf16, which holds every e4m3 value), scales into S_OUT (G, S); with
    WITH_DOT also the row dot products DOT = sum(X * O) (the backward's delta =
    rowsum(dO * O), fused into the pass that reads dO); with CHANNEL_AMAX also each
    head's per-channel max |x| into CAMAX (G, D) (float32 bits, starting at 0), for the
    per-channel view of the same X.
    SAVED (the training forward's Q and K, `fp8_train`): the values also as e4m3
    bytes into Y8, and CHANNEL_AMAX's maxima of the represented values (value x row
    scale, float32) instead of x, from which the backward's per-channel view of them is
    made (over the finite values: a row with NaN, whose represented values are NaN, spoils
    its own elements of that view, not its channels)."""
    g = tl.program_id(1).to(tl.int64)
    run = tl.zeros([BLOCK_R, D], tl.int32)
    for i in range(BLOCKS):
        s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
        offs = rows[:, None] * D + tl.arange(0, D)[None, :]
        ok = (s < S)[:, None]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        y, scale = _fp8_per_row(x, 1, HW_CVT)
        tl.store(S_OUT + rows, scale, mask=s < S)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
        if SAVED:
            tl.store(Y8 + offs, y.to(tl.float8e4nv), mask=ok)
        if WITH_DOT:
            o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(DOT + rows, tl.sum(x * o, axis=1), mask=s < S)
        if CHANNEL_AMAX:
            run = _abs_bits_max(run, y * scale[:, None] if SAVED else x, ok)
    if CHANNEL_AMAX:
        _channel_amax_flush(CAMAX + g * D, run, D)


@triton.jit
def _fp8_tiles_kernel(X, Y, S_OUT, S, D: tl.constexpr, TILE: tl.constexpr, HW_CVT: tl.constexpr):
    """FP8 of X (G, S, D) with one scale per TILE rows (`reference.operands.quantize_fp8_tiles`):
    a program per (tile, head), its TILE x D values one block of `_fp8_per_row`'s
    arithmetic (amax over the whole tile's finite values; rows past S count as zeros), the
    scale stored for each of its rows into S_OUT (G, S), the values as Y's dtype, a NaN or
    Inf as NaN (`formats.quantize_fp8(finite_scale=True)`)."""
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    ok = (rows < S)[:, None]
    offs = (g * S + rows)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    # `_fp8_per_row`'s arithmetic with the tile as the block: the maxima over both axes,
    # NaN and Inf counting as 0
    scale, inv = fp8_scale_inv(tl.max(_finite_channel_max(x, TILE, D), axis=0).to(tl.float32, bitcast=True))
    # NaN and Inf stored as NaN: x - x is +0 for a finite x, NaN otherwise (`_v_kernel`)
    y = _e4m3_signed(x * inv - (x - x), HW_CVT)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(S_OUT + g * S + rows, tl.zeros([TILE], tl.float32) + scale, mask=rows < S)


def _fp8_outputs(x: torch.Tensor, dtype: torch.dtype, where: str):
    """(x contiguous, G, S, D of its (G, S, D) heads form, the values and the scales to
    write): the outputs made in x's shape and in x's shape less its last dim, as the
    quantizers return them (the kernels read pointers only, so no (G, S, D) views are
    made: each is one more tensor operation of host time a call)."""
    if dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"{where}: dtype float8_e4m3fn or bfloat16, got {dtype}")
    S, D = (x.shape[-2] if x.dim() > 1 else 1), x.shape[-1]
    y = torch.empty(x.shape, device=x.device, dtype=dtype)
    s = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    return x.contiguous(), math.prod(x.shape[:-2]), S, D, y, s


def quantize_qk_fp8(x: torch.Tensor, dot_with: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn,
                    channel_amax: bool = False):
    """Per-token FP8 of x (..., S, D): (e4m3 values as `dtype`, float8_e4m3fn or
    bfloat16; scales (..., S)); with `dot_with` (same shape) also the row sums of
    x * dot_with in float32; with `channel_amax` also max |x| per head and channel
    (..., D), as `abs_max_bits(x, per_channel=True)` (for a per-channel view of x)."""
    xc, G, S, D, y, s = _fp8_outputs(x, dtype, "quantize_qk_fp8")
    dev = x.device
    dot = torch.empty(x.shape[:-1], device=dev, dtype=torch.float32) if dot_with is not None else \
        nothing(dev, torch.float32)
    camax = torch.zeros((*x.shape[:-2], D), device=dev, dtype=torch.int32) if channel_amax else \
        nothing(dev, torch.int32)
    other = dot_with.contiguous() if dot_with is not None else xc
    blocks = CHANNEL_BLOCKS if channel_amax else 1
    grid, block = _row_grid(S, G, blocks)
    _fp8_rows_kernel[grid](xc, y, s, other, dot, camax, S, D=D, BLOCK_R=block, BLOCKS=blocks,
                           WITH_DOT=dot_with is not None, CHANNEL_AMAX=channel_amax, HW_CVT=_hw_cvt(), num_warps=4)
    return (y, s) + ((dot,) if dot_with is not None else ()) + ((camax,) if channel_amax else ())


def quantize_k_fp8_tiles(x: torch.Tensor, tile: int, dtype: torch.dtype = torch.float8_e4m3fn):
    """FP8 of x (..., S, D) with one scale per `tile` tokens (`Recipe.k_scale="tile"`):
    (e4m3 values as `dtype`, scales (..., S), each tile's repeated per token)."""
    xc, G, S, D, y, s = _fp8_outputs(x, dtype, "quantize_k_fp8_tiles")
    _fp8_tiles_kernel[(_cdiv(S, tile), G)](xc, y, s, S, D=D, TILE=tile, HW_CVT=_hw_cvt(), num_warps=8)
    return y, s
