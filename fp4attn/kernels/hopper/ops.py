"""The Hopper forward as a registered custom op (with a fake implementation, so
torch.compile can trace through it), and the recipe -> kernel-flag mapping."""

from __future__ import annotations

import math

import torch
import triton

from fp4attn.kernels.hopper.forward import attn_fwd_kernel
from fp4attn.kernels.hopper.operands import prepare_operands
from fp4attn.recipes import Recipe
from fp4attn.reference.forward import LOG2E

P_MODES = {("fp8", "exp2"): 0, ("mxfp4", "directp"): 1, ("mxfp4", "exp2"): 2}
BLOCK_M = 128
BLOCK_N = 128  # equals Recipe.block_n of every preset: the tile is part of the numerics
HEAD_DIMS = (64, 128)


def unsupported_reason(recipe: Recipe, head_dim: int) -> str | None:
    """Why the Hopper kernel cannot run `recipe` at `head_dim`, or None if it can."""
    if recipe.qk not in ("fp8", "nvfp4"):
        return f"Q/K format {recipe.qk!r} (kernels run 'fp8' and 'nvfp4')"
    if (recipe.p, recipe.p_build) not in P_MODES:
        return f"P {recipe.p!r} built by {recipe.p_build!r} (kernels run {sorted(P_MODES)})"
    if recipe.v not in ("fp8", "mxfp4"):
        return f"V format {recipe.v!r} (kernels run 'fp8' and 'mxfp4')"
    if not recipe.consistent_norm:
        return "consistent_norm=False (kernels sum the represented P values)"
    if recipe.block_n != BLOCK_N:
        return f"block_n={recipe.block_n} (kernels tile {BLOCK_N} keys)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernels run {HEAD_DIMS})"
    return None


@torch.library.custom_op("fp4attn::hopper_fwd", mutates_args=())
def hopper_fwd(
    q: torch.Tensor, k: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, vt: torch.Tensor, vs: torch.Tensor,
    causal_offset: int, causal: bool, scale: float, p_mode: int, write_p: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out bf16 (B, H, Sq, D), lse fp32 (B, H, Sq), debug fp32 (B, H, Sq_pad, Sk) or empty)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    sq_pad = triton.cdiv(Sq, BLOCK_M) * BLOCK_M
    p_dbg = torch.zeros((B, H, sq_pad, Sk) if write_p else (1, 1, 1, 1), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(Sq, BLOCK_M), B * H)
    attn_fwd_kernel[grid](
        q, k, qs, ks, vt, vs, out, lse, p_dbg,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        vt.stride(0), vt.stride(1), vt.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        p_dbg.stride(0), p_dbg.stride(1), p_dbg.stride(2),
        H, H // Hkv, Sq, Sk, causal_offset, scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        QK_FP8=q.dtype == torch.float8_e4m3fn, P_MODE=p_mode, CAUSAL=causal, WRITE_P=int(write_p),
        num_warps=8, num_stages=3,
    )
    return out, lse, p_dbg if write_p else p_dbg[:0]


@hopper_fwd.register_fake
def _(q, k, qs, ks, vt, vs, causal_offset, causal, scale, p_mode, write_p):
    B, H, Sq, D = q.shape
    sq_pad = math.ceil(Sq / BLOCK_M) * BLOCK_M
    p_shape = (B, H, sq_pad, k.shape[2]) if write_p else (0, 1, 1, 1)
    return (q.new_empty((B, H, Sq, D), dtype=torch.bfloat16), q.new_empty((B, H, Sq), dtype=torch.float32),
            q.new_empty(p_shape, dtype=torch.float32))


def hopper_attention(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None, write_p: int = 0):
    """Quantize the bf16/fp16/fp32 inputs into the kernel layouts and run the forward.

    write_p: 0 nothing extra; 1 also return every P tile's values (times 2**8, so
    exact e4m3 values; tests); 2 the log2 scores (diagnostics)."""
    ops = prepare_operands(q, k, v, recipe)
    return hopper_fwd(ops.q, ops.k, ops.qs, ops.ks, ops.vt, ops.vs, causal_offset or 0, causal_offset is not None,
                      scale, P_MODES[(recipe.p, recipe.p_build)], int(write_p))
