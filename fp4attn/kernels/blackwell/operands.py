"""Q, K and V in the layouts the Blackwell forward reads, from the reference quantizers
(so the codes and scales are the reference's by construction).

The block-scaled tensor-core product reads E2M1 codes packed two to a byte along its
contraction dim (element 2i in the low nibble, as `formats.minifloat.pack_e2m1` packs
them) and one scale per block in a (rows, blocks) matrix: exactly the payloads of
`formats.nvfp4` (along the head dim) and `formats.mx` (along the keys), so no bytes are
rearranged:

    q, k    NVFP4: (B, H, S, D/2) uint8 codes with (B, H, S, D/16) e4m3 block scales;
            FP8: (B, H, S, D) e4m3 values (no block scales)
    qs, ks  (B, H, S) float32: the NVFP4 tensor scale of the token's (batch, head), or
            the FP8 per-token scale; applied to the float32 product
    v       MXFP4: (B, Hkv, D, Skp/2) uint8 codes packed along the keys, with
            (B, Hkv, D, Skp/32) E8M0 scales; FP8: V^T (B, Hkv, D, Skp) e4m3 with
            (B, Hkv, D) float32 per-channel scales. Skp is Sk rounded up to whole key
            tiles, the padding zero keys (a zero adds nothing and changes no block's
            amax), so the kernel loads V tiles without a mask.

MXFP4 V keeps the reference's window (`reference.encoding.V_WINDOW`: blocks more than
2**14 below the head's largest are zero), which the reference applies on every target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4attn.formats import quantize_fp8, quantize_mxfp4
from fp4attn.formats.constants import E8M0_BIAS, E8M0_NAN, MX_BLOCK
from fp4attn.recipes import Recipe
from fp4attn.reference.forward import robust_qk
from fp4attn.reference.operands import QKOperand, v_window

# the key tile of the Blackwell forward: Recipe.block_n of every preset it runs
BLOCK_N = 128


@dataclass(frozen=True)
class BlackwellOperands:
    q: torch.Tensor
    q_sc: torch.Tensor | None  # NVFP4 block scales, None for FP8 Q/K
    k: torch.Tensor
    k_sc: torch.Tensor | None
    qs: torch.Tensor
    ks: torch.Tensor
    v: torch.Tensor
    v_sc: torch.Tensor | None  # MXFP4 E8M0 scales, None for FP8 V
    vs: torch.Tensor | None  # FP8 per-channel scales, None for MXFP4 V

    @property
    def qk_fp4(self) -> bool:
        return self.q_sc is not None

    @property
    def pv_fp4(self) -> bool:
        return self.v_sc is not None


def _qk(op: QKOperand, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    scale = op.scale.expand(*op.values.shape[:-1], 1).squeeze(-1).float().contiguous()
    if fmt == "nvfp4":
        return op.payload.data.contiguous(), op.payload.scale.contiguous(), scale
    if fmt == "fp8":
        return op.values.to(torch.float8_e4m3fn).contiguous(), None, scale
    raise ValueError(f"the Blackwell forward reads Q/K in 'nvfp4' or 'fp8', not {fmt!r}")


def _pad_keys(v: torch.Tensor) -> torch.Tensor:
    return F.pad(v, (0, 0, 0, -v.shape[-2] % BLOCK_N))


def quantize_v_mxfp4_packed(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 V along the keys, inside the reference's window: (codes (B, H, D, Skp/2)
    uint8, E8M0 scales (B, H, D, Skp/32) uint8); flushed blocks have all codes 0."""
    q = quantize_mxfp4(_pad_keys(v), dim=-2)
    scale = q.scale
    _, flushed = v_window(scale.to(torch.int32) - E8M0_BIAS, scale != E8M0_NAN)
    data = q.data.reshape(*scale.shape, MX_BLOCK // 2).masked_fill(flushed.unsqueeze(-1), 0)
    return data.reshape(q.data.shape).contiguous(), scale.contiguous()


def quantize_v_fp8_t(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 V with one scale per channel, that of its finite values (a NaN or Inf a NaN
    element, `reference.operands.quantize_v`): (V^T (B, H, D, Skp) e4m3, scales (B, H, D))."""
    q = quantize_fp8(v, dim=-2, block=None, fmt="e4m3", finite_scale=True)  # data (B, H, D, 1, S)
    vt = q.data.squeeze(-2)
    vt = F.pad(vt.view(torch.uint8), (0, -vt.shape[-1] % BLOCK_N)).view(torch.float8_e4m3fn)
    return vt.contiguous(), q.scale.squeeze(-1).float().contiguous()


def _pad_channels(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """t's last dim padded with zero bytes to n (codes, e4m3 values or block scales: a zero
    byte is a zero in each)."""
    if t is None or t.shape[-1] == n:
        return t
    return F.pad(t.view(torch.uint8), (0, n - t.shape[-1])).view(t.dtype)


def prepare_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe,
                     scale: float, head_dim: int | None = None) -> tuple[BlackwellOperands, float]:
    """The operands of `recipe` for the Blackwell forward, quantized by the reference
    (with its K smoothing, Hadamard rotation and 4/6 block scales where the recipe asks
    for them, `reference.forward.robust_qk`), and the softmax scale that goes with them
    (the rotation folds a power of two into it). `head_dim`: the caller's, where q and k
    are zero-padded to D channels: Q and K are quantized at that head dim, as the
    reference quantizes the unpadded inputs (the rotation's Hadamard blocks depend on
    it), and their codes and block scales padded with zeros after."""
    if recipe.qk_fallback is not None or recipe.p_sink or recipe.smooth_v:
        raise ValueError(f"the Blackwell forward does not apply qk_fallback, p_sink or smooth_v (recipe "
                         f"{recipe.name!r})")
    D = q.shape[-1]
    if head_dim is not None and not 0 < head_dim <= D:
        raise ValueError(f"prepare_operands: head_dim={head_dim} for inputs padded to {D} channels; accepted: "
                         f"1 to {D}")
    d = head_dim or D
    q_op, k_op, scale, _ = robust_qk(q[..., :d], k[..., :d], recipe, scale)
    (qv, q_sc, qs), (kv, k_sc, ks) = _qk(q_op, recipe.qk), _qk(k_op, recipe.qk)
    if d < D:
        per_byte = 2 if recipe.qk == "nvfp4" else 1  # packed E2M1 codes: two channels a byte
        qv, kv = _pad_channels(qv, D // per_byte), _pad_channels(kv, D // per_byte)
        q_sc, k_sc = _pad_channels(q_sc, D // 16), _pad_channels(k_sc, D // 16)
    if recipe.v == "mxfp4":
        vv, v_sc = quantize_v_mxfp4_packed(v)
        vs = None
    elif recipe.v == "fp8":
        vv, vs = quantize_v_fp8_t(v)
        v_sc = None
    else:
        raise ValueError(f"the Blackwell forward reads V in 'mxfp4' or 'fp8', not {recipe.v!r}")
    return BlackwellOperands(qv, q_sc, kv, k_sc, qs, ks, vv, v_sc, vs), scale
