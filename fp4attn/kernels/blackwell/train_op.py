"""Training on Blackwell: the Blackwell forward on the operands the backward keeps, and
the backward, each a registered custom op with a fake implementation, the backward
registered as the forward op's autograd formula.

The saved operands, their quantizers and the backward are the Hopper training
kernels' (`kernels.hopper.train_op`), which are plain Triton and build for sm_100a
(`fp4attn compile-report` compiles them): the forward keeps the NVFP4 Q/K payloads (two
E2M1 codes a byte, an e4m3 scale per 16, one tensor scale per head) and the LSE, and the
backward rebuilds P from exactly those, with its four gradient products on the FP8
tensor cores (`kind::f8f6f4`). What changes from Hopper: the forward is
`forward_triton.attn_fwd_sm100_kernel` on the same codes and scales (block-scaled FP4
QK^T), and the backward runs its Triton kernels at the Blackwell launch
(`routing.BLACKWELL_BACKWARD_LAUNCH`: no Hopper TMA or Gluon paths), where the dQ
kernel's S is the block-scaled FP4 product of the same payload (`kind::mxf4nvf4`, as the
forward's QK^T), and so are the dK/dV kernel's scores at head dim 64 (S of two query
tiles, P^T taken from it); at 128 its S^T is a bf16 product of the grid values (the FP4
build spills there). Exact all, equal up to float32 summation order.
"""

from __future__ import annotations

import torch

from fp4attn import routing
from fp4attn.kernels.blackwell.forward_op import launch_forward
from fp4attn.kernels.blackwell.operands import BlackwellOperands, quantize_v_mxfp4_packed
from fp4attn.kernels.hopper.train_op import (
    TRAIN_BACKWARD_SCHEMA,
    TRAIN_FORWARD_SCHEMA,
    backward_operands,
    launch_backward,
    quantize_for_training,
    setup_train_context,
    train_backward_fake,
    train_backward_formula,
    train_forward_fake,
)
from fp4attn.recipes import Recipe, robust_unsupported_reason

# the outlier-robust fields the training kernels apply: the Hopper training's, whose payload this one keeps
TRAIN_ROBUST_FIELDS = routing.HOPPER_TRAIN_ROBUST_FIELDS


# the Hopper training ops' schemas: the same arguments, and the same payload saved
@torch.library.custom_op("fp4attn::blackwell_train_forward", mutates_args=(), schema=TRAIN_FORWARD_SCHEMA)
def _train_forward_op(q, k, v, qk, p, p_build, v_fmt, causal_offset, causal, scale, smooth_k=False,
                      four_over_six=False):
    """(out, lse, then what the backward reads, as the Hopper training forward returns
    it: `hopper.train_op.quantize_for_training`'s saved tensors, with the robust fields
    `smooth_k` and `four_over_six` applied in the NVFP4 payload)."""
    if qk != "nvfp4":
        raise ValueError(f"blackwell_train_forward: Q/K format {qk!r} (the training kernels run 'nvfp4')")
    ops, saved = quantize_for_training(q, k, v, v_fmt, smooth_k, four_over_six)
    q_codes, q_bscale, k_codes, k_bscale = saved[:4]
    if v_fmt == "mxfp4":  # the forward's PV reads MXFP4 codes; the backward keeps its e4m3 view of V
        v_codes, v_sc = quantize_v_mxfp4_packed(v)
        v_op, vs = v_codes, None
    else:
        v_op, v_sc, vs = ops.vt, None, ops.vs
    fwd = BlackwellOperands(q_codes, q_bscale, k_codes, k_bscale, ops.qs, ops.ks, v_op, v_sc, vs)
    out, lse, _ = launch_forward(fwd, scale=scale, causal_offset=causal_offset if causal else None)
    # the tensor scales (one per head) are views of the per-row scales: copied, so that
    # only one float a head is kept
    return (out, lse, *saved[:4], *(s.clone(memory_format=torch.contiguous_format) for s in saved[4:6]),
            *saved[6:])


_train_forward_op.register_fake(train_forward_fake)


@torch.library.custom_op("fp4attn::blackwell_train_backward", mutates_args=(), schema=TRAIN_BACKWARD_SCHEMA)
def _train_backward_op(dout, out, lse, q_codes, q_bscale, k_codes, k_bscale, qs, ks, q_amax, k_amax, v_t, v_ts, p,
                       p_build, causal_offset, causal, scale, dq_dtype, dk_dtype, dv_dtype):
    """(dq, dk, dv) in the given dtypes from the forward's saved operands, by the
    Triton backward kernels at the Blackwell launch."""
    ops = backward_operands(dout, out, q_codes, q_bscale, k_codes, k_bscale, qs, ks, q_amax, k_amax, v_t, v_ts)
    launch = routing.blackwell_backward_launch(q_codes.shape[-1] * 2)
    with routing.override_launch(backward=launch):
        # the kernels multiply their scores from the NVFP4 payload itself where the launch
        # says so (block-scaled FP4 MMA)
        return launch_backward(ops, lse, p, p_build, causal_offset, causal, scale, (dq_dtype, dk_dtype, dv_dtype),
                               nvfp4=(q_codes, q_bscale, k_codes, k_bscale))


_train_backward_op.register_fake(train_backward_fake)
_train_forward_op.register_autograd(train_backward_formula(_train_backward_op, "Blackwell"),
                                   setup_context=setup_train_context)


def blackwell_train_attention(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None):
    """Forward of a training recipe on the Blackwell kernels, differentiable in q, k, v:
    (out bf16, lse fp32). GQA: dK and dV are summed over each group's query heads. A
    recipe with robust fields other than the Hopper training's (TRAIN_ROBUST_FIELDS) is
    refused, never trained as another recipe."""
    reason = robust_unsupported_reason(recipe, TRAIN_ROBUST_FIELDS)
    if reason is not None:
        raise ValueError(f"blackwell_train_attention: {reason}; the reference trains it")
    out, lse, *_ = _train_forward_op(q, k, v, recipe.qk, recipe.p, recipe.p_build, recipe.v, causal_offset or 0,
                                     causal_offset is not None, scale, recipe.smooth_k, recipe.qk_four_over_six)
    return out, lse
