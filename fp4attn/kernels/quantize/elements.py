"""The quantizers' element arithmetic in Triton: float32 rounded to the e4m3, bf16 and
E2M1 grids, E2M1 codes and values, exact powers of two and floor(log2), signs. Each is
one element's operation of `fp4attn.formats.minifloat` (`round_to_format`,
`encode_e2m1`, `decode_e2m1`, `pow2`, `floor_log2`) bit for bit: explicit arithmetic on
the float32 bits where a conversion would round otherwise, or where the interpreter
cannot run the hardware's (`_hw_cvt`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from fp4attn.kernels.common import round_e4m3, round_e4m3_cvt


def _hw_cvt() -> bool:
    """Whether the kernels round to e4m3 by the hardware conversion: everywhere but
    under the Triton interpreter, which cannot run its inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _with_sign_of(mag, v):
    """mag carrying v's sign bit (so -0 stays -0, as torch.copysign in the reference)."""
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -mag, mag)


@triton.jit
def _signed(mag, x):
    """Non-negative (or NaN) mag with x's sign, as `_with_sign_of(mag, x)` gives it: -mag
    for a negative x (sign bit set, -0 included), except +0 for mag = 0 (Triton's -mag
    is 0 - mag). The sign bit by one bitwise op, and + 0 (-0 + 0 = +0, any other value
    unchanged): two instructions instead of a compare, a subtraction and a select."""
    b = mag.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
    return b.to(tl.float32, bitcast=True) + 0.0


@triton.jit
def _e4m3_signed(v, HW_CVT: tl.constexpr):
    """float32 on the e4m3 grid, nearest even, saturating at +-448 (Inf too), NaN kept:
    by the packed hardware conversion (cvt.rn.satfinite, `round_e4m3_cvt`) on the GPU,
    or on the float32 bits (`round_e4m3`) where it cannot run (the interpreter). The bit
    arithmetic took about five times the instructions, and made the quantizers that
    round twice (the training's per-token view of V) instruction-bound."""
    if HW_CVT:
        return round_e4m3_cvt(v)
    r = _with_sign_of(round_e4m3(tl.minimum(tl.abs(v), 448.0)), v)
    return tl.where(v != v, v, r)


@triton.jit
def _abs_bits(x):
    """The float32 bits of |x| as int32: ordered as the magnitudes, NaN above +Inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _round_bf16(x):
    """float32 x rounded to bf16 (nearest even, overflowing to Inf; NaN as torch's CPU
    conversion gives it, 0x7FC0), as float32, on the bits: the interpreter's bf16 cast
    truncates."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x != x, 0x7FC00000, b).to(tl.float32, bitcast=True)  # NaN: torch's 0x7FC0


@triton.jit
def _e2m1_value(a):
    """E2M1 value (0 .. 6) nearest to non-negative a, ties to the even code, saturating
    at 6: a + c rounds a to the grid's spacing at a when c is 2**23 times that spacing
    (0.5 below 2, 1 in [2, 4), 2 in [4, 6]: c = max(2**22, a's power of two times
    2**22), from a's exponent bits), and subtracting c again is exact. The add's ties
    go to the even multiple of the spacing, which is E2M1's even code (0.25 -> 0, 0.75
    -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Five instructions (sm_90
    SASS: FMNMX, LOP3, VIADDMNMX, two FADD); rounding the bits to one mantissa bit at
    and above 1 and the 2**23 shift below it took nine."""
    a = tl.minimum(a, 6.0)
    c = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) + (22 << 23), 0x4A800000)
    c = c.to(tl.float32, bitcast=True)
    return (a + c) - c


@triton.jit
def _e2m1_code(v):
    """E2M1 magnitude code (0 .. 7, int32) of a value on the E2M1 grid: from 1 up its
    float32 exponent and mantissa bit ((e + 127) * 2 + m - 252: 1 -> 2, 6 -> 7), below
    it 0.5 -> 1, 0 -> 0, and a NaN 0, as `formats.encode_e2m1` codes them. What reaches
    it is on the grid or NaN: `_e2m1_value`'s results (over every non-negative float32,
    the eight grid values and NaNs) and Direct-P's classified P values (the Blackwell
    forward's packing where the interpreter runs it). The code of 2 * v below 1 is the
    same on the grid, not for a NaN, and its conversion changed the NVFP4 packing's SASS."""
    return tl.where(v >= 1.0, (v.to(tl.int32, bitcast=True) >> 22) - 252, (v > 0.0).to(tl.int32))


@triton.jit
def _e2m1_magnitude(c):
    """The value (0, 0.5, 1, 1.5, 2, 3, 4, 6) of E2M1 magnitude code c (int32, 0 .. 7)."""
    return tl.where(c <= 4, c.to(tl.float32) * 0.5, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))


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
