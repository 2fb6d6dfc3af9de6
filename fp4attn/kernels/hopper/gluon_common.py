"""Gluon helpers shared by the Hopper kernels in `forward_pipelined.py` and
`backward_pipelined.py`: mbarriers."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers, each completing a phase after `count` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def invalidate(bars, n: gl.constexpr):
    """Invalidate the n mbarriers of `bars` (from `barriers`)."""
    for i in gl.static_range(n):
        mbarrier.invalidate(bars.index(i))
