"""Fused Triton quantizers: bf16/fp16/fp32 Q, K, V into the forward kernel's operand
layouts, one pass over each operand after the reductions its scales need: the minimum
and maximum of the tensor (NVFP4 Q/K) or of each channel (FP8 V) by `torch.aminmax`,
from which the kernels compute the scales themselves, and MXFP4 V's block exponents
and head maximum (`_mx_block_stats_kernel`). Two or three launches per operand, and
nothing here waits for the GPU.

Each reproduces the reference quantizer bit for bit (`kernels/hopper/operands.py`
builds the same tensors from `fp4attn.formats`; tests compare them with
`torch.equal`): divisions are `div_rn` (IEEE, as torch's tensor division), and values
are rounded to the e4m3 / E2M1 grids by explicit arithmetic before the final, exact
cast.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fp4attn.formats import constants
from fp4attn.formats.constants import MX_BLOCK
from fp4attn.kernels.common import fp8_scale_inv, round_e4m3
from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands, qk_dtype
from fp4attn.recipes import Recipe
from fp4attn.reference import encoding

FP32_MAX = tl.constexpr(constants.FP32_MAX)
E2M1_EMAX = tl.constexpr(constants.E2M1_EMAX)
E8M0_EMIN = tl.constexpr(constants.E8M0_EMIN)
E8M0_EMAX = tl.constexpr(constants.E8M0_EMAX)
V_TOP = tl.constexpr(encoding.V_TOP)
V_WINDOW = tl.constexpr(encoding.V_WINDOW)


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
def _e2m1_code(a):
    """E2M1 magnitude code (0 .. 7, int32) nearest to non-negative a, ties to even,
    saturating: the number of rounding boundaries a passes (0.25 and 1.25 and 2.5 are
    ties that go down to the even code, 0.75, 1.75 and 3.5 ties that go up)."""
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))


@triton.jit
def _e2m1_magnitude(c):
    """The value (0, 0.5, 1, 1.5, 2, 3, 4, 6) of E2M1 magnitude code c (int32, 0 .. 7)."""
    return tl.where(c <= 4, c.to(tl.float32) * 0.5, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))


@triton.jit
def _e2m1_value(a):
    """E2M1 value (0 .. 6) nearest to non-negative a, ties to even, saturating."""
    return _e2m1_magnitude(_e2m1_code(a))


@triton.jit
def _fp8_per_row(x, AXIS: tl.constexpr):
    """FP8 e4m3 of a float32 tile with one scale per row along AXIS, as
    `formats.fp8.quantize_fp8`: (values on the e4m3 grid, as float32; scale). scale =
    amax / 448, element = e4m3(x * (448 / amax)); rows below FP8_MIN_AMAX get scale 1;
    a row holding NaN or Inf gets scale NaN."""
    bad = tl.sum((x != x).to(tl.int32), axis=AXIS) > 0
    amax = tl.max(tl.abs(x), axis=AXIS)
    amax = tl.where(bad, float("nan"), amax)
    scale, inv = fp8_scale_inv(amax)
    nonfinite = bad | (amax == float("inf"))
    y = _e4m3_signed(x * (inv[:, None] if AXIS == 1 else inv[None, :]))
    return y, tl.where(nonfinite, float("nan"), scale)


@triton.jit
def _fp8_rows_kernel(X, Y, S, O, DOT, R, D: tl.constexpr, BLOCK_R: tl.constexpr, WITH_DOT: tl.constexpr):
    """Per-row FP8 of rows of D contiguous elements, stored as Y's dtype (e4m3, or bf16,
    which holds every e4m3 value); with WITH_DOT also the row dot products
    DOT = sum(X * O) (the backward's delta = rowsum(dO * O), fused into the pass that
    reads dO)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    ok = (rows < R)[:, None]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    y, scale = _fp8_per_row(x, 1)
    tl.store(S + rows, scale, mask=rows < R)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    if WITH_DOT:
        o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(DOT + rows, tl.sum(x * o, axis=1), mask=rows < R)


