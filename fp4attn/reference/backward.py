"""Reference backward of the training recipes.

P is rebuilt from the forward's saved quantized Q/K and its LSE (no second
high-precision score path): P = 2**(t - lse * log2 e) with t the same log2 scores the
forward computed. The four gradient products then run on low-precision views:

    dV = P_r^T  dO_g          dP = dO_g  V_a^T
    dS = P * (dP - delta),    delta = rowsum(dO * O)
    dQ = dS_g  K_a * scale    dK = dS_g^T Q_a * scale

P_r is P in the recipe's own P format (FP8 for `train`, Direct-P MXFP4 for
`train-mxfp4pv`). With the affine builder (`train-affine`) the backward has no
exponential per score: the trained forward measures its codes from the integer m~ =
ceil(running max) (`affine.snap_max(..., trained=True)`), and an integer shift of the
reference point moves every byte by 8, a power of two; so the codes measured from
ceil(lse2) (lse2 = lse * log2 e), times 2**(ceil(lse2) - lse2), are the forward's
normalized P exactly wherever the bytes stay normal. That P serves dS, and rounded to
e4m3 (times 2**8, as FP8 P) it is P_r for dV: 2**(ceil(lse2) - lse2) is no power of two,
and a factor per query cannot leave a product that sums over the queries. `_a` are
e4m3 views of the saved operands, `_g` views in
`recipe.grad` (e4m3 or e5m2); for grad="bf16" every view is bf16. Each view is
quantized with one scale per row of the product's contraction dim, so the scales
factor out of the product. The views of Q, K, V and dO span the whole contraction
dim (they exist before the backward starts); dS exists one tile at a time, so its
views carry one scale per DS_BLOCK contraction elements (per query row and 64-key
tile for dQ, per key and 64-query tile for dK): a kernel scales each tile's partial
product and never needs a second pass over dS. The quantizers pass gradients
straight through (Q's gradient is the gradient of its quantized value).

The recipe's robust transforms (`robust.py`) are applied to the gradients as their
adjoints: the products run on the rotated Q/K the forward saved, with the scale the
rotation folds in, and dQ, dK are rotated back (`robust.unrotate`); K smoothing passes
gradients straight through (exact: the softmax's gradient sums to zero over the keys);
with V smoothing the saved V is the represented values plus V's mean, so dP and delta
= rowsum(dO * O) describe the same V.

Non-finite values, as in the forward: every view's scales are taken over the finite
values (a NaN or Inf spoils its own element, `quantize_fp8(finite_scale=True)`), and a
key that a row does not attend to (log2 score -inf) never reaches that row's gradients
or receives from it: its P and dS are 0 there, and 0 x NaN is kept out of every product
(the spoiled entries are put back into exactly the outputs a visible pair feeds). So a
NaN LSE (a row whose forward was NaN) makes its P on the keys it attends, and the
gradients they feed, NaN: its dq row, the dk and dv of those keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp4attn.formats import E4M3, quantize_fp8, round_to_format
from fp4attn.formats.constants import MX_BLOCK
from fp4attn.recipes import Recipe, inference_only_message
from fp4attn.reference import robust
from fp4attn.reference.affine import build_p_affine
from fp4attn.reference.directp import build_p
from fp4attn.reference.encoding import P_OFFSET_LOG2
from fp4attn.reference.forward import (
    LOG2E,
    ForwardResult,
    expand_heads,
    kept_out_product,
    log2_bias,
    masked_log2_scores,
)
from fp4attn.reference.masks import causal_offset
from fp4attn.reference.operands import QKOperand

P_OFFSET = float(2**P_OFFSET_LOG2)  # FP8 P's fixed scale
DS_BLOCK = 64  # contraction elements per scale of dS's FP8 views (a backward kernel tile)
# queries per step of the reference backward: bounds its (B, H, rows, Sk) temporaries;
# a multiple of DS_BLOCK, so dS's query blocks never straddle two steps
QUERY_CHUNK = 1024


def low_precision_view(x: torch.Tensor, contraction_dim: int, fmt: str, block: int | None = None) -> torch.Tensor:
    """x as one operand of a product sees it: fp8 with a scale per row of the
    contraction dim (per `block` elements of it, if given), or bf16."""
    if fmt == "bf16":
        return x.to(torch.bfloat16).float()
    return quantize_fp8(x, dim=contraction_dim, block=block, fmt=fmt, finite_scale=True).dequantize()


def visible_product(w: torch.Tensor, visible: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w @ x where w is 0 off `visible` (a (..., M, N) mask): x's non-finite entries
    (..., N, K) kept out of the product and put back as NaN into exactly the outputs that
    a visible pair reads them in (0 x NaN would spoil the rows that never see them)."""
    if not torch.compiler.is_compiling() and torch.isfinite(x).all():  # eager: the product alone (traced: no branch)
        return w @ x
    out, spoiled = kept_out_product(w, visible, x)
    return out.masked_fill(spoiled, math.nan)


