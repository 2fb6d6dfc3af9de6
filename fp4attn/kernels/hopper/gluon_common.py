"""Gluon helpers shared by the Hopper kernels in `forward_gluon_ws.py` and
`backward_gluon.py`: the wgmma accumulator layout, mbarriers, and the host-side TMA
descriptors of their operands."""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache
def shared_layout(block: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The NVMMA shared-memory layout of a (bf16 or e4m3) TMA tile of shape `block`, as
    wgmma reads it. Cached: building one took the host 5-15 us, and a `train` forward
    and backward builds ten descriptors (the backward's seven took 0.16 ms of host time,
    benchmarks/results/log/h200-train-step-profile.txt)."""
    if dtype not in _GLUON_DTYPES:
        raise ValueError(f"TMA tile of dtype {dtype}: the Gluon kernels load {sorted(map(str, _GLUON_DTYPES))}")
    return gl.NVMMASharedLayout.get_default_for(list(block), _GLUON_DTYPES[dtype])


def tma_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Gluon TMA descriptor of the 2-D tensor t (bf16 or e4m3, last dim contiguous) in
    tiles of `block`."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, shared_layout(tuple(block), t.dtype))


@gluon.constexpr_function
def wgmma_layout(warps, n, k):
    """The accumulator layout of `warps` warps' (16 * warps) x n wgmma products with k
    per instruction (16 for bf16 operands, 32 for e4m3). The registers do not depend on
    k: products of either kind with the same n share them (a layout change between the
    two is free), but the instruction is chosen by it."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, k])


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers, each completing a phase after `count` arrivals; one thread
    initializes them (`barriers_ready` before any use)."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def barriers_ready():
    """Once a program's mbarriers are initialized (`barriers`, by one thread), before any
    thread waits on one, arrives at one or names one in a TMA copy: the inits made visible
    to the asynchronous proxy (the TMA unit completes copies on them) and to every thread
    of the program, by a proxy fence and a barrier of all its threads. (A cluster would
    need `fence.mbarrier_init` as well; these kernels run one CTA per cluster.) Called
    before `gl.warp_specialize`, the barrier spans the default partition's warps, which
    run everything before it; the worker partitions start after it."""
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def invalidate(bars, n: gl.constexpr):
    """Invalidate the n mbarriers of `bars` (from `barriers`)."""
    for i in gl.static_range(n):
        mbarrier.invalidate(bars.index(i))
