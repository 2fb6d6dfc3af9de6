"""The Hopper forward as a registered custom op (with a fake implementation, so
torch.compile traces through it), and the recipe -> kernel-flag mapping.

The op takes the bf16/fp16/fp32 inputs and quantizes them inside: the operand
quantizers are bit-exact definitions, and letting the compiler fuse them changed their
rounding (torch.compile gave different codes than eager; docs/notes/hopper-forward.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fp4attn.kernels.hopper.forward import attn_fwd_kernel
from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands, padded_vt_rows, tma_loadable
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import Recipe
from fp4attn.reference.forward import LOG2E, log2_bias
from fp4attn.reference.masks import key_mask_view

# the warp-specialized kernel's layout where it runs: one consumer warpgroup and the
# producer warp per 64-row program, two programs per SM (forward_pipelined.ws_launch;
# h200-forward-ws-2.txt: 536 TFLOP/s against 455-468 for 128-row programs); its OVERLAP
# is `ForwardLaunch.ws_overlap`
WS_PARTITIONS = 2
P_MODES = {("fp8", "exp2"): 0, ("mxfp4", "directp"): 1, ("mxfp4", "exp2"): 2}
# "block_m,warps,stages[,p_hw_cvt[,rowsum_mma[,tma_kv[,pv_add[,warp_specialized[,ws_overlap]]]]]]"
LAUNCH_ENV = "FP4ATTN_FORWARD_LAUNCH"


@dataclass(frozen=True)
class ForwardLaunch:
    """Launch shape and code variant of the forward; speed only (query rows are
    independent, so BLOCK_M changes no value; p_hw_cvt rounds FP8 P by the packed
    hardware conversion, RNE as the bit arithmetic it replaces; rowsum_mma sums each P
    tile's rows on the tensor cores, as the PV product sums them, instead of in float32
    on the CUDA cores: docs/numerics.md; tma_kv loads K and V^T tiles by TMA, where the
    operands allow it: `tma_descriptors`; pv_add adds each tile's PV into O by a float32
    addition of its own, which lets ptxas chain the wgmmas, instead of through Triton's
    promotion; warp_specialized runs the FP8-P recipes on the Gluon kernel
    `forward_pipelined.attn_fwd_ws_kernel` instead, 64-row programs of one consumer
    warpgroup and a producer warp, with pv_add's arithmetic: bit-identical outputs;
    ws_overlap its OVERLAP, where the next tile's QK^T is issued: 1 beside PV, 4 before
    the softmax)."""

    block_m: int = 128
    warps: int = 8
    stages: int = 3
    p_hw_cvt: bool = False
    rowsum_mma: bool = False
    tma_kv: bool = False
    pv_add: bool = False
    warp_specialized: bool = False
    ws_overlap: int = 1


# Measured at (8,16,4096,128) and (16,16,2048,64), kernel alone, TFLOP/s
# (benchmarks/results/h200-forward-launch*.txt). 64-row programs of 4 warps run two per
# SM (255 registers each), so one program's softmax overlaps the other's products:
# 128 rows -> 64 rows took fp8 287 -> 409, nvfp4-fp8 369 -> 379, fp8-directp 148 -> 173.
# Rounding FP8 P by the packed hardware conversion (p_hw_cvt) then took nvfp4-fp8 379 -> 432
# and fp8 409 -> 481. With each tile's PV added into O in float32 (the kernel's default
# since h200-forward-launch-4.txt) the hardware conversion and 2 stages win at D=128 in
# every case, causal fp8 included (378 bit arithmetic -> 419), and 3 stages at D=64
# (fp8 298 -> 333, nvfp4-fp8 268 -> 307). K and V^T by TMA (h200-forward-tma.txt, 2
# stages) then took the bf16-QK^T kernels at (8,16,4096,128) from 372 to 450 (fp8,
# nvfp4-fp8; causal 348 -> 413, directp causal 240 -> 265) and at (4,16,8192,64) from
# 330 to 366 (directp 144 -> 172), but the FP8-QK^T ones down (fp8-fastacc 478 -> 339:
# 200 spill bytes instead of 152). Adding each tile's PV into O by a float32 addition of
# its own (pv_add) lets ptxas chain the bf16-QK^T kernels' wgmmas (h200-forward-pv-add.txt,
# (8,16,4096,128): nvfp4-fp8 456 -> 497, causal 416 -> 447, directp 270 -> 288). At D=64
# it raises registers from 168 to 200-210 and gains nothing (h200-forward-d64-pv-add.txt:
# fp8 at (16,16,2048,64) 341 -> 343, causal 282 -> 238), so D=64 keeps Triton's
# promotion. The warp-specialized Gluon kernel (h200-forward-ws-2.txt) then took FP8 P
# at (8,16,4096,128) from 494 to 536 (causal 447 -> 478) and lost on Direct-P (286 ->
# 270) and at D=64 (nvfp4-fp8 341 -> 327), so it runs FP8 P at D=128 only. With QK^T on
# the FP8 tensor cores summed by the tensor core alone (the `fast_accum` recipes, no
# promotion: the Gluon kernel then compiles as with bf16 QK^T) it took fp8-fastacc at
# D=128 from 450-505 (Triton, promoted) to 616-656 TFLOP/s, causal 366-486 -> 543-623
# (h200-forward-fastacc.txt); at D=64 the Triton kernel stays ahead (392 against 364).
# Unpromoted it no longer spills, and at D=64 causal K and V^T by TMA then gain
# (h200-forward-d64-fastacc.txt: fp8-fastacc 286 -> 318 at (16,16,2048,64), 344 -> 378 at
# (4,16,8192,64); fp8-directp-fastacc 147 -> 146, 168 -> 166), non-causal they lose
# (392 -> 368, 412 -> 390). The next tile's QK^T issued before the softmax instead of
# beside PV (ws_overlap 4, h200-forward-ws-overlap4.txt, (8,16,4096,128) /
# (2,16,16384,128) / (4,32,4096,128)): bf16 QK^T causal +4-8% (fp8 489 -> 529, 536 -> 569,
# 478 -> 496), non-causal 0-2% (nvfp4-fp8 +1-10%); e4m3 QK^T causal +3-5% (fp8-fastacc
# 548 -> 574, 616 -> 633, 543 -> 559), non-causal -7-8% (646 -> 594): its QK^T hides
# less (half the tensor time) than the 64 register moves per tile and the last tile's
# repeated product cost. Keyed by (head dim, QK^T on the FP8 tensor cores, causal).
DEFAULT_LAUNCH = {
    (128, True, False): ForwardLaunch(64, 4, 2, True, warp_specialized=True),
    (128, True, True): ForwardLaunch(64, 4, 2, True, warp_specialized=True, ws_overlap=4),
    (64, True, False): ForwardLaunch(64, 4, 3, True),
    (64, True, True): ForwardLaunch(64, 4, 3, True, tma_kv=True),
    **{(128, False, causal): ForwardLaunch(64, 4, 2, True, tma_kv=True, pv_add=True, warp_specialized=True,
                                           ws_overlap=4) for causal in (True, False)},
    **{(64, False, causal): ForwardLaunch(64, 4, 2, True, tma_kv=True) for causal in (True, False)},
}


def forward_launch(head_dim: int, qk_fp8: bool, causal: bool) -> ForwardLaunch:
    """The launch shape for this head dim, Q/K format and masking, or the one
    FP4ATTN_FORWARD_LAUNCH names."""
    spec = os.environ.get(LAUNCH_ENV)
    if not spec:
        return DEFAULT_LAUNCH[head_dim, qk_fp8, causal]
    try:
        fields = [int(x) for x in spec.split(",")]
        block_m, warps, stages = fields[:3]
        flags = (fields[3:] + [0] * 5)[:5]
        overlap = fields[8] if len(fields) == 9 else 1
        if len(fields) > 9:
            raise ValueError
    except ValueError as e:
        raise ValueError(f"{LAUNCH_ENV}={spec!r}: expected "
                         "'block_m,warps,stages[,p_hw_cvt[,rowsum_mma[,tma_kv[,pv_add[,warp_specialized"
                         "[,ws_overlap]]]]]]', "
                         "e.g. '64,4,2' or '64,4,2,1,0,1,1'") from e
    if (block_m not in (64, 128) or warps not in (4, 8) or not 1 <= stages <= 4 or set(flags) - {0, 1}
            or overlap not in (0, 1, 4)):
        raise ValueError(f"{LAUNCH_ENV}={spec!r}: block_m 64 or 128, warps 4 or 8, stages 1-4, p_hw_cvt, "
                         "rowsum_mma, tma_kv, pv_add and warp_specialized 0 or 1, ws_overlap 0, 1 or 4")
    return ForwardLaunch(block_m, warps, stages, *(bool(f) for f in flags), ws_overlap=overlap)


HEAD_DIMS = (64, 128)


def kernel_head_dim(head_dim: int) -> int | None:
    """The kernel head dim that runs `head_dim`: itself (64, 128), or for a smaller
    multiple of 16 the next one up, the inputs zero-padded. Padding is exact in every
    recipe: zero channels add nothing to a score, leave NVFP4's tensor amax, FP8's
    per-token amax and MXFP4 V's window unchanged, and come out as zero columns. None
    above 128."""
    if head_dim % 16:
        return None
    return next((d for d in HEAD_DIMS if head_dim <= d), None)


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
    if kernel_head_dim(head_dim) is None:
        return f"head_dim {head_dim} (kernels run multiples of 16 up to {HEAD_DIMS[-1]}; below 64 and 128 zero-padded)"
    return None


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


def launch_forward(ops: KernelOperands, *, scale: float, causal_offset: int | None, p_mode: int,
                   write_p: int = 0, qk_promote: int = 0, pv_promote: bool = True,
                   key_bias: torch.Tensor | None = None):
    """Run the kernel on prepared operands: (out bf16, lse fp32, debug fp32 or empty).

    write_p: 0 nothing extra; 1 also every P tile's values (times 2**8, exact e4m3
    values; tests); 2 the log2 scores (diagnostics). key_bias: (B, Sk) float32 added to
    the log2 scores (`key_bias_of_mask`). qk_promote: fp8 QK^T products accumulated on
    the tensor cores before each float32 addition (0: all of them, the `fast_accum`
    recipes' definition; 32, Triton kernel only: a diagnostic);
    pv_promote: each tile's PV product added into O in float32 (False, a diagnostic:
    O accumulates on the tensor cores).
    """
    q, k = ops.q, ops.k
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    qk_fp8 = q.dtype == torch.float8_e4m3fn
    if ops.vt_keys_padded and ops.vt.stride(2) % BLOCK_N:
        raise ValueError(f"launch_forward: V^T marked as padded to whole key tiles, but its rows hold "
                         f"{ops.vt.stride(2)} keys, not a multiple of {BLOCK_N}")
    cfg = forward_launch(D, qk_fp8, causal_offset is not None)
    if (cfg.warp_specialized and p_mode == 0 and not (qk_fp8 and qk_promote) and pv_promote and not write_p
            and key_bias is None and tma_loadable(ops) and q.is_contiguous()):
        # the Gluon kernel: the Triton kernel's arithmetic (pv_add), no debug tiles or key
        # bias, no promotion of e4m3 QK^T (with it ptxas serializes the kernel's wgmmas,
        # C7511; imported here: only this path needs Triton's Gluon frontend)
        from fp4attn.kernels.hopper.forward_pipelined import launch_forward_pipelined

        out, lse = launch_forward_pipelined(ops, scale=scale, causal_offset=causal_offset, p_mode=p_mode,
                                            p_hw_cvt=cfg.p_hw_cvt, warp_specialized=True, partitions=WS_PARTITIONS,
                                            stages=cfg.stages, overlap=cfg.ws_overlap, qk_promote=qk_promote)
        return out, lse, torch.empty((0, 1, 1, 1), device=q.device, dtype=torch.float32)
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    sq_pad = triton.cdiv(Sq, cfg.block_m) * cfg.block_m
    # never touched without write_p: allocated, not filled (a fill is one more launch per call)
    dbg = (torch.zeros((B, H, sq_pad, Sk), device=q.device, dtype=torch.float32) if write_p else
           torch.empty((1, 1, 1, 1), device=q.device, dtype=torch.float32))
    grid = (triton.cdiv(Sq, cfg.block_m), B * H)
    kb = key_bias.contiguous() if key_bias is not None else lse  # never read without KEY_BIAS
    descs = tma_descriptors(ops) if cfg.tma_kv else None
    attn_fwd_kernel[grid](
        q, k, ops.qs, ops.ks, ops.vt, ops.vs, out, lse, dbg, kb, *(descs or (None, None)),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        ops.vt.stride(0), ops.vt.stride(1), ops.vt.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        dbg.stride(0), dbg.stride(1), dbg.stride(2),
        H, H // Hkv, Sq, Sk, causal_offset or 0, scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=BLOCK_N,
        QK_FP8=qk_fp8, P_MODE=p_mode, CAUSAL=causal_offset is not None,
        WRITE_P=int(write_p), QK_PROMOTE=qk_promote, KEY_BIAS=key_bias is not None, P_HW_CVT=cfg.p_hw_cvt,
        ROWSUM_MMA=cfg.rowsum_mma, PV_PROMOTE=pv_promote, VT_PADDED=ops.vt_keys_padded, TMA_KV=descs is not None,
        PV_ADD=cfg.pv_add,
        # the debug tile goes through shared memory: one stage less keeps it in 227 KB
        num_warps=cfg.warps, num_stages=min(cfg.stages, 2) if write_p else cfg.stages,
    )
    return out, lse, dbg if write_p else dbg[:0]


def key_bias_of_mask(attn_mask: torch.Tensor, batch: int, sk: int) -> torch.Tensor | None:
    """An SDPA attn_mask that depends on the batch and the key only (`key_mask_view`:
    key padding) as the (B, Sk) log2-unit bias the kernel adds, computed by the
    reference's own `log2_bias`; None for any other mask."""
    key_mask = key_mask_view(attn_mask)
    if key_mask is None:
        return None
    bias = log2_bias(key_mask, sk, 1)  # (b, 1, 1, Sk), padded by 0 keys
    return bias.expand(batch, 1, 1, sk).reshape(batch, sk).float().contiguous()


