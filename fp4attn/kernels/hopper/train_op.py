"""Training on Hopper: a forward that keeps the quantized operands for the backward,
and the backward, each a registered custom op with a fake implementation, the
backward registered as the forward op's autograd formula (so torch.compile and
activation checkpointing trace through them).

The forward saves what the recipe's backward reads and nothing more, as the paper
keeps it: the NVFP4 Q/K payloads (two E2M1 codes a byte, an e4m3 scale per 16, the
tensor scale, and each channel's largest grid value, which the backward's per-channel
FP8 views of Q and K need), V as the per-token e4m3 view of its represented values
that dP = dO V^T reads, the output and the LSE: about 4.2 bytes per element of
Q/K/V/O, where bf16 grid values of Q/K took 7 and bf16 attention keeps 8. No score
tile is kept: the backward decodes Q/K to their bf16 grid values and rebuilds P from
these.

Per-token FP8 Q/K (`train-fp8`) have ops of their own (`hopper_train_forward_fp8`,
`hopper_train_backward_fp8`) with the same layers: the forward keeps Q and K as their
e4m3 bytes (1 byte an element), their per-token scales and each channel's largest
represented value (`kernels/quantize/fp8_train.py`), the rest as above: about 5.1 bytes per
element; the backward widens the bytes to bf16 values with the per-channel views in
one pass, and its kernels (the Gluon ones where the lengths are whole tiles, as for NVFP4;
else the Triton ones) take a scale per query and per key (ROW_SCALES).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from fp4attn.kernels.backward_triton import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, operand_tile
from fp4attn.kernels.hopper.forward_op import launch_forward
from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands
from fp4attn.kernels.quantize.fp8 import quantize_qk_fp8
from fp4attn.kernels.quantize.fp8_train import fp8_qk_views, quantize_qk_fp8_saved
from fp4attn.kernels.quantize.nvfp4 import decode_nvfp4_rows, quantize_qk_nvfp4
from fp4attn.kernels.quantize.statistics import key_mean
from fp4attn.kernels.quantize.v_operand import quantize_v_t
from fp4attn.recipes import Recipe
from fp4attn.reference.backward import DS_BLOCK, refuse_double_backward
from fp4attn.reference.forward import LOG2E

# the outlier-robust fields the NVFP4 training kernels apply (`routing.HOPPER_TRAIN_ROBUST_FIELDS`; the
# Blackwell training, which keeps the same payload, takes them from here)
from fp4attn.routing import (
    TRAIN_P_MODES,
    BackwardKernel,
    BackwardPlan,
    hopper_backward_plan,
    hopper_train_unsupported,
    interpreting,
)


def quantize_for_training(q, k, v, v_fmt: str, smooth_k: bool = False,
                          four_over_six: bool = False) -> tuple[KernelOperands, tuple[torch.Tensor, ...]]:
    """The forward kernel's operands of a training recipe (NVFP4 Q/K, V in `v_fmt`), and
    what the backward reads, in the order `backward_operands` takes it: Q's codes and
    block scales, K's, the tensor decode scales of Q and K (one float per head: (B, H), (B, Hkv)), the
    channels' max |grid value| of Q and K ((B, H, D) float32 bits), and the per-token
    e4m3 view of V's represented values with its scales. `smooth_k`, `four_over_six`:
    the robust fields (`Recipe.smooth_k`, `Recipe.qk_four_over_six`); the backward then
    reads the smoothed K, whose gradient is K's (the softmax ignores the shift)."""
    # K's mean and the heads' max |k - mean| (the tensor scales') from one pass over K
    mean, k_tensor_amax = key_mean(k, amax=True) if smooth_k else (None, None)
    qv, qs, q_codes, q_bscale, q_amax = quantize_qk_nvfp4(q, packed=True, channel_amax=True,
                                                          four_over_six=four_over_six)
    kv, ks, k_codes, k_bscale, k_amax = quantize_qk_nvfp4(k, packed=True, channel_amax=True, mean=mean,
                                                          four_over_six=four_over_six, amax=k_tensor_amax)
    vt, vs, v_t, v_ts = quantize_v_t(v, v_fmt, pad_keys_to=BLOCK_N, tokens=True)
    ops = KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True)
    return ops, (q_codes, q_bscale, k_codes, k_bscale, qs[..., 0], ks[..., 0], q_amax, k_amax, v_t, v_ts)


