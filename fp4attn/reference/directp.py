"""Building the probability tile P from the normalized log-score.

The input is x = t - m in log2 units (t = score * softmax_scale * log2(e), m the running
row maximum), so x <= 0 and masked keys are -inf. Each builder returns the represented
P values: the numbers the PV product consumes and, with consistent normalization, the
numbers the row sum adds up.

Direct-P (MXFP4 P without exp)
-------------------------------
Per block of 32 keys, MXFP4 of the exact p = 2**x has the E8M0 exponent
e_b = floor(log2(max p)) - 2 = floor(max x) - 2, because 2**x is monotone. The element
is RNE_e2m1(2**(x - e_b)), and with y = x - e_b that is a comparison of y against the
base-2 logs of the E2M1 rounding midpoints:

    code >= 1  iff 2**y >  0.25   (y > -2, the tie 0.25 goes to the even code 0)
    code >= 2  iff 2**y >= 0.75   (tie to 1.0, code 2)
    code >= 3  iff 2**y >  1.25   (tie to 1.0)
    code >= 4  iff 2**y >= 1.75   (tie to 2.0)
    code >= 5  iff 2**y >  2.5    (tie to 2.0)
    code >= 6  iff 2**y >= 3.5    (tie to 4.0)
    code >= 7  iff 2**y >  5      (tie to 4.0)

Every midpoint but 0.25 has an irrational log, so for float32 y each test is y >= T_k
with T_k the smallest float32 at or above log2(midpoint) (for 0.25: the float32 just
above -2). The code is the number of thresholds passed. y < 3 always (y <= max x -
floor(max x) + 2), so 6 is never exceeded and saturation is implicit. The codes are
exactly RNE MXFP4 of the real exponential of the float32 score; "exp2" building instead
rounds the float32 `exp2(x)`, whose own rounding can move a value across a midpoint or
a block maximum across a power of two (measured in docs/numerics.md).

Blocks below `encoding.P_EMIN` are dropped, as the Hopper e4m3 encoding cannot hold
them (`encoding.py`).

With `sink=True` (`Recipe.p_sink`) the keys that tie a block's maximum x are taken out
of the block: they get the FP8 P value e4m3(2**x * 2**8) / 2**8 (exactly 1 for the row
maximum) and the block exponent comes from the largest of the other keys, whose codes
are then built as above. A block whose other keys are all masked holds only its top.
`sink_keys` (`Recipe.p_sink_keys`) limits that to the blocks of x's first sink_keys
keys; the later blocks are built as without `sink`.

A NaN in x (a NaN score) gives NaN in P, whatever the builder: it must reach the output.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fp4attn.formats import E4M3, decode_e2m1, quantize_mxfp4, round_to_format
from fp4attn.formats.constants import E2M1_EMAX, E8M0_BIAS, MX_BLOCK
from fp4attn.formats.minifloat import pow2
from fp4attn.reference.encoding import P_EMIN, P_OFFSET_LOG2

_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _threshold(mid: float) -> float:
    """Smallest float32 T with (y >= T iff 2**y rounds up past `mid`) for float32 y."""
    exact = math.log2(mid)
    t = np.float32(exact)
    if float(t) < exact or mid == 0.25:  # 0.25 is a tie that rounds down: strict y > -2
        t = np.nextafter(t, np.float32(np.inf))
    return float(t)


DIRECTP_THRESHOLDS = tuple(_threshold(m) for m in _MIDPOINTS)


def directp_classify(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct-P codes and block exponents of a log2-score tile.

    Args:
        x: float32 (..., N) normalized log2 scores (<= 0, -inf for masked keys), N a
            multiple of 32.

    Returns:
        codes: uint8 (..., N) E2M1 codes 0..7 (P is non-negative).
        block_exp: int32 (..., N // 32) the E8M0 exponent e_b of each block; blocks that
            are empty or below P_EMIN have all codes 0 and e_b = P_EMIN - 1.
    """
    xb = x.reshape(*x.shape[:-1], -1, MX_BLOCK)
    xmax = xb.amax(dim=-1)
    live = xmax > -math.inf
    e_b = torch.floor(torch.where(live, xmax, torch.zeros_like(xmax))).to(torch.int32) - E2M1_EMAX
    keep = live & (e_b >= P_EMIN)
    e_b = torch.where(keep, e_b, torch.full_like(e_b, P_EMIN - 1))
    y = xb - e_b.unsqueeze(-1).float()
    codes = torch.zeros_like(y, dtype=torch.uint8)
    for t in DIRECTP_THRESHOLDS:
        codes += (y >= t).to(torch.uint8)
    codes = codes.masked_fill(~keep.unsqueeze(-1), 0)
    return codes.reshape(x.shape), e_b


