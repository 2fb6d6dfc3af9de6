"""Fused Triton quantizers produce the reference quantizers' operands (run on an H200).

Values must be identical (NaN where the reference has NaN); e4m3 bytes identical up to
the sign of zero (the reference keeps -0 for negative values that round to zero)."""

import pytest
import torch

from fp4attn.recipes import PRESETS

pytestmark = pytest.mark.gpu


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """(values equal incl. NaN positions, number of bytes that differ only by -0/+0)."""
    x, y = a.float(), b.float()
    nan = torch.isnan(x)
    values = torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan])
    zero_sign = 0
    if a.dtype == torch.float8_e4m3fn:
        zero_sign = int(((a.view(torch.uint8) != b.view(torch.uint8)) & (x == 0)).sum())
    return values, zero_sign


@pytest.mark.parametrize("recipe", ["fp8", "fp8-directp", "nvfp4-fp8", "directp"])
@pytest.mark.parametrize("s,d", [(1, 64), (113, 128), (1000, 64), (4096, 128)])
def test_fused_quantizers_match_reference(recipe, s, d):
    from fp4attn.kernels.hopper.operands import prepare_operands
    from fp4attn.kernels.hopper.quantize import prepare_operands_fused

    q, k, v = (torch.randn(2, 3, s, d, device="cuda", dtype=torch.bfloat16) * 4 for _ in range(3))
    v[0, 0, : s // 2] *= 2.0**-18  # MXFP4 V: blocks below the head's window
    k[1, 2, 0] = 0.0  # an all-zero row
    want = prepare_operands(q, k, v, PRESETS[recipe])
    got = prepare_operands_fused(q, k, v, PRESETS[recipe])
    for name in ("q", "k", "qs", "ks", "vt", "vs"):
        a, b = getattr(want, name), getattr(got, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        values, zero_sign = _same(a, b)
        assert values, f"{recipe} {name}: values differ"
        print(f"{recipe} {name}: {zero_sign} bytes differ only in the sign of zero")
