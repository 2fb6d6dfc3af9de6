"""The Hopper FP8 attention backward in CUDA C++ (`cuda/attn_bwd_fp8.cu`): FlashAttention-3's
backward structure (a TMA producer warp, two consumer warpgroups that own 64 keys each and keep
dK and dV in registers over the query tiles, dQ added to a float32 workspace by bulk reduce-adds
in the same pass), every gradient product on the FP8 tensor cores. Its numerics are the
Triton kernels' for per-token FP8 Q/K and FP8 P from exp2 (`train-fp8`), up to float32
summation order; `cuda/kernel_bwd.cuh` says how each K-major operand is obtained, the headers
beside it (`cuda/*_bwd.cuh`) hold the kernel's roles.

Built at first use by NVRTC (`nvrtc_build`), one cubin per (head dim, causal); `compile_variant`
runs without a GPU (the CPU compile check). The launcher takes the `BackwardOperands` the
Triton and Gluon kernels take.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4attn.kernels.hopper.nvrtc_build import (
    Build,
    check,
    compile_source,
    driver,
    load_function,
    options_for,
    tensor_map,
)
from fp4attn.reference.backward import DS_BLOCK
from fp4attn.reference.forward import LOG2E

SOURCE = Path(__file__).with_name("cuda") / "attn_bwd_fp8.cu"
KERNEL_NAME = "attn_bwd_fp8"
HEAD_DIMS = (64, 128)
BLOCK_N = 128  # keys per CTA (two consumer warpgroups of 64)
BLOCK_M = DS_BLOCK  # queries per tile: dS's scale block
THREADS = 384
STAGES = 2
DS_BUFS = 3  # dS tiles in flight (DS_BUFS, cuda/kernel_traits_bwd.cuh)
DQ_PAD = 4  # floats after each staged dQ row (DQS_ROW, cuda/kernel_traits_bwd.cuh)


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel (masking only; the arithmetic is the same)."""

    head_dim: int
    causal: bool

    def defines(self) -> list[str]:
        return [f"-DHEAD_DIM={self.head_dim}", f"-DCAUSAL={int(self.causal)}"]

    def shared_bytes(self) -> int:
        """Dynamic shared memory, as the kernel's SMEM_BYTES: K (bf16), V, K_c, the stage ring
        (Q bf16, dO_t, dO_c, Q_c, the per-tile numbers rounded to 1 KiB), DS_BUFS dS tiles, the
        consumers' dQ staging, the dS maxima and scales, the barriers, 1 KiB of alignment."""
        d = self.head_dim
        num = -(-(4 * BLOCK_M + 2 * d) * 4 // 1024) * 1024
        stage = BLOCK_M * 2 * d + 3 * BLOCK_M * d + num
        return (1024 + BLOCK_N * 2 * d + 2 * BLOCK_N * d + STAGES * stage + DS_BUFS * BLOCK_M * BLOCK_N
                + 2 * BLOCK_M * (d // 2 + DQ_PAD) * 4 + 2 * 2 * 4 * 64 * 4 + DS_BUFS * 2 * 64 * 4 + 64)


def all_variants() -> list[Variant]:
    """Every variant the launcher can pick (what the compile check builds)."""
    return [Variant(d, c) for d in HEAD_DIMS for c in (False, True)]


def compile_variant(variant: Variant, *, use_cache: bool = True, announce: bool = True) -> Build:
    """The variant's cubin for sm_90a, from the disk cache or built by NVRTC (no GPU needed)."""
    return compile_source(SOURCE, options_for(variant.defines()), f"the CUDA attention backward ({variant})",
                          use_cache=use_cache, announce=announce)


class _Params(ctypes.Structure):
    # the kernel's `Params` (cuda/params_bwd.cuh): nine 64-byte aligned tensor maps, pointers, ints, the scales,
    # padded to the C++ struct's size
    _fields_ = [*((name, ctypes.c_uint8 * 128) for name in (
        "q_map0", "q_map1", "dot_map0", "dot_map1", "doc_map", "qc_map", "k_map", "v_map", "kc_map")),
        *((name, ctypes.c_uint64) for name in (
            "lse", "delta", "qs", "dots", "docs", "qcs", "ks", "vts", "dq_accum", "dk", "dv")),
        ("H", ctypes.c_int32), ("group", ctypes.c_int32), ("Sq", ctypes.c_int32), ("Sk", ctypes.c_int32),
        ("causal_offset", ctypes.c_int32), ("qk_scale", ctypes.c_float), ("sm_scale", ctypes.c_float),
        ("_pad", ctypes.c_uint8 * 12)]


assert ctypes.sizeof(_Params) == 1280


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, row_scales: bool, p_mode: int) -> str | None:
    """Why the CUDA backward cannot run these operands (None: it can)."""
    if not q.is_cuda:
        return "the CUDA backward runs on CUDA tensors only"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "the CUDA backward is built for sm_90a (Hopper)"
    if not row_scales or p_mode != 0:
        return "the CUDA backward trains per-token FP8 Q/K with FP8 P from exp2 (train-fp8)"
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if D not in HEAD_DIMS:
        return f"the CUDA backward has head dims {HEAD_DIMS}; got {D}"
    if Sq % BLOCK_M or Sk % BLOCK_N or Sq == 0 or Sk == 0:
        return f"the CUDA backward takes Sq a multiple of {BLOCK_M} and Sk of {BLOCK_N}; got {Sq}, {Sk}"
    return None


def _function(variant: Variant, device: torch.device):
    return load_function(("backward", variant), lambda: compile_variant(variant), KERNEL_NAME, device,
                         variant.shared_bytes())


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"launch_backward_cuda: {name} is {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
    return t.contiguous()


def launch_backward_cuda(ops, lse: torch.Tensor, causal_offset: int, causal: bool, scale: float,
                         dtypes=(torch.float32,) * 3):
    """(dq, dk, dv) from the backward's operands (`train_op.BackwardOperands` with per-token
    FP8 Q/K) and the forward's LSE, float32 sums stored in `dtypes`."""
    qv, kv, qs, ks, do_t, do_ts, do_c, do_cs, v_t, v_ts, q_c, q_cs, k_c, k_cs, delta = ops
    B, H, Sq, D = qv.shape
    Hkv, Sk = kv.shape[1], kv.shape[2]
    reason = unsupported_reason(qv, kv, qs.dim() == qv.dim() - 1, 0)
    if reason:
        raise ValueError(f"launch_backward_cuda: {reason}")
    e4m3, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16
    qv = _check("q", qv, (B, H, Sq, D), bf16)
    kv = _check("k", kv, (B, Hkv, Sk, D), bf16)
    do_t = _check("do_t", do_t, (B, H, Sq, D), e4m3)
    v_t = _check("v_t", v_t, (B, Hkv, Sk, D), e4m3)
    do_c = _check("do_c", do_c, (B, H, D, Sq), e4m3)
    q_c = _check("q_c", q_c, (B, H, D, Sq), e4m3)
    k_c = _check("k_c", k_c, (B, Hkv, D, Sk), e4m3)
    numbers = [_check(n, t.reshape(t.shape[:3]) if t.dim() == 4 and t.shape[-1] == 1 else t, shape, f32)
               for n, t, shape in (("lse", lse, (B, H, Sq)), ("delta", delta, (B, H, Sq)), ("qs", qs, (B, H, Sq)),
                                   ("do_ts", do_ts, (B, H, Sq)), ("do_cs", do_cs, (B, H, D)),
                                   ("q_cs", q_cs, (B, H, D)), ("ks", ks, (B, Hkv, Sk)), ("v_ts", v_ts, (B, Hkv, Sk)),
                                   ("k_cs", k_cs, (B, Hkv, D)))]
    lse, delta, qs, do_ts, do_cs, q_cs, ks, v_ts, k_cs = numbers

    dev = qv.device
    variant = Variant(D, causal)
    # the kernel's staging rows: D / 2 floats and 4 of padding (shared-memory banks)
    dq_accum = torch.zeros((B * H, Sq // BLOCK_M, 2, BLOCK_M, D // 2 + DQ_PAD), device=dev, dtype=f32)
    dk = torch.empty((B, Hkv, Sk, D), device=dev, dtype=f32)
    dv = torch.empty((B, Hkv, Sk, D), device=dev, dtype=f32)

    p = _Params()
    rq, re = 2 * D, D  # bytes of a bf16 and an e4m3 row
    rows_q, rows_k = B * H * Sq, B * Hkv * Sk

    def perm(base, rb, box0, swz):  # a query tile in two permuted boxes (the kernel's header)
        return tensor_map(base, [rb, 2, 4, rows_q // 16], [rb, 4 * rb, 16 * rb], [box0, 2, 4, BLOCK_M // 16], swz)

    maps = {
        # the permuted query tiles: row 32 h + 8 a + 2 q + b of a tile holds query 16 a + 4 q + 2 h + b
        "q_map0": perm(qv.data_ptr(), rq, 128, 128), "q_map1": perm(qv.data_ptr() + 2 * rq, rq, 128, 128),
        "dot_map0": perm(do_t.data_ptr(), re, re, re), "dot_map1": perm(do_t.data_ptr() + 2 * re, re, re, re),
        "doc_map": tensor_map(do_c.data_ptr(), [Sq, B * H * D], [Sq], [BLOCK_M, D], 64),
        "qc_map": tensor_map(q_c.data_ptr(), [Sq, B * H * D], [Sq], [BLOCK_M, D], 64),
        "k_map": tensor_map(kv.data_ptr(), [rq, rows_k], [rq], [128, BLOCK_N], 128),
        "v_map": tensor_map(v_t.data_ptr(), [re, rows_k], [re], [re, BLOCK_N], re),
        "kc_map": tensor_map(k_c.data_ptr(), [Sk, B * Hkv * D], [Sk], [BLOCK_N, D], 128),
    }
    for name, data in maps.items():
        ctypes.memmove(ctypes.addressof(getattr(p, name)), data, 128)
    for name, t in (("lse", lse), ("delta", delta), ("qs", qs), ("dots", do_ts), ("docs", do_cs), ("qcs", q_cs),
                    ("ks", ks), ("vts", v_ts), ("dq_accum", dq_accum), ("dk", dk), ("dv", dv)):
        setattr(p, name, t.data_ptr())
    p.H, p.group, p.Sq, p.Sk = H, H // Hkv, Sq, Sk
    p.causal_offset = causal_offset if causal else 0
    p.qk_scale, p.sm_scale = scale * LOG2E, scale

    fn = _function(variant, dev)
    drv = driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(p))
    stream = drv.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    check((drv.cuLaunchKernel(fn, Sk // BLOCK_N, B * Hkv, 1, THREADS, 1, 1, variant.shared_bytes(), stream,
                              ctypes.addressof(args), 0)[0], None), "cuLaunchKernel")
    # dQ: the workspace's (tile, half, row, column) blocks in (query, head dim) order, times K_c's
    # channel scales (of each query head's K/V head) and the softmax scale
    dq = dq_accum[..., :D // 2].reshape(B, H, Sq // BLOCK_M, 2, BLOCK_M, D // 2).permute(0, 1, 2, 4, 3, 5)
    dq = dq.reshape(B, H, Sq, D)
    k_cs_q = k_cs.repeat_interleave(H // Hkv, dim=1) if Hkv != H else k_cs
    dq = (dq * k_cs_q[:, :, None, :] * scale).to(dtypes[0])
    return dq, dk.to(dtypes[1]), dv.to(dtypes[2])
