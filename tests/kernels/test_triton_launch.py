"""`CachedLaunch`: a Triton kernel launched through its compiled form after the first call
of a specialization gives what Triton's own launch gives, at every specialization the
binder distinguishes (an integer 1, a multiple of 16, another value; a tensor 16-byte
aligned or not; another dtype)."""

import pytest
import torch
import triton
import triton.language as tl

from fp4attn.kernels.triton_launch import CachedLaunch, _arg_key


@triton.jit
def _axpb_kernel(X, Y, N, A, B: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(X + i, mask=ok, other=0.0)
    tl.store(Y + i, (x * A + B).to(Y.dtype.element_ty), mask=ok)


def test_the_key_separates_what_the_binder_specializes_on():
    a = torch.zeros(8)
    assert _arg_key(1) != _arg_key(16) != _arg_key(17)
    assert _arg_key(a) != _arg_key(a[1:])  # 16-byte aligned or not
    assert _arg_key(a) != _arg_key(a.double())
    assert _arg_key(2.0) == _arg_key(3.0)  # a float is not specialized


@pytest.mark.gpu
def test_later_launches_match_tritons_own():
    launch = CachedLaunch(_axpb_kernel)
    stream = torch.cuda.current_stream().cuda_stream
    base = torch.randn(4096, device="cuda")
    for n in (1, 16, 17, 1000, 1, 17):
        for offset in (0, 1):  # aligned, then a view 4 bytes in
            for dtype in (torch.float32, torch.bfloat16):
                x = base[offset:offset + n]
                for a in (2.0, -0.5):
                    for call in range(2):  # the first call of a key through Triton's binder, the second not
                        y = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
                        grid = (triton.cdiv(n, 256), 1, 1)
                        launch(grid, (x, y, n, a), dict(B=3, BLOCK=256), stream, num_warps=4)
                        want = torch.empty_like(y)
                        _axpb_kernel[grid](x, want, n, a, B=3, BLOCK=256, num_warps=4)
                        assert torch.equal(y, want), (n, offset, dtype, a, call)
    assert 0 < len(launch.compiled) <= 5 * 2 * 2
