"""Gluon helpers shared by the Hopper kernels in `forward_pipelined.py` and
`backward_pipelined.py`: the wgmma accumulator layout and mbarriers."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.constexpr_function
def wgmma_layout(warps, n, k):
    """The accumulator layout of `warps` warps' (16 * warps) x n wgmma products with k
    per instruction (16 for bf16 operands, 32 for e4m3). The registers do not depend on
    k: products of either kind with the same n share them (a layout change between the
    two is free), but the instruction is chosen by it."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, k])


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