def quantize_for_training_fp8(q, k, v, v_fmt: str) -> tuple[KernelOperands, tuple[torch.Tensor, ...]]:
    """The forward kernel's operands of a training recipe with per-token FP8 Q/K (the
    `fp8` inference recipe's: e4m3 values as bf16, per-token scales; V in `v_fmt`), and
    what the backward reads, in the order `backward_operands_fp8` takes it: Q's e4m3
    bytes (B, H, Sq, D) and per-token scales (B, H, Sq), K's likewise at Hkv heads, the
    channels' max |represented value| of Q and K ((B, heads, D) float32 bits), and the
    per-token e4m3 view of V's represented values with its scales."""
    qv, q8, qs, q_amax = quantize_qk_fp8_saved(q)
    kv, k8, ks, k_amax = quantize_qk_fp8_saved(k)
    vt, vs, v_t, v_ts = quantize_v_t(v, v_fmt, pad_keys_to=BLOCK_N, tokens=True)
    ops = KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True)
    return ops, (q8, qs, k8, ks, q_amax, k_amax, v_t, v_ts)


def _train_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, p: str, p_build: str, v_fmt: str,
    causal_offset: int, causal: bool, scale: float, smooth_k: bool = False, four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, then what the backward reads: `quantize_for_training`'s saved
    tensors). The bf16 grid values and V^T the forward kernel multiplies are made in
    the same passes as these and dropped after it."""
    if qk != "nvfp4":
        raise ValueError(f"hopper_train_forward: Q/K format {qk!r} (this op trains 'nvfp4' Q/K; per-token 'fp8' Q/K "
                         "train through fp4attn::hopper_train_forward_fp8)")
    ops, saved = quantize_for_training(q, k, v, v_fmt, smooth_k, four_over_six)
    out, lse, _ = launch_forward(ops, scale=scale, causal_offset=causal_offset if causal else None,
                                 p_mode=TRAIN_P_MODES[(p, p_build)], training=True)
    # the tensor scales (one per head) are views of the per-row scales: copied, so that
    # only one float a head is kept
    return (out, lse, *saved[:4], *(s.clone(memory_format=torch.contiguous_format) for s in saved[4:6]),
            *saved[6:])


# the schema of every target's NVFP4 training forward op: the Blackwell training keeps this
# payload and returns it in this order (`blackwell.train_op`)
TRAIN_FORWARD_SCHEMA = torch.library.infer_schema(_train_forward, mutates_args=())
_train_forward_op = torch.library.custom_op("fp4attn::hopper_train_forward", _train_forward, mutates_args=())


def _train_forward_fake_ends(q, k):
    """What every training forward op returns first and last, as empty tensors: (out, lse),
    and (the channels' maxima of Q and K, V's per-token e4m3 view and its scales)."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    f32, i32 = torch.float32, torch.int32
    return ((q.new_empty((B, H, Sq, D), dtype=torch.bfloat16), q.new_empty((B, H, Sq), dtype=f32)),
            (q.new_empty((B, H, D), dtype=i32), q.new_empty((B, Hkv, D), dtype=i32),
             q.new_empty((B, Hkv, Sk, D), dtype=torch.float8_e4m3fn), q.new_empty((B, Hkv, Sk), dtype=f32)))


