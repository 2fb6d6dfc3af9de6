"""`CachedLaunch`: a Triton kernel launched through its compiled form after the first call
of a specialization gives what Triton's own launch gives, at every specialization the
binder distinguishes (an integer 1, a multiple of 16, another value; a tensor 16-byte
aligned or not; another dtype)."""

import pytest
import torch
import triton
import triton.language as tl

from fp4attn.kernels.triton_launch import CachedLaunch


@triton.jit
def _axpb_kernel(X, Y, N, A, B: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(X + i, mask=ok, other=0.0)
    tl.store(Y + i, (x * A + B).to(Y.dtype.element_ty), mask=ok)


class _Compiled:
    """A compiled kernel's stand-in: its launches recorded."""

    def __init__(self, launches):
        self.launches, self.function, self.packed_metadata = launches, "function", "metadata"

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit, *bound):
        self.launches.append(bound)


class _Jit:
    """A JIT function's stand-in: each `[grid](...)` a compile through the binder."""

    arg_names = ["X", "N", "A", "B"]

    def __init__(self):
        self.compiles, self.launches = [], []

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            self.compiles.append(args)
            return _Compiled(self.launches)

        return compile_and_launch


def test_the_binder_runs_once_a_specialization():
    """A key per what the binder specializes on: an integer's value (1, a multiple of 16,
    another), a tensor's dtype and 16-byte alignment; a float is not specialized. A later
    launch of a key takes every parameter in order, the constexprs after the arguments."""
    fn = _Jit()
    launch = CachedLaunch(fn)
    x = torch.zeros(64)
    calls = [(x, 1, 2.0), (x, 16, 2.0), (x, 17, 2.0), (x[1:], 16, 2.0), (x.double(), 16, 2.0), (x, 16, 3.0),
             (x, 1, 5.0)]
    for args in calls:
        launch((1, 1, 1), args, dict(B=7), 0, num_warps=4)
    assert len(fn.compiles) == 5  # the last two reuse (x, 16) and (x, 1)
    assert fn.launches == [(x, 16, 3.0, 7), (x, 1, 5.0, 7)]


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
