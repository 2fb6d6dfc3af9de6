"""Reference decode attention: new query rows against a quantized KV cache.

A step of generation attends Sq new query rows (1, or up to 16 with speculative
decoding) of each sequence to the L_b tokens its cache holds, the new ones included.
Decode reads every cached byte once per step and does little arithmetic on it, so its
speed is the cache's size: the cache is quantized (`reference.kvcache`), and the
arithmetic stays in bf16 operands with float32 sums, as the Hopper kernel runs it.
With q rounded to bf16 (an Inf in it becomes NaN, as `reference.operands` makes it) and
then to f16 at its row's power-of-two scale (`half_queries`), K and V as block values kb,
vb (exact in bf16) times token scales ks, vs, and t the scores in log2 units:

    t_ij = (q_i . kb_j) * (ks_j * scale * log2(e))     key j visible to row i, else -inf
    m_i  = ceil(max_j t_ij)                                   (an integer: see below)
    p_ij = 2**(t_ij - m_i),   l_i = sum_j p_ij                 (float32)
    o_i  = sum_j bf16(p_ij * vs_j) * vb_j / l_i,   lse_i = (m_i + log2 l_i) * ln 2

The f16 rounding of q is exact for every element down to 2**-28 of its row's largest
(the kernels multiply in f16, where FP8 keys convert in one instruction); below that it
rounds as f16 subnormals do, far under the float32 rounding of the scores.

FP8 values (`p_half`): their e4m3 codes are exact in f16, and so the product takes P in
f16 too, whose 11 bits are finer than bf16's 8 but whose range is narrow. The value's
token scale vs_j = mu_j * 2**E_j (`split_scales`: mu in [1, 2), E an integer) puts its
exponent into the score and its mantissa into P, so that a second integer maximum keeps
P at the top of f16's range whatever the token scales are:

    u_ij = t_ij + E_j,   M_i = ceil(max_j u_ij)
    o_i  = 2**(M_i - 13 - m_i) * sum_j f16(2**(u_ij - M_i) * mu_j * 2**13) * vb_j / l_i

(P below 2**15; f16's normal range reaches 2**-28 below the largest term.)

The maximum is rounded up to an integer so that a kernel's online softmax, which
rescales its running sums by 2**(m_old - m_new) whenever the maximum grows, and its
split-K combine only ever multiply by powers of two: those commute with the bf16
rounding of P, so the result does not depend on the tile or the split a key fell in
(beyond float32 summation order). P is bf16 (FlashAttention's choice), not FP4 or FP8:
decode is bound by the cache's bytes, and a coarser P would cost accuracy for no speed.

Visibility: key j of sequence b is visible to query row r when j < L_b, j >= start_b
(left padding, `key_start`), and, with `causal`, j <= L_b - Sq + r (bottom-right
alignment: the last row sees every key, as FlashAttention's `causal`). A row that sees
no key is 0 with LSE -inf.

Non-finite values, in the rows that read them and nowhere else: a NaN score (a NaN in
q, or in a visible key) makes its row NaN; a NaN in channel d of a visible value (or a
NaN value token scale, which covers every channel) makes channel d of the row NaN. A
value that no row of the step can see (beyond L_b, before start_b, or hidden by the
causal mask from this row) never reaches it, whatever it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4attn.reference.forward import LN2, LOG2E, expand_heads


@dataclass(frozen=True)
class DecodeResult:
    out: torch.Tensor  # float32 (B, Hq, Sq, D)
    lse: torch.Tensor  # float32 (B, Hq, Sq), natural log; -inf for rows that see no key


def visible_keys(lengths: torch.Tensor, sq: int, n_keys: int, causal: bool,
                 key_start: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (B, 1, Sq, n_keys): key j visible to query row r of sequence b."""
    j = torch.arange(n_keys, device=lengths.device)
    lens = lengths.to(torch.int64).reshape(-1, 1, 1, 1)
    vis = j < lens
    if key_start is not None:
        vis = vis & (j >= key_start.to(torch.int64).reshape(-1, 1, 1, 1))
    if causal:
        r = torch.arange(sq, device=lengths.device).reshape(1, 1, sq, 1)
        vis = vis & (j <= lens - sq + r)
    return vis.expand(-1, 1, sq, n_keys)


# P's offset in f16 for `p_half` (module docstring): the largest P is below 2**14 * 2
P_HALF_SHIFT = 13
# the value formats whose P is f16 (`p_half`): their values are exact in f16
P_HALF_FORMATS = ("fp8",)


