"""The Hopper FP8 attention forward in CUDA C++ (`cuda/attn_fwd_fp8.cu`): FlashAttention-3's
schedule (a TMA producer warpgroup, two consumer warpgroups taking turns on the tensor
cores, setmaxnreg), which Triton 3.6 cannot express (docs/notes/hopper-forward.md).

Built at first use by NVRTC through `cuda-bindings` (no CUDA toolkit needed), one cubin
per variant (head dim, causal, key bias, stages), cached on disk under
$FP4ATTN_CACHE_DIR or ~/.cache/fp4attn, keyed by the source, the options and NVRTC's
version; a build prints one line. `compile_variant` also runs without a GPU (the CPU
compile check); launching needs one.

Numerics: the `fast_accum` recipes (e4m3 Q/K) and, with `Variant.qk_bf16`, the exact ones
(bf16 Q/K, whose e4m3 or NVFP4 values bf16 holds exactly); P as FP8 from exp2, FP8 or MXFP4
from the affine map (`affine_p`, `affine_mx`). The launcher's build (`SOFTMAX`) does
FlashAttention-3's per-score work, with the row sums of P from the PV product and a
quarter of the exp2s by a polynomial: P codes equal to the recipe's on 99.986% of entries
(the issue's bar is 99.9%), outputs within bf16 rounding. `MEASURED["recipe"]` builds the
Gluon kernel's arithmetic (forward_gluon_ws.attn_fwd_ws_kernel) operation for operation,
measured bit-identical to it (benchmarks/results/log/h200-forward-cuda.txt).
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


@dataclass(frozen=True)
class Variant:
    """One compiled form of the kernel (speed and masking only; the arithmetic is the same)."""

    head_dim: int
    causal: bool
    key_bias: bool = False
    stages: int = 2
    ablate_softmax: bool = False  # timing only: no softmax, wrong outputs (the kernel's ceiling)
    rowsum_int: bool = False  # the row sums' e4m3 -> f16 on the integer units (bit-identical)
    # one FMA per score into exp2 and the row sums from the PV product (the kernel's header):
    # P codes equal to the others' but for rounding, l with the tensor core's FP8 sums
    fused_softmax: bool = False
    exp_poly: int = 0  # fused_softmax only: column groups (of 16) whose exp2 is a polynomial on the FMA units
    # fused_softmax only: FP8 P by the affine map (reference/affine.py; the affine FP8-P
    # recipes): one FMA and one max per score, no exp2
    affine_p: bool = False
    # affine_p timing builds (wrong outputs): 1 without the key-scale product, 2 also without
    # the row maximum (docs/notes/affine-p.md places the softmax's cost with them)
    affine_ablate: int = 0
    # affine_p only: Recipe.rescale="lazy" (P mode 7): the rows' points move only when a byte
    # would not fit, so P is built without waiting for the tile's maximum
    lazy_rescale: bool = False
    # affine_p only: MXFP4 P by the affine map (P mode 5): per 32-key block its exponent and
    # a lookup of the block's e4m3 bytes, each score's code from one FMA (the kernel's header)
    affine_mx: bool = False
    # affine_mx with K per key and no key bias: codes read off subnormal FMA results, no
    # subtraction a score (the kernel's header); False, the subtraction (measured beside)
    mx_subnormal: bool = True
    # fused_softmax only: K's scales one per key tile (`Recipe.k_scale="tile"`), folded into
    # the rows' factors once per tile instead of a product per score
    key_tile_scale: bool = False
    # Q and K in bf16, QK^T on the bf16 tensor cores (the exact recipes' operands); False: e4m3
    # on the FP8 tensor cores (the fast_accum recipes')
    qk_bf16: bool = False
    # consumer warpgroups of 64 query rows per CTA: 3 gives each scheduler a third softmax warp
    # to interleave, in 160 registers per thread (head dim 64 only: 128 would spill)
    consumers: int = 2
    dump_p: bool = False  # checking only: every tile's P codes written to a buffer
    ablate_epilogue: bool = False  # timing only: no epilogue, no outputs (what a unit's end costs)

    def __post_init__(self):
        if (self.affine_p or self.key_tile_scale) and not self.fused_softmax:
            raise ValueError("Variant: affine_p and key_tile_scale are forms of the fused softmax; they need "
                             "fused_softmax=True")
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

    def defines(self) -> list[str]:
        return [f"-DHEAD_DIM={self.head_dim}", f"-DCAUSAL={int(self.causal)}",
                f"-DKEY_BIAS={int(self.key_bias)}", f"-DSTAGES={self.stages}",
                f"-DABLATE_SOFTMAX={int(self.ablate_softmax)}", f"-DROWSUM_INT={int(self.rowsum_int)}",
                f"-DFUSED_SOFTMAX={int(self.fused_softmax)}", f"-DEXP_POLY={self.exp_poly}",
                f"-DCONSUMERS={self.consumers}", f"-DDUMP_P={int(self.dump_p)}", f"-DAFFINE_P={int(self.affine_p)}",
                f"-DAFFINE_ABLATE={self.affine_ablate}", f"-DKEY_TILE_SCALE={int(self.key_tile_scale)}",
                f"-DLAZY_RESCALE={int(self.lazy_rescale)}", f"-DAFFINE_MX={int(self.affine_mx)}",
                f"-DMX_SUBNORMAL_OK={int(self.mx_subnormal)}", f"-DQK_BF16={int(self.qk_bf16)}",
                f"-DABLATE_EPILOGUE={int(self.ablate_epilogue)}"]

    def shared_bytes(self) -> int:
        """Dynamic shared memory: Q's two buffers, the K and V^T rings, the consumers' output
        stages (64 rows of 2 * d + 16 bytes each), the key scales and bias, the mbarriers, and
        1024 bytes to align the tiles for the 128-byte swizzle (with fused_softmax, 8 rows of
        ones after each V^T stage)."""
        d, qk = self.head_dim, self.head_dim * (2 if self.qk_bf16 else 1)  # qk: bytes of a Q or K row
        tiles = 2 * self.block_m * qk + self.stages * (BLOCK_N * (qk + d) + (8 * BLOCK_N if self.fused_softmax else 0))
        tiles += self.consumers * 64 * (2 * d + 16)
        return 1024 + tiles + 2 * self.stages * BLOCK_N * 4 + (4 + 5 * self.stages) * 8


# K/V^T ring depth per (head dim, causal): depths 2, 3 and 4 ran within 2% of each other
# (benchmarks/results/log/h200-forward-cuda-variants.txt, run A; docs/notes/hopper-forward.md)
STAGES = {(128, False): 2, (128, True): 2, (64, False): 2, (64, True): 2}
# the row sums' e4m3 -> f16 on the integer units per (head dim, causal): bit-identical results;
# at D=128 7-9% faster non-causal, 0.4-1.8% causal, at D=64 0 to -1% (noise)
# (benchmarks/results/log/h200-forward-cuda-softmax.txt, cuda against cuda_isum)
ROWSUM_INT = {(128, False): True, (128, True): True, (64, False): False, (64, True): False}


# the softmax the launcher builds: FlashAttention-3's per-score work with the row sums from
# the PV product (fused_softmax) and a quarter of the exp2s by polynomial (exp_poly=4):
# P codes 99.986% equal to the recipe's arithmetic, 2-9% faster than the fused softmax
# alone and 7-21% faster than the recipe's arithmetic at every measured shape
# (benchmarks/results/log/h200-forward-cuda-fused-poly.txt)
SOFTMAX = {"fused_softmax": True, "exp_poly": 4}


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
    softmax = (dict(SOFTMAX, exp_poly=0, affine_p=True, lazy_rescale=lazy_rescale, affine_mx=affine_mx) if affine_p
               else SOFTMAX)
    return Variant(head_dim, causal, key_bias, STAGES[head_dim, causal],
                   rowsum_int=ROWSUM_INT[head_dim, causal], consumers=CONSUMERS[head_dim, causal],
                   key_tile_scale=key_tile_scale, qk_bf16=qk_bf16, **softmax)


# the launcher's build fields of each P mode the kernel builds (routing.P_MODES): exp2 FP8 P,
# affine FP8 P, affine MXFP4 P, affine FP8 P rescaled lazily (`launch_forward_cuda(**...)`)
P_MODE_BUILDS: dict[int, dict[str, bool]] = {0: {}, 4: {"affine_p": True}, 5: {"affine_p": True, "affine_mx": True},
                                             7: {"affine_p": True, "lazy_rescale": True}}


def measured_variants() -> list[Variant]:
    """The softmax variants built for measurement beside the launcher's (compile-checked too)."""
    return [dataclasses.replace(variant_for(d, c), **kw) for d in HEAD_DIMS for c in (False, True)
            for kw in MEASURED.values()]


