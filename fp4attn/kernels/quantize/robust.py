"""The outlier-robust NVFP4 Q and K (`robust_qk_operands`), as `reference.forward.robust_qk`
computes them, for the fields the fused quantizers apply (`FUSED_ROBUST_FIELDS`): the
statistics' passes first (`statistics`: Q's maximum and sums of squares; K's mean, the
maximum of K - mean and its sums of squares, the last programs making the fallback
choice), then NVFP4's quantizing passes (`nvfp4`). No kernel of its own.
"""

from __future__ import annotations

import torch

from fp4attn.kernels.quantize.nvfp4 import quantize_qk_nvfp4
from fp4attn.kernels.quantize.rows import _heads, _next_pow2, _zero_views
from fp4attn.kernels.quantize.statistics import _key_pass, _key_pass_work, abs_max_bits
from fp4attn.recipes import Recipe

FUSED_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six", "qk_fallback")  # what the fused quantizers apply


def robust_qk_operands(q: torch.Tensor, k: torch.Tensor, recipe: Recipe, scale: float | None,
                       head_dim: int | None = None):
    """NVFP4 Q and K of a recipe with fused robust fields (FUSED_ROBUST_FIELDS), as
    `reference.forward.robust_qk` computes them: (qv, qs, kv, ks), the kernel's layouts,
    and the (B, Hkv) heads that took the FP8 fallback (None without it). `head_dim`: the
    caller's head dim where q and k are zero-padded to the kernel's (`routing.kernel_head_dim`):
    the fallback's statistic divides by it, as the reference of the unpadded inputs does.

    With `smooth_k`, two reads of K: one pass (`statistics._key_pass`) makes its mean, the maximum
    of K - mean (from each channel's largest and smallest key) and, under
    `qk_fallback`, its sums of squares (`robust.smoothed_sum_sq`), and the last program
    of each K head makes the fallback choice from them and Q's sums of squares (the pass
    over Q that makes Q's maximum runs first); then the quantizing pass. Without
    `smooth_k` the maxima (and sums of squares) of Q and K are passes of
    `statistics.abs_max_bits`, the K one making the choice."""
    if recipe.qk != "nvfp4":
        raise ValueError(f"robust_qk_operands: the fused robust quantizers are NVFP4's, got qk={recipe.qk!r}")
    choice = recipe.qk_fallback is not None
    if choice and scale is None:
        raise ValueError("robust_qk_operands: qk_fallback needs the softmax scale")
    B, H, Sq, D = q.shape
    Hkv = k.shape[1]
    if head_dim is not None and not 0 < head_dim <= D:
        raise ValueError(f"robust_qk_operands: head_dim={head_dim} for inputs padded to {D} channels; accepted: "
                         f"1 to {D}")
    Gq, Gk = B * H, B * Hkv
    f64, i32 = torch.float64, torch.int32
    smooth = recipe.smooth_k
    # every sum, maximum and count of the call in one fill
    key_work = _key_pass_work(Gk, D, True, choice) if smooth else []
    zeros = _zero_views(q.device, (Gq if choice else 0, f64), (Gq, i32), (Gk if choice and not smooth else 0, f64),
                        (0 if smooth else Gk, i32), (Gk if choice and not smooth else 0, i32), *key_work)
    sq_q, amax_q, sq_k, amax_k, count = zeros[:5]
    abs_max_bits(q, per_channel=False, out=amax_q, sum_sq=sq_q if choice else None, finite=True)
    fb_q = fb_k = mean = None
    if choice:
        fb = torch.empty(Gq + Gk, device=q.device, dtype=torch.int8)
        fb_q, fb_k = fb[:Gq], fb[Gq:]
        group = H // Hkv
        args = dict(SQ_Q=sq_q, FB_Q=fb_q, FB_K=fb_k, S_Q=Sq, D_STAT=head_dim or D, GROUP=group,
                    GROUP_P2=_next_pow2(group), SCALE=float(scale),
                    LIMIT=float(recipe.qk_fallback_logit_std))
    k3 = _heads(k)
    if smooth:
        mean, amax_k = _key_pass(k3, True, args if choice else None, zeros[5:])
        mean = mean.view(B, Hkv, 1, D)
    elif choice:
        abs_max_bits(k3, per_channel=False, out=amax_k, sum_sq=sq_k, finite=True, choice=dict(COUNT=count, **args))
    else:
        abs_max_bits(k3, per_channel=False, out=amax_k, finite=True)
    f46 = recipe.qk_four_over_six
    qv, qs = quantize_qk_nvfp4(q, four_over_six=f46, fallback=fb_q, amax=amax_q)
    kv, ks = quantize_qk_nvfp4(k, mean=mean, four_over_six=f46, fallback=fb_k, amax=amax_k)
    return qv, qs, kv, ks, (fb_k.view(torch.bool).view(B, Hkv) if choice else None)