def _reduce_heads(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hkv, ...), summing the query heads that share a K/V head."""
    b, hq = x.shape[:2]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:]).sum(dim=2)


def reference_backward(
    fwd: ForwardResult,
    out: torch.Tensor,
    dout: torch.Tensor,
    recipe: Recipe,
    *,
    scale: float,
    causal: str | None = None,
    attn_mask: torch.Tensor | None = None,
    mask_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp32 for the forward `fwd` whose output was `out`; with
    `mask_grad`, also the gradient of the float `attn_mask` (fp32, in its shape): an
    additive score bias gets dS = P * (dP - delta) in natural units, summed over the
    dims the mask broadcasts along."""
    if recipe.grad is None:
        raise RuntimeError(inference_only_message(recipe))
    g = recipe.grad
    a = "bf16" if g == "bf16" else "e4m3"
    hq, hkv = fwd.q.values.shape[1], fwd.k.values.shape[1]
    sq, sk = fwd.q.values.shape[-2], fwd.k.values.shape[-2]

    if recipe.rotate_qk is not None:
        scale = scale * robust.rotation_scale(fwd.q.values.shape[-1])
    offset, bias = causal_offset(causal, sq, sk), log2_bias(attn_mask, sk, 1)
    do = dout.float()
    # views over the whole sequence or head dim: they exist before the backward starts
    q_a = low_precision_view(fwd.q.dequantize(), -2, a)
    k_a = low_precision_view(expand_heads(fwd.k.dequantize(), hq), -2, a)
    v_a = low_precision_view(expand_heads(fwd.v, hq), -1, a)
    do_c, do_t = low_precision_view(do, -2, g), low_precision_view(do, -1, g)
    delta = (do * out.float()).sum(dim=-1, keepdim=True)
    lse2 = (fwd.lse * LOG2E).unsqueeze(-1)
    pad = -sk % MX_BLOCK  # MXFP4 blocks of 32 keys start at key 0, as in the forward tiles

    dq = torch.empty(q_a.shape, device=q_a.device)
    dk = torch.zeros(*q_a.shape[:2], sk, q_a.shape[-1], device=q_a.device)
    dv = torch.zeros(*q_a.shape[:2], sk, v_a.shape[-1], device=q_a.device)  # V's head dim may differ
    step = max(DS_BLOCK, QUERY_CHUNK // DS_BLOCK * DS_BLOCK)
    if mask_grad:
        mask_shape = (1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)
        broadcast = [d for d in range(4) if mask_shape[d] == 1]  # summed over: the mask repeats along them
        dmask = torch.zeros(mask_shape, device=q_a.device)
    for i0 in range(0, sq, step):
        rows = slice(i0, min(sq, i0 + step))
        q_rows = QKOperand(fwd.q.values[..., rows, :],
                           fwd.q.scale[..., rows, :] if fwd.q.scale.shape[-2] > 1 else fwd.q.scale)
        t = masked_log2_scores(q_rows, fwd.k, scale, offset, bias, 0, sk, i0)
        visible = (t != -math.inf).expand(*q_a.shape[:2], -1, -1)  # NaN scores are visible
        x = torch.where(t == -math.inf, torch.full_like(t, -math.inf), t - lse2[..., rows, :])
        if recipe.p_build == "affine":  # the forward's codes from the LSE: no exponential per score
            l2 = lse2[..., rows, :]
            live = l2 != -math.inf
            m_ref = torch.where(live, torch.ceil(l2), torch.zeros_like(l2))
            factor = torch.where(live, torch.exp2(m_ref - l2), torch.zeros_like(l2))
            p = build_p_affine(t, m_ref.squeeze(-1), recipe.p) * factor
            p_r = round_to_format(p * P_OFFSET, E4M3) / P_OFFSET  # e4m3(p * 2**8) / 2**8
        else:
            p = torch.exp2(x)
            p_r = build_p(F.pad(x, (0, pad), value=-math.inf), recipe.p, recipe.p_build, recipe.p_sink,
                          recipe.p_sink_keys)[..., :sk]
        # a NaN LSE (a NaN row) or the affine builders' NaN point stays off the keys it hides
        p, p_r = torch.where(visible, p, 0.0), torch.where(visible, p_r, 0.0)
        dv += visible_product(p_r.transpose(-1, -2), visible.transpose(-1, -2), do_c[..., rows, :])
        dp = do_t[..., rows, :] @ v_a.transpose(-1, -2)
        ds = torch.where(visible, p * (dp - delta[..., rows, :]), 0.0)
        if mask_grad:
            dmask[..., rows if mask_shape[2] > 1 else slice(None), :] += (
                ds.sum(dim=broadcast, keepdim=True) if broadcast else ds)  # sum(dim=[]) would sum every dim
        dq[..., rows, :] = visible_product(low_precision_view(ds, -1, g, DS_BLOCK), visible, k_a) * scale
        dk += visible_product(low_precision_view(ds, -2, g, DS_BLOCK).transpose(-1, -2), visible.transpose(-1, -2),
                              q_a[..., rows, :])
    dk = dk * scale
    if recipe.rotate_qk is not None:
        dq, dk = robust.unrotate(dq), robust.unrotate(dk)
    grads = dq, _reduce_heads(dk, hkv), _reduce_heads(dv, hkv)
    return (*grads, dmask.reshape(attn_mask.shape)) if mask_grad else grads


def refuse_double_backward(what: str) -> None:
    """Raise if a backward runs under create_graph=True (grad mode is on inside it only
    then). The training backwards are first-order: their quantizers pass gradients
    straight through and their own operations are not recorded, so a second derivative
    through them would be wrong, not merely slow; SDPA's fused backwards refuse it too."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} has no double backward: torch.autograd.grad(..., create_graph=True) and "
                           ".backward(create_graph=True) through it are not supported (second derivatives "
                           "need torch.nn.functional.scaled_dot_product_attention's math backend)")