# the softmax variants measured beside the launcher's (benchmarks/bench_forward_cuda.py
# --variants; Variant fields over the table's); exp2 in f16x2 was measured and removed
# (benchmarks/results/log/h200-forward-cuda-softmax.txt, commit 0702b95)
MEASURED = {
    # the recipe's arithmetic operation for operation: bit-identical to the Gluon kernel
    # (the checking script's base), row sums converted on the integer units at D=128
    "recipe": {"fused_softmax": False, "exp_poly": 0, "consumers": 2},
    "cvt": {"fused_softmax": False, "exp_poly": 0, "rowsum_int": False, "consumers": 2},  # row sums by cvt: bit-identical
    "fused": {"exp_poly": 0, "consumers": 2},  # the fused softmax, every exp2 by MUFU
    "fpoly8": {"exp_poly": 8},  # half of the exp2s by polynomial
    "c2": {"consumers": 2},  # two consumer warpgroups at head dim 64 too (the launcher's take three)
}
EXACT_VARIANTS = ("recipe", "cvt")  # bit-identical to each other and to the Gluon kernel, or wrong


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


class _Params(ctypes.Structure):
    # the kernel's `Params`: four 64-byte aligned tensor maps, pointers, ints, the scale;
    # padded to the C++ struct's size (a multiple of its 64-byte alignment)
    _fields_ = [("q_map", ctypes.c_uint8 * 128), ("k_map0", ctypes.c_uint8 * 128),
                ("k_map1", ctypes.c_uint8 * 128), ("v_map", ctypes.c_uint8 * 128),
                ("qs", ctypes.c_uint64), ("ks", ctypes.c_uint64), ("vs", ctypes.c_uint64),
                ("key_bias", ctypes.c_uint64), ("out", ctypes.c_uint64), ("lse", ctypes.c_uint64),
                ("H", ctypes.c_int32), ("group", ctypes.c_int32), ("Sq", ctypes.c_int32),
                ("Sk", ctypes.c_int32), ("causal_offset", ctypes.c_int32),
                ("k_rows_per_head", ctypes.c_int32), ("qk_scale", ctypes.c_float), ("units", ctypes.c_int32),
                ("p_dump", ctypes.c_uint64),  # at 592 (8-byte aligned, as in C++)
                ("_pad", ctypes.c_uint8 * 40)]