@torch.library.custom_op("fp4attn::hopper_attention", mutates_args=())
def _hopper_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, p: str, p_build: str, v_fmt: str, fast_accum: bool,
    causal_offset: int, causal: bool, scale: float, write_p: int, key_bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recipe = Recipe(qk=qk, p=p, v=v_fmt, p_build=p_build, fast_accum=fast_accum)
    ops = prepare_operands_fused(q, k, v, recipe)
    return launch_forward(ops, scale=scale, causal_offset=causal_offset if causal else None,
                          p_mode=P_MODES[(p, p_build)], write_p=write_p, key_bias=key_bias)


@_hopper_attention_op.register_fake
def _(q, k, v, qk, p, p_build, v_fmt, fast_accum, causal_offset, causal, scale, write_p, key_bias):
    B, H, Sq, D = q.shape
    block_m = forward_launch(D, fast_accum, causal).block_m
    sq_pad = math.ceil(Sq / block_m) * block_m
    dbg_shape = (B, H, sq_pad, k.shape[2]) if write_p else (0, 1, 1, 1)
    return (q.new_empty((B, H, Sq, D), dtype=torch.bfloat16), q.new_empty((B, H, Sq), dtype=torch.float32),
            q.new_empty(dbg_shape, dtype=torch.float32))


def hopper_attention(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None, write_p: int = 0,
                     key_bias: torch.Tensor | None = None):
    """Quantize bf16/fp16/fp32 (B, H, S, D) inputs into the kernel layouts and run the
    forward: (out bf16, lse fp32, debug tile or empty; see `launch_forward`)."""
    return _hopper_attention_op(q, k, v, recipe.qk, recipe.p, recipe.p_build, recipe.v, recipe.fast_accum,
                                causal_offset or 0, causal_offset is not None, scale, int(write_p), key_bias)
