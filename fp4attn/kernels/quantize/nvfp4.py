"""NVFP4 Q/K along the head dim with one tensor scale per head (`_nvfp4_rows_kernel`,
`quantize_qk_nvfp4`): TransformerEngine's operation order, as
`formats.nvfp4.quantize_nvfp4(x, scale_dims=x.ndim - 2)` defines it, the grid values as
bf16 and, for training, the packed payload; with the outlier-robust forms of
`reference.forward.robust_qk` (K less its mean, 4-or-6 block scales as
`quantize_nvfp4(four_over_six=True)`, heads quantized per token to FP8 instead,
`reference.operands.quantize_qk_fallback`). And the payload's decode back to grid values,
with the per-channel FP8 view of the dequantized values that the training backward reads
(`_nvfp4_decode_kernel`, `decode_nvfp4_rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4attn.formats import constants
from fp4attn.kernels.common import max_propagating_nan, round_e4m3
from fp4attn.kernels.quantize.elements import (
    _e2m1_code,
    _e2m1_magnitude,
    _e2m1_value,
    _e4m3_signed,
    _hw_cvt,
    _signed,
)
from fp4attn.kernels.quantize.fp8 import _fp8_channel_scales, _fp8_per_row
from fp4attn.kernels.quantize.rows import (
    CHANNEL_BLOCKS,
    _abs_bits_max,
    _block_rows,
    _channel_amax_flush,
    _heads,
    _row_grid,
)
from fp4attn.kernels.quantize.statistics import abs_max_bits

FP32_MAX = tl.constexpr(constants.FP32_MAX)


# 1 / 6 rounded to float32 (0x3E2AAAAB), the constant of the NVFP4 multiplier: a literal,
# where a division at run time took a reciprocal's dozen instructions in every program
ONE_SIXTH = tl.constexpr(0.1666666716337204)


@triton.jit
def _nvfp4_tensor_scales(AMAX):
    """(multiplier, decode scale, decode scale as the kernels read it) of an NVFP4
    tensor (one head) whose max |x| (float32 bits) is at AMAX, as `formats.nvfp4`
    computes them (TransformerEngine's rule): S_enc = min(448 * 6 / amax, FP32_MAX), 1
    where that is 0; decode 1 / S_enc; multiplier S_enc * (1 / 6). Every operation is a
    single IEEE-rounded one (no product meets an add, so nothing is contracted into an
    FMA). amax is that of the head's finite values (`abs_max_bits(..., finite=True)`)."""
    amax = tl.load(AMAX).to(tl.float32, bitcast=True)
    one = tl.full(amax.shape, 1.0, tl.float32)
    s_enc = tl.minimum(tl.div_rn(one * 2688.0, amax), FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
    s_dec = tl.div_rn(one, s_enc)
    return s_enc * ONE_SIXTH, s_dec, s_dec, s_enc


@triton.jit
def _nvfp4_block_offsets(rows, D: tl.constexpr):
    """Element offsets of rows of D contiguous elements seen as (rows, D / 16 blocks, 16)."""
    return rows[:, None, None] * D + tl.arange(0, D // 16)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]


@triton.jit
def _nvfp4_row_block(X, g, S, i, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr, D: tl.constexpr):
    """`_row_block` seen as (BLOCK_R, D / 16 blocks, 16)."""
    s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
    return tl.load(X + _nvfp4_block_offsets(rows, D), mask=((s < S) & (i < BLOCKS))[:, None, None], other=0.0)


@triton.jit
def _row_offsets(rows, N: tl.constexpr):
    """Offsets of rows of N contiguous entries, (rows, N): the payload's code bytes
    (N = D / 2) and block scales (N = D / 16)."""
    return rows[:, None] * N + tl.arange(0, N)[None, :]


@triton.jit
def _nvfp4_block_scale(amax_b, mult, s_dec, HW_CVT: tl.constexpr):
    """(decode scale d, encode multiplier) of blocks (rows, blocks) with max |x| amax_b
    scaled by `mult` (S_enc / top): d = e4m3(min(amax_b * mult, 448)), the multiplier
    min(1 / (d * s_dec), FP32_MAX) (`formats.nvfp4`). The e4m3 rounding by the
    hardware's saturating conversion where HW_CVT (`_e4m3_signed`: 448 and NaN as the
    clamp gives them; the bit arithmetic was 2.5 instructions an element of the 4-or-6
    pass, whose two threads a block both round its two candidates)."""
    # a NaN block maximum gives a NaN scale (torch's clamp propagates NaN; tl.minimum
    # must be told to)
    nan_ok: tl.constexpr = tl.PropagateNan.ALL
    d = tl.minimum(amax_b * mult, FP32_MAX, propagate_nan=nan_ok)
    if HW_CVT:
        d = _e4m3_signed(d, True)
    else:
        d = round_e4m3(tl.minimum(d, 448.0, propagate_nan=nan_ok))
    enc = tl.minimum(tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d * s_dec), FP32_MAX, propagate_nan=nan_ok)
    return d, enc


@triton.jit
def _nvfp4_rows_kernel(X, Y, AMAX, SDEC, CODES, BSCALE, CAMAX, MEAN, FB, S, D: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCKS: tl.constexpr, PACKED: tl.constexpr, CHANNEL_AMAX: tl.constexpr,
                       HAS_MEAN: tl.constexpr = False, FOUR_OVER_SIX: tl.constexpr = False,
                       FALLBACK: tl.constexpr = False, HW_CVT: tl.constexpr = True):
    """NVFP4 grid values (E2M1 x E4M3 block scale, without the tensor scale) of X (G, S,
    D) as bf16, in TransformerEngine's operation order (formats/nvfp4.py), each head's
    tensor scale from its finite values' max |x| at AMAX (G,), a block holding a NaN or
    Inf NaN (scale 0x7F, codes 0); SDEC (G, S) gets the head's decode scale in every
    row's slot. With PACKED also the payload
    as `quantize_nvfp4` stores it: CODES (G, S, D / 2) uint8, two E2M1 codes a byte,
    element 2i in the low nibble; BSCALE (G, S, D / 16) the e4m3 block scales. With
    CHANNEL_AMAX also each head's per-channel max |grid value| into CAMAX (G, D)
    (float32 bits, starting at 0). BLOCKS blocks of BLOCK_R rows a program.

    The outlier-robust forms (`reference.forward.robust_qk`): HAS_MEAN quantizes x - MEAN
    (G, D) (K smoothing); FOUR_OVER_SIX scales each block to 4 or 6, whichever has the
    smaller largest error (`formats.quantize_nvfp4(four_over_six=True)`); FALLBACK: the
    heads whose FB (G,) int8 is 1 are quantized per token to FP8 instead (values as bf16,
    the row scales into SDEC; not with PACKED or CHANNEL_AMAX)."""
    g = tl.program_id(1).to(tl.int64)
    mult, s_dec, s_dec_out, s_enc = _nvfp4_tensor_scales(AMAX + g)
    run = tl.zeros([BLOCK_R, D], tl.int32)
    mu = tl.zeros([BLOCK_R, D // 16, 16], tl.float32)
    if HAS_MEAN:
        # loaded for every row of the tile, in its layout (L1 hits), not (1, D) then moved
        # across threads through shared memory
        mu = tl.load(MEAN + g * D + _nvfp4_block_offsets(tl.zeros([BLOCK_R], tl.int64), D)).to(tl.float32)
    fp8_head = False
    if FALLBACK:
        fp8_head = tl.load(FB + g) != 0
    # several blocks a program: the next block's load issued before this block's work
    # (`_row_block`)
    PREFETCH: tl.constexpr = BLOCKS > 1
    if PREFETCH:
        nxt = _nvfp4_row_block(X, g, S, 0, BLOCK_R, BLOCKS, D)
    for i in range(BLOCKS):
        s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
        offs = _nvfp4_block_offsets(rows, D)
        ok = (s < S)[:, None, None]
        if PREFETCH:
            x = nxt.to(tl.float32)
            nxt = _nvfp4_row_block(X, g, S, i + 1, BLOCK_R, BLOCKS, D)
        else:
            x = _nvfp4_row_block(X, g, S, i, BLOCK_R, BLOCKS, D).to(tl.float32)
        if HAS_MEAN:
            x = x - mu
        if fp8_head:
            y8, sc = _fp8_per_row(tl.reshape(x, [BLOCK_R, D]), 1, HW_CVT)
            tl.store(SDEC + rows, sc, mask=s < S)
            tl.store(Y + _row_offsets(rows, D), y8.to(tl.bfloat16), mask=(s < S)[:, None])
        else:
            tl.store(SDEC + rows, tl.full([BLOCK_R], 0.0, tl.float32) + s_dec_out, mask=s < S)
            # on magnitudes: |x * enc| is |x| * enc exactly (rounding is symmetric), and
            # the sign goes back on at the end
            ax = tl.abs(x)
            # NaN or Inf in a block makes its maximum NaN or Inf, and the block NaN (its
            # scale; the codes are 0): a finite block's maximum is the plain one
            amax_b = tl.reduce(ax, 2, max_propagating_nan)
            d, enc = _nvfp4_block_scale(amax_b, mult, s_dec, HW_CVT)
            mag = _e2m1_value(ax * enc[:, :, None])
            if FOUR_OVER_SIX:
                # the 4-scaled candidate, and the larger error of each (`formats.nvfp4.
                # _block_error`: max |e2m1 * d - x * S_enc| over the block) on magnitudes:
                # |mag * d - |x| * S_enc| is |(+-mag) * d - x * S_enc| (x * S_enc rounded
                # alone). E2M1 (at most 2 significant bits) times e4m3 (4 bits, at least
                # 2**-9) is exact in float32, so an FMA contraction of the difference
                # rounds as the reference's two operations
                d4, enc4 = _nvfp4_block_scale(amax_b, s_enc * 0.25, s_dec, HW_CVT)
                mag4 = _e2m1_value(ax * enc4[:, :, None])
                t = libdevice.mul_rn(ax, s_enc)
                err4 = tl.max(tl.abs(mag4 * d4[:, :, None] - t), axis=2)
                better = err4 < tl.max(tl.abs(mag * d[:, :, None] - t), axis=2)
                d = tl.where(better, d4, d)
                mag = tl.where(better[:, :, None], mag4, mag)
            d = tl.where(amax_b < float("inf"), d, float("nan"))
            # the signed E2M1 value times d, as from y = x * enc: y has x's sign (enc > 0),
            # or is NaN only where d is (a NaN head)
            val = _signed(mag, x) * d[:, :, None]
            tl.store(Y + offs, val.to(tl.bfloat16), mask=ok)
            if CHANNEL_AMAX:
                run = _abs_bits_max(run, tl.reshape(val, [BLOCK_R, D]), (s < S)[:, None])
            if PACKED:
                # the elements of a NaN block (d is NaN) get code 0 (E2M1 has no NaN;
                # the block scale carries it)
                code = _e2m1_code(mag) | tl.where(x.to(tl.int32, bitcast=True) < 0, 8, 0)
                code = tl.where((d != d)[:, :, None], 0, code)
                lo, hi = tl.split(tl.reshape(code, [BLOCK_R, D // 2, 2]))
                rok = (s < S)[:, None]
                tl.store(CODES + _row_offsets(rows, D // 2), (lo | (hi << 4)).to(tl.uint8), mask=rok)
                tl.store(BSCALE + _row_offsets(rows, D // 16), d.to(tl.float8e4nv), mask=rok)
    if CHANNEL_AMAX:
        _channel_amax_flush(CAMAX + g * D, run, D)


@triton.jit
def _nvfp4_decode_kernel(CODES, BSCALE, Y, CT, CS, SCALE, CAMAX, S, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         CHANNELS: tl.constexpr, HW_CVT: tl.constexpr):
    """The grid values (E2M1 x block scale) of packed NVFP4 rows (G, S, D / 2) into Y
    (G, S, D) as Y's dtype: the inverse of `_nvfp4_rows_kernel`'s payload, the same
    values as its Y. With CHANNELS also the per-channel FP8 of the dequantized values
    (grid values times the head's tensor decode scale SCALE (G,)), stored transposed: CT (G, D, S)
    e4m3 and CS (G, D), from the channels' max |grid value| CAMAX (G, D) that the
    quantizing pass recorded (the backward's Q/K views for dK = dS^T Q and dQ = dS K)."""
    g = tl.program_id(1).to(tl.int64)
    s, rows = _block_rows(g, S, 0, BLOCK_S, 1)
    rok = (s < S)[:, None]
    b = tl.load(CODES + _row_offsets(rows, D // 2), mask=rok, other=0).to(tl.int32)
    code = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_S, D // 16, 16])
    d = tl.load(BSCALE + _row_offsets(rows, D // 16), mask=rok, other=0.0).to(tl.float32)
    mag = _e2m1_magnitude(code & 7)
    val = tl.where(code >= 8, -mag, mag) * d[:, :, None]
    tl.store(Y + _nvfp4_block_offsets(rows, D), val.to(Y.dtype.element_ty), mask=rok[:, :, None])
    if CHANNELS:
        dd = tl.arange(0, D)
        scale, inv = _fp8_channel_scales(CAMAX + g * D, SCALE + g, D, True)
        if tl.program_id(0) == 0:
            tl.store(CS + g * D + dd, scale)
        out = _e4m3_signed(tl.reshape(val, [BLOCK_S, D]) * tl.load(SCALE + g) * inv[None, :], HW_CVT)
        tl.store(CT + g * D * S + dd[None, :] * S + s[:, None], out.to(tl.float8e4nv), mask=rok)


def quantize_qk_nvfp4(x: torch.Tensor, packed: bool = False, channel_amax: bool = False, *,
                      mean: torch.Tensor | None = None, four_over_six: bool = False,
                      fallback: torch.Tensor | None = None, amax: torch.Tensor | None = None):
    """NVFP4 of x (..., S, D) along D with one tensor scale per head, that is per index
    of the leading dims (`formats.quantize_nvfp4(x, scale_dims=x.ndim - 2)`): (bf16 grid
    values without the tensor scale, the head's tensor decode scale broadcast to (...,
    S), from the head's finite values, a block holding a NaN or Inf NaN, as
    `reference.operands.quantize_qk`); with
    `packed` also the payload, (codes (..., S, D / 2) uint8, block scales (..., S, D /
    16) float8_e4m3fn), byte for byte that `quantize_nvfp4`'s data and scale; with
    `channel_amax` also max |grid value| per head and channel (..., D) as float32 bits (what `decode_nvfp4_rows(..., channels_scale=...)` needs).

    The outlier-robust forms (`reference.forward.robust_qk`): `mean` (..., 1, D) float32
    is subtracted first (K smoothing); `four_over_six` picks 4 or 6 per block; `fallback`
    (bool or int8 0/1, one per head) quantizes those heads per token to FP8 instead (inference only:
    not with `packed` or `channel_amax`). `amax`: the heads' max |x - mean| bits over
    the finite values from `abs_max_bits(..., finite=True)`, if already computed."""
    if fallback is not None and (packed or channel_amax):
        raise ValueError("quantize_qk_nvfp4: the FP8 fallback heads have no NVFP4 payload (packed, channel_amax)")
    x3 = _heads(x)
    G, S, D = x3.shape
    mean3 = mean.reshape(G * D).float().contiguous() if mean is not None else None
    # both maxima start at zero: one buffer, one fill; the channel maxima (an output)
    # first, at the buffer's aligned start
    n_camax = G * D if channel_amax else 0
    zeros = torch.zeros(n_camax + (G if amax is None else 0), device=x.device, dtype=torch.int32)
    camax = zeros[:n_camax]
    if amax is None:  # the row kernel computes the tensor scales from it
        amax = abs_max_bits(x3, per_channel=False, out=zeros[n_camax:], mean=mean3, finite=True)
    amax = amax.reshape(G).contiguous()
    y = torch.empty(x3.shape, device=x.device, dtype=torch.bfloat16)
    s_dec = torch.empty((G, S), device=x.device, dtype=torch.float32)
    codes = torch.empty((G, S, D // 2) if packed else 0, device=x.device, dtype=torch.uint8)
    bscale = torch.empty((G, S, D // 16) if packed else 0, device=x.device, dtype=torch.float8_e4m3fn)
    # the 4-or-6 pass is bound by its arithmetic's latency: several blocks a program,
    # each block's work beside the next one's load (H200, (8, 16, 4096, 128): 0.107 ->
    # 0.101 ms a tensor); the plain pass is faster with one block a program
    blocks = CHANNEL_BLOCKS if channel_amax or four_over_six else 1
    grid, block = _row_grid(S, G, blocks)
    fb = fallback.reshape(G).to(torch.int8).contiguous() if fallback is not None else amax
    _nvfp4_rows_kernel[grid](x3, y, amax, s_dec, codes, bscale, camax, mean3 if mean3 is not None else amax, fb, S,
                             D=D, BLOCK_R=block, BLOCKS=blocks, PACKED=packed, CHANNEL_AMAX=channel_amax,
                             HAS_MEAN=mean3 is not None, FOUR_OVER_SIX=four_over_six,
                             FALLBACK=fallback is not None, HW_CVT=_hw_cvt(), num_warps=4)
    out = (y.view(x.shape), s_dec.view(x.shape[:-1]))
    if packed:
        out += (codes.view(*x.shape[:-1], D // 2), bscale.view(*x.shape[:-1], D // 16))
    if channel_amax:
        out += (camax.view(*x.shape[:-2], D),)
    return out


def decode_nvfp4_rows(codes: torch.Tensor, bscale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      channels_scale: torch.Tensor | None = None, channel_amax: torch.Tensor | None = None):
    """Grid values (..., S, D) as `dtype` (bfloat16 or float32; both hold them exactly)
    of a packed NVFP4 payload (`quantize_qk_nvfp4(..., packed=True)`'s codes and block
    scales), without the tensor scale.

    With `channels_scale` (the tensor decode scales, float32, one per head: (...,) or
    (..., S) as `quantize_qk_nvfp4` returns them, whose first column is read) and
    `channel_amax` (the channels' max |grid value| per head, (..., D) float32 bits, from
    `quantize_qk_nvfp4(..., channel_amax=True)`), also the per-channel FP8 of the
    dequantized values in the same pass, as `quantize_v_t(values, "fp8",
    scale=channels_scale)` makes it: (values, e4m3 (..., D, S), scales (..., D))."""
    D = codes.shape[-1] * 2
    if bscale.shape[-1] * 16 != D or codes.dtype != torch.uint8 or bscale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"decode_nvfp4_rows: codes (..., D/2) uint8 and block scales (..., D/16) float8_e4m3fn, "
                         f"got {tuple(codes.shape)} {codes.dtype} and {tuple(bscale.shape)} {bscale.dtype}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"decode_nvfp4_rows: dtype bfloat16 or float32, got {dtype}")
    channels = channels_scale is not None
    if channels != (channel_amax is not None):
        raise ValueError("decode_nvfp4_rows: channels_scale and channel_amax go together (the per-channel view)")
    c3, b3 = _heads(codes), _heads(bscale)
    G, S, _ = c3.shape
    y = torch.empty((G, S, D), device=codes.device, dtype=dtype)
    ct = torch.empty((G, D, S) if channels else 0, device=codes.device, dtype=torch.float8_e4m3fn)
    cs = torch.empty((G, D) if channels else 0, device=codes.device, dtype=torch.float32)
    none = cs  # pointer arguments the decode alone does not read
    head_scale = _per_head(channels_scale, G, S) if channels else none
    grid, block = _row_grid(S, G, 1)
    _nvfp4_decode_kernel[grid](
        c3, b3, y, ct, cs, head_scale, channel_amax.contiguous() if channels else none,
        S, D=D, BLOCK_S=block, CHANNELS=channels, HW_CVT=_hw_cvt(), num_warps=4)
    values = y.view(*codes.shape[:-1], D)
    if not channels:
        return values
    lead = codes.shape[:-2]
    return values, ct.view(*lead, D, S), cs.view(*lead, D)


def _per_head(scale: torch.Tensor, G: int, S: int) -> torch.Tensor:
    """One float32 per head (G,) from per-head (G) or per-row (G * S, every row of a
    head the same) tensor decode scales."""
    if scale.numel() == G * S:
        scale = scale.reshape(G, S)[:, 0]
    elif scale.numel() != G:
        raise ValueError(f"tensor decode scales: one per head ({G}) or per row ({G * S}), got {tuple(scale.shape)}")
    return scale.reshape(G).float().contiguous()
