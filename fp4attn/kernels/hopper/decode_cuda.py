"""The decode split kernel in CUDA C++ (`cuda/decode_split.cu`): one warp a split, no
barrier (the Triton kernel's four warps cross twice a key tile), its key tiles streamed
through a per-warp cp.async ring in shared memory, for one new query row per sequence
over bf16, FP8, NVFP4 or MXFP4 keys and values (what it takes: `routing.decode.cuda_unsupported_reason`),
and the combine of its partials (`decode_combine`, the same merge as the Triton
combine's). Same numerics as the Triton kernel (`reference/decode.py`); `decode_op`
routes to it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4attn.kernels.hopper.nvrtc_build import (  # noqa: F401
    Build,
    check,
    compile_source,
    driver,
    load_function,
    options_for,
)
from fp4attn.routing.decode import (
    CUDA_STAGES,
    CUDA_TILE,
    CUDA_WARPS,
    DECODE_HEAD_DIMS,
    SM90_SHARED,
    cuda_ring_refused,
    cuda_stages,
    cuda_unsupported_reason,
    resident_programs,
)

SOURCE = Path(__file__).with_name("cuda") / "decode_split.cu"
KERNEL_NAME, COMBINE_NAME = "decode_split", "decode_combine"
FORMATS = {"bf16": 0, "fp8": 1, "nvfp4": 2, "mxfp4": 3}  # decode_op.FORMAT_CODES, of routing.decode.CUDA_FORMATS
COMBINE_WARPS = 8
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the combine's OUT_KIND


def _key_words(head_dim: int, fmt: str) -> int:
    """u32 words of one key in a lane's ring slot (decode_split.cu's `Raw::k`; bf16 keys: two
    unused words that keep the values 16-byte aligned, their tile is the warp's)."""
    return {"nvfp4": head_dim // 32, "mxfp4": head_dim // 32, "bf16": 2}.get(fmt, head_dim // 16)


def _scale_words(head_dim: int, fmt: str, rows: int) -> int:
    """u32 words of the block-scale rows a lane's slot holds (decode_split.cu's `Raw::ksc`,
    `Raw::vsc`): `rows` token rows of D/16 bytes (NVFP4) or D/32 (MXFP4); one row of D/16
    bytes, unused, for the other formats."""
    return {"nvfp4": rows * head_dim // 64, "mxfp4": rows * head_dim // 128}.get(fmt, head_dim // 64)


def _value_words(head_dim: int, fmt: str) -> int:
    """u32 words of one value row in a lane's ring slot (decode_split.cu's `Raw::v`; bf16
    values: one unused word, their tile is the warp's)."""
    return {"nvfp4": head_dim // 64, "mxfp4": head_dim // 64, "bf16": 1}.get(fmt, head_dim // 32)


@dataclass(frozen=True)
class Variant:
    head_dim: int
    k_format: str
    v_format: str
    hi_rows: bool  # more than 8 query rows
    warps: int = CUDA_WARPS
    stages: int = CUDA_STAGES  # the per-warp ring's key tiles (0: the next tile prefetched in registers)
    ablate: int = 0  # timing-only builds (wrong outputs): 1, no dequantization (tools/probe_decode_bound.py)

    def defines(self) -> list[str]:
        return [f"-DHEAD_DIM={self.head_dim}", f"-DK_FMT={FORMATS[self.k_format]}",
                f"-DV_FMT={FORMATS[self.v_format]}", f"-DHI_ROWS={int(self.hi_rows)}", f"-DWARPS={self.warps}",
                f"-DSTAGES={self.stages}", f"-DCOMBINE_WARPS={COMBINE_WARPS}", f"-DSLOT_BYTES={self.slot_bytes()}",
                f"-DABLATE_DEQUANT={self.ablate}"]

    def slot_bytes(self) -> int:
        """A lane's slot of one key tile in the ring (decode_split.cu's `Raw` and `SLOT`):
        codes, token scales, block-scale rows, in an odd number of 16-byte units."""
        d = self.head_dim
        words = (2 * _key_words(d, self.k_format) + 4 * _value_words(d, self.v_format) + 8
                 + _scale_words(d, self.k_format, 2) + _scale_words(d, self.v_format, 4))
        units = -(-words // 4)
        return 16 * (units if units % 2 else units + 1)

    def shared_bytes(self) -> int:
        """Dynamic shared memory of one CTA: its warps' rings (each lane's slots, and the
        warp's tiles of bf16 keys and values: 16 rows of 2 D bytes each, decode_split.cu's
        STAGE_TILES)."""
        tiles = 16 * 2 * self.head_dim * [self.k_format, self.v_format].count("bf16")
        return self.stages * self.warps * (32 * self.slot_bytes() + tiles)


def all_variants(stages: tuple[int, ...] | None = None) -> list[Variant]:
    """Every variant the routing can pick (`stages`: these ring depths instead of the
    routed one)."""
    variants = [Variant(d, kf, vf, hi, stages=st) for d in DECODE_HEAD_DIMS for kf in FORMATS for vf in FORMATS
                for hi in (False, True) for st in (stages or (cuda_stages(kf, vf),))
                if not cuda_ring_refused(kf, vf, st) and cuda_unsupported_reason(kf, vf, d, 1, 1, CUDA_TILE) is None]
    # a ring two CTAs cannot hold together is no variant (bf16's three tiles at D=128)
    return [v for v in variants if 2 * v.shared_bytes() <= SM90_SHARED]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "ka", "ks", "kt", "va", "vs", "vt", "table", "lens", "start",
                                               "o_acc", "o_ml")] + \
               [(n, ctypes.c_int) for n in ("hkv", "page_size", "table_stride", "hq", "group", "batch",
                                            "split_tokens", "has_start")] + [("qk_scale", ctypes.c_float)]


class _CombineArgs(ctypes.Structure):
    """The combine's parameters side by side; the launch points at each field."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("o_acc", "o_ml", "out", "lse")] + \
               [(n, ctypes.c_int) for n in ("n_rows", "splits", "out_kind")]


_COMBINE_OFFSETS = tuple(getattr(_CombineArgs, f[0]).offset for f in _CombineArgs._fields_)
_SplitArgv = ctypes.c_void_p * 1
_CombineArgv = ctypes.c_void_p * len(_COMBINE_OFFSETS)


@functools.cache
def compile_variant(variant: Variant, use_cache: bool = True) -> Build:
    return compile_source(SOURCE, options_for(variant.defines()), f"the CUDA decode kernel ({variant})",
                          use_cache=use_cache)


@functools.cache
def resident_ctas(variant: Variant) -> int:
    """CTAs of the variant an sm_90 SM holds (registers from ptxas's report, its rings'
    shared memory)."""
    registers = compile_variant(variant).registers(KERNEL_NAME) or 255
    return resident_programs(registers, variant.warps, variant.shared_bytes())


class Launcher:
    """One variant's split kernel and combine on one device: the functions loaded at the
    first launch, each call only its parameters packed (a fresh block a launch: the driver
    copies it at the launch, and two threads may launch at once)."""

    def __init__(self, variant: Variant, device: torch.device):
        self.variant, self.device = variant, device
        self.shared = variant.shared_bytes()
        self.threads = 32 * variant.warps
        self._split = self._combine = None

    def split(self, q: torch.Tensor, ka, ks, kt, va, vs, vt, table: torch.Tensor, lengths: torch.Tensor,
              key_start: torch.Tensor | None, o_acc: torch.Tensor, o_ml: torch.Tensor, *, kv_heads: int,
              page_size: int, split_tokens: int, ctas: int, qk_scale: float, stream: int) -> None:
        """The split kernel over grid (ctas, B * kv_heads): warp w of CTA c writes split
        c * warps + w of o_acc / o_ml ((ctas * warps, B, Hq, 1, D) and (..., 2) float32)."""
        B, Hq = q.shape[0], q.shape[1]
        has_start = key_start is not None
        p = _Params(q.data_ptr(), ka.data_ptr(), ks.data_ptr(), kt.data_ptr(), va.data_ptr(), vs.data_ptr(),
                    vt.data_ptr(), table.data_ptr(), lengths.data_ptr(),
                    key_start.data_ptr() if key_start is not None else 0,
                    o_acc.data_ptr(), o_ml.data_ptr(), kv_heads, page_size, table.stride(0), Hq, Hq // kv_heads, B,
                    split_tokens, int(has_start), qk_scale)
        fn = self._split
        if fn is None:
            variant = self.variant
            fn = self._split = load_function(("decode", variant), lambda: compile_variant(variant), KERNEL_NAME,
                                             self.device, self.shared)
        _launch(fn, (ctas, B * kv_heads), self.threads, self.shared, _SplitArgv(ctypes.addressof(p)), stream)

    def combine(self, o_acc: torch.Tensor, o_ml: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                stream: int) -> None:
        """out (B, Hq, Sq, D) in float32, bf16 or fp16 and lse (B, Hq, Sq) from the splits'
        partials o_acc (splits, B, Hq, Sq, D) and o_ml (..., 2): a row a CTA."""
        n_rows = out.numel() // out.shape[-1]
        p = _CombineArgs(o_acc.data_ptr(), o_ml.data_ptr(), out.data_ptr(), lse.data_ptr(), n_rows, o_acc.shape[0],
                         OUT_KINDS[out.dtype])
        base = ctypes.addressof(p)
        fn = self._combine
        if fn is None:
            variant = self.variant
            fn = self._combine = load_function(("decode", variant, COMBINE_NAME), lambda: compile_variant(variant),
                                               COMBINE_NAME, self.device)
        _launch(fn, (n_rows, 1), 32 * COMBINE_WARPS, 0, _CombineArgv(*map(base.__add__, _COMBINE_OFFSETS)), stream)


def _stream_object_handle(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


current_stream: Callable[[int], int]  # the current stream's handle on a device, without a Stream object
try:  # as Triton's launcher asks it
    from torch._C import _cuda_getCurrentRawStream as current_stream
except ImportError:  # a torch built without CUDA
    current_stream = _stream_object_handle


def _launch(fn, grid: tuple[int, int], threads: int, shared: int, args, stream: int) -> None:
    check((driver().cuLaunchKernel(fn, grid[0], grid[1], 1, threads, 1, 1, shared, stream, ctypes.addressof(args),
                                   0)[0], None), "cuLaunchKernel")
