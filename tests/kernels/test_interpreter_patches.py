"""The speed patches of tests/interpreter.py (SPEEDUPS, in KERNEL_PATCHES) against the
interpreter's own paths: a tl.reduce with the kernels' own combiner, folded over whole slices,
gives the element-by-element reduction's values bit for bit, and a kernel's jit
helpers, their re-patching of triton.language skipped, compute what they compute with
it, the language restored after each launch."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

SCRIPT = KERNEL_PATCHES + textwrap.dedent('''
    import numpy as np
    import torch

    from fp4attn.kernels.common import max_propagating_nan

    @triton.jit
    def _first_max(a, ia, b, ib):
        """(max, index of its first occurrence), NaN the largest: a tuple combiner."""
        take = (b > a) | ((b != b) & (a == a))
        return tl.where(take, b, a), tl.where(take, ib, ia)

    @triton.jit
    def _reduces(X, I, ROWS, COLS, ROW_ARG, M: tl.constexpr, N: tl.constexpr):
        m, n = tl.arange(0, M), tl.arange(0, N)
        x = tl.load(X + m[:, None] * N + n[None, :])
        i = tl.load(I + m[:, None] * N + n[None, :])
        tl.store(ROWS + m, tl.reduce(x, 1, max_propagating_nan))
        tl.store(COLS + n[None, :], tl.reduce(x, 0, max_propagating_nan, keep_dims=True))
        _, arg = tl.reduce((x, i), 1, _first_max)
        tl.store(ROW_ARG + m, arg)

    M, N = 16, 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, N, generator=g)
    x[0, 3] = float("nan")
    x[1, :] = 0.0
    x[1, ::2] = -0.0  # +0 and -0 tied: the fold's order decides which is kept
    x[2, 5], x[2, 9] = float("inf"), -float("inf")
    x[3, :] = -float("inf")
    x[4, 7] = x[4, 20] = 9.0  # a tie: the first index
    x[6:, 30] = float("nan")
    x[5] = float("nan")
    idx = torch.arange(M * N, dtype=torch.int32).reshape(M, N) % N

    def run():
        out = torch.empty(M), torch.empty(N), torch.empty(M, dtype=torch.int32)
        _reduces[(1,)](x, idx, *out, M, N)
        return out

    folded = run()
    interpreter.ReduceOps.generic_reduce = _element_reduce
    element = run()
    interpreter.ReduceOps.generic_reduce = _folded_reduce
    for a, b in zip(folded, element):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (a, b)
    assert bool(torch.isnan(folded[0][0])) and bool(torch.isnan(folded[1][30])) and int(folded[2][4]) == 7

    @triton.jit
    def _helper(a, b):
        return tl.maximum(a, b) * 2.0 + tl.where(a < b, 1.0, 0.0)

    @triton.jit
    def _calls(X, Y, N: tl.constexpr):
        n = tl.arange(0, N)
        x = tl.load(X + n)
        tl.store(Y + n, _helper(x, -x) + _helper(x, 0.5))

    xs = torch.randn(64, generator=g)
    want = (torch.maximum(xs, -xs) * 2 + (xs < -xs).float()) + (torch.maximum(xs, torch.tensor(0.5)) * 2
                                                                 + (xs < 0.5).float())
    maximum, reduce = tl.maximum, tl.reduce
    for _ in range(2):  # the second launch patches the language again
        y = torch.empty(64)
        _calls[(1,)](xs, y, 64)
        assert torch.equal(y, want), (y - want).abs().max()
        assert not _patched and tl.maximum is maximum and tl.reduce is reduce
        assert tl.core.is_builtin(tl.maximum)
    print("ok")
''')


def test_interpreter_speed_patches_keep_its_results():
    run_under_interpreter(SCRIPT)
