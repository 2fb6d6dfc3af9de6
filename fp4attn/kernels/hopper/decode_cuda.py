"""The decode split kernel in CUDA C++ (`cuda/decode_split.cu`): one warp a split, no
shared memory and no barrier (the Triton kernel's four warps cross twice a key tile), for
one new query row per sequence over FP8 or NVFP4 keys and values (what it takes:
`decode_routing.cuda_unsupported_reason`). Its partials go to
the Triton combine kernel (`decode_triton.decode_combine_kernel`) as splits of their own.
Same numerics as the Triton kernel (`reference/decode.py`); `decode_op` routes to it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4attn.decode_routing import CUDA_WARPS, DECODE_HEAD_DIMS, resident_programs
from fp4attn.kernels.hopper.nvrtc_build import (Build, check, compile_source, driver, load_function,  # noqa: F401
                                               options_for)

SOURCE = Path(__file__).with_name("cuda") / "decode_split.cu"
KERNEL_NAME = "decode_split"
FORMATS = {"fp8": 1, "nvfp4": 2}  # decode_op.FORMAT_CODES, of decode_routing.CUDA_FORMATS


@dataclass(frozen=True)
class Variant:
    head_dim: int
    k_format: str
    v_format: str
    hi_rows: bool  # more than 8 query rows
    warps: int = CUDA_WARPS

    def defines(self) -> list[str]:
        return [f"-DHEAD_DIM={self.head_dim}", f"-DK_FMT={FORMATS[self.k_format]}",
                f"-DV_FMT={FORMATS[self.v_format]}", f"-DHI_ROWS={int(self.hi_rows)}", f"-DWARPS={self.warps}"]


def all_variants() -> list[Variant]:
    return [Variant(d, kf, vf, hi) for d in DECODE_HEAD_DIMS for kf in FORMATS for vf in FORMATS for hi in (False, True)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "ka", "ks", "kt", "va", "vs", "vt", "table", "lens", "start",
                                               "o_acc", "o_ml")] + \
               [(n, ctypes.c_int) for n in ("hkv", "page_size", "table_stride", "hq", "group", "batch",
                                            "split_tokens", "has_start")] + [("qk_scale", ctypes.c_float)]


@functools.cache
def compile_variant(variant: Variant, use_cache: bool = True) -> Build:
    return compile_source(SOURCE, options_for(variant.defines()), f"the CUDA decode kernel ({variant})",
                          use_cache=use_cache)


def resident_ctas(variant: Variant) -> int:
    """CTAs of the variant an sm_90 SM holds (registers from ptxas's report)."""
    return resident_programs(compile_variant(variant).registers() or 255, variant.warps, 0)


def launch_split(q: torch.Tensor, ka, ks, kt, va, vs, vt, table: torch.Tensor, lengths: torch.Tensor,
                 key_start: torch.Tensor | None, o_acc: torch.Tensor, o_ml: torch.Tensor, *, variant: Variant,
                 kv_heads: int, page_size: int, split_tokens: int, ctas: int, qk_scale: float) -> None:
    """The split kernel over grid (ctas, B * kv_heads): warp w of CTA c writes split
    c * warps + w of o_acc / o_ml ((ctas * warps, B, Hq, 1, D) and (..., 2) float32)."""
    B, Hq, _, _ = q.shape
    p = _Params()
    for name, t in (("q", q), ("ka", ka), ("ks", ks), ("kt", kt), ("va", va), ("vs", vs), ("vt", vt),
                    ("table", table), ("lens", lengths), ("o_acc", o_acc), ("o_ml", o_ml)):
        setattr(p, name, t.data_ptr())
    p.start = key_start.data_ptr() if key_start is not None else 0
    p.hkv, p.page_size, p.table_stride, p.hq = kv_heads, page_size, table.stride(0), Hq
    p.group, p.batch, p.split_tokens, p.has_start = Hq // kv_heads, B, split_tokens, int(key_start is not None)
    p.qk_scale = qk_scale
    fn = load_function(("decode", variant), lambda: compile_variant(variant), KERNEL_NAME, q.device)
    drv = driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(p))
    stream = drv.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    check((drv.cuLaunchKernel(fn, ctas, B * kv_heads, 1, 32 * variant.warps, 1, 1, 0, stream,
                              ctypes.addressof(args), 0)[0], None), "cuLaunchKernel")
