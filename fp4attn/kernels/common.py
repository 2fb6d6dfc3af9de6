"""Triton helpers shared by every GPU generation: building the e4m3 P tile.

Each helper takes x = t - m (log2 units, <= 0, -inf for masked keys) for a whole
(BLOCK_M, BLOCK_N) tile and returns (p_fp32, l_add): the represented P values already
multiplied by 2**P_OFFSET_LOG2 (exact e4m3 values, so the caller's cast is exact for
MXFP4) and the row sums that consistent normalization adds to l. They reproduce
`fp4attn.reference.directp.build_p` value for value (see docs/numerics.md).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4attn.reference import directp, encoding

P_EMIN = tl.constexpr(encoding.P_EMIN)
P_OFFSET_LOG2 = tl.constexpr(encoding.P_OFFSET_LOG2)
# y >= T thresholds (reference/directp.py), each the float32 just at or above the log
T_QUARTER = tl.constexpr(directp.DIRECTP_THRESHOLDS[0])  # y > -2: code 1 (0.5)
T_075 = tl.constexpr(directp.DIRECTP_THRESHOLDS[1])  # y >= log2(0.75): code 2 (1.0)
T_125 = tl.constexpr(directp.DIRECTP_THRESHOLDS[2])  # frac(y) >= log2(1.25): mantissa bit
T_175 = tl.constexpr(directp.DIRECTP_THRESHOLDS[3])  # frac(y) >= log2(1.75): carries up


@triton.jit
def _blocks(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) -> (BLOCK_M, BLOCK_N // 32, 32): one MXFP4 block per last row.

    All MXFP4 P arithmetic stays in this 3-D view (the block reductions are then
    in-thread plus quad shuffles of the wgmma accumulator layout) and is reshaped back
    once, as e4m3, for the PV product.
    """
    return tl.reshape(x, (BLOCK_M, BLOCK_N // 32, 32))


@triton.jit
def _finish(p3, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """e4m3 (BLOCK_M, BLOCK_N) tile and fp32 row sums of a 3-D block view of P."""
    l_add = tl.sum(tl.sum(p3, axis=2), axis=1)
    return tl.reshape(p3.to(tl.float8e4nv), (BLOCK_M, BLOCK_N)), l_add


@triton.jit
def p_fp8_exp2(x):
    """FP8 P: e4m3(2**x * 2**8). Returns (values as e4m3, fp32 row sums of them)."""
    p8 = tl.math.exp2(x + P_OFFSET_LOG2).to(tl.float8e4nv)
    return p8, tl.sum(p8.to(tl.float32), axis=1)


@triton.jit
def p_mxfp4_directp(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """MXFP4 P by Direct-P, as exact e4m3 values E2M1 * 2**(e_b + 8).

    Per 32-key block e_b = floor(max x) - 2 and y = x - e_b < 3. For y >= 0 (E2M1
    normals) the value is built as float32 bits: exponent n + e_b + 8 with n = floor(y)
    and one mantissa bit per threshold passed by frac(y) (two passes carry into the
    exponent, as rounding up to the next power of two), capped at 6 * 2**e_b. For
    y < 0 it is 1.0, 0.5 or 0 times 2**e_b. No exp is computed.
    """
    x = _blocks(x, BLOCK_M, BLOCK_N)
    e_b = tl.floor(tl.max(x, axis=2))[:, :, None] - 2.0  # -inf for a fully masked block
    keep = e_b >= P_EMIN
    e_b = tl.where(keep, e_b, 0.0)
    y = x - e_b
    n = tl.floor(y)
    f = y - n  # exact for n >= 0 (Sterbenz)
    m1 = (f >= T_125).to(tl.int32) + (f >= T_175).to(tl.int32)
    e_out = e_b.to(tl.int32) + P_OFFSET_LOG2 + 127
    bits = ((n.to(tl.int32) + e_out) << 23) + (m1 << 22)
    bits = tl.minimum(bits, ((e_out + 2) << 23) + (1 << 22))  # saturate at 6 * 2**e_b
    normal = bits.to(tl.float32, bitcast=True)
    scale = (e_out << 23).to(tl.float32, bitcast=True)  # 2**(e_b + 8)
    sub = tl.where(y >= T_075, scale, tl.where(y >= T_QUARTER, 0.5 * scale, 0.0))
    p = tl.where(keep, tl.where(y >= 0.0, normal, sub), 0.0)
    return _finish(p, BLOCK_M, BLOCK_N)


@triton.jit
def p_mxfp4_exp2(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """MXFP4 P from float32 exp2 and OCP rounding (the baseline Direct-P replaces):
    e_b = floor(log2 max p) - 2 from the bits of max p, then RNE to E2M1 of p / 2**e_b."""
    p = tl.math.exp2(_blocks(x, BLOCK_M, BLOCK_N))
    pb = tl.max(p, axis=2)[:, :, None]
    e_b = ((pb.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 2
    keep = (pb > 0.0) & (e_b >= P_EMIN)
    e_b = tl.where(keep, e_b, 0)
    q = p * ((127 - e_b) << 23).to(tl.float32, bitcast=True)  # p / 2**e_b, exact
    # RNE to one mantissa bit for q >= 1: add half an ulp of that grid (ties to even)
    qb = q.to(tl.int32, bitcast=True)
    qb = (qb + ((1 << 21) - 1) + ((qb >> 22) & 1)) & ~((1 << 22) - 1)
    normal = tl.minimum(qb.to(tl.float32, bitcast=True), 6.0)
    sub = libdevice.rint(q * 2.0) * 0.5  # 0, 0.5, 1 below 1 (ties to even)
    v = tl.where(keep, tl.where(q >= 1.0, normal, sub), 0.0)
    p = v * ((e_b + P_OFFSET_LOG2 + 127) << 23).to(tl.float32, bitcast=True)
    return _finish(p, BLOCK_M, BLOCK_N)
