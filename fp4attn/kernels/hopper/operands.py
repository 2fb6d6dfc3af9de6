"""Q, K and V in the layouts the Hopper forward kernels read: from the reference
quantizers (`prepare_operands`: the codes and scales are the reference's by
construction), or from the fused Triton quantizers of `kernels/quantize/`
(`prepare_operands_fused`: the same tensors, bit for bit, which the forward runs on).

    q, k    (B, H, S, D) bf16: NVFP4 grid values, or FP8 recipes' e4m3 values (exact in
            bf16, so QK^T runs on the bf16 tensor cores and sums in float32); e4m3 for
            `Recipe.fast_accum` (QK^T on the FP8 tensor cores)
    qs, ks  (B, H, S) float32: per-token scale (FP8) or the tensor scale (NVFP4)
    vt      (B, Hkv, D, S) e4m3, V transposed so the PV product is K-major (the fused
            quantizers' is a view of rows padded to the key tile: `vt_keys_padded`)
    vs      (B, Hkv, D) float32: per-channel scale (FP8) or 2**c (MXFP4, per head)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fp4attn.formats import E4M3, quantize_fp8, round_to_format
from fp4attn.formats.minifloat import pow2
from fp4attn.kernels.quantize.fp8 import quantize_k_fp8_tiles, quantize_qk_fp8
from fp4attn.kernels.quantize.nvfp4 import quantize_qk_nvfp4
from fp4attn.kernels.quantize.robust import FUSED_ROBUST_FIELDS, robust_qk_operands
from fp4attn.kernels.quantize.v_operand import quantize_v_t
from fp4attn.recipes import Recipe
from fp4attn.reference.operands import quantize_qk, quantize_v_mxfp4
from fp4attn.routing import KEY_TILE as BLOCK_N  # the forward's key tile (routing.KEY_TILE)


@dataclass(frozen=True)
class KernelOperands:
    q: torch.Tensor
    k: torch.Tensor
    qs: torch.Tensor
    ks: torch.Tensor
    vt: torch.Tensor
    vs: torch.Tensor
    # vt is a (B, H, D, S) view of rows padded with zero keys to a multiple of the
    # forward's key tile (`quantize_v_t(pad_keys_to=...)`): the kernel reads them unmasked
    vt_keys_padded: bool = False
    # ks holds one value per key tile, repeated per key (`Recipe.k_scale="tile"`): the CUDA
    # forward folds it into each row's factor once per tile
    k_tile_scales: bool = False


def qk_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype the forward kernel reads Q/K in, which picks the tensor cores of QK^T:
    e4m3 for `fast_accum` (FP8 wgmma), else bf16 (exact for e4m3 values and for NVFP4's
    element x E4M3 block scale, at most six significant bits)."""
    return torch.float8_e4m3fn if recipe.fast_accum else torch.bfloat16


def _qk(x: torch.Tensor, recipe: Recipe, tile: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    op = quantize_qk(x, recipe.qk, tile=tile)
    values = op.values.to(qk_dtype(recipe))
    return values.contiguous(), op.scale.expand(*x.shape[:-1], 1).squeeze(-1).contiguous()


def prepare_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe) -> KernelOperands:
    qv, qs = _qk(q, recipe)
    kv, ks = _qk(k, recipe, BLOCK_N if recipe.k_scale == "tile" else 0)
    if recipe.v == "fp8":
        vq = quantize_fp8(v, dim=-2, block=None, fmt="e4m3", finite_scale=True)  # data (B, H, D, 1, S)
        vt, vs = vq.data.squeeze(-2), vq.scale.squeeze(-1)
    else:  # mxfp4: E2M1 x 2**(e - c) is an exact e4m3 value inside the window
        values, c = quantize_v_mxfp4(v)
        vt = round_to_format(values * pow2(-c)[..., None, None], E4M3).to(torch.float8_e4m3fn).transpose(-1, -2)
        vs = pow2(c)[..., None].expand(*c.shape, v.shape[-1])
    return KernelOperands(qv, kv, qs, ks, vt.contiguous(), vs.float().contiguous(),
                          k_tile_scales=recipe.k_scale == "tile")


def prepare_operands_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe,
                           scale: float | None = None, head_dim: int | None = None) -> KernelOperands:
    """The same tensors as `prepare_operands`, from the fused quantizers; for a recipe
    with outlier-robust fields (only FUSED_ROBUST_FIELDS; `qk_fallback` needs the softmax
    `scale`, and for zero-padded inputs the caller's `head_dim`: `robust_qk_operands`)
    those of `reference.forward.robust_qk`. `Recipe.p_sink` is the forward's (P_MODE 3);
    the other robust fields are refused, never dropped."""
    other = [f for f in ("rotate_qk", "smooth_v") if getattr(recipe, f)]
    if other:
        raise ValueError(f"prepare_operands_fused: {', '.join(other)} are not applied by the fused quantizers")
    if any(getattr(recipe, f) not in (False, None) for f in FUSED_ROBUST_FIELDS):
        qv, qs, kv, ks, _ = robust_qk_operands(q, k, recipe, scale, head_dim)
        vt, vs = quantize_v_t(v, recipe.v, pad_keys_to=BLOCK_N)
        return KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True)
    if recipe.qk == "fp8":
        qk = functools.partial(quantize_qk_fp8, dtype=qk_dtype(recipe))
    else:
        qk = quantize_qk_nvfp4
    qv, qs = qk(q)
    tiles = recipe.k_scale == "tile"
    kv, ks = quantize_k_fp8_tiles(k, BLOCK_N, qk_dtype(recipe)) if tiles else qk(k)
    vt, vs = quantize_v_t(v, recipe.v, pad_keys_to=BLOCK_N)
    return KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True, k_tile_scales=tiles)


def tma_loadable(ops: KernelOperands) -> bool:
    """Whether K and V^T can be loaded by TMA in whole tiles (`tma_descriptors`)."""
    k, vt = ops.k, ops.vt
    D, Hkv = k.shape[3], k.shape[1]
    return (ops.vt_keys_padded and k.is_contiguous() and vt.stride(3) == 1 and vt.stride(2) % BLOCK_N == 0
            and vt.stride(1) == D * vt.stride(2) and vt.stride(0) == Hkv * vt.stride(1)
            and (k.data_ptr() | vt.data_ptr()) % 16 == 0)


def padded_vt_rows(ops: KernelOperands) -> torch.Tensor:
    """V^T as the (B*Hkv*D, keys) matrix the TMA descriptors cover, each row its stored
    keys padded with zeros to whole tiles (needs `tma_loadable`)."""
    rows = ops.vt.stride(2)
    return ops.vt.as_strided((ops.vt.shape[0] * ops.vt.shape[1] * ops.vt.shape[2], rows), (rows, 1))
