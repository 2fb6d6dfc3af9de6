"""The Hopper FP8 attention forward in CUDA C++ (`cuda/attn_fwd_fp8.cu` and the headers it
includes, by role: `cuda/kernel_fwd.cuh` the roles and schedule, `cuda/mainloop_fwd.cuh` the
loads and products, `cuda/softmax_fwd.cuh` and `cuda/p_build.cuh` the online softmax and the
P builders, `cuda/epilogue_fwd.cuh` the output): FlashAttention-3's schedule (a TMA producer
warpgroup, two consumer warpgroups taking turns on the tensor cores, setmaxnreg), which
Triton 3.6 cannot express (docs/notes/hopper-forward.md).

Built at first use by NVRTC through `cuda-bindings` (no CUDA toolkit needed), one cubin
per variant (`Variant`: head dim, causal, key bias, P builder, ...; its fields name the
kernel's -D switches), cached on disk under $FP4ATTN_CACHE_DIR or ~/.cache/fp4attn, keyed
by the source, the options and NVRTC's version; a build prints one line. `compile_variant`
also runs without a GPU (the CPU compile check); launching needs one.

Numerics: the `fast_accum` recipes (e4m3 Q/K) and, with `Variant.qk_bf16`, the exact ones
(bf16 Q/K, whose e4m3 or NVFP4 values bf16 holds exactly); P as FP8 from exp2, FP8 or MXFP4
from the affine map (`affine_p`, `affine_mx`). The kernel does FlashAttention-3's
per-score work, with the row sums of P from the PV product and a quarter of the exp2s by a
polynomial (`EXP_POLY`): P codes equal to the recipe's on 99.986% of entries (the bar is
99.9%), outputs within bf16 rounding. A checking build beside it, outside the package
(dev/cuda/attn_fwd_fp8_check.cu, launched by dev/forward_cuda_check.py), computes the
Gluon kernel's arithmetic (forward_gluon_ws.attn_fwd_ws_kernel) operation for operation,
measured bit-identical to it (benchmarks/results/log/h200-forward-cuda.txt), and writes P's
codes for the tests that hold the kernel to the Triton kernel's.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4attn.kernels.common import sm_count
from fp4attn.kernels.hopper.nvrtc_build import (  # noqa: F401
    ARCH,
    CACHE_ENV,
    Build,
    check,
    compile_source,
    driver,
    load_function,
    nvrtc_version,
    options_for,
    tensor_map,
)
from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands

SOURCE = Path(__file__).with_name("cuda") / "attn_fwd_fp8.cu"
KERNEL_NAME = "attn_fwd_fp8"
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634


def define(name: str, default=dataclasses.MISSING):
    """A `Variant` field that is the kernel's compile-time switch `name` (-Dname=value)."""
    return dataclasses.field(default=default, metadata={"define": name})


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel: each field one of the kernel's -D switches
    (`defines`); speed, masking and the P builder (the recipe's P mode)."""

    head_dim: int = define("HEAD_DIM")
    causal: bool = define("CAUSAL")
    key_bias: bool = define("KEY_BIAS", False)
    stages: int = define("STAGES", 2)  # the K/V^T ring's depth
    exp_poly: int = define("EXP_POLY", 0)  # column groups (of 16) whose exp2 is a polynomial on the FMA units
    # FP8 P by the affine map (reference/affine.py; the affine FP8-P recipes): one FMA and one
    # max per score, no exp2
    affine_p: bool = define("AFFINE_P", False)
    # affine_p only: Recipe.rescale="lazy" (P mode 7): the rows' points move only when a byte
    # would not fit, so P is built without waiting for the tile's maximum
    lazy_rescale: bool = define("LAZY_RESCALE", False)
    # affine_p only: MXFP4 P by the affine map (P mode 5): per 32-key block its exponent and
    # a lookup of the block's e4m3 bytes, each score's code from one FMA (cuda/p_build.cuh)
    affine_mx: bool = define("AFFINE_MX", False)
    # K's scales one per key tile (`Recipe.k_scale="tile"`), folded into the rows' factors once
    # per tile instead of a product per score
    key_tile_scale: bool = define("KEY_TILE_SCALE", False)
    # Q and K in bf16, QK^T on the bf16 tensor cores (the exact recipes' operands); False: e4m3
    # on the FP8 tensor cores (the fast_accum recipes')
    qk_bf16: bool = define("QK_BF16", False)
    # consumer warpgroups of 64 query rows per CTA: 3 gives each scheduler a third softmax warp
    # to interleave, in 160 registers per thread (head dim 64 only: 128 would spill)
    consumers: int = define("CONSUMERS", 2)

    def __post_init__(self):
        if self.lazy_rescale and not self.affine_p:
            raise ValueError("Variant: lazy_rescale is a form of the affine FP8 P; it needs affine_p=True")
        if self.affine_mx and (not self.affine_p or self.lazy_rescale):
            raise ValueError("Variant: affine_mx is a form of the affine P with exact rescaling; it needs "
                             "affine_p=True and lazy_rescale=False")
        if self.consumers not in (2, 3) or (self.consumers == 3 and self.head_dim != 64):
            raise ValueError(f"Variant: consumers must be 2, or 3 at head dim 64; got {self.consumers} "
                             f"at head dim {self.head_dim}")

    @property
    def block_m(self) -> int:
        """Query rows per CTA."""
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def rowsum_by_pv(self) -> bool:
        """The row sums of P from the PV product (8 rows of ones after each V^T stage)."""
        return True

    def defines(self) -> list[str]:
        """The kernel's -D switches, one a field."""
        return [f"-D{f.metadata['define']}={int(getattr(self, f.name))}" for f in dataclasses.fields(self)]

    def shared_bytes(self) -> int:
        """Dynamic shared memory: Q's two buffers, the K and V^T rings, the consumers' output
        stages (64 rows of 2 * d + 16 bytes each), the key scales and bias, the mbarriers, and
        1024 bytes to align the tiles for the 128-byte swizzle (8 rows of ones after each V^T
        stage: the row sums' columns of the PV product)."""
        d, qk = self.head_dim, self.head_dim * (2 if self.qk_bf16 else 1)  # qk: bytes of a Q or K row
        tiles = 2 * self.block_m * qk + self.stages * (BLOCK_N * (qk + d) + (8 * BLOCK_N if self.rowsum_by_pv else 0))
        tiles += self.consumers * 64 * (2 * d + 16)
        return 1024 + tiles + 2 * self.stages * BLOCK_N * 4 + (4 + 5 * self.stages) * 8


# K/V^T ring depth per (head dim, causal): depths 2, 3 and 4 ran within 2% of each other
# (benchmarks/results/log/h200-forward-cuda-variants.txt, run A; docs/notes/hopper-forward.md)
STAGES = {(128, False): 2, (128, True): 2, (64, False): 2, (64, True): 2}


# of the 16 column groups of the exp2 builds' P, those whose exp2 is a polynomial on the FMA
# units: P codes 99.986% equal to the recipe's arithmetic, 2-9% faster than every exp2 by
# MUFU and 7-21% faster than the recipe's arithmetic at every measured shape
# (benchmarks/results/log/h200-forward-cuda-fused-poly.txt)
EXP_POLY = 4


# consumer warpgroups per CTA: three at head dim 64 (192 query rows; a third softmax warp per
# scheduler), +11-12% non-causal and +2-3% causal over two in the same run, outputs and P
# codes the same (benchmarks/results/log/h200-forward-cuda-consumers.txt); at 128 three do not fit
CONSUMERS = {(128, False): 2, (128, True): 2, (64, False): 3, (64, True): 3}


def variant_for(head_dim: int, causal: bool, key_bias: bool = False, affine_p: bool = False,
                key_tile_scale: bool = False, lazy_rescale: bool = False, affine_mx: bool = False,
                qk_bf16: bool = False) -> Variant:
    """The launcher's build; affine_p: the affine FP8-P recipes' (no exp2: exp_poly unused);
    key_tile_scale: K's scales one per key tile (`KernelOperands.k_tile_scales`);
    lazy_rescale: `Recipe.rescale="lazy"` (with affine_p); affine_mx: MXFP4 P by the affine
    map (with affine_p); qk_bf16: bf16 Q/K (the exact recipes)."""
    return Variant(head_dim, causal, key_bias, STAGES[head_dim, causal], exp_poly=0 if affine_p else EXP_POLY,
                   affine_p=affine_p, lazy_rescale=lazy_rescale, affine_mx=affine_mx,
                   key_tile_scale=key_tile_scale, qk_bf16=qk_bf16, consumers=CONSUMERS[head_dim, causal])


# the launcher's build fields of each P mode the kernel builds (routing.P_MODES): exp2 FP8 P,
# affine FP8 P, affine MXFP4 P, affine FP8 P rescaled lazily (`launch_forward_cuda(**...)`)
P_MODE_BUILDS: dict[int, dict[str, bool]] = {0: {}, 4: {"affine_p": True}, 5: {"affine_p": True, "affine_mx": True},
                                             7: {"affine_p": True, "lazy_rescale": True}}


def all_variants() -> list[Variant]:
    """Every variant the launcher can pick (what the compile check builds)."""
    # the affine builds: FP8 P, FP8 P rescaled lazily, MXFP4 P; bf16 Q/K (the exact recipes: no
    # lazy or per-tile form among them)
    affine = ((False, False), (True, False), (False, True))
    fp8 = [variant_for(d, c, kb, af, kt, lz, mx) for d in HEAD_DIMS for c in (False, True) for kb in (False, True)
           for af in (False, True) for kt in (False, True) for lz, mx in (affine if af else ((False, False),))]
    bf16 = [variant_for(d, c, kb, af, False, False, mx, qk_bf16=True) for d in HEAD_DIMS for c in (False, True)
            for kb in (False, True) for af, mx in ((False, False), (True, False), (True, True))]
    return fp8 + bf16


# ---------------------------------------------------------------------------- build
def compile_variant(variant: Variant, *, use_cache: bool = True, announce: bool = True) -> Build:
    """The variant's cubin for sm_90a, from the disk cache or built by NVRTC (no GPU needed)."""
    return compile_source(SOURCE, options_for(variant.defines()), f"the CUDA attention forward ({variant})",
                          use_cache=use_cache, announce=announce)


# ---------------------------------------------------------------------------- load and launch
def _function(variant: Variant, device: torch.device):
    """The loaded kernel for this variant in the device's primary context (torch's)."""
    return load_function(("forward", variant), lambda: compile_variant(variant), KERNEL_NAME, device,
                         variant.shared_bytes())


class Params(ctypes.Structure):
    # the kernel's `Params` (cuda/params_fwd.cuh): four 64-byte aligned tensor maps, pointers,
    # ints, the scale; padded to the C++ struct's size (a multiple of its 64-byte alignment)
    _fields_ = [("q_map", ctypes.c_uint8 * 128), ("k_map0", ctypes.c_uint8 * 128),
                ("k_map1", ctypes.c_uint8 * 128), ("v_map", ctypes.c_uint8 * 128),
                ("qs", ctypes.c_uint64), ("ks", ctypes.c_uint64), ("vs", ctypes.c_uint64),
                ("key_bias", ctypes.c_uint64), ("out", ctypes.c_uint64), ("lse", ctypes.c_uint64),
                ("H", ctypes.c_int32), ("group", ctypes.c_int32), ("Sq", ctypes.c_int32),
                ("Sk", ctypes.c_int32), ("causal_offset", ctypes.c_int32),
                ("k_rows_per_head", ctypes.c_int32), ("qk_scale", ctypes.c_float), ("units", ctypes.c_int32),
                ("_pad", ctypes.c_uint8 * 48)]


assert ctypes.sizeof(Params) == 640 and Params.units.offset == 588


def cuda_unsupported_reason(ops: KernelOperands, *, causal_offset: int | None = None,
                            key_bias: torch.Tensor | None = None) -> str | None:
    """Why the CUDA kernel cannot run these operands (None: it can)."""
    q, k, vt = ops.q, ops.k, ops.vt
    if not q.is_cuda:
        return "the CUDA forward runs on CUDA tensors only"
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        return f"the CUDA forward is built for sm_90a (Hopper); this GPU is sm_{major}{minor}"
    if q.dtype != k.dtype or q.dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        return (f"the CUDA forward multiplies e4m3 Q/K (the fast_accum recipes) or bf16 Q/K (the exact ones); "
                f"got {q.dtype} and {k.dtype}")
    if vt.dtype != torch.float8_e4m3fn:
        return f"the CUDA forward takes e4m3 V^T; got {vt.dtype}"
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if D not in HEAD_DIMS:
        return f"the CUDA forward has head dims {HEAD_DIMS}; got {D}"
    if H % Hkv:
        return f"query heads ({H}) must be a multiple of key/value heads ({Hkv})"
    if Sq < 1 or Sk < 1:
        return f"empty sequence (Sq={Sq}, Sk={Sk})"
    if key_bias is not None and tuple(key_bias.shape) != (B, Sk):
        return f"key_bias must be (B, Sk) = {(B, Sk)}; got {tuple(key_bias.shape)}"
    return None


def _k_rows(k: torch.Tensor) -> torch.Tensor:
    """K as contiguous rows, each head's keys padded with zero rows to a multiple of 16 (the
    permuted TMA boxes address keys in groups of 16; padded keys are masked)."""
    B, Hkv, Sk, D = k.shape
    if Sk % 16 == 0 and k.is_contiguous():
        return k
    padded = torch.zeros((B, Hkv, -(-Sk // 16) * 16, D), dtype=k.dtype, device=k.device)
    padded[:, :, :Sk] = k
    return padded


def _vt_rows(ops: KernelOperands) -> tuple[torch.Tensor, int]:
    """V^T as (B*Hkv*D, keys) rows with a 16-byte multiple stride (TMA), and that stride."""
    vt = ops.vt
    B, Hkv, D, Sk = vt.shape
    row = vt.stride(2)
    if (vt.stride(3) == 1 and row % 16 == 0 and row >= Sk and vt.stride(1) == D * row
            and vt.stride(0) == Hkv * vt.stride(1)):
        return vt, vt.stride(2)
    row = -(-Sk // 16) * 16
    padded = torch.zeros((B, Hkv, D, row), dtype=vt.dtype, device=vt.device)
    padded[..., :Sk] = vt
    return padded, row


@dataclass
class Launch:
    """One launch's parameter and grid, and the tensors it writes (`prepare_launch`)."""

    params: Params
    grid: int
    out: torch.Tensor  # (B, H, Sq, D) bf16
    lse: torch.Tensor  # (B, H, Sq) float32
    operands: tuple[torch.Tensor, ...]  # what the parameter points into, held until the launch is queued


def prepare_launch(ops: KernelOperands, variant: Variant, *, scale: float, causal_offset: int | None,
                   key_bias: torch.Tensor | None, persistent: bool) -> Launch:
    """The kernel parameter of a launch of `variant` on these operands, its grid (one CTA per
    work unit, or per SM with `persistent`), and the outputs it writes."""
    q = ops.q.contiguous()
    B, H, Sq, D = q.shape
    Hkv, Sk = ops.k.shape[1], ops.k.shape[2]
    k = _k_rows(ops.k)
    vt, vt_row = _vt_rows(ops)
    qs, ks, vs = ops.qs.float().contiguous(), ops.ks.float().contiguous(), ops.vs.float().contiguous()
    kb = key_bias.float().contiguous() if key_bias is not None else None
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)

    rb = D * q.element_size()  # bytes of a Q or K row; the tiles are loaded in chunks of one swizzle span
    chunk = min(rb, 128)
    k_rows = k.shape[0] * k.shape[1] * k.shape[2]
    p = Params()
    maps = (
        tensor_map(q.data_ptr(), [rb, B * H * Sq], [rb], [chunk, variant.block_m], chunk),
        # K's rows permuted per 16 keys (see cuda/kernel_fwd.cuh): keys 16n + 4q + 2h + b
        # land in row 64h + 8n + 2q + b of the tile, one box per h (and chunk)
        tensor_map(k.data_ptr(), [rb, 2, 4, k_rows // 16], [rb, 4 * rb, 16 * rb], [chunk, 2, 4, 8], chunk),
        tensor_map(k.data_ptr() + 2 * rb, [rb, 2, 4, k_rows // 16], [rb, 4 * rb, 16 * rb], [chunk, 2, 4, 8],
                    chunk),
        tensor_map(vt.data_ptr(), [Sk, B * Hkv * D], [vt_row], [BLOCK_N, D], 128),
    )
    for name, data in zip(("q_map", "k_map0", "k_map1", "v_map"), maps):
        ctypes.memmove(ctypes.addressof(getattr(p, name)), data, 128)
    p.qs, p.ks, p.vs = qs.data_ptr(), ks.data_ptr(), vs.data_ptr()
    p.key_bias = kb.data_ptr() if kb is not None else 0
    p.out, p.lse = out.data_ptr(), lse.data_ptr()
    p.H, p.group, p.Sq, p.Sk = H, H // Hkv, Sq, Sk
    p.causal_offset = causal_offset or 0
    p.k_rows_per_head = k.shape[2]
    p.qk_scale = scale * LOG2E
    p.units = B * H * -(-Sq // variant.block_m)
    # the kernel's __launch_bounds__(THREADS, 1) and shared memory leave one CTA an SM
    grid = min(p.units, sm_count(q.device)) if persistent else p.units
    return Launch(p, grid, out, lse, (q, k, vt, qs, ks, vs, *([kb] if kb is not None else [])))


def launch_kernel(fn, params: ctypes.Structure, variant: Variant, grid: int, device: torch.device) -> None:
    """Queue the loaded kernel `fn` on torch's current stream with `params` (the kernel's one
    parameter, by value)."""
    drv = driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    stream = drv.CUstream(torch.cuda.current_stream(device).cuda_stream)
    check((drv.cuLaunchKernel(fn, grid, 1, 1, variant.threads, 1, 1,
                               variant.shared_bytes(), stream,
                               ctypes.addressof(args), 0)[0], None), "cuLaunchKernel")


def launch_forward_cuda(ops: KernelOperands, *, scale: float, causal_offset: int | None,
                        key_bias: torch.Tensor | None = None, affine_p: bool = False, lazy_rescale: bool = False,
                        affine_mx: bool = False, persistent: bool = False, **variant):
    """Run the CUDA kernel on prepared operands (`KernelOperands`, e4m3 Q/K/V^T): (out bf16
    (B, H, Sq, D), lse float32 (B, H, Sq)). causal_offset: query i sees keys j <= i + offset
    (None: no causal mask); key_bias: (B, Sk) float32 log2-unit bias (`key_bias_of_mask`).
    To measure: `variant`, `Variant` fields in place of the table's (stages, exp_poly,
    consumers). affine_p: FP8 P by the affine map (P mode 4) instead of exp2 (P mode 0),
    lazy_rescale with it `Recipe.rescale="lazy"` (P mode 7), affine_mx with it MXFP4 P by the
    affine map (P mode 5; V^T holds MXFP4 V as `operands.prepare_operands`);
    `ops.k_tile_scales` picks the build that folds K's per-tile scale into the rows'
    factors. persistent: one CTA per SM, each taking work units (query blocks of a head)
    in turn, instead of one CTA per unit (the same arithmetic, unit for unit)."""
    fields = {"stages", "exp_poly", "consumers"}
    unknown = sorted(set(variant) - fields)
    if unknown:
        raise ValueError(f"launch_forward_cuda: unknown variant fields {unknown}; accepted: {sorted(fields)}")
    reason = cuda_unsupported_reason(ops, causal_offset=causal_offset, key_bias=key_bias)
    if reason:
        raise ValueError(f"launch_forward_cuda: {reason}")
    D = ops.q.shape[-1]
    built = dataclasses.replace(variant_for(D, causal_offset is not None, key_bias is not None, affine_p,
                                            ops.k_tile_scales, lazy_rescale, affine_mx,
                                            ops.q.dtype == torch.bfloat16), **variant)
    launch = prepare_launch(ops, built, scale=scale, causal_offset=causal_offset, key_bias=key_bias,
                            persistent=persistent)
    launch_kernel(_function(built, ops.q.device), launch.params, built, launch.grid, ops.q.device)
    return launch.out, launch.lse
