"""V as the forward's PV operand: e4m3 V^T (B, H, D, S) with one scale per head and channel
(`_v_kernel`, `quantize_v_t`). FP8: per channel over the finite values,
`formats.quantize_fp8(v, dim=-2, finite_scale=True)`; MXFP4: E2M1 x 2**e per 32 keys and
channel, placed inside its head's e4m3 window, the blocks below it flushed
(`reference.operands.quantize_v_mxfp4`, `v_window`); both as `reference.operands.quantize_v`
defines them and `kernels.hopper.operands.prepare_operands` lays them out. V is read once
where a head's blocks can all be resident (`ONE_PASS_BLOCKS_PER_SM`); with `tokens` the
same launch also writes the training backward's per-token FP8 view of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4attn.kernels.common import sm_count
from fp4attn.kernels.placeholders import nothing
from fp4attn.kernels.quantize.elements import (
    _e2m1_value,
    _e4m3_signed,
    _hw_cvt,
    _pow2,
    _with_sign_of,
)
from fp4attn.kernels.quantize.fp8 import _fp8_channel_scales, _fp8_per_row
from fp4attn.kernels.quantize.mxfp4 import E8M0_EMIN, _mx_exponents
from fp4attn.kernels.quantize.rows import _cdiv, _finite_channel_max
from fp4attn.reference import encoding

V_TOP = tl.constexpr(encoding.V_TOP)
V_WINDOW = tl.constexpr(encoding.V_WINDOW)


@triton.jit
def _v_kernel(V, VT, VS, SCALE, STATS_AT, Y, YS, WORK, G, S, S_ROW, D: tl.constexpr, BLOCK_S: tl.constexpr,
              MXFP4: tl.constexpr, HAS_SCALE: tl.constexpr, TOKENS: tl.constexpr, HW_CVT: tl.constexpr,
              STATS: tl.constexpr, QUANT: tl.constexpr):
    """V (S, D) of each head -> e4m3 V^T (D, S) in rows of S_ROW >= S keys (zero past S)
    and the per-channel scales VS (G, D), written by each head's first block.

    A program takes one block of BLOCK_S keys of one head, in the order of a ticket drawn
    from WORK[0] (G * cdiv(S_ROW, BLOCK_S) blocks). STATS: the head's statistic from the
    block into STATS_AT by an atomic max: FP8, each channel's max |v| (G, D), float32
    bits; MXFP4, the largest exponent of a finite 32-key block (G,), less E8M0_EMIN (so
    that zeros start it). QUANT: the block's values from the finished statistic. With
    both, the block stays in registers between them: the program counts itself into
    WORK[1 + g] and waits until all its head's blocks are counted, so V is read once (a
    pass for the maxima and a pass for the values read it twice). The tickets make the
    wait safe: every block of an earlier ticket belongs to a program that is running or
    done, so a head waits only on programs that run, provided the GPU holds a head's
    blocks at once (`ONE_PASS_BLOCKS_PER_SM`). Longer heads take two launches, STATS then
    QUANT, as do heads of more than one block under the interpreter, which runs programs
    one after another.

    FP8: e4m3(v * inv[d]), with v first multiplied by the scalar SCALE if HAS_SCALE, a NaN
    or Inf stored as NaN; the per-channel scales from each channel's max |v| over its
    finite values (STATS; given maxima are used as they are) as `formats.fp8.fp8_scales`
    computes them (`_fp8_channel_scales`): `formats.quantize_fp8(finite_scale=True)`.
    MXFP4: E2M1 of v * 2**-e times 2**(e - c), e the block's exponent (`_mx_exponents`)
    and c from the head's largest finite exponent (`reference.operands.v_window`):
    blocks more than V_WINDOW below it are flushed to +0, non-finite blocks are NaN.
    TOKENS: also the per-token FP8 of V's represented values (V^T's values times VS),
    Y (G, S, D) e4m3 and YS (G, S): the training backward's view of V in
    dP = dO V^T, from the tile already in registers."""
    NB: tl.constexpr = BLOCK_S // 32
    n_blocks = tl.cdiv(S_ROW, BLOCK_S)
    if STATS and QUANT:
        item = tl.atomic_add(WORK, 1, sem="relaxed")
    else:
        item = tl.program_id(0)
    bh = (item // n_blocks).to(tl.int64)
    b = item % n_blocks
    s = b * BLOCK_S + tl.arange(0, NB)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    dd = tl.arange(0, D)
    ok = s < S
    v = tl.load(V + bh * S * D + s * D + d, mask=ok, other=0.0).to(tl.float32)
    if STATS:
        if MXFP4:
            e, finite = _mx_exponents(v)
            top = tl.max(tl.max(tl.max(tl.where(finite, e, E8M0_EMIN), axis=2), axis=1), axis=0)
            tl.atomic_max(STATS_AT + bh, top - E8M0_EMIN, sem="relaxed")
        else:
            # of the finite values: NaN and Inf count as 0
            cmax = _finite_channel_max(v, BLOCK_S, D)
            tl.atomic_max(STATS_AT + bh * D + dd, cmax, sem="relaxed")  # (`_channel_amax_flush`)
        if QUANT:
            # the count follows every thread's atomics (the barrier, then a release), and
            # the reads of the statistic follow the count (acquire, which also drops the
            # L1's lines; MXFP4's one word is read `.cg`, from L2, besides)
            tl.debug_barrier()
            tl.atomic_add(WORK + 1 + bh, 1, sem="release")
            counted = tl.atomic_add(WORK + 1 + bh, 0, sem="acquire")
            while counted < n_blocks:
                counted = tl.atomic_add(WORK + 1 + bh, 0, sem="acquire")
    if QUANT:
        if MXFP4:
            e, finite = _mx_exponents(v)  # again: fewer registers held through the wait
            e_max = tl.load(STATS_AT + bh, cache_modifier=".cg") + E8M0_EMIN
            c = tl.minimum(tl.maximum(e_max - V_TOP, -126), 126)
            osc = _pow2(tl.minimum(tl.maximum(e - c, -149), 127))
            osc = tl.where(finite & (e < e_max - V_WINDOW), 0.0, osc)
            osc = tl.where(finite, osc, float("nan"))
            y = v * _pow2(-tl.minimum(tl.maximum(e, -127), 127))
            mag = _e2m1_value(tl.abs(y))
            out = _with_sign_of(mag, y) * osc
            out = tl.where(osc == 0.0, 0.0, out)  # a flushed block is +0, as the reference's masked_fill
            vs = tl.full([D], 0.0, tl.float32) + _pow2(c)
        else:
            vs, inv = _fp8_channel_scales(STATS_AT + bh * D, SCALE, D, HAS_SCALE)
            if HAS_SCALE:
                v = v * tl.load(SCALE)
            # NaN and Inf as NaN: v - v is +0 for a finite v (x - +0 is x, -0 included) and NaN
            # for NaN or Inf (the conversion saturates Inf; no select held across it)
            out = _e4m3_signed(v * inv[None, None, :] - (v - v), HW_CVT)
        if b == 0:
            tl.store(VS + bh * D + dd, vs)
        out = tl.where(ok, out, 0.0)  # the rows' padding past S (a NaN block's too) is zero
        tl.store(VT + bh * D * S_ROW + d * S_ROW + s, out.to(tl.float8e4nv), mask=s < S_ROW)
        if TOKENS:
            # the represented values exactly as the reference's (one float32 product)
            y, ys = _fp8_per_row(out * vs[None, None, :], 2, HW_CVT)
            tok = b * BLOCK_S + tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
            tl.store(YS + bh * S + tok, ys, mask=tok < S)
            tl.store(Y + bh * S * D + s * D + d, y.to(tl.float8e4nv), mask=ok)


# keys and warps a program of `_v_kernel` by head dim (the per-token view: 32 keys, 4
# warps; at 64 keys it took 167 registers). H100, V read once at (8, 16, 4096, 128)
# (tools/probe_v_quant.py, log/h100-v-read-once/): FP8 0.101 ms with 128 keys and 4 warps
# (154 registers), 0.116 with 64, 0.133 with 128 keys and 8 warps (a bf16 copy of V: 0.094);
# MXFP4 0.193, 0.313, 0.354; read twice, 0.126 to 0.142 (FP8) and 0.215 to 0.360 (MXFP4)
V_PROGRAM = {64: (128, 4), 128: (128, 4)}


# V read once waits on its head's blocks, so they must be resident together: a head of at
# most half a block per SM (8448 keys on 132 SMs) is safe even while up to three other
# such launches run on other streams (an SM holds two to three of these programs: a stuck
# set of launches would need each of them to hold fewer than a head's blocks)
ONE_PASS_BLOCKS_PER_SM = 0.5


def quantize_v_t(v: torch.Tensor, fmt: str, scale: torch.Tensor | None = None, pad_keys_to: int = 1,
                 channel_amax: torch.Tensor | None = None, tokens: bool = False, one_pass: bool | None = None):
    """V (B, H, S, D) as e4m3 V^T (B, H, D, S) and its per-channel scale (B, H, D): FP8 per
    channel, or MXFP4 inside its e4m3 window (`reference.operands.quantize_v`).

    `scale` (FP8 only): a float32 scalar tensor; quantize v * scale (rounded in float32,
    as the reference's dequantized NVFP4 values) without materializing the product.
    `pad_keys_to`: V^T's rows are allocated with a multiple of this many keys, zero past
    S, and V^T is returned as the (B, H, D, S) view of them: a kernel can then read
    whole key tiles without a mask, and rows start 16-byte aligned whatever S is (an
    unaligned row stride made the forward load V^T a byte at a time).
    `channel_amax` (FP8 only): max |v| per head and channel, (B, H, D) float32 bits,
    when a pass over v has recorded it (`quantize_qk_fp8(..., channel_amax=True)`);
    computed here otherwise.
    `tokens`: also the per-token FP8 of V's represented values (V^T's values times the
    scales), (B, H, S, D) e4m3 and (B, H, S): the training backward's view of V, made
    from the tile in registers instead of a pass over V^T.
    `one_pass`: whether V is read once (its statistic and values in one launch,
    `_v_kernel`) or twice (two launches; the same bytes); None: once where that is safe
    (a head of one block of a program's keys; on the GPU, of at most
    `ONE_PASS_BLOCKS_PER_SM` such blocks per SM)."""
    if (scale is not None or channel_amax is not None) and fmt != "fp8":
        raise ValueError(f"quantize_v_t: `scale` and `channel_amax` are for fmt='fp8' only, got fmt={fmt!r}")
    if not isinstance(pad_keys_to, int) or pad_keys_to < 1:
        raise ValueError(f"quantize_v_t: pad_keys_to must be a positive int (1: no padding), got {pad_keys_to!r}")
    B, H, S, D = v.shape
    G = B * H
    s_row = _cdiv(S, pad_keys_to) * pad_keys_to
    block_s, warps = (32, 4) if tokens else V_PROGRAM.get(D, (64, 4))
    n_blocks = _cdiv(s_row, block_s)
    # a head of one block never waits (and so runs under the interpreter too)
    resident = n_blocks == 1 or (_hw_cvt() and v.is_cuda and n_blocks <= ONE_PASS_BLOCKS_PER_SM * sm_count(v.device))
    if one_pass is None:
        one_pass = resident
    elif one_pass and not resident:
        raise ValueError(f"quantize_v_t: one_pass needs a head of one {block_s}-key block, or the GPU and at most "
                         f"{ONE_PASS_BLOCKS_PER_SM} such blocks a head per SM ({n_blocks} blocks a head here)")
    vc = v.contiguous()
    vt = torch.empty((B, H, D, s_row), device=v.device, dtype=torch.float8_e4m3fn)
    vs = torch.empty((B, H, D), device=v.device, dtype=torch.float32)
    if tokens:
        y = torch.empty((B, H, S, D), device=v.device, dtype=torch.float8_e4m3fn)
        ys = torch.empty((B, H, S), device=v.device, dtype=torch.float32)
    else:
        y, ys = nothing(v.device, torch.float8_e4m3fn), nothing(v.device, torch.float32)
    if channel_amax is not None:  # the statistic given: the values alone
        stats = tickets = channel_amax.contiguous()  # (no tickets read)
        passes = [dict(STATS=False, QUANT=True)]
    else:
        # the statistic (FP8: G x D maxima; MXFP4: G exponents) and the one-launch form's
        # tickets and counts, in one buffer of zeros
        n_stats = G * D if fmt == "fp8" else G
        work = torch.zeros(n_stats + 1 + G, device=v.device, dtype=torch.int32)
        stats, tickets = work[:n_stats], work[n_stats:]
        if one_pass:
            passes = [dict(STATS=True, QUANT=True)]  # V read once (`_v_kernel`)
        else:
            passes = [dict(STATS=True, QUANT=False), dict(STATS=False, QUANT=True)]
    args = (vc, vt, vs, scale if scale is not None else vs, stats, y, ys, tickets, G, S, s_row)
    consts = dict(D=D, BLOCK_S=block_s, MXFP4=fmt == "mxfp4", HAS_SCALE=scale is not None, TOKENS=tokens,
                  HW_CVT=_hw_cvt(), num_warps=warps)
    for flags in passes:
        _v_kernel[(G * n_blocks,)](*args, **consts, **flags)
    out = ((vt[..., :S] if s_row > S else vt), vs)
    return out + (y, ys) if tokens else out
