"""The Blackwell forward as a registered custom op (with a fake implementation, so
torch.compile traces through it): quantize with the reference quantizers, launch
`forward_triton.attn_fwd_sm100_kernel`.

Under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) the kernel runs without
its inline PTX (`HW_CVT` off: the same bytes by integer arithmetic); the interpreter
also needs the block-scaled product it lacks (tests/interpreter_blackwell.py).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton

from fp4attn.kernels.blackwell.forward_triton import attn_fwd_sm100_kernel
from fp4attn.kernels.blackwell.operands import BLOCK_N, BlackwellOperands, prepare_operands
from fp4attn.recipes import Recipe, robust_unsupported_reason
from fp4attn.reference.forward import LOG2E
from fp4attn.routing import BLACKWELL_FORWARD_ROBUST_FIELDS, blackwell_forward_launch, interpreting, target_of


@contextlib.contextmanager
def _descriptor_scratch(device: torch.device):
    """The global memory the pipelined kernel's on-device TMA descriptors are written to
    (128 bytes each, per program), from torch's allocator on `device`, for this launch
    only: Triton asks its allocator for it at launch (`triton.set_allocator` would
    replace a caller's allocator for good, so the context's is set and restored)."""
    from triton.runtime import _allocation

    token = _allocation._allocator.set(
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def launch_forward(ops: BlackwellOperands, *, scale: float, causal_offset: int | None,
                   key_bias: torch.Tensor | None = None, write_p: bool = False, p_affine: bool = False):
    """Run the kernel on prepared operands: (out bf16, lse fp32, P tile or empty).

    write_p: also every P tile's represented values, float32 (B, H, Sq padded to
    BLOCK_M, Sk) (tests). key_bias: (B, Sk) float32 added to the log2 scores
    (`reference.forward.key_bias_of_mask`). p_affine: P by the affine map
    (`Recipe.p_build == "affine"`), else Direct-P (MXFP4 P) or exp2 (FP8 P)."""
    q, k = ops.q, ops.k
    B, H, Sq = q.shape[:3]
    Hkv, Sk = k.shape[1], k.shape[2]
    D = ops.v.shape[2]
    cfg = blackwell_forward_launch(D, causal_offset is not None, key_bias is not None, target_of(q.device))
    dev = q.device
    out = torch.empty((B, H, Sq, D), device=dev, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=dev, dtype=torch.float32)
    sq_pad = triton.cdiv(Sq, cfg.block_m) * cfg.block_m
    dbg = (torch.zeros((B, H, sq_pad, Sk), device=dev, dtype=torch.float32) if write_p else
           torch.empty((1, 1, 1, 1), device=dev, dtype=torch.float32))
    # arguments a recipe does not read get a tensor of the right type, never loaded
    q_sc = ops.q_sc if ops.q_sc is not None else torch.empty((1, 1, 1, 1), device=dev, dtype=torch.float8_e4m3fn)
    k_sc = ops.k_sc if ops.k_sc is not None else q_sc
    v_sc = ops.v_sc if ops.v_sc is not None else torch.empty((1, 1, 1, 1), device=dev, dtype=torch.uint8)
    vs = ops.vs if ops.vs is not None else lse
    kb = key_bias.contiguous() if key_bias is not None else lse
    grid = (triton.cdiv(Sq, cfg.block_m), B * H)
    # the pipelined kernel at D=128 (TMA_HEAD_DIM) loads K and V by TMA from descriptors
    # it builds; Triton calls the allocator only for a build that has them (the
    # interpreter reads them as blocks of the tensors and needs no memory for them)
    scratch = _descriptor_scratch(dev) if cfg.pipelined and not interpreting() else contextlib.nullcontext()
    with scratch:
        attn_fwd_sm100_kernel[grid](
            q, q_sc, k, k_sc, ops.qs, ops.ks, ops.v, v_sc, vs, out, lse, dbg, kb,
            q.stride()[:3], q_sc.stride()[:3], k.stride()[:3], k_sc.stride()[:3], ops.v.stride()[:3],
            v_sc.stride()[:3], out.stride()[:3], dbg.stride()[:3],
            (H, H // Hkv, Sq, Sk, causal_offset or 0, scale * LOG2E),
            HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=BLOCK_N, QK_FP4=ops.qk_fp4, PV_FP4=ops.pv_fp4,
            CAUSAL=causal_offset is not None, HW_CVT=not interpreting(), KEY_BIAS=key_bias is not None,
            WRITE_P=write_p, PIPELINED=cfg.pipelined, P_AFFINE=p_affine, num_warps=cfg.warps,
            num_stages=cfg.stages,
        )
    return out, lse, dbg if write_p else dbg[:0]


@torch.library.custom_op("fp4attn::blackwell_attention", mutates_args=())
def _blackwell_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, p: str, p_build: str, v_fmt: str,
    causal_offset: int, causal: bool, scale: float, write_p: bool, key_bias: Optional[torch.Tensor],
    smooth_k: bool = False, rotate_qk: str = "", four_over_six: bool = False, head_dim: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_dim: the caller's, where q and k are zero-padded (0: theirs; `prepare_operands`)."""
    recipe = Recipe(qk=qk, p=p, v=v_fmt, p_build=p_build, smooth_k=smooth_k, rotate_qk=rotate_qk or None,
                    qk_four_over_six=four_over_six)
    ops, scale = prepare_operands(q, k, v, recipe, scale, head_dim or None)
    return launch_forward(ops, scale=scale, causal_offset=causal_offset if causal else None, key_bias=key_bias,
                          write_p=write_p, p_affine=p_build == "affine")


@_blackwell_attention_op.register_fake
def _(q, k, v, qk, p, p_build, v_fmt, causal_offset, causal, scale, write_p, key_bias, smooth_k=False, rotate_qk="",
      four_over_six=False, head_dim=0):
    B, H, Sq, D = q.shape
    block_m = blackwell_forward_launch(D, causal, key_bias is not None, target_of(q.device)).block_m
    sq_pad = -(-Sq // block_m) * block_m
    dbg_shape = (B, H, sq_pad, k.shape[2]) if write_p else (0, 1, 1, 1)
    return (q.new_empty((B, H, Sq, D), dtype=torch.bfloat16), q.new_empty((B, H, Sq), dtype=torch.float32),
            q.new_empty(dbg_shape, dtype=torch.float32))


def blackwell_attention(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None,
                        key_bias: torch.Tensor | None = None, write_p: bool = False, head_dim: int | None = None):
    """Quantize bf16/fp16/fp32 (B, H, S, D) inputs (D 64 or 128) and run the Blackwell
    forward: (out bf16, lse fp32, P tile or empty; see `launch_forward`). Of the robust
    fields it applies those of `routing.BLACKWELL_FORWARD_ROBUST_FIELDS` (in the
    quantizers) and refuses the others, never running another recipe. `head_dim`: the
    caller's, where the inputs are zero-padded to D (the rotation is that head dim's)."""
    reason = robust_unsupported_reason(recipe, BLACKWELL_FORWARD_ROBUST_FIELDS)
    if reason is not None:
        raise ValueError(f"blackwell_attention: {reason}; the reference runs it")
    return _blackwell_attention_op(q, k, v, recipe.qk, recipe.p, recipe.p_build, recipe.v, causal_offset or 0,
                                   causal_offset is not None, scale, bool(write_p), key_bias, recipe.smooth_k,
                                   recipe.rotate_qk or "", recipe.qk_four_over_six, head_dim or 0)
