"""What the package puts in place under the Triton interpreter (`fp4attn.kernels.
interpreter_compat`, applied on importing `fp4attn.kernels`): loop bounds held as arrays
(NumPy >= 2.3), libdevice's rounded operations, bf16 `tl.dot` operands decoded from their
bits, e4m3 casts that keep NaN both ways, as torch and the GPU convert it, and the GPU's NaN
rules where NumPy's differ (min/max without `propagate_nan` return the other operand;
float-to-integer casts make NaN 0 and saturate)."""

import textwrap

import pytest

from tests.interpreter import run_under_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    import fp4attn.kernels  # noqa: F401  (applies the patches)
    from fp4attn.kernels import interpreter_compat

    assert interpreter_compat.apply() and interpreter_compat.interpreting()

    @triton.jit
    def loop_sum(X, OUT, N):
        acc = tl.zeros([16], tl.float32)
        for i in range(N):  # a runtime loop bound
            acc = libdevice.add_rn(acc, libdevice.mul_rn(tl.load(X + i * 16 + tl.arange(0, 16)), 2.0))
        tl.store(OUT + tl.arange(0, 16), acc)

    x = torch.randn(5, 16)
    out = torch.empty(16)
    loop_sum[(1,)](x, out, 5)
    assert torch.equal(out, (x * 2).sum(0)) or torch.allclose(out, (x * 2).sum(0), rtol=0, atol=1e-6)

    @triton.jit
    def dot(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        a = tl.load(A + tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :])
        b = tl.load(B + tl.arange(0, K)[:, None] * N + tl.arange(0, N)[None, :])
        tl.store(C + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g).bfloat16(), torch.randn(32, 16, generator=g).bfloat16()
    c = torch.empty(16, 16)
    dot[(1,)](a, b, c, M=16, N=16, K=32)
    want = a.float() @ b.float()  # products of bf16 values are exact in float32
    assert torch.allclose(c, want, rtol=1e-6, atol=1e-5), float((c - want).abs().max())

    @triton.jit
    def e4m3_round_trip(X, Y8, Y, W8, W, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y8 + i, tl.load(X + i).to(tl.float8e4nv))
        tl.store(Y + i, tl.load(W8 + i).to(tl.float32))
        tl.store(W + i, tl.load(X + i).to(tl.float8e4nv).to(tl.float32))

    vals = torch.tensor([float("nan"), -float("nan"), 1.0, -2.5, 448.0, 0.0, -0.0, 2.0**-9] * 2)
    y8, y, w = torch.empty(16, dtype=torch.float8_e4m3fn), torch.empty(16), torch.empty(16)
    codes = torch.arange(0x70, 0x80, dtype=torch.uint8)
    codes[-8:] = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE, 0x01, 0x81, 0x00, 0x80], dtype=torch.uint8)
    e4m3_round_trip[(1,)](vals, y8, y, codes.view(torch.float8_e4m3fn), w, N=16)
    want8 = vals.to(torch.float8_e4m3fn)  # values on the grid: torch's cast is exact
    assert torch.equal(y8.view(torch.uint8), want8.view(torch.uint8)), (y8.view(torch.uint8), want8.view(torch.uint8))
    wanty = codes.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(wanty)
    assert torch.equal(torch.isnan(y), nan) and torch.equal(y[~nan], wanty[~nan]), (y, wanty)
    assert torch.equal(torch.isnan(w), torch.isnan(vals)) and torch.equal(w[~torch.isnan(w)], vals[~torch.isnan(vals)])

    @triton.jit
    def nan_rules(X, LO, HI, LO_ALL, I, N: tl.constexpr):
        x = tl.load(X + tl.arange(0, N))
        tl.store(LO + tl.arange(0, N), tl.minimum(x, 1.0))  # PTX min.f32: NaN gives the other
        tl.store(HI + tl.arange(0, N), tl.maximum(x, -1.0))
        tl.store(LO_ALL + tl.arange(0, N), tl.minimum(x, 1.0, propagate_nan=tl.PropagateNan.ALL))
        tl.store(I + tl.arange(0, N), x.to(tl.int32))  # cvt.rzi.s32.f32: NaN 0, saturating

    x = torch.tensor([float("nan"), 3.0, -3.0, float("inf"), -float("inf"), 3e10, -3e10, -2.75])
    lo, hi, lo_all, i = torch.empty(8), torch.empty(8), torch.empty(8), torch.empty(8, dtype=torch.int32)
    nan_rules[(1,)](x, lo, hi, lo_all, i, N=8)
    nan = torch.isnan(x)
    assert torch.equal(lo, torch.where(nan, 1.0, torch.clamp(x, max=1.0))), lo
    assert torch.equal(hi, torch.where(nan, -1.0, torch.clamp(x, min=-1.0))), hi
    assert torch.isnan(lo_all[0]) and torch.equal(lo_all[1:], lo[1:])
    assert i.tolist() == [0, 3, -3, 2**31 - 1, -2**31, 2**31 - 1, -2**31, -2], i
    print("ok")
''')


@pytest.mark.interpreter
def test_interpreter_compatibility_patches():
    run_under_interpreter(SCRIPT, timeout=300)


def test_no_patches_outside_the_interpreter(monkeypatch):
    from fp4attn.kernels import interpreter_compat

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not interpreter_compat.interpreting()