def train_forward_fake(q, k, v, qk, p, p_build, v_fmt, causal_offset, causal, scale, smooth_k=False,
                       four_over_six=False):
    """The training forward op's fake implementation (shapes and dtypes of the output and
    the saved payload); shared by every target's training op."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    f32, u8, e4m3 = torch.float32, torch.uint8, torch.float8_e4m3fn
    first, last = _train_forward_fake_ends(q, k)
    return (*first,
            q.new_empty((B, H, Sq, D // 2), dtype=u8), q.new_empty((B, H, Sq, D // 16), dtype=e4m3),
            q.new_empty((B, Hkv, Sk, D // 2), dtype=u8), q.new_empty((B, Hkv, Sk, D // 16), dtype=e4m3),
            q.new_empty((B, H), dtype=f32), q.new_empty((B, Hkv), dtype=f32), *last)


@torch.library.custom_op("fp4attn::hopper_train_forward_fp8", mutates_args=())
def _train_forward_fp8_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, p: str, p_build: str, v_fmt: str,
    causal_offset: int, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, then what the backward reads: `quantize_for_training_fp8`'s saved
    tensors) of a training recipe with per-token FP8 Q/K. The bf16 values and V^T the
    forward kernel multiplies are made in the same passes as these and dropped after it.
    No robust fields (`routing.HOPPER_TRAIN_QK`)."""
    if qk != "fp8":
        raise ValueError(f"hopper_train_forward_fp8: Q/K format {qk!r} (this op trains per-token 'fp8' Q/K; "
                         "'nvfp4' Q/K train through fp4attn::hopper_train_forward)")
    ops, saved = quantize_for_training_fp8(q, k, v, v_fmt)
    out, lse, _ = launch_forward(ops, scale=scale, causal_offset=causal_offset if causal else None,
                                 p_mode=TRAIN_P_MODES[(p, p_build)], training=True)
    return (out, lse, *saved)


@_train_forward_fp8_op.register_fake
def _(q, k, v, qk, p, p_build, v_fmt, causal_offset, causal, scale):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    first, last = _train_forward_fake_ends(q, k)
    return (*first, q.new_empty((B, H, Sq, D), dtype=e4m3), q.new_empty((B, H, Sq), dtype=f32),
            q.new_empty((B, Hkv, Sk, D), dtype=e4m3), q.new_empty((B, Hkv, Sk), dtype=f32), *last)


