"""Fused Triton quantizers: bf16/fp16/fp32 Q, K, V into the forward kernel's operand
layouts, one pass over each operand (reductions over the whole sequence, for FP8 V's
per-channel scale and MXFP4 V's head window, are small torch reductions first).

Each reproduces the reference quantizer bit for bit (`kernels/hopper/operands.py`
builds the same tensors from `fp4attn.formats`; tests compare them with
`torch.equal`): divisions are `div_rn` (IEEE, as torch's tensor division), and values
are rounded to the e4m3 / E2M1 grids by explicit arithmetic before the final, exact
cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4attn.formats.blocks import to_blocks
from fp4attn.formats.constants import MX_BLOCK
from fp4attn.formats.fp8 import fp8_scales
from fp4attn.formats.minifloat import exact_div, pow2
from fp4attn.formats.mx import mx_exponent
from fp4attn.formats.nvfp4 import nvfp4_global_encode_scale
from fp4attn.kernels.common import FP8_MIN_AMAX, round_e4m3
from fp4attn.kernels.hopper.operands import KernelOperands
from fp4attn.recipes import Recipe
from fp4attn.reference.operands import v_window


@triton.jit
def _with_sign_of(mag, v):
    """mag carrying v's sign bit (so -0 stays -0, as torch.copysign in the reference)."""
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -mag, mag)


@triton.jit
def _e4m3_signed(v):
    """float32 on the e4m3 grid, nearest even, saturating at +-448, NaN kept."""
    r = _with_sign_of(round_e4m3(tl.minimum(tl.abs(v), 448.0)), v)
    return tl.where(v != v, v, r)


@triton.jit
def _e2m1_value(a):
    """E2M1 value (0 .. 6) nearest to non-negative a, ties to even, saturating."""
    c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
         + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return tl.where(c <= 4, c.to(tl.float32) * 0.5, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))


@triton.jit
def _fp8_rows_kernel(X, Y, S, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Per-row FP8: scale = amax / 448, element = e4m3(x * (448 / amax))."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    ok = (rows < R)[:, None]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    bad = tl.sum((x != x).to(tl.int32), axis=1) > 0
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.where(bad, float("nan"), amax)
    zero = amax < FP8_MIN_AMAX  # formats/fp8.py: flushed, as all-zero rows
    scale = tl.where(zero, 1.0, tl.div_rn(amax, 448.0))
    inv = tl.where(zero, 1.0, tl.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax))
    nonfinite = bad | (amax == float("inf"))
    tl.store(S + rows, tl.where(nonfinite, float("nan"), scale), mask=rows < R)
    tl.store(Y + offs, _e4m3_signed(x * inv[:, None]).to(tl.float8e4nv), mask=ok)


@triton.jit
def _nvfp4_rows_kernel(X, Y, MULT, SDEC, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """NVFP4 grid values (E2M1 x E4M3 block scale, without the tensor scale) as bf16,
    in TransformerEngine's operation order (formats/nvfp4.py)."""
    NB: tl.constexpr = D // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = (rows.to(tl.int64)[:, None, None] * D + tl.arange(0, NB)[None, :, None] * 16
            + tl.arange(0, 16)[None, None, :])
    ok = (rows < R)[:, None, None]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    mult = tl.load(MULT)
    s_dec = tl.load(SDEC)
    d = tl.minimum(tl.max(tl.abs(x), axis=2) * mult, 3.4028234663852886e38)
    d = round_e4m3(tl.minimum(d, 448.0))
    enc = tl.minimum(tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d * s_dec), 3.4028234663852886e38)
    y = x * enc[:, :, None]
    mag = _e2m1_value(tl.minimum(tl.abs(y), 6.0))
    val = _with_sign_of(mag, y) * d[:, :, None]
    tl.store(Y + offs, val.to(tl.bfloat16), mask=ok)