assert ctypes.sizeof(_Params) == 640 and _Params.p_dump.offset == 592


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


def _p_dump_shape(ops: KernelOperands, consumers: int) -> tuple[int, ...]:
    """(B*H, query blocks, key tiles, consumer threads, 64): a P dump of a build with
    `consumers` consumer warpgroups (64 query rows and 128 threads each)."""
    B, H, Sq, _ = ops.q.shape
    return (B * H, -(-Sq // (64 * consumers)), -(-ops.k.shape[2] // BLOCK_N), 128 * consumers, 64)


def p_dump_buffer(ops: KernelOperands, consumers: int) -> torch.Tensor:
    """A buffer for `launch_forward_cuda(p_dump=...)` of a build with `consumers` consumer
    warpgroups: (B*H, query blocks, key tiles, consumer threads, 64) uint8 filled with 0xFF
    (never a P code: tiles a block skips keep it)."""
    return torch.full(_p_dump_shape(ops, consumers), 0xFF, dtype=torch.uint8, device=ops.q.device)


def p_codes_by_slab(p_dump: torch.Tensor, rows: int, causal: bool) -> torch.Tensor:
    """A `p_dump_buffer` of any build as (B*H, 64-row slabs, key tiles, 128 threads, 64): the
    same layout whatever the consumers per CTA, so that two builds' P codes compare entry for
    entry; `rows` (Sq) bounds the slabs. The dump is by CTA, and causal grids run the query
    blocks last to first."""
    bh, blocks, tiles, threads, _ = p_dump.shape
    consumers = threads // 128
    if causal:
        p_dump = p_dump.flip(1)
    slabs = p_dump.view(bh, blocks, tiles, consumers, 128, 64).permute(0, 1, 3, 2, 4, 5)
    return slabs.reshape(bh, blocks * consumers, tiles, 128, 64)[:, :-(-rows // 64)]


def launch_forward_cuda(ops: KernelOperands, *, scale: float, causal_offset: int | None,
                        key_bias: torch.Tensor | None = None, p_dump: torch.Tensor | None = None,
                        affine_p: bool = False, lazy_rescale: bool = False, affine_mx: bool = False,
                        persistent: bool = False, **variant):
    """Run the CUDA kernel on prepared operands (`KernelOperands`, e4m3 Q/K/V^T): (out bf16
    (B, H, Sq, D), lse float32 (B, H, Sq)). causal_offset: query i sees keys j <= i + offset
    (None: no causal mask); key_bias: (B, Sk) float32 log2-unit bias (`key_bias_of_mask`).
    To measure: `variant`, `Variant` fields in place of the table's (stages, ablate_softmax,
    rowsum_int, fused_softmax, exp_poly; `MEASURED`); p_dump, a `p_dump_buffer` that
    receives every tile's P codes. affine_p: FP8 P by the affine map (P mode 4) instead of
    exp2 (P mode 0), lazy_rescale with it `Recipe.rescale="lazy"` (P mode 7), affine_mx with
    it MXFP4 P by the affine map (P mode 5; V^T holds MXFP4 V as `operands.prepare_operands`);
    `ops.k_tile_scales` picks the build that folds K's per-tile scale into the rows'
    factors. persistent: one CTA per SM, each taking work units (query blocks of a head)
    in turn, instead of one CTA per unit (the same arithmetic, unit for unit)."""
    fields = {f.name for f in dataclasses.fields(Variant)} - {"head_dim", "causal", "key_bias", "dump_p", "affine_p",
                                                             "key_tile_scale", "lazy_rescale", "affine_mx", "qk_bf16"}
    unknown = sorted(set(variant) - fields)
    if unknown:
        raise ValueError(f"launch_forward_cuda: unknown variant fields {unknown}; accepted: {sorted(fields)}")
    reason = cuda_unsupported_reason(ops, causal_offset=causal_offset, key_bias=key_bias)
    if reason:
        raise ValueError(f"launch_forward_cuda: {reason}")
    q = ops.q.contiguous()
    B, H, Sq, D = q.shape
    Hkv, Sk = ops.k.shape[1], ops.k.shape[2]
    variant = dataclasses.replace(variant_for(D, causal_offset is not None, key_bias is not None, affine_p,
                                              ops.k_tile_scales, lazy_rescale, affine_mx,
                                              ops.q.dtype == torch.bfloat16), **variant,
                                  dump_p=p_dump is not None)
    if p_dump is not None:
        need = _p_dump_shape(ops, variant.consumers)
        if p_dump.dtype != torch.uint8 or tuple(p_dump.shape) != need or not p_dump.is_contiguous():
            raise ValueError(f"launch_forward_cuda: p_dump must be contiguous uint8 {need} (p_dump_buffer)")
    k = _k_rows(ops.k)
    vt, vt_row = _vt_rows(ops)
    qs, ks, vs = ops.qs.float().contiguous(), ops.ks.float().contiguous(), ops.vs.float().contiguous()
    kb = key_bias.float().contiguous() if key_bias is not None else None
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)

    rb = D * q.element_size()  # bytes of a Q or K row; the tiles are loaded in chunks of one swizzle span
    chunk = min(rb, 128)
    k_rows = k.shape[0] * k.shape[1] * k.shape[2]
    p = _Params()
    maps = (
        tensor_map(q.data_ptr(), [rb, B * H * Sq], [rb], [chunk, variant.block_m], chunk),
        # K's rows permuted per 16 keys (see the kernel's header): keys 16n + 4q + 2h + b
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
    p.p_dump = p_dump.data_ptr() if p_dump is not None else 0
    p.units = B * H * -(-Sq // variant.block_m)
    # the kernel's __launch_bounds__(THREADS, 1) and shared memory leave one CTA an SM
    grid = min(p.units, sm_count(q.device)) if persistent else p.units

    fn = _function(variant, q.device)
    drv = driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(p))
    stream = drv.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    check((drv.cuLaunchKernel(fn, grid, 1, 1, variant.threads, 1, 1,
                               variant.shared_bytes(), stream,
                               ctypes.addressof(args), 0)[0], None), "cuLaunchKernel")
    return out, lse
