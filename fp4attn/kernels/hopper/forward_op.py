"""The Hopper forward as a registered custom op (with a fake implementation, so
torch.compile traces through it), and the recipe -> kernel-flag mapping.

The op takes the bf16/fp16/fp32 inputs and quantizes them inside: the operand
quantizers are bit-exact definitions, and letting the compiler fuse them changed their
rounding (torch.compile gave different codes than eager; docs/notes/hopper-forward.md).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fp4attn.kernels.hopper.forward_triton import attn_fwd_kernel
from fp4attn.kernels.hopper.operands import (
    BLOCK_N,
    KernelOperands,
    padded_vt_rows,
    prepare_operands_fused,
    tma_loadable,
)
from fp4attn.kernels.placeholders import nothing
from fp4attn.recipes import Recipe
from fp4attn.reference.forward import LOG2E, key_bias_of_mask  # noqa: F401  (the launchers' key bias)
from fp4attn.routing import (
    ForwardKernel,
    ForwardPlan,
    PMode,
    forward_launch,
    hopper_forward_plan,
    hopper_robust_unsupported,
    interpreting,
    p_sink_tiles,
)
from fp4attn.routing import p_mode as _p_mode


def tma_descriptors(ops: KernelOperands) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Host-built TMA descriptors of K, (B*Hkv*Sk, D) in tiles of (BLOCK_N, D), and of
    V^T, (B*Hkv*D, keys) in tiles of (D, BLOCK_N); None where the operands do not allow
    them (TMA needs contiguous rows with 16-byte strides, and V^T padded to whole tiles
    so that no tile reads past its head's keys)."""
    if not tma_loadable(ops):
        return None
    B, Hkv, Sk, D = ops.k.shape
    k2, vt2 = ops.k.view(B * Hkv * Sk, D), padded_vt_rows(ops)
    return (TensorDescriptor(k2, list(k2.shape), [D, 1], [BLOCK_N, D]),
            TensorDescriptor(vt2, list(vt2.shape), [vt2.shape[1], 1], [D, BLOCK_N]))


def forward_plan(ops: KernelOperands, *, causal_offset: int | None, p_mode: int, write_p: int = 0,
                 key_bias: torch.Tensor | None = None, training: bool = False) -> ForwardPlan:
    """The routing's plan for a forward on these operands (`routing.hopper_forward_plan`
    of their head dim, Q/K dtype, lengths, device and layout, and of the call)."""
    q, k = ops.q, ops.k
    return hopper_forward_plan(head_dim=q.shape[3], qk_fp8=q.dtype == torch.float8_e4m3fn, p_mode=p_mode,
                               causal=causal_offset is not None, keys=k.shape[2], queries=q.shape[2],
                               key_bias=key_bias is not None, write_p=bool(write_p), training=training,
                               on_cuda=q.is_cuda, kv_tma=tma_loadable(ops), q_contiguous=q.is_contiguous(),
                               interpreter=interpreting())


def launch_forward(ops: KernelOperands, *, scale: float, causal_offset: int | None, p_mode: int,
                   write_p: int = 0, key_bias: torch.Tensor | None = None, sink_tiles: int = 0,
                   training: bool = False, plan: ForwardPlan | None = None):
    """Run the kernel the plan names on prepared operands: (out bf16, lse fp32, debug
    fp32 or empty).

    write_p: 0 nothing extra; 1 also every P tile's values (times 2**8, exact e4m3
    values; tests, on the Triton kernel). key_bias: (B, Sk) float32 added to the log2
    scores (`key_bias_of_mask`). sink_tiles: with p_mode 3, the first key tiles that
    keep the blocks' top keys apart, the others plain Direct-P (`routing.p_sink_tiles`);
    0, every tile. training: the training forward, which never takes the CUDA C++ kernel.
    plan: the `routing.ForwardPlan` to run (tests, measurements: one kernel forced);
    by default `forward_plan` of these operands. A plan is executed as it says: one
    made for another call (P mode, masking, debug tiles, key bias, training), or a CUDA
    C++ plan on operands that kernel cannot run, raises.
    """
    if sink_tiles and p_mode != PMode.MXFP4_DIRECTP_SINK:
        raise ValueError(f"launch_forward: sink_tiles={sink_tiles} is for p_mode 3 (p_sink), got p_mode={p_mode}")
    if ops.vt_keys_padded and ops.vt.stride(2) % BLOCK_N:
        raise ValueError(f"launch_forward: V^T marked as padded to whole key tiles, but its rows hold "
                         f"{ops.vt.stride(2)} keys, not a multiple of {BLOCK_N}")
    if plan is None:
        plan = forward_plan(ops, causal_offset=causal_offset, p_mode=p_mode, write_p=write_p, key_bias=key_bias,
                            training=training)
    else:
        planned = (int(plan.p_mode), plan.causal, plan.write_p, plan.key_bias, plan.training)
        given = (int(p_mode), causal_offset is not None, bool(write_p), key_bias is not None, training)
        if planned != given:
            raise ValueError(f"launch_forward: the plan is for another call: (p_mode, causal, write_p, key_bias, "
                             f"training) {planned}, this call's {given}")
    if plan.kernel is ForwardKernel.CUDA:
        return _run_cuda(plan, ops, scale, causal_offset, key_bias)
    if plan.kernel is ForwardKernel.GLUON_WS:
        return _run_gluon_ws(plan, ops, scale, causal_offset)
    return _run_triton(plan, ops, scale, causal_offset, write_p, key_bias, sink_tiles)