@triton.jit
def _v_kernel(V, VT, INV, OUT_SCALE, S, D: tl.constexpr, BLOCK_S: tl.constexpr, MXFP4: tl.constexpr):
    """V (S, D) of one head -> e4m3 V^T (D, S).

    FP8: e4m3(v * inv[d]). MXFP4: E2M1 of v * 2**-e (e per 32 keys and channel) times
    2**(e - c): OUT_SCALE holds 2**(e - c), 0 for blocks flushed by the window, NaN for
    non-finite blocks."""
    NB: tl.constexpr = BLOCK_S // 32
    bh = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * NB + tl.arange(0, NB)  # 32-key block index
    s = blk[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    ok = s < S
    v = tl.load(V + bh * S * D + s * D + d, mask=ok, other=0.0).to(tl.float32)
    nblocks = tl.cdiv(S, 32)
    if MXFP4:
        t_off = bh * nblocks * D + blk[:, None, None] * D + d  # tables are (B*H, n_blocks, D)
        tmask = blk[:, None, None] < nblocks
        inv = tl.load(INV + t_off, mask=tmask, other=1.0)
        osc = tl.load(OUT_SCALE + t_off, mask=tmask, other=0.0)
        y = v * inv
        mag = _e2m1_value(tl.abs(y))
        out = _with_sign_of(mag, y) * osc
        out = tl.where(osc == 0.0, 0.0, out)  # a flushed block is +0, as the reference's masked_fill
    else:
        inv = tl.load(INV + bh * D + d)
        out = _e4m3_signed(v * inv)
    tl.store(VT + bh * D * S + d * S + s, out.to(tl.float8e4nv), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1, x.shape[-1])


def quantize_qk_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xr = _rows(x)
    y = torch.empty(xr.shape, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(xr.shape[0], device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(xr.shape[0], 16),)
    _fp8_rows_kernel[grid](xr, y, s, xr.shape[0], D=x.shape[-1], BLOCK_R=16, num_warps=4)
    return y.view(x.shape), s.view(x.shape[:-1])


def quantize_qk_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s_enc = nvfp4_global_encode_scale(x.float().abs().amax())
    s_dec = exact_div(1.0, s_enc).reshape(1)
    mult = (s_enc * exact_div(torch.ones_like(s_enc), 6.0)).reshape(1)
    xr = _rows(x)
    y = torch.empty(xr.shape, device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(xr.shape[0], 16),)
    _nvfp4_rows_kernel[grid](xr, y, mult, s_dec, xr.shape[0], D=x.shape[-1], BLOCK_R=16, num_warps=4)
    return y.view(x.shape), s_dec.expand(x.shape[:-1]).contiguous()


def quantize_v_t(v: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, S, D = v.shape
    vc = v.contiguous()
    vt = torch.empty((B, H, D, S), device=v.device, dtype=torch.float8_e4m3fn)
    if fmt == "fp8":
        vf = vc.float()
        vs, inv = fp8_scales(vf.abs().amax(dim=-2), ~torch.isfinite(vf).all(dim=-2))
        inv = inv.contiguous()
        out_scale = inv
    else:
        vb, _ = to_blocks(vc, -2, MX_BLOCK)  # (B, H, D, n_blocks, 32): the per-block reduction
        finite = torch.isfinite(vb).all(dim=-1)
        e = mx_exponent(torch.where(torch.isfinite(vb), vb, 0.0).abs().amax(dim=-1))
        c, flushed = v_window(e, finite)
        osc = pow2((e - c[..., None, None]).clamp(-149, 127)).masked_fill(flushed, 0.0)
        osc = osc.masked_fill(~finite, float("nan"))
        inv = pow2(-e.clamp(-127, 127)).transpose(-1, -2).contiguous()  # (B, H, n_blocks, D)
        out_scale = osc.transpose(-1, -2).contiguous()
        vs = pow2(c)[..., None].expand(B, H, D).contiguous()
    block_s = 64
    grid = (triton.cdiv(S, block_s), B * H)
    _v_kernel[grid](vc, vt, inv, out_scale, S, D=D, BLOCK_S=block_s, MXFP4=fmt == "mxfp4", num_warps=4)
    return vt, vs.float()


def prepare_operands_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe) -> KernelOperands:
    """The same tensors as `operands.prepare_operands`, from fused kernels."""
    qk = quantize_qk_fp8 if recipe.qk == "fp8" else quantize_qk_nvfp4
    qv, qs = qk(q)
    kv, ks = qk(k)
    vt, vs = quantize_v_t(v, recipe.v)
    return KernelOperands(qv, kv, qs, ks, vt, vs)
