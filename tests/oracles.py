"""Independent float64 oracles for the format tests: brute-force nearest values."""

from __future__ import annotations

import numpy as np
import torch


def format_grid(exp_bits: int, man_bits: int, bias: int, max_value: float) -> np.ndarray:
    """All finite non-negative values of a format in code order, from the bit layout."""
    vals = []
    for code in range(1 << (exp_bits + man_bits)):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == 0:
            v = m * 2.0 ** (1 - bias - man_bits)
        else:
            v = (1 + m / 2**man_bits) * 2.0 ** (e - bias)
        if v > max_value:
            break
        vals.append(v)
    return np.array(vals, dtype=np.float64)


def nearest_even(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Round |x| to the nearest grid value, ties to the even code, saturating at the
    top; keeps the sign, NaN stays NaN."""
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    out = grid[pick]
    out = np.where(a >= grid[-1], grid[-1], out)
    out = np.copysign(out, x)
    return np.where(np.isnan(x), np.nan, out)


def all_16bit_values(dtype: torch.dtype) -> torch.Tensor:
    """Every non-NaN value of a 16-bit float dtype, as float32."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    v = bits.view(dtype).float()
    return v[~torch.isnan(v)]