def _train_backward(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_codes: torch.Tensor, q_bscale: torch.Tensor,
    k_codes: torch.Tensor, k_bscale: torch.Tensor, qs: torch.Tensor, ks: torch.Tensor, q_amax: torch.Tensor,
    k_amax: torch.Tensor, v_t: torch.Tensor, v_ts: torch.Tensor, p: str, p_build: str, causal_offset: int,
    causal: bool, scale: float, dq_dtype: torch.dtype, dk_dtype: torch.dtype, dv_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the given dtypes from the forward's saved operands."""
    ops = backward_operands(dout, out, q_codes, q_bscale, k_codes, k_bscale, qs, ks, q_amax, k_amax, v_t, v_ts)
    return launch_backward(ops, lse, p, p_build, causal_offset, causal, scale, (dq_dtype, dk_dtype, dv_dtype))


# the schema of every target's NVFP4 training backward op (the forward's saved payload, as
# TRAIN_FORWARD_SCHEMA returns it, then the call's arguments and the gradients' dtypes)
TRAIN_BACKWARD_SCHEMA = torch.library.infer_schema(_train_backward, mutates_args=())
_train_backward_op = torch.library.custom_op("fp4attn::hopper_train_backward", _train_backward, mutates_args=())


@torch.library.custom_op("fp4attn::hopper_train_backward_fp8", mutates_args=())
def _train_backward_fp8_op(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q8: torch.Tensor, qs: torch.Tensor, k8: torch.Tensor,
    ks: torch.Tensor, q_amax: torch.Tensor, k_amax: torch.Tensor, v_t: torch.Tensor, v_ts: torch.Tensor, p: str,
    p_build: str, causal_offset: int, causal: bool, scale: float, dq_dtype: torch.dtype, dk_dtype: torch.dtype,
    dv_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the given dtypes from `hopper_train_forward_fp8`'s saved operands."""
    ops = backward_operands_fp8(dout, out, q8, qs, k8, ks, q_amax, k_amax, v_t, v_ts)
    return launch_backward(ops, lse, p, p_build, causal_offset, causal, scale, (dq_dtype, dk_dtype, dv_dtype))


@_train_backward_fp8_op.register_fake
def _(dout, out, lse, q8, qs, k8, ks, q_amax, k_amax, v_t, v_ts, p, p_build, causal_offset, causal, scale, dq_dtype,
      dk_dtype, dv_dtype):
    return (dout.new_empty(dout.shape, dtype=dq_dtype), dout.new_empty(k8.shape, dtype=dk_dtype),
            dout.new_empty(k8.shape, dtype=dv_dtype))


class BackwardOperands(NamedTuple):
    """What the backward kernels read besides the LSE (reference/backward.py's views):
    Q and K as exact values (B, heads, S, D) with their scales qs, ks: NVFP4 grid values
    with the tensor decode scales, one a head ((B, heads)), or per-token FP8's e4m3
    values with their scales ((B, heads, S): `row_scales`); e4m3 views with float32
    scales, per token (B, heads, S, D) for dO and V in dP = dO V^T, per channel and
    stored transposed (B, heads, D, S; contraction dim contiguous) for dO, Q and K in dV,
    dK and dQ; delta = rowsum(dO * O)."""

    q: torch.Tensor
    k: torch.Tensor
    qs: torch.Tensor
    ks: torch.Tensor
    do_t: torch.Tensor
    do_ts: torch.Tensor
    do_c: torch.Tensor
    do_cs: torch.Tensor
    v_t: torch.Tensor
    v_ts: torch.Tensor
    q_c: torch.Tensor
    q_cs: torch.Tensor
    k_c: torch.Tensor
    k_cs: torch.Tensor
    delta: torch.Tensor

    @property
    def row_scales(self) -> bool:
        """Whether Q and K carry a scale per token (FP8 Q/K), not one per head (NVFP4)."""
        return self.qs.dim() == self.q.dim() - 1


def _dout_views(dout, out) -> tuple[torch.Tensor, ...]:
    """dO's per-token e4m3 view with its scales, its per-channel view (transposed) with
    its scales, and delta = rowsum(dO * O), in two passes over dO: the first makes the
    per-token view and delta and records the channel maxima the second needs."""
    do_t, do_ts, delta, do_amax = quantize_qk_fp8(dout, dot_with=out, channel_amax=True)
    do_c, do_cs = quantize_v_t(dout, "fp8", channel_amax=do_amax)
    return do_t, do_ts, do_c, do_cs, delta


def backward_operands(dout, out, q_codes, q_bscale, k_codes, k_bscale, qs, ks, q_amax, k_amax, v_t, v_ts,
                      values_dtype: torch.dtype = torch.bfloat16) -> BackwardOperands:
    """The backward's operands from the forward's saved ones (`quantize_for_training`),
    in four passes: Q and K each decoded to grid values (as `values_dtype`) together
    with their per-channel views, whose scales the forward's channel maxima give; dO
    read once for its per-token view, delta and its channel maxima, and once more for
    its per-channel view."""
    qv, q_c, q_cs = decode_nvfp4_rows(q_codes, q_bscale, values_dtype, channels_scale=qs, channel_amax=q_amax)
    kv, k_c, k_cs = decode_nvfp4_rows(k_codes, k_bscale, values_dtype, channels_scale=ks, channel_amax=k_amax)
    do_t, do_ts, do_c, do_cs, delta = _dout_views(dout, out)
    return BackwardOperands(qv, kv, qs.contiguous(), ks.contiguous(), do_t, do_ts, do_c, do_cs, v_t.contiguous(),
                            v_ts.contiguous(), q_c, q_cs, k_c, k_cs, delta)


def backward_operands_fp8(dout, out, q8, qs, k8, ks, q_amax, k_amax, v_t, v_ts,
                          values_dtype: torch.dtype = torch.bfloat16) -> BackwardOperands:
    """The backward's operands from what the FP8 Q/K training forward saved
    (`quantize_for_training_fp8`), in four passes as `backward_operands`: Q's and K's
    e4m3 bytes each widened to `values_dtype` together with the per-channel views of
    their represented values (`kernels.quantize.fp8_train.fp8_qk_views`), and dO's two. The
    per-token scales are the kernels' `qs`, `ks` as saved."""
    qv, q_c, q_cs = fp8_qk_views(q8, qs, q_amax, values_dtype)
    kv, k_c, k_cs = fp8_qk_views(k8, ks, k_amax, values_dtype)
    do_t, do_ts, do_c, do_cs, delta = _dout_views(dout, out)
    return BackwardOperands(qv, kv, qs.contiguous(), ks.contiguous(), do_t, do_ts, do_c, do_cs, v_t.contiguous(),
                            v_ts.contiguous(), q_c, q_cs, k_c, k_cs, delta)


def tiles_tma_loadable(q, do_t, do_c, q_c, k, v_t, k_c) -> bool:
    """Whether the backward loops' operand tiles can arrive by TMA: both lengths whole
    tiles of DS_BLOCK and every operand contiguous and 16-byte aligned."""
    Sq, Sk = q.shape[2], k.shape[2]
    ops = (q, do_t, do_c, q_c, k, v_t, k_c)
    return not (Sq % DS_BLOCK or Sk % DS_BLOCK) and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ops)


def backward_descriptors(q, do_t, do_c, q_c, k, v_t, k_c) -> dict[str, TensorDescriptor] | None:
    """Host-built TMA descriptors of the tiles each backward loop reads, by kernel
    argument name: token-major operands (B*heads*S, D) in tiles of (DS_BLOCK, D),
    channel-major ones (B*heads*D, S) in tiles of (D, DS_BLOCK). None unless both
    lengths are whole tiles (then no tile reads a row of the next head, whose values,
    NaN included, would otherwise meet a finite P or dS) and every operand is
    contiguous and 16-byte aligned, as TMA needs."""
    if not tiles_tma_loadable(q, do_t, do_c, q_c, k, v_t, k_c):
        return None

    def desc(t: torch.Tensor, channel_major: bool) -> TensorDescriptor:
        t2, block = operand_tile(t, channel_major)
        return TensorDescriptor(t2, list(t2.shape), [t2.shape[1], 1], block)

    return dict(Q=desc(q, False), DO_T=desc(do_t, False), DO_C=desc(do_c, True), Q_C=desc(q_c, True),
                K=desc(k, False), V_T=desc(v_t, False), K_C=desc(k_c, True))


def _scores_fp4(cfg, ops: BackwardOperands, nvfp4) -> tuple[dict, dict]:
    """The dQ and dK/dV kernels' QK_FP4 arguments where the launch multiplies their scores
    from the NVFP4 payload (`qk_fp4_dq`, `qk_fp4_dkdv`: Blackwell's): Q and K as their
    codes, with their block scales; else none. `nvfp4`: (Q's codes, Q's block scales, K's
    codes, K's block scales) as `quantize_for_training` saves them. A launch the kernels
    cannot run so is refused, never run as another product."""
    if not (cfg.qk_fp4_dq or cfg.qk_fp4_dkdv):
        return {}, {}
    if nvfp4 is None or ops.row_scales:
        raise ValueError("launch_backward: a launch with qk_fp4_dq or qk_fp4_dkdv multiplies the NVFP4 payload of Q "
                         "and K (pass nvfp4=(q_codes, q_bscale, k_codes, k_bscale)); per-token FP8 Q/K have none")
    if cfg.qk_fp4_dq and (cfg.tma or cfg.dq_gluon or cfg.block_m_dq != 128):
        raise ValueError(f"launch_backward: qk_fp4_dq runs the Triton dQ kernel by pointer loads at block_m_dq=128 "
                         f"(tcgen05's block-scaled MMA has 128 rows), not tma={cfg.tma}, dq_gluon={cfg.dq_gluon}, "
                         f"block_m_dq={cfg.block_m_dq}")
    if cfg.qk_fp4_dkdv and (cfg.tma or cfg.dkdv_gluon):
        raise ValueError(f"launch_backward: qk_fp4_dkdv runs the Triton dK/dV kernel by pointer loads, not "
                         f"tma={cfg.tma}, dkdv_gluon={cfg.dkdv_gluon}")
    q_codes, q_bscale, k_codes, k_bscale = (t.contiguous() for t in nvfp4)
    (B, H, Sq, D), (Hkv, Sk) = ops.q.shape, ops.k.shape[1:3]
    want = {"q codes": (q_codes, (B, H, Sq, D // 2), torch.uint8),
            "q block scales": (q_bscale, (B, H, Sq, D // 16), torch.float8_e4m3fn),
            "k codes": (k_codes, (B, Hkv, Sk, D // 2), torch.uint8),
            "k block scales": (k_bscale, (B, Hkv, Sk, D // 16), torch.float8_e4m3fn)}
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"launch_backward: NVFP4 {name} {tuple(t.shape)} {t.dtype}, expected {shape} {dtype} "
                             "(the payload of the operands the backward was given)")
    args = dict(Q=q_codes, K=k_codes, QK_FP4=True, QSC=q_bscale, KSC=k_bscale)
    return (dict(args) if cfg.qk_fp4_dq else {}), (dict(args) if cfg.qk_fp4_dkdv else {})


def backward_plan(ops: BackwardOperands, p_mode: int) -> BackwardPlan:
    """The routing's plan for a backward on these operands (`routing.hopper_backward_plan`
    of their head dim, Q/K scales, lengths, device and layout, and of the P mode)."""
    qv, kv = ops.q, ops.k
    return hopper_backward_plan(head_dim=qv.shape[3], qk="fp8" if ops.row_scales else "nvfp4", p_mode=p_mode,
                                queries=qv.shape[2], keys=kv.shape[2], on_cuda=qv.is_cuda,
                                tiles_tma=tiles_tma_loadable(qv, ops.do_t, ops.do_c, ops.q_c, kv, ops.v_t, ops.k_c),
                                interpreter=interpreting())


def launch_backward(ops: BackwardOperands, lse, p, p_build, causal_offset, causal, scale,
                    dtypes=(torch.float32,) * 3, nvfp4: tuple[torch.Tensor, ...] | None = None,
                    plan: BackwardPlan | None = None):
    """Run the dkdv and dq kernels the plan names on the backward's operands: (dq, dk, dv),
    float32 sums stored in `dtypes`. Per-token Q/K scales (`BackwardOperands.row_scales`)
    run the kernels' ROW_SCALES form. `nvfp4`: Q's and K's saved NVFP4 payload (codes and
    block scales), which a launch with `qk_fp4_dq` or `qk_fp4_dkdv` (Blackwell's)
    multiplies for that kernel's scores instead of their grid values (the same products,
    exact either way). `plan`: the `routing.BackwardPlan` to run (tests, measurements);
    by default `backward_plan` of these operands; one made for another P mode or Q/K
    scales raises."""
    qv, kv, qs, ks, do_t, do_ts, do_c, do_cs, v_t, v_ts, q_c, q_cs, k_c, k_cs, delta = ops
    B, H, Sq, D = qv.shape
    Hkv, Sk = kv.shape[1], kv.shape[2]
    lse = lse.contiguous()
    off = causal_offset if causal else 0
    p_mode = TRAIN_P_MODES[(p, p_build)]
    row_scales = ops.row_scales
    if plan is None:
        plan = backward_plan(ops, p_mode)
    elif (plan.p_mode, plan.row_scales) != (p_mode, row_scales):
        raise ValueError(f"launch_backward: the plan is for another call: (p_mode, row_scales) "
                         f"{(int(plan.p_mode), plan.row_scales)}, this call's {(int(p_mode), row_scales)}")
    elif plan.tma and not tiles_tma_loadable(qv, do_t, do_c, q_c, kv, v_t, k_c):
        raise ValueError("launch_backward: the plan reads the tiles by TMA, which these operands do not allow "
                         "(tiles_tma_loadable: whole 64-token tiles, contiguous, aligned)")
    if plan.dkdv is BackwardKernel.CUDA:
        from fp4attn.kernels.hopper.backward_cuda import launch_backward_cuda

        return launch_backward_cuda(ops, lse, off, causal, scale, dtypes)
    cfg = plan.launch
    dq_fp4, dkdv_fp4 = _scores_fp4(cfg, ops, nvfp4)
    dq = torch.empty((B, H, Sq, D), device=qv.device, dtype=dtypes[0])
    dk = torch.empty((B, Hkv, Sk, D), device=qv.device, dtype=dtypes[1])
    dv = torch.empty((B, Hkv, Sk, D), device=qv.device, dtype=dtypes[2])
    dkdv_gluon, dq_gluon = plan.dkdv is BackwardKernel.GLUON, plan.dq is BackwardKernel.GLUON
    # the Triton kernels' TMA descriptors only where one of them runs; the Gluon
    # kernels' once for both (each costs host time at every call)
    descs = backward_descriptors(qv, do_t, do_c, q_c, kv, v_t, k_c) if plan.triton_descriptors else None
    tiles = descs or dict(Q=qv, DO_T=do_t, DO_C=do_c, Q_C=q_c, K=kv, V_T=v_t, K_C=k_c)
    if dkdv_gluon or dq_gluon:
        from fp4attn.kernels.hopper import backward_gluon

        gluon_ops = dict(q=qv, k=kv, do_t=do_t, v_t=v_t)
        if dkdv_gluon:
            gluon_ops.update(do_c=do_c, q_c=q_c)
        if dq_gluon:
            gluon_ops.update(k_c=k_c)
        gluon_descs = backward_gluon.descriptors(**gluon_ops)
    if dkdv_gluon:
        backward_gluon.launch_dkdv_gluon(gluon_descs, qs, ks, lse, delta, do_ts, do_cs, v_ts, q_cs, dk, dv,
                                         off, causal, scale, cfg.dkdv_in_flight, cfg.dkdv_maxnreg,
                                         cfg.dkdv_staged, row_scales=row_scales)
    else:
        # the scores from Q's and K's NVFP4 payload (QK_FP4) or from their grid values
        q_s, k_s = (dkdv_fp4.pop("Q"), dkdv_fp4.pop("K")) if dkdv_fp4 else (tiles["Q"], kv)
        attn_bwd_dkdv_kernel[(triton.cdiv(Sk, cfg.block_n_dkdv), B * Hkv)](
            q_s, k_s, qs, ks, lse, delta, tiles["DO_T"], do_ts, tiles["DO_C"], do_cs, v_t, v_ts, tiles["Q_C"],
            q_cs, dk, dv, (H, H // Hkv, Sq, Sk, off, scale * LOG2E, scale),
            HEAD_DIM=D, BLOCK_M=DS_BLOCK, BLOCK_N=cfg.block_n_dkdv, P_MODE=int(plan.p_mode), CAUSAL=causal,
            HW_CVT=cfg.hw_cvt, TMA=descs is not None, ROW_SCALES=row_scales, num_warps=cfg.warps_dkdv,
            num_stages=cfg.stages_dkdv, **dkdv_fp4)
    if dq_gluon:
        backward_gluon.launch_dq_gluon(gluon_descs, qs, ks, lse, delta, do_ts, v_ts, k_cs, dq, off, causal,
                                       scale, cfg.dq_maxnreg, row_scales=row_scales)
        return dq, dk, dv
    # S from Q's and K's NVFP4 payload (QK_FP4) or from their grid values
    q_s, k_s = (dq_fp4.pop("Q"), dq_fp4.pop("K")) if dq_fp4 else (qv, tiles["K"])
    attn_bwd_dq_kernel[(triton.cdiv(Sq, cfg.block_m_dq), B * H)](
        q_s, k_s, qs, ks, lse, delta, do_t, do_ts, tiles["V_T"], v_ts, tiles["K_C"], k_cs, dq,
        (H, H // Hkv, Sq, Sk, off, scale * LOG2E, scale),
        HEAD_DIM=D, BLOCK_M=cfg.block_m_dq, BLOCK_N=DS_BLOCK, CAUSAL=causal,
        HW_CVT=cfg.hw_cvt, TMA=descs is not None, ROW_SCALES=row_scales, P_MODE=int(plan.p_mode),
        num_warps=cfg.warps_dq, num_stages=cfg.stages_dq, **dq_fp4)
    return dq, dk, dv


_train_forward_op.register_fake(train_forward_fake)


def train_backward_fake(dout, out, lse, q_codes, q_bscale, k_codes, k_bscale, qs, ks, q_amax, k_amax, v_t, v_ts, p,
                        p_build, causal_offset, causal, scale, dq_dtype, dk_dtype, dv_dtype):
    """The training backward op's fake implementation; shared by every target's."""
    kshape = (*k_codes.shape[:-1], k_codes.shape[-1] * 2)
    return (dout.new_empty(dout.shape, dtype=dq_dtype), dout.new_empty(kshape, dtype=dk_dtype),
            dout.new_empty(kshape, dtype=dv_dtype))


_train_backward_op.register_fake(train_backward_fake)


def setup_train_context(ctx, inputs, output):
    """The training forward op's autograd context, for every target's op (each takes q,
    k, v, qk, p, p_build, v_fmt, causal_offset, causal, scale first, then its own
    flags)."""
    q, k, v, _qk, p, p_build, _v_fmt, causal_offset, causal, scale = inputs[:10]  # then the robust flags
    ctx.save_for_backward(*output)  # out, lse and the quantized operands
    # the LSE and the saved operands get no gradient: left None, not filled with zeros
    # (nine fill kernels per backward)
    ctx.set_materialize_grads(False)
    ctx.args = (p, p_build, causal_offset, causal, scale)
    ctx.dtypes = (q.dtype, k.dtype, v.dtype)
    ctx.n_inputs = len(inputs)  # one gradient (or None) each


def train_backward_formula(backward_op, kernels: str):
    """The training forward op's autograd formula, running `backward_op`: gradients of q,
    k, v (in their dtypes) from the output's; the LSE and the saved operands are not
    differentiable outputs, and a second derivative is refused."""
    def backward(ctx, dout, *_unused):
        refuse_double_backward(f"fp4attn.attention (the {kernels} training kernels)")
        if dout is None:  # the output was not used: no gradient flows to q, k, v
            return (None,) * ctx.n_inputs
        grads = backward_op(dout.contiguous(), *ctx.saved_tensors, *ctx.args, *ctx.dtypes)
        return tuple(grads) + (None,) * (ctx.n_inputs - 3)
    return backward


# autograd registered on the op itself (not an autograd.Function around it): under
# torch.compile the Function's traced backward received a zero output gradient
# (AOTAutograd, torch 2.11; scripts/diagnose_compile.py), the op-level formula does not
_train_forward_op.register_autograd(train_backward_formula(_train_backward_op, "Hopper"),
                                   setup_context=setup_train_context)
_train_forward_fp8_op.register_autograd(train_backward_formula(_train_backward_fp8_op, "Hopper"),
                                       setup_context=setup_train_context)


def hopper_train_attention(q, k, v, recipe: Recipe, *, scale: float, causal_offset: int | None):
    """Forward of a training recipe on the Hopper kernels, differentiable in q, k, v:
    (out bf16, lse fp32). GQA: dK and dV are summed over each group's query heads.
    NVFP4 Q/K train through `hopper_train_forward`, per-token FP8 Q/K through
    `hopper_train_forward_fp8`. A recipe with robust fields other than its Q/K format's
    (`routing.HOPPER_TRAIN_QK`: TRAIN_ROBUST_FIELDS for NVFP4, none for FP8), or with
    `fast_accum`, is refused, never trained as another recipe."""
    # the routing's own rule (the Q/K format, fast_accum, the robust fields each format's
    # saved operands carry, the forward's formats and head dim), for a direct call
    reason = hopper_train_unsupported(recipe, q.shape[-1])
    if reason is not None:
        raise ValueError(f"hopper_train_attention: {reason}, with {recipe.qk!r} Q/K; the reference trains it")
    args = (recipe.qk, recipe.p, recipe.p_build, recipe.v, causal_offset or 0, causal_offset is not None, scale)
    if recipe.qk == "fp8":
        out, lse, *_ = _train_forward_fp8_op(q, k, v, *args)
    else:
        out, lse, *_ = _train_forward_op(q, k, v, *args, recipe.smooth_k, recipe.qk_four_over_six)
    return out, lse