def mxfp4_p_values(codes: torch.Tensor, block_exp: torch.Tensor) -> torch.Tensor:
    """Represented values E2M1(code) * 2**e_b of a P tile (..., N)."""
    v = decode_e2m1(codes).reshape(*codes.shape[:-1], -1, MX_BLOCK)
    return (v * pow2(block_exp).unsqueeze(-1)).reshape(codes.shape)


def exp2_mxfp4_classify(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and block exponents of MXFP4(exp2(x)) (float32 exp2, then OCP rounding),
    with the same P_EMIN window as Direct-P. Same returns as `directp_classify`."""
    q = quantize_mxfp4(torch.exp2(x), dim=-1)
    e_b = q.scale.to(torch.int32) - E8M0_BIAS
    keep = e_b >= P_EMIN
    codes = q.codes().masked_fill(~keep.unsqueeze(-1), 0)
    return codes.reshape(x.shape), torch.where(keep, e_b, torch.full_like(e_b, P_EMIN - 1))


def fp8_p_values(x: torch.Tensor) -> torch.Tensor:
    """FP8 P: e4m3(2**x * 2**8) / 2**8 (the Hopper P tile's offset, `encoding.py`)."""
    offset = float(2**P_OFFSET_LOG2)
    return round_to_format(torch.exp2(x) * offset, E4M3) / offset


def _mxfp4_sink_values(x: torch.Tensor, classify) -> torch.Tensor:
    """MXFP4 P with each block's top keys outside the block scale (module docstring)."""
    xb = x.reshape(*x.shape[:-1], -1, MX_BLOCK)
    top = (xb == xb.amax(dim=-1, keepdim=True)) & (xb > -math.inf)
    rest = mxfp4_p_values(*classify(xb.masked_fill(top, -math.inf).reshape(x.shape)))
    return torch.where(top.reshape(x.shape), fp8_p_values(x), rest)


def build_p(x: torch.Tensor, p_format: str, p_build: str, sink: bool = False, sink_keys: int = 0) -> torch.Tensor:
    """Represented P values of a log2-score tile x (..., N): what PV consumes. `sink`
    (MXFP4 only): each block's top keys kept outside its scale (module docstring), in
    the blocks of the first `sink_keys` keys of x only where that is nonzero (a multiple
    of 32: the blocks are independent, so the tile splits between them exactly)."""
    if sink and 0 < sink_keys < x.shape[-1]:
        if sink_keys % MX_BLOCK:
            raise ValueError(f"build_p: sink_keys={sink_keys} must be whole {MX_BLOCK}-key blocks")
        return torch.cat((build_p(x[..., :sink_keys], p_format, p_build, True),
                          build_p(x[..., sink_keys:], p_format, p_build, False)), dim=-1)
    nan = torch.isnan(x)
    if p_format == "mxfp4":
        classify = directp_classify if p_build == "directp" else exp2_mxfp4_classify
        p = _mxfp4_sink_values(x, classify) if sink else mxfp4_p_values(*classify(x))
        return p.masked_fill(nan, float("nan"))
    if sink:
        raise ValueError(f"build_p: sink=True is for MXFP4 P, got p_format={p_format!r}")
    p = torch.exp2(x)
    if p_format == "fp8":
        return fp8_p_values(x)
    if p_format == "bf16":
        return p.to(torch.bfloat16).float()
    raise ValueError(f"unknown P format {p_format!r}")
