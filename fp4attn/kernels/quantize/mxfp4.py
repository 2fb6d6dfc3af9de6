"""MXFP4's shared block exponent in Triton (`_mx_exponents`): per 32-element block,
floor(log2) of its largest finite magnitude less E2M1's largest exponent (2: 6 is 1.5 x
2**2), clamped to E8M0's range (the floor rule of `formats.mx.mx_exponent`), and whether
the block is all finite. V's quantizer takes it (`v_operand`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4attn.formats import constants
from fp4attn.kernels.quantize.elements import _floor_log2

E2M1_EMAX = tl.constexpr(constants.E2M1_EMAX)
E8M0_EMIN = tl.constexpr(constants.E8M0_EMIN)
E8M0_EMAX = tl.constexpr(constants.E8M0_EMAX)


@triton.jit
def _mx_exponents(v):
    """Per 32-key block and channel of a (NB, 32, D) float32 tile: the shared MXFP4
    exponent of its finite entries (`formats.mx.mx_exponent`, floor rule) and whether all
    of them are finite, (NB, 1, D)."""
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-inf and NaN
    amax = tl.max(tl.where(finite, a, 0.0), axis=1, keep_dims=True)
    all_finite = tl.min(finite.to(tl.int32), axis=1, keep_dims=True) != 0
    positive = amax > 0.0
    e = tl.where(positive, _floor_log2(tl.where(positive, amax, 1.0)) - E2M1_EMAX, E8M0_EMIN)
    return tl.minimum(tl.maximum(e, E8M0_EMIN), E8M0_EMAX), all_finite
