"""The quantizers' host arithmetic: the grid helpers give Triton's values."""

import pytest


def test_grid_helpers_equal_tritons():
    triton = pytest.importorskip("triton")
    from fp4attn.kernels.quantize.rows import _cdiv, _next_pow2

    for n in range(1, 5000, 7):
        assert _next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 32, 64, 128, 1024):
            assert _cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert _cdiv(0, 128) == 0 and _next_pow2(1) == 1 and _next_pow2(2**20 + 1) == 2**21