@triton.jit
def _fp8_tokens_of_vt_kernel(VT, VS, Y, YS, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Per-token FP8 of V's represented values, read from its (D, S) e4m3 form and
    per-channel scales VS: Y (S, D) e4m3 and YS (S,) per head."""
    bh = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = (s < S)[None, :]
    v = tl.load(VT + bh * D * S + d[:, None] * S + s[None, :], mask=ok, other=0.0).to(tl.float32)
    v = v * tl.load(VS + bh * D + d)[:, None]  # the reference's represented values, exactly
    y, scale = _fp8_per_row(v, 0)
    tl.store(YS + bh * S + s, scale, mask=s < S)
    tl.store(Y + bh * S * D + s[None, :] * D + d[:, None], y.to(tl.float8e4nv), mask=ok)


@triton.jit
def _abs_max_of(lo, hi):
    """max |x| from the minimum and maximum of x, exactly x.float().abs().max() (NaN
    propagates, +0 for an all-zero x)."""
    return tl.abs(tl.maximum(hi.to(tl.float32), -lo.to(tl.float32), propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _nvfp4_tensor_scales(LO, HI):
    """(multiplier, decode scale) of an NVFP4 tensor whose minimum and maximum are at LO
    and HI, as `formats.nvfp4` computes them (TransformerEngine's rule): S_enc =
    min(448 * 6 / amax, FP32_MAX), 1 where that is 0; decode 1 / S_enc; multiplier
    S_enc * (1 / 6). Every operation is a single IEEE-rounded one (no product meets an
    add, so nothing is contracted into an FMA)."""
    amax = _abs_max_of(tl.load(LO), tl.load(HI))
    one = tl.full(amax.shape, 1.0, tl.float32)
    s_enc = tl.minimum(tl.div_rn(one * 2688.0, amax), FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
    return s_enc * tl.div_rn(one, one * 6.0), tl.div_rn(one, s_enc)


@triton.jit
def _nvfp4_block_offsets(rows, D: tl.constexpr):
    """Element offsets of rows of D contiguous elements seen as (rows, D / 16 blocks, 16)."""
    return (rows.to(tl.int64)[:, None, None] * D + tl.arange(0, D // 16)[None, :, None] * 16
            + tl.arange(0, 16)[None, None, :])


@triton.jit
def _row_offsets(rows, N: tl.constexpr):
    """Offsets of rows of N contiguous entries, (rows, N): the payload's code bytes
    (N = D / 2) and block scales (N = D / 16)."""
    return rows.to(tl.int64)[:, None] * N + tl.arange(0, N)[None, :]


@triton.jit
def _nvfp4_rows_kernel(X, Y, LO, HI, SDEC, CODES, BSCALE, R, D: tl.constexpr, BLOCK_R: tl.constexpr,
                       PACKED: tl.constexpr):
    """NVFP4 grid values (E2M1 x E4M3 block scale, without the tensor scale) as bf16,
    in TransformerEngine's operation order (formats/nvfp4.py), the tensor scale from the
    tensor's minimum and maximum at LO and HI; SDEC (R,) gets the decode scale in every
    row's slot. With PACKED also the payload as `quantize_nvfp4` stores it: CODES (R,
    D / 2) uint8, two E2M1 codes a byte, element 2i in the low nibble; BSCALE (R, D / 16)
    the e4m3 block scales."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = _nvfp4_block_offsets(rows, D)
    ok = (rows < R)[:, None, None]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    mult, s_dec = _nvfp4_tensor_scales(LO, HI)
    tl.store(SDEC + rows, tl.full([BLOCK_R], 0.0, tl.float32) + s_dec, mask=rows < R)
    # a NaN anywhere makes the tensor scale NaN, and with it every block scale (torch's
    # clamp propagates NaN; tl.minimum must be told to)
    nan_ok: tl.constexpr = tl.PropagateNan.ALL
    d = tl.minimum(tl.max(tl.abs(x), axis=2) * mult, FP32_MAX, propagate_nan=nan_ok)
    d = round_e4m3(tl.minimum(d, 448.0, propagate_nan=nan_ok))
    enc = tl.minimum(tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d * s_dec), FP32_MAX, propagate_nan=nan_ok)
    y = x * enc[:, :, None]
    code = _e2m1_code(tl.minimum(tl.abs(y), 6.0))
    val = _with_sign_of(_e2m1_magnitude(code), y) * d[:, :, None]
    tl.store(Y + offs, val.to(tl.bfloat16), mask=ok)
    if PACKED:
        # a NaN element gets code 0 (E2M1 has no NaN; the block scale carries it)
        nan = y != y
        code = tl.where(nan, 0, code | tl.where(y.to(tl.int32, bitcast=True) < 0, 8, 0))
        lo, hi = tl.split(tl.reshape(code, [BLOCK_R, D // 2, 2]))
        rok = (rows < R)[:, None]
        tl.store(CODES + _row_offsets(rows, D // 2), (lo | (hi << 4)).to(tl.uint8), mask=rok)
        tl.store(BSCALE + _row_offsets(rows, D // 16), d.to(tl.float8e4nv), mask=rok)


@triton.jit
def _nvfp4_decode_rows_kernel(CODES, BSCALE, Y, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """The bf16 grid values (E2M1 x block scale) of packed NVFP4 rows: the inverse of
    `_nvfp4_rows_kernel`'s payload, the same values as its Y."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = (rows < R)[:, None]
    b = tl.load(CODES + _row_offsets(rows, D // 2), mask=rok, other=0).to(tl.int32)
    code = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_R, D // 16, 16])
    d = tl.load(BSCALE + _row_offsets(rows, D // 16), mask=rok, other=0.0).to(tl.float32)
    mag = _e2m1_magnitude(code & 7)
    val = tl.where(code >= 8, -mag, mag) * d[:, :, None]
    tl.store(Y + _nvfp4_block_offsets(rows, D), val.to(tl.bfloat16), mask=rok[:, :, None])


@triton.jit
def _floor_log2(a):
    """floor(log2 a) as int32 for positive finite float32 a, exact, subnormals included:
    they are scaled by 2**64 first (exact), so that their exponent field counts."""
    small = a < 1.1754943508222875e-38  # 2**-126, the smallest normal
    b = tl.where(small, a * 18446744073709551616.0, a).to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 127 - tl.where(small, 64, 0)


@triton.jit
def _pow2(e):
    """Exact float32 2**e for int32 e in [-149, 127] (`formats.minifloat.pow2`)."""
    normal = (tl.maximum(e + 127, 1) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _v_kernel(V, VT, VS, SCALE, LO, HI, E, FINITE, EMAX, S, S_ROW, D: tl.constexpr, BLOCK_S: tl.constexpr,
              MXFP4: tl.constexpr, HAS_SCALE: tl.constexpr):
    """V (S, D) of one head -> e4m3 V^T (D, S) in rows of S_ROW >= S keys and the
    per-channel scales VS (B*H, D), written by the first program of each head.

    FP8: e4m3(v * inv[d]), with v first multiplied by the scalar SCALE if HAS_SCALE; the
    per-channel scales from each channel's minimum and maximum over the sequence (LO,
    HI: (B*H, D)) as `formats.fp8.fp8_scales` computes them (with SCALE, of max |v| *
    SCALE, which is max |v * SCALE|: rounding is monotonic).
    MXFP4: E2M1 of v * 2**-e times 2**(e - c), with E and FINITE the block exponents and
    finiteness per 32 keys and channel ((B*H, n_blocks, D), `_mx_block_stats_kernel`)
    and c from the head's largest finite exponent EMAX (`reference.operands.v_window`):
    blocks more than V_WINDOW below it are flushed to +0, non-finite blocks are NaN."""
    NB: tl.constexpr = BLOCK_S // 32
    bh = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * NB + tl.arange(0, NB)  # 32-key block index
    s = blk[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    dd = tl.arange(0, D)
    ok = s < S
    v = tl.load(V + bh * S * D + s * D + d, mask=ok, other=0.0).to(tl.float32)
    if MXFP4:
        nblocks = tl.cdiv(S, 32)
        t_off = bh * nblocks * D + blk[:, None, None] * D + d
        tmask = blk[:, None, None] < nblocks
        e = tl.load(E + t_off, mask=tmask, other=0)
        finite = tl.load(FINITE + t_off, mask=tmask, other=1) != 0
        e_max = tl.load(EMAX + bh)
        c = tl.minimum(tl.maximum(e_max - V_TOP, -126), 126)
        osc = _pow2(tl.minimum(tl.maximum(e - c, -149), 127))
        osc = tl.where(finite & (e < e_max - V_WINDOW), 0.0, osc)
        osc = tl.where(finite, osc, float("nan"))
        y = v * _pow2(-tl.minimum(tl.maximum(e, -127), 127))
        mag = _e2m1_value(tl.abs(y))
        out = _with_sign_of(mag, y) * osc
        out = tl.where(osc == 0.0, 0.0, out)  # a flushed block is +0, as the reference's masked_fill
        if tl.program_id(0) == 0:
            tl.store(VS + bh * D + dd, tl.full([D], 0.0, tl.float32) + _pow2(c))
    else:
        amax = _abs_max_of(tl.load(LO + bh * D + dd), tl.load(HI + bh * D + dd))
        nonfinite = (amax != amax) | (amax == float("inf"))  # the channel holds a NaN or Inf
        if HAS_SCALE:
            amax = amax * tl.load(SCALE)
            v = v * tl.load(SCALE)
        scale, inv = fp8_scale_inv(amax)
        if tl.program_id(0) == 0:
            tl.store(VS + bh * D + dd, tl.where(nonfinite, float("nan"), scale))
        out = _e4m3_signed(v * inv[None, None, :])
    tl.store(VT + bh * D * S_ROW + d * S_ROW + s, out.to(tl.float8e4nv), mask=ok)


@triton.jit
def _mx_block_stats_kernel(V, E, FINITE, EMAX, S, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Per 32-key block and channel of V (S, D) of one head: the shared MXFP4 exponent of
    its finite entries (`formats.mx.mx_exponent`, floor rule) and whether all of them
    are finite, as (n_blocks, D) tables, and into EMAX (B*H,) the head's largest
    exponent of a finite block (an atomic max, so the order of programs cannot matter).
    Reads V once in its own layout."""
    NB: tl.constexpr = BLOCK_S // 32
    bh = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    s = blk[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    v = tl.load(V + bh * S * D + s * D + d, mask=s < S, other=0.0).to(tl.float32)
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-inf and NaN
    amax = tl.max(tl.where(finite, a, 0.0), axis=1)
    all_finite = tl.min(finite.to(tl.int32), axis=1) != 0
    positive = amax > 0.0
    e = tl.where(positive, _floor_log2(tl.where(positive, amax, 1.0)) - E2M1_EMAX, E8M0_EMIN)
    e = tl.minimum(tl.maximum(e, E8M0_EMIN), E8M0_EMAX)
    nblocks = tl.cdiv(S, 32)
    off = bh * nblocks * D + blk[:, None] * D + tl.arange(0, D)[None, :]
    ok = blk[:, None] < nblocks
    tl.store(E + off, e, mask=ok)
    tl.store(FINITE + off, all_finite.to(tl.int8), mask=ok)
    tl.atomic_max(EMAX + bh, tl.max(tl.max(tl.where(all_finite & ok, e, E8M0_EMIN), axis=1), axis=0))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1, x.shape[-1])


def quantize_qk_fp8(x: torch.Tensor, dot_with: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn):
    """Per-token FP8 of x (..., D): (e4m3 values as `dtype`, float8_e4m3fn or bfloat16;
    scales (...)); with `dot_with` (same shape) also the row sums of x * dot_with in
    float32."""
    if dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"quantize_qk_fp8: dtype float8_e4m3fn or bfloat16, got {dtype}")
    xr = _rows(x)
    y = torch.empty(xr.shape, device=x.device, dtype=dtype)
    s = torch.empty(xr.shape[0], device=x.device, dtype=torch.float32)
    dot = torch.empty(xr.shape[0] if dot_with is not None else 0, device=x.device, dtype=torch.float32)
    other = _rows(dot_with) if dot_with is not None else xr
    grid = (triton.cdiv(xr.shape[0], 16),)
    _fp8_rows_kernel[grid](xr, y, s, other, dot, xr.shape[0], D=x.shape[-1], BLOCK_R=16,
                           WITH_DOT=dot_with is not None, num_warps=4)
    if dot_with is not None:
        return y.view(x.shape), s.view(x.shape[:-1]), dot.view(x.shape[:-1])
    return y.view(x.shape), s.view(x.shape[:-1])


def quantize_qk_nvfp4(x: torch.Tensor, packed: bool = False):
    """NVFP4 of x (..., D) along D with one tensor scale (`formats.quantize_nvfp4`):
    (bf16 grid values without the tensor scale, the tensor decode scale broadcast to
    (...)); with `packed` also the payload, (codes (..., D / 2) uint8, block scales
    (..., D / 16) float8_e4m3fn), byte for byte `quantize_nvfp4(x)`'s data and scale."""
    lo, hi = torch.aminmax(x)  # the tensor scale is computed from them in the row kernel
    xr = _rows(x)
    D = x.shape[-1]
    y = torch.empty(xr.shape, device=x.device, dtype=torch.bfloat16)
    s_dec = torch.empty(xr.shape[0], device=x.device, dtype=torch.float32)
    codes = torch.empty((xr.shape[0], D // 2 if packed else 0), device=x.device, dtype=torch.uint8)
    bscale = torch.empty((xr.shape[0], D // 16 if packed else 0), device=x.device, dtype=torch.float8_e4m3fn)
    grid = (triton.cdiv(xr.shape[0], 16),)
    _nvfp4_rows_kernel[grid](xr, y, lo, hi, s_dec, codes, bscale, xr.shape[0], D=D, BLOCK_R=16, PACKED=packed,
                             num_warps=4)
    out = (y.view(x.shape), s_dec.view(x.shape[:-1]))
    if packed:
        out += (codes.view(*x.shape[:-1], D // 2), bscale.view(*x.shape[:-1], D // 16))
    return out


def decode_nvfp4_rows(codes: torch.Tensor, bscale: torch.Tensor) -> torch.Tensor:
    """bf16 grid values (..., D) of a packed NVFP4 payload (`quantize_qk_nvfp4(...,
    packed=True)`'s codes and block scales), without the tensor scale."""
    D = codes.shape[-1] * 2
    if bscale.shape[-1] * 16 != D or codes.dtype != torch.uint8 or bscale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"decode_nvfp4_rows: codes (..., D/2) uint8 and block scales (..., D/16) float8_e4m3fn, "
                         f"got {tuple(codes.shape)} {codes.dtype} and {tuple(bscale.shape)} {bscale.dtype}")
    cr, br = _rows(codes), _rows(bscale)
    y = torch.empty((cr.shape[0], D), device=codes.device, dtype=torch.bfloat16)
    _nvfp4_decode_rows_kernel[(triton.cdiv(cr.shape[0], 16),)](cr, br, y, cr.shape[0], D=D, BLOCK_R=16, num_warps=4)
    return y.view(*codes.shape[:-1], D)


def quantize_v_t(v: torch.Tensor, fmt: str, scale: torch.Tensor | None = None,
                 pad_keys_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """V (B, H, S, D) as e4m3 V^T (B, H, D, S) and its per-channel scale (B, H, D): FP8 per
    channel, or MXFP4 inside its e4m3 window (`reference.operands.quantize_v`).

    `scale` (FP8 only): a float32 scalar tensor; quantize v * scale (rounded in float32,
    as the reference's dequantized NVFP4 values) without materializing the product.
    `pad_keys_to`: V^T's rows are allocated with a multiple of this many keys, zero past
    S, and V^T is returned as the (B, H, D, S) view of them: a kernel can then read
    whole key tiles without a mask, and rows start 16-byte aligned whatever S is (an
    unaligned row stride made the forward load V^T a byte at a time)."""
    if scale is not None and fmt != "fp8":
        raise ValueError(f"quantize_v_t: `scale` is for fmt='fp8' only, got fmt={fmt!r}")
    if not isinstance(pad_keys_to, int) or pad_keys_to < 1:
        raise ValueError(f"quantize_v_t: pad_keys_to must be a positive int (1: no padding), got {pad_keys_to!r}")
    B, H, S, D = v.shape
    vc = v.contiguous()
    s_row = triton.cdiv(S, pad_keys_to) * pad_keys_to
    vt = torch.empty((B, H, D, s_row), device=v.device, dtype=torch.float8_e4m3fn)
    if s_row > S:
        vt[..., S:].zero_()
    vs = torch.empty((B, H, D), device=v.device, dtype=torch.float32)
    none = vs  # pointer arguments the other format's path does not read
    block_s = 64
    grid = (triton.cdiv(S, block_s), B * H)
    if fmt == "fp8":
        lo, hi = torch.aminmax(vc, dim=-2)  # the scales are computed from them in _v_kernel
        _v_kernel[grid](vc, vt, vs, scale if scale is not None else none, lo, hi, none, none, none, S, s_row, D=D,
                        BLOCK_S=block_s, MXFP4=False, HAS_SCALE=scale is not None, num_warps=4)
    else:
        n_blocks = triton.cdiv(S, MX_BLOCK)
        e = torch.empty((B, H, n_blocks, D), device=v.device, dtype=torch.int32)
        finite = torch.empty((B, H, n_blocks, D), device=v.device, dtype=torch.int8)
        e_max = torch.full((B * H,), constants.E8M0_EMIN, device=v.device, dtype=torch.int32)
        _mx_block_stats_kernel[grid](vc, e, finite, e_max, S, D=D, BLOCK_S=block_s, num_warps=4)
        _v_kernel[grid](vc, vt, vs, none, none, none, e, finite, e_max, S, s_row, D=D, BLOCK_S=block_s,
                        MXFP4=True, HAS_SCALE=False, num_warps=4)
    return (vt[..., :S] if s_row > S else vt), vs


def quantize_fp8_tokens_of_vt(vt: torch.Tensor, vs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 (B, H, S, D) e4m3 and scales (B, H, S) of V's represented values
    vt^T * vs, read from the forward's V^T (B, H, D, S) and per-channel scales (B, H, D)."""
    B, H, D, S = vt.shape
    y = torch.empty((B, H, S, D), device=vt.device, dtype=torch.float8_e4m3fn)
    ys = torch.empty((B, H, S), device=vt.device, dtype=torch.float32)
    block_s = 32
    _fp8_tokens_of_vt_kernel[(triton.cdiv(S, block_s), B * H)](vt.contiguous(), vs.contiguous(), y, ys, S, D=D,
                                                                BLOCK_S=block_s, num_warps=4)
    return y, ys


def prepare_operands_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe) -> KernelOperands:
    """The same tensors as `operands.prepare_operands`, from fused kernels."""
    if recipe.qk == "fp8":
        qk = functools.partial(quantize_qk_fp8, dtype=qk_dtype(recipe))
    else:
        qk = quantize_qk_nvfp4
    qv, qs = qk(q)
    kv, ks = qk(k)
    vt, vs = quantize_v_t(v, recipe.v, pad_keys_to=BLOCK_N)
    return KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True)