def _no_debug(q: torch.Tensor) -> torch.Tensor:
    return nothing(q.device, torch.float32, 4)


def _run_cuda(plan: ForwardPlan, ops: KernelOperands, scale: float, causal_offset: int | None, key_bias):
    """The CUDA C++ kernel (FlashAttention-3's schedule), its build by P mode
    (`forward_cuda.P_MODE_BUILDS`); imported here: only this path needs NVRTC."""
    from fp4attn.kernels.hopper.forward_cuda import (
        P_MODE_BUILDS,
        cuda_unsupported_reason,
        launch_forward_cuda,
    )

    why = cuda_unsupported_reason(ops, causal_offset=causal_offset, key_bias=key_bias)
    if why is not None:
        raise ValueError(f"launch_forward: the plan runs the CUDA C++ kernel, which cannot run these operands: {why}")
    out, lse = launch_forward_cuda(ops, scale=scale, causal_offset=causal_offset, key_bias=key_bias,
                                   persistent=plan.launch.cuda_persistent, **P_MODE_BUILDS[plan.p_mode])
    return out, lse, _no_debug(ops.q)


def _run_gluon_ws(plan: ForwardPlan, ops: KernelOperands, scale: float, causal_offset: int | None):
    """The Gluon warp-specialized kernel: the Triton kernel's arithmetic (pv_add), no debug
    tiles or key bias (imported here: only this path needs Triton's Gluon frontend)."""
    from fp4attn.kernels.hopper.forward_gluon_ws import launch_forward_ws

    launch = plan.launch
    out, lse = launch_forward_ws(ops, scale=scale, causal_offset=causal_offset, p_mode=plan.p_mode,
                                 p_hw_cvt=launch.p_hw_cvt, stages=launch.stages, overlap=launch.ws_overlap)
    return out, lse, _no_debug(ops.q)


