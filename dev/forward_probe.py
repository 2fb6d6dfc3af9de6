"""What the forward probes of tools/ (probe_affine_bound, probe_affine_mx,
probe_lazy_rescale) time alike: one Hopper forward kernel alone on prepared operands, the
median of triton.testing.do_bench, beside SDPA cuDNN bf16 at the same shape; a cell of
their tables is a build's TFLOP/s and its speed against cuDNN's. Needs a GPU to run."""

from __future__ import annotations

import dataclasses

from fp4attn.kernels.hopper.operands import KernelOperands


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def cudnn_ms(q, k, v, causal: bool) -> float:
    """SDPA's cuDNN attention on the bf16 inputs: the probes' baseline."""
    from fp4attn.tools.benchmark import sdpa

    f = sdpa("sdpa-cudnn")
    return median_ms(lambda: f(q, k, v, causal))


def below_cuda_ms(ops: KernelOperands, p_mode: int, *, fast_accum: bool, causal: bool) -> float:
    """The Triton/Gluon kernel that the forward's launch table runs below its CUDA C++ key
    counts (`cuda_from_keys`), on `ops` in P mode `p_mode`."""
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.routing import forward_launch, override_launch

    d = ops.q.shape[-1]
    table = dataclasses.replace(forward_launch(d, fast_accum, causal), cuda_from_keys=())
    with override_launch(forward=table):
        return median_ms(lambda: launch_forward(ops, scale=d**-0.5, causal_offset=0 if causal else None,
                                                p_mode=p_mode))


def checking_ms(ops: KernelOperands, *, causal: bool, **build) -> float:
    """A build of the CUDA C++ forward's checking source (`forward_cuda_check.launch_checking`
    with the fields `build`) on `ops`."""
    from dev.forward_cuda_check import launch_checking

    d = ops.q.shape[-1]
    return median_ms(lambda: launch_checking(ops, scale=d**-0.5, causal_offset=0 if causal else None, **build))


def cell(flops: float, ms: float, base_ms: float) -> str:
    """A table cell: TFLOP/s of `flops` in `ms`, and the speed against the baseline's `base_ms`."""
    return f"{flops / ms * 1e-9:.0f} ({base_ms / ms:.2f}x)"
