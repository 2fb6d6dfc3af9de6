"""The Hopper families ("hopper-forward", "hopper-train"): what their kernels take
(`hopper_forward_unsupported`, `hopper_train_unsupported`, with the outlier-robust fields
they apply) and, for a call they take, the plans that name what runs
(`hopper_forward_route_plan`, `hopper_backward_route_plan`), which the route carries."""

from __future__ import annotations

from fp4attn.recipes import Recipe, robust_fields, robust_unsupported_reason
from fp4attn.routing.common import HOPPER_HEAD_DIMS, TRAIN_GRAD_FORMATS, _shape_unsupported, kernel_head_dim
from fp4attn.routing.hopper_backward import BackwardPlan, hopper_backward_plan
from fp4attn.routing.hopper_forward import ForwardPlan, hopper_forward_plan
from fp4attn.routing.variants import P_MODES, p_mode

# the outlier-robust fields the Hopper kernels apply: the forward's fused quantizers
# (smooth_k, qk_four_over_six, qk_fallback) and Direct-P with each 32-key block's top key
# apart (p_sink, P_MODE 3); the training keeps smooth_k and qk_four_over_six in its saved
# NVFP4 payload (the FP8 fallback would need FP8 Q/K views in the backward kernels)
HOPPER_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six", "qk_fallback", "p_sink")
HOPPER_TRAIN_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six")
# the Q/K formats the Hopper training kernels train, each with the robust fields its saved
# operands carry: the NVFP4 payload those above; per-token FP8 (`train-fp8`) none (its
# quantizers subtract no mean)
HOPPER_TRAIN_QK = {"nvfp4": HOPPER_TRAIN_ROBUST_FIELDS, "fp8": ()}


def hopper_robust_unsupported(recipe: Recipe, fields: tuple[str, ...] = HOPPER_ROBUST_FIELDS) -> str | None:
    """Why the Hopper kernels cannot apply `recipe`'s robust fields (they apply
    `fields`), or None."""
    if recipe.p_sink and recipe.p_build != "directp":
        return "p_sink with p_build='exp2' (the kernels build p_sink P by Direct-P)"
    return robust_unsupported_reason(recipe, fields)


def hopper_forward_unsupported(recipe: Recipe, head_dim: int) -> str | None:
    """Why the Hopper forward kernels cannot run `recipe` at `head_dim`, or None."""
    robust = hopper_robust_unsupported(recipe)
    if robust is not None:
        return robust
    if recipe.qk not in ("fp8", "nvfp4"):
        return f"Q/K format {recipe.qk!r} (kernels run 'fp8' and 'nvfp4')"
    if (recipe.p, recipe.p_build) not in P_MODES:
        return f"P {recipe.p!r} built by {recipe.p_build!r} (kernels run {sorted(P_MODES)})"
    if recipe.v not in ("fp8", "mxfp4"):
        return f"V format {recipe.v!r} (kernels run 'fp8' and 'mxfp4')"
    return _shape_unsupported(recipe, head_dim)


def hopper_train_unsupported(recipe: Recipe, head_dim: int) -> str | None:
    """Why the Hopper training kernels cannot train `recipe` at `head_dim`, or None."""
    if recipe.grad is None:
        return f"recipe {recipe.name!r} is inference-only (grad=None)"
    if recipe.grad not in TRAIN_GRAD_FORMATS:
        return f"gradient format {recipe.grad!r} (kernels run {TRAIN_GRAD_FORMATS})"
    if recipe.qk not in HOPPER_TRAIN_QK:
        return f"Q/K format {recipe.qk!r} for training (kernels train {' and '.join(map(repr, HOPPER_TRAIN_QK))} Q/K)"
    if recipe.fast_accum:
        return "fast_accum=True for training (the training kernels sum QK^T exactly: fast_accum=False)"
    fields = HOPPER_TRAIN_QK[recipe.qk]
    robust = hopper_robust_unsupported(recipe, fields)
    if robust is not None and not fields:
        names = robust_fields(recipe)
        kept = "; ".join(f"{', '.join(f)} with {qk!r} Q/K" for qk, f in HOPPER_TRAIN_QK.items() if f)
        return (f"outlier-robust field{'s' if len(names) > 1 else ''} {', '.join(names)} of recipe "
                f"{recipe.name!r} with {recipe.qk!r} Q/K for training (the training kernels apply none with "
                f"{recipe.qk!r} Q/K; {kept})")
    if robust is not None:
        return robust
    return hopper_forward_unsupported(recipe, head_dim)


def _routed_kernel_head_dim(head_dim: int) -> int:
    """`kernel_head_dim` of a call a Hopper family took: one it has no kernel for never gets
    a plan (`_shape_unsupported` sends it to the reference)."""
    dk = kernel_head_dim(head_dim)
    if dk is None:
        raise ValueError(f"head_dim {head_dim}: no Hopper kernel runs it (kernels run multiples of 16 up to "
                         f"{HOPPER_HEAD_DIMS[-1]}), so it has no plan")
    return dk


def hopper_forward_route_plan(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                              on_cuda: bool = True, training: bool = False) -> ForwardPlan:
    """`hopper_forward_plan` of a routed call: the recipe's Q/K dtype (`fast_accum`: e4m3)
    and P mode, a key mask as the key bias, the operands as the fused quantizers make them
    (TMA-loadable, contiguous), the GPU's launch (under the interpreter too, which stands
    in for an H200 here)."""
    return hopper_forward_plan(head_dim=_routed_kernel_head_dim(head_dim), qk_fp8=recipe.fast_accum,
                               p_mode=p_mode(recipe), causal=causal, keys=keys, key_bias=mask == "key",
                               training=training, on_cuda=on_cuda)


def hopper_backward_route_plan(recipe: Recipe, head_dim: int, on_cuda: bool = True) -> BackwardPlan:
    """`hopper_backward_plan` of a routed training call: lengths not known (the route
    takes none), so the kernels of whole tiles, with the GPU's launch."""
    return hopper_backward_plan(head_dim=_routed_kernel_head_dim(head_dim), qk=recipe.qk,
                                p_mode=p_mode(recipe), on_cuda=on_cuda)


def _hopper_forward_plans(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                          on_cuda: bool = True) -> tuple[ForwardPlan]:
    return (hopper_forward_route_plan(recipe, head_dim, causal, mask, keys, on_cuda),)


def _hopper_train_plans(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                        on_cuda: bool = True) -> tuple[ForwardPlan, BackwardPlan]:
    return (hopper_forward_route_plan(recipe, head_dim, causal, mask, keys, on_cuda, training=True),
            hopper_backward_route_plan(recipe, head_dim, on_cuda))


def _plan_names(plans) -> str:
    return " + ".join(p.name for p in plans)


def _hopper_forward_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                           on_cuda: bool = True) -> str:
    """The Hopper forward kernel that runs the call (`hopper_forward_route_plan`)."""
    return _plan_names(_hopper_forward_plans(recipe, head_dim, causal, mask, keys, on_cuda))


def _hopper_train_kernel(recipe: Recipe, head_dim: int, causal: bool, mask: str, keys: int = 0,
                         on_cuda: bool = True) -> str:
    """The Hopper training kernels that run the call: the forward's, then the backward's."""
    return _plan_names(_hopper_train_plans(recipe, head_dim, causal, mask, keys, on_cuda))