def _run_triton(plan: ForwardPlan, ops: KernelOperands, scale: float, causal_offset: int | None, write_p: int,
                key_bias, sink_tiles: int):
    """The Triton kernel, every P mode, with debug tiles and a key bias where asked."""
    q, k = ops.q, ops.k
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    cfg = plan.launch
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    sq_pad = triton.cdiv(Sq, cfg.block_m) * cfg.block_m
    # never touched without write_p: no storage (its strides 1, as the JIT specializes them)
    dbg = torch.zeros((B, H, sq_pad, Sk), device=q.device, dtype=torch.float32) if write_p else _no_debug(q)
    grid = (triton.cdiv(Sq, cfg.block_m), B * H)
    kb = key_bias.contiguous() if key_bias is not None else lse  # never read without KEY_BIAS
    descs = tma_descriptors(ops) if plan.tma_kv else (None, None)
    if descs is None:
        raise ValueError("launch_forward: the plan reads K and V^T by TMA, which these operands do not allow "
                         "(operands.tma_loadable)")
    attn_fwd_kernel[grid](
        q, k, ops.qs, ops.ks, ops.vt, ops.vs, out, lse, dbg, kb, *descs,
        q.stride()[:3], k.stride()[:3], ops.vt.stride()[:3], out.stride()[:3], dbg.stride()[:3],
        (H, H // Hkv, Sq, Sk, causal_offset or 0, scale * LOG2E),
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=BLOCK_N,
        QK_FP8=q.dtype == torch.float8_e4m3fn, P_MODE=int(plan.p_mode), CAUSAL=causal_offset is not None,
        WRITE_P=int(write_p), KEY_BIAS=key_bias is not None, P_HW_CVT=cfg.p_hw_cvt,
        VT_PADDED=ops.vt_keys_padded, TMA_KV=plan.tma_kv, PV_ADD=cfg.pv_add, SINK_TILES=sink_tiles,
        num_warps=cfg.warps, num_stages=plan.stages,
    )
    return out, lse, dbg


def _forward(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None, write_p: int, key_bias,
             head_dim: int | None):
    """The op's work: the operands from the fused quantizers, then the planned kernel."""
    ops = prepare_operands_fused(q, k, v, recipe, scale=scale, head_dim=head_dim)
    return launch_forward(ops, scale=scale, causal_offset=causal_offset, p_mode=_p_mode(recipe), write_p=write_p,
                          key_bias=key_bias, sink_tiles=p_sink_tiles(recipe))


@functools.lru_cache(maxsize=256)
def op_recipe(*, fallback_logit_std: float = 0.0, grad: str = "", **fields) -> Recipe:
    """The `Recipe` the forward op rebuilds from its flat arguments: fallback_logit_std 0 is no
    Q/K fallback, grad "" none."""
    if fallback_logit_std:
        fields.update(qk_fallback="fp8", qk_fallback_logit_std=fallback_logit_std)
    return Recipe(**fields, grad=grad or None)


# torch.compile traces the op through its fake implementation; an eager call runs `_forward`
# (`hopper_attention`)
@torch.library.custom_op("fp4attn::hopper_attention", mutates_args=())
def _hopper_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, p: str, p_build: str, v_fmt: str, fast_accum: bool,
    causal_offset: int, causal: bool, scale: float, write_p: int, key_bias: Optional[torch.Tensor],
    smooth_k: bool = False, four_over_six: bool = False, fallback_logit_std: float = 0.0, p_sink: bool = False,
    p_sink_keys: int = 0, head_dim: int = 0, k_scale: str = "token", rescale: str = "exact", grad: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The robust fields the kernels apply (`HOPPER_ROBUST_FIELDS`): fallback_logit_std
    0 is no Q/K fallback; head_dim the caller's head dim where q and k are zero-padded
    (0: theirs), which the fallback's statistic divides by; k_scale and rescale
    `Recipe.k_scale` and `Recipe.rescale`; grad `Recipe.grad` ("" for None), which decides the
    trained affine P (a training recipe's forward without gradients builds its P as with them)."""
    recipe = op_recipe(qk=qk, p=p, v=v_fmt, p_build=p_build, fast_accum=fast_accum, smooth_k=smooth_k,
                       qk_four_over_six=four_over_six, p_sink=p_sink, p_sink_keys=p_sink_keys, k_scale=k_scale,
                       rescale=rescale, fallback_logit_std=fallback_logit_std, grad=grad)
    return _forward(q, k, v, recipe, scale=scale, causal_offset=causal_offset if causal else None, write_p=write_p,
                    key_bias=key_bias, head_dim=head_dim or None)


@_hopper_attention_op.register_fake
def _(q, k, v, qk, p, p_build, v_fmt, fast_accum, causal_offset, causal, scale, write_p, key_bias, smooth_k=False,
      four_over_six=False, fallback_logit_std=0.0, p_sink=False, p_sink_keys=0, head_dim=0, k_scale="token",
      rescale="exact", grad=""):
    B, H, Sq, D = q.shape
    block_m = forward_launch(D, fast_accum, causal).block_m
    sq_pad = math.ceil(Sq / block_m) * block_m
    dbg_shape = (B, H, sq_pad, k.shape[2]) if write_p else (0, 1, 1, 1)
    return (q.new_empty((B, H, Sq, D), dtype=torch.bfloat16), q.new_empty((B, H, Sq), dtype=torch.float32),
            q.new_empty(dbg_shape, dtype=torch.float32))


def hopper_attention(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None, write_p: int = 0,
                     key_bias: torch.Tensor | None = None, head_dim: int | None = None):
    """Quantize bf16/fp16/fp32 (B, H, S, D) inputs into the kernel layouts and run the
    forward: (out bf16, lse fp32, debug tile or empty; see `launch_forward`). A recipe
    with robust fields the kernels do not apply is refused (`hopper_robust_unsupported`),
    never run as another recipe. `head_dim`: the caller's, where the inputs are
    zero-padded to D (the Q/K fallback's statistic is the unpadded inputs')."""
    reason = hopper_robust_unsupported(recipe)
    if reason is not None:
        raise ValueError(f"hopper_attention: {reason}; the reference runs it")
    if not torch.compiler.is_compiling():
        # eager: the op's body directly, with the recipe as given (the op's own dispatch and
        # the recipe rebuilt from flat arguments cost ~40 us of host a call, on calls whose
        # kernels take ~0.5 ms: `decode_op.hopper_decode` does the same)
        return _forward(q, k, v, recipe, scale=scale, causal_offset=causal_offset, write_p=int(write_p),
                        key_bias=key_bias, head_dim=head_dim)
    return _hopper_attention_op(q, k, v, recipe.qk, recipe.p, recipe.p_build, recipe.v, recipe.fast_accum,
                                causal_offset or 0, causal_offset is not None, scale, int(write_p), key_bias,
                                recipe.smooth_k, recipe.qk_four_over_six,
                                recipe.qk_fallback_logit_std if recipe.qk_fallback else 0.0, recipe.p_sink,
                                recipe.p_sink_keys, head_dim or 0, recipe.k_scale, recipe.rescale, recipe.grad or "")