def _exponent_field(x: torch.Tensor) -> torch.Tensor:
    return (x.contiguous().view(torch.int32) >> 23) & 0xFF


def half_queries(qv: torch.Tensor) -> torch.Tensor:
    """q (float32, bf16 values) rounded to f16 at its row's power-of-two scale 2**e,
    e = 14 - floor(log2 amax) (so the row's largest lies in [2**14, 2**15)), clamped to
    [-126, 100], and scaled back: what the kernels' f16 products hold. A row of zeros,
    subnormals or NaN takes e from the same rule on its amax's exponent field."""
    amax = qv.abs().amax(dim=-1, keepdim=True)
    e = (141 - _exponent_field(amax)).clamp(-126, 100).float()
    return (qv * torch.exp2(e)).half().float() * torch.exp2(-e)


def split_scales(vs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, mu) with vs = mu * 2**E: a normal float's exponent and its mantissa in [1, 2);
    zeros, subnormals, Inf and NaN keep E = 0 and mu = vs."""
    field = _exponent_field(vs)
    normal = (field > 0) & (field < 255)
    mant = ((vs.contiguous().view(torch.int32) & 0x807FFFFF) | 0x3F800000).view(torch.float32)
    return torch.where(normal, field - 127, 0).float(), torch.where(normal, mant, vs)


def reference_decode(q: torch.Tensor, kb: torch.Tensor, ks: torch.Tensor, vb: torch.Tensor, vs: torch.Tensor,
                     lengths: torch.Tensor, *, scale: float, causal: bool = True,
                     key_start: torch.Tensor | None = None, p_half: bool = False) -> DecodeResult:
    """Decode attention of q (B, Hq, Sq, D) over cached keys and values given as block
    values kb, vb (float32 (B, Hkv, N, D), exact in bf16) and token scales ks, vs
    (float32 (B, Hkv, N)), sequence b holding lengths[b] <= N tokens (entries past it
    are never read). key_start (B,): the first key each sequence attends to. p_half:
    P in f16 with the value scales' exponents split off (FP8 values: module docstring)."""
    hq, sq = q.shape[1], q.shape[2]
    n = kb.shape[2]
    qv = q.to(torch.bfloat16).float()
    qv = half_queries(qv.masked_fill(torch.isinf(qv), float("nan")))
    vis = visible_keys(lengths.to(q.device), sq, n, causal, key_start)  # (B, 1, Sq, N)
    kb, ks = expand_heads(kb, hq), expand_heads(ks, hq)
    vb, vs = expand_heads(vb, hq), expand_heads(vs, hq)
    t = (qv @ kb.transpose(-1, -2)) * (ks * (scale * LOG2E)).unsqueeze(-2)
    t = t.masked_fill(~vis, -math.inf)
    m = torch.ceil(t.amax(dim=-1))
    m_use = torch.where(m == -math.inf, torch.zeros_like(m), m)
    p = torch.exp2(t - m_use.unsqueeze(-1))
    l = p.sum(dim=-1)
    # values no visible row reads must not reach the product (0 * NaN): cleaned, and the
    # NaNs put back into exactly the (row, channel) entries that read them
    vs_nan = torch.isnan(vs)
    nan_map = torch.isnan(vb) | vs_nan.unsqueeze(-1)  # (B, Hq, N, D)
    vb_clean = vb.masked_fill(nan_map, 0.0)
    vs_clean = vs.masked_fill(vs_nan, 0.0)
    if p_half:
        big_e, mu = split_scales(vs_clean)
        u = t + big_e.unsqueeze(-2)
        big_m = torch.ceil(u.amax(dim=-1))
        big_m = torch.where(big_m == -math.inf, torch.zeros_like(big_m), big_m)
        pv = (torch.exp2(u - big_m.unsqueeze(-1)) * (mu * 2.0 ** P_HALF_SHIFT).unsqueeze(-2)).half().float()
        acc = (pv @ vb_clean) * torch.exp2(big_m - P_HALF_SHIFT - m_use).unsqueeze(-1)
    else:
        pv = (p * vs_clean.unsqueeze(-2)).to(torch.bfloat16).float()
        acc = pv @ vb_clean
    out_nan = (vis.expand_as(p).float() @ nan_map.float()) > 0
    seen = m != -math.inf
    safe_l = torch.where(seen, l, torch.ones_like(l))
    out = torch.where(seen.unsqueeze(-1), acc / safe_l.unsqueeze(-1), 0.0)
    out = out.masked_fill(out_nan, float("nan"))
    lse = torch.where(seen, (m + torch.log2(safe_l)) * LN2, -math.inf)
    return DecodeResult(out, lse)
