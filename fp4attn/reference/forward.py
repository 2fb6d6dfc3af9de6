"""Reference forward: tile-by-tile online softmax, as a kernel computes it.

For each tile of `recipe.block_n` keys, with t the scores in log2 units
(t = s * scale * log2(e)) and m the running row maximum:

    m_new = max(m, rowmax(t));  alpha = 2**(m - m_new);  x = t - m_new
    P     = build_p(x)                               (directp.py; with p_sink_keys the
                                                      sink remedy on the first tiles only;
                                                      affine.py: m_new snapped to the
                                                      affine map's grid, P from t;
                                                      rescale="lazy": m_new moves only
                                                      when the tile's bytes would not fit)
    l     = alpha * l + rowsum(P if consistent_norm else 2**x)
    acc   = alpha * acc + P @ V
    out   = acc / l,  lse = (m + log2(l)) * ln(2)

The rescale is exact-max (every tile; with rescale="lazy", whenever a tile would exceed
what its P format holds), so no key tile is ever scaled against a maximum it overflows: logits of any size stay finite, and tiles far below a later maximum are
multiplied by 2**(m - m_new) = 0 rather than underflowing inside a block scale.

Before quantizing, the recipe's outlier-robust transforms (`robust.py`: K smoothing,
Hadamard rotation of Q and K, V smoothing) rewrite the operands without changing the
attention they define in real arithmetic.

Non-finite values (the rules every backend follows):
- every scale is computed per (batch, head) at the widest, so nothing in one (batch,
  head) changes another's result;
- every statistic (NVFP4's tensor amax, FP8 V's channel and K's tile maxima, the robust
  means, sums of squares and maxima) is taken over the finite values, and a NaN or Inf
  spoils only its own scale block: NVFP4 Q/K's 16 channels of one token, FP8 Q/K's
  token, MXFP4 V's 32 keys of one channel, and for FP8 V (one scale per channel) and
  FP8 K per tile (one scale per key tile) the element alone;
- so a NaN or Inf in q gives NaN in its row (and LSE NaN there); in k, in the rows that
  attend to its key (the score is NaN, and with it the row's running maximum); in v, in
  the channels it spoils of the rows that attend to its key (to a key of its MXFP4
  block): a key that a row does not attend to (masked: its log2 score is -inf) never
  reaches it, whatever its value holds (P is 0 there, and 0 x NaN is kept out of P V);
  a NaN in a float mask, or a score that overflows, gives NaN in its row;
- a row that sees no key (fully masked) is 0 with LSE -inf, as SDPA in torch >= 2.13.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4attn.recipes import Recipe
from fp4attn.reference import robust
from fp4attn.reference.affine import K_FP8_F32, K_FP8_LAZY_F32, build_p_affine, lazy_reference_point, snap_max
from fp4attn.reference.directp import build_p
from fp4attn.reference.masks import causal_offset, key_mask, key_mask_view
from fp4attn.reference.operands import QKOperand, quantize_qk, quantize_qk_fallback, quantize_v

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class ForwardResult:
    out: torch.Tensor  # fp32 (B, Hq, Sq, D)
    lse: torch.Tensor  # fp32 (B, Hq, Sq), natural log; -inf for rows that see no key
    q: QKOperand  # the quantized operands, (B, H, S, D) with K and V at Hkv heads, as the
    k: QKOperand  # score product sees them (rotated and smoothed where the recipe says so)
    v: torch.Tensor  # V as the output sees it: the represented values (plus V's mean with smooth_v)
    p: torch.Tensor | None = None  # (B, Hq, Sq, Sk) represented P of each key's tile, if asked
    qk_fallback: torch.Tensor | None = None  # (B, Hkv) bool: heads whose Q/K took `Recipe.qk_fallback`


def expand_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...): each K/V head serves Hq // Hkv query heads."""
    return x if x.shape[1] in (1, hq) else x.repeat_interleave(hq // x.shape[1], dim=1)


def log2_bias(attn_mask: torch.Tensor | None, sk: int, block_n: int) -> torch.Tensor | None:
    """An SDPA attn_mask as an additive bias in log2 units, keys padded to whole tiles:
    boolean False -> -inf, float m -> m * log2(e)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, device=attn_mask.device).masked_fill(~attn_mask, -math.inf)
    else:
        bias = attn_mask.float() * LOG2E
    bias = bias.expand(*bias.shape[:-1], sk)
    return F.pad(bias, (0, -sk % block_n), value=-math.inf)


def log2_scores(q: QKOperand, k: QKOperand, scale: float, cols: slice) -> torch.Tensor:
    """Scores of keys `cols` in log2 units: (Qv Kv^T) * (Qs * scale * log2 e) * Ks^T."""
    hq = q.values.shape[1]
    kv = expand_heads(k.values[..., cols, :], hq)
    ks = expand_heads(k.scale[..., cols, :] if k.scale.shape[-2] > 1 else k.scale, hq)
    acc = q.values @ kv.transpose(-1, -2)
    return acc * (q.scale * (scale * LOG2E)) * ks.transpose(-1, -2)


def masked_log2_scores(q: QKOperand, k: QKOperand, scale: float, offset: int | None, bias: torch.Tensor | None,
                       j0: int, width: int, i0: int = 0) -> torch.Tensor:
    """Log2 scores of keys [j0, j0 + width) with the attn_mask bias added and hidden keys
    (causal, or past Sk: the tile's padding) at -inf; bias as from `log2_bias`. `q` may
    be a slice of the queries starting at row i0 (bias keeps all rows)."""
    sq, sk = q.values.shape[-2], k.values.shape[-2]
    t = log2_scores(q, k, scale, slice(j0, j0 + width))
    t = F.pad(t, (0, j0 + width - min(sk, j0 + width)))
    if bias is not None:
        if bias.ndim >= 2 and bias.shape[-2] > 1:  # a per-query mask: this slice's rows
            bias = bias[..., i0 : i0 + sq, :]
        t = t + bias[..., j0 : j0 + width]
    rows = torch.arange(i0, i0 + sq, device=t.device)
    cols = torch.arange(j0, j0 + width, device=t.device)
    return t.masked_fill(~key_mask(offset, rows, cols, sk), -math.inf)


def kept_out_product(w: torch.Tensor, visible: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w @ x for a w that is 0 off `visible` ((..., M, N) bool), with x's non-finite
    entries (..., N, K) kept out of the product (0 x NaN would spoil the rows that never
    see them), and the (..., M, K) bool of the outputs a visible pair reads one in: where
    the caller puts NaN back."""
    bad = ~torch.isfinite(x)
    return w @ x.masked_fill(bad, 0.0), (visible.to(x.dtype) @ bad.to(x.dtype)) > 0


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: Recipe,
    *,
    scale: float,
    causal: str | None = None,
    attn_mask: torch.Tensor | None = None,
    return_p: bool = False,
) -> ForwardResult:
    """Attention of (B, Hq, Sq, D) queries over (B, Hkv, Sk, D) keys/values in `recipe`.

    Inputs are assumed validated (see `fp4attn.api`); Hq must be a multiple of Hkv.
    `attn_mask` follows SDPA: boolean (True attends) or additive float, broadcastable
    to (B, Hq, Sq, Sk). `return_p` keeps each tile's represented P (relative to that
    tile's running max), which a kernel's P codes must reproduce.
    """
    q_op, k_op, scale, fallback = robust_qk(q, k, recipe, scale)
    v_mean = robust.key_mean(v) if recipe.smooth_v else None
    v_rep = quantize_v(v if v_mean is None else robust.smooth(v, v_mean), recipe.v)
    B, H, Sq, _ = q.shape
    Sk, Dv = k.shape[-2], v.shape[-1]
    bn = recipe.block_n
    offset = causal_offset(causal, Sq, Sk)

    m = torch.full((B, H, Sq), -math.inf, device=q.device)
    l = torch.zeros((B, H, Sq), device=q.device)
    acc = torch.zeros((B, H, Sq, Dv), device=q.device)
    p_all = torch.zeros((B, H, Sq, Sk), device=q.device) if return_p else None
    bias = log2_bias(attn_mask, Sk, bn)
    last_key = Sk if offset is None else min(Sk, Sq + offset)  # keys past it are hidden from every row
    # V's non-finite entries are kept out of P V (`kept_out_product`) and put back into
    # exactly the (row, channel) entries of the rows that attend to them
    v_nan = torch.zeros((B, H, Sq, Dv), dtype=torch.bool, device=q.device)
    for j0 in range(0, last_key, bn):  # a kernel skips tiles the causal mask hides entirely
        t = masked_log2_scores(q_op, k_op, scale, offset, bias, j0, bn)
        m_new = torch.maximum(m, t.amax(dim=-1))
        m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        lazy = recipe.rescale == "lazy"
        if lazy:
            # the row's point stays while the tile's bytes fit above it (affine.py)
            m_use = lazy_reference_point(t, m, m_use)
        elif recipe.p_build == "affine":
            # the affine map's reference point: the maximum snapped to its grid (affine.py)
            m_use = snap_max(m_use, recipe.p, trained=recipe.grad is not None)
        alpha = torch.exp2(m - m_use)
        x = t - m_use.unsqueeze(-1)
        if recipe.p_build == "affine":
            p = build_p_affine(t, m_use, recipe.p, K_FP8_LAZY_F32 if lazy else K_FP8_F32)
        else:
            # p_sink_keys: the sink remedy on the tiles of the first keys only (whole tiles)
            sink = recipe.p_sink and (recipe.p_sink_keys == 0 or j0 < recipe.p_sink_keys)
            p = build_p(x, recipe.p, recipe.p_build, sink)
        if return_p:
            p_all[..., j0 : j0 + bn] = p[..., : min(bn, Sk - j0)]
        l = alpha * l + (p if recipe.consistent_norm else torch.exp2(x)).sum(dim=-1)
        v_tile = F.pad(expand_heads(v_rep[..., j0 : j0 + bn, :], H), (0, 0, 0, j0 + bn - min(Sk, j0 + bn)))
        pv, spoiled = kept_out_product(p, t != -math.inf, v_tile)
        v_nan |= spoiled
        acc = alpha.unsqueeze(-1) * acc + pv
        # the running point every later tile is measured from (m itself, or the affine
        # builders' snapped m~, which stays -inf for a row that has seen no key)
        m = torch.where(m_new == -math.inf, m_new, m_use)

    # a row that saw a key has l > 0 (its maximum's P is 1) or NaN; only unseen rows are 0
    seen = m != -math.inf
    safe_l = torch.where(seen, l, torch.ones_like(l))
    out = torch.where(seen.unsqueeze(-1), acc / safe_l.unsqueeze(-1), 0.0).masked_fill(v_nan, math.nan)
    lse = torch.where(seen, (m + torch.log2(safe_l)) * LN2, -math.inf)
    if v_mean is not None:
        mean = expand_heads(v_mean, H)
        out = torch.where(seen.unsqueeze(-1), out + mean, 0.0)
        v_rep = v_rep + v_mean
    return ForwardResult(out, lse, q_op, k_op, v_rep, p_all, fallback)


def robust_qk(q: torch.Tensor, k: torch.Tensor, recipe: Recipe,
              scale: float) -> tuple[QKOperand, QKOperand, float, torch.Tensor | None]:
    """Q and K as the score product sees them under `recipe` (smoothed, rotated,
    quantized), the softmax scale that goes with them, and the (B, Hkv) heads that took
    the Q/K fallback format (None without `Recipe.qk_fallback`)."""
    qf, kf, mean = q, k, None
    if recipe.smooth_k:
        mean = robust.key_mean(kf)
        kf = robust.smooth(kf, mean)
    if recipe.rotate_qk is not None:
        qf, kf = robust.rotate(qf), robust.rotate(kf)
        scale = scale * robust.rotation_scale(q.shape[-1])
    f46 = recipe.qk_four_over_six
    if recipe.qk_fallback is None:
        k_tile = recipe.block_n if recipe.k_scale == "tile" else 0
        return quantize_qk(qf, recipe.qk, f46), quantize_qk(kf, recipe.qk, f46, k_tile), scale, None
    hq, hkv = q.shape[1], k.shape[1]
    if mean is not None and recipe.rotate_qk is None:
        # smoothed K's sums of squares from K's float64 sums per channel (the pass over
        # K that makes its mean makes them too, `robust.smoothed_sum_sq`)
        sq_q = robust.finite_or_zero(qf.float()).double().square().sum(dim=(-2, -1))
        sq_k = robust.smoothed_sum_sq(*robust.key_sums(k), mean, k.shape[-2])
        spread = robust.logit_std_of_sums(sq_q, expand_heads(sq_k, hq), q.shape[-2], k.shape[-2], q.shape[-1],
                                          scale)  # (B, Hq)
    else:
        spread = robust.logit_std(qf, expand_heads(kf, hq), scale)  # (B, Hq)
    fallback = spread.reshape(q.shape[0], hkv, hq // hkv).amax(-1) > recipe.qk_fallback_logit_std
    return (quantize_qk_fallback(qf, expand_heads(fallback[..., None], hq)[..., 0], f46),
            quantize_qk_fallback(kf, fallback, f46), scale, fallback)


def key_bias_of_mask(attn_mask: torch.Tensor, batch: int, sk: int) -> torch.Tensor | None:
    """An SDPA attn_mask that depends on the batch and the key only (`key_mask_view`:
    key padding) as the (B, Sk) log2-unit bias the kernel adds, computed by the
    reference's own `log2_bias`; None for any other mask."""
    key_mask = key_mask_view(attn_mask)
    if key_mask is None:
        return None
    bias = log2_bias(key_mask, sk, 1)  # (b, 1, 1, Sk), padded by 0 keys
    return bias.expand(batch, 1, 1, sk).reshape(batch, sk).float().contiguous()
