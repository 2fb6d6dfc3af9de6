"""Direct-P: codes are exactly RNE MXFP4 of the real exponential, computed in float64."""

import math

import numpy as np
import pytest
import torch

from fp4attn.formats.constants import E2M1_VALUES
from fp4attn.reference import DIRECTP_THRESHOLDS, build_p, directp_classify, exp2_mxfp4_classify
from fp4attn.reference.encoding import P_EMIN
from tests.oracles import nearest_even

GRID = np.array(E2M1_VALUES)


def _log_scores(shape, seed, spread=6.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * spread
    return t - t.amax(dim=-1, keepdim=True)


def _oracle_codes(x: np.ndarray):
    """float64 MXFP4 of the exact 2**x per block of 32, with the P_EMIN window."""
    xb = x.reshape(*x.shape[:-1], -1, 32)
    e = np.floor(xb.max(axis=-1, keepdims=True)) - 2
    keep = (e >= P_EMIN) & np.isfinite(e)
    e = np.where(keep, e, 0)
    vals = nearest_even(np.exp2(xb - e), GRID)
    codes = np.searchsorted(GRID, vals)
    return np.where(keep, codes, 0).reshape(x.shape)


def test_thresholds_bracket_the_midpoint_logs():
    for t, mid in zip(DIRECTP_THRESHOLDS, (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)):
        below = np.nextafter(np.float32(t), np.float32(-np.inf))
        if mid == 0.25:
            assert float(below) == -2.0  # y = -2 exactly is the tie that rounds to 0
        else:
            assert float(below) < math.log2(mid) <= t


def test_codes_equal_float64_oracle():
    x = _log_scores((64, 256), seed=1)
    codes, _ = directp_classify(x)
    # the classifier works on float32 y = x - e_b; feed the oracle that same y
    xb = x.reshape(64, 8, 32)
    e = torch.floor(xb.amax(-1, keepdim=True)) - 2
    y = (xb - e).double().numpy()
    want = np.searchsorted(GRID, nearest_even(np.exp2(y), GRID)).reshape(64, 256)
    keep = (e >= P_EMIN).expand_as(xb).reshape(64, 256).numpy()
    np.testing.assert_array_equal(codes.numpy(), np.where(keep, want, 0))
    # and against the exact exponential of x itself, all but float32 rounding of y agree
    agree = (codes.numpy() == _oracle_codes(x.double().numpy())).mean()
    assert agree > 0.9999


def test_block_exponent_masked_and_window():
    x = torch.full((1, 96), -math.inf)
    x[0, 0] = 0.0  # block 0: max 0 -> e_b = -2, code of 2**2 = 4 is 6
    x[0, 32] = -14.5  # block 1: e_b = -17 < P_EMIN: dropped
    codes, e_b = directp_classify(x)
    assert e_b.tolist() == [[-2, P_EMIN - 1, P_EMIN - 1]]
    assert codes[0, 0].item() == 6 and int(codes[0, 1:].sum()) == 0


def test_directp_matches_exp2_rounding_nearly_always():
    x = _log_scores((128, 512), seed=2)
    c_d, e_d = directp_classify(x)
    c_e, e_e = exp2_mxfp4_classify(x)
    assert (c_d == c_e).float().mean().item() > 0.9999
    assert (e_d == e_e).float().mean().item() > 0.9999


@pytest.mark.parametrize("fmt,build", [("mxfp4", "directp"), ("mxfp4", "exp2"), ("fp8", "exp2"), ("bf16", "exp2")])
def test_represented_p_is_close_and_bounded(fmt, build):
    x = _log_scores((8, 128), seed=3, spread=2.0)
    p = build_p(x, fmt, build)
    exact = torch.exp2(x)
    assert bool((p <= 1.5).all()) and bool((p >= 0).all())
    # MXFP4 elements are within half an E2M1 step of the block scale's grid
    tol = {"mxfp4": 0.25, "fp8": 2**-4, "bf16": 2**-8}[fmt]
    assert float(((p - exact).abs() / exact.amax(-1, keepdim=True)).max()) <= tol
