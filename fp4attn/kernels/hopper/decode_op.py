"""The KV cache append and the decode attention on Hopper as registered custom ops (each
with a fake implementation, so torch.compile traces through them), and their launchers.

The ops take the cache's pool tensors, never the `KVCache` object: a custom op's
arguments are tensors and plain values. Formats without block or token scales pass an
empty tensor in their place (never read).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from fp4attn import decode_routing
from fp4attn.kernels.common import sm_count
from fp4attn.kernels.hopper.decode_triton import decode_combine_kernel, decode_split_kernel
from fp4attn.kernels.hopper.kvcache_triton import kvcache_append_kernel
from fp4attn.reference.forward import LOG2E

FORMAT_CODES = {"bf16": 0, "fp8": 1, "nvfp4": 2, "mxfp4": 3}  # decode_triton's BF16, FP8, NVFP4, MXFP4
APPEND_BLOCK_T = 16  # tokens a program quantizes: one step's new tokens fit one program
COMBINE_ROWS = 16


def _on_gpu() -> bool:
    """Whether the kernels run on the GPU (inline PTX, hardware conversions) rather than
    under the Triton interpreter."""
    return not decode_routing.interpreting()


def _sms(device: torch.device) -> int:
    # under the interpreter (CPU tensors) a nominal count: the split plan is then small
    return sm_count(device) if device.type == "cuda" else 4


def _or_empty(t: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t is not None else torch.empty(0, dtype=dtype, device=like.device)


def pool_tensors(pool, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A `kvcache.PayloadPool`'s (data, block scales, token scales), empty tensors in
    place of the ones its format has not."""
    return (pool.data, _or_empty(pool.block_scale, like, torch.uint8),
            _or_empty(pool.token_scale, like, torch.float32))


# ----------------------------------------------------------------------------- append
@torch.library.custom_op("fp4attn::kvcache_append", mutates_args=("ka", "ks", "kt", "va", "vs", "vt", "lengths"))
def _append_op(k: torch.Tensor, v: torch.Tensor, ka: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor,
               va: torch.Tensor, vs: torch.Tensor, vt: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
               counts: Optional[torch.Tensor], k_fmt: str, v_fmt: str, page_size: int) -> None:
    B, H, S, D = k.shape
    k, v = k.contiguous(), v.contiguous()
    grid = (triton.cdiv(S, APPEND_BLOCK_T), B * H)
    kvcache_append_kernel[grid](
        k, v, ka, ks, kt, va, vs, vt, table, lengths, counts if counts is not None else lengths,
        k.stride(0), k.stride(1), k.stride(2), S, H, page_size, table.stride(0),
        D=D, K_FMT=FORMAT_CODES[k_fmt], V_FMT=FORMAT_CODES[v_fmt], BLOCK_T=APPEND_BLOCK_T,
        HAS_COUNTS=counts is not None, HW=_on_gpu(), num_warps=4)
    lengths.add_(counts if counts is not None else S)


@_append_op.register_fake
def _(k, v, ka, ks, kt, va, vs, vt, table, lengths, counts, k_fmt, v_fmt, page_size):
    return None


def hopper_append(cache, k: torch.Tensor, v: torch.Tensor, counts: list[int] | None) -> None:
    """Quantize k, v (B, Hkv, S_new, D) into `cache` (a checked `KVCache.append`; its
    pages already assigned); counts: tokens per sequence, or None for all."""
    counts_t = None
    if counts is not None:
        src = torch.tensor(counts, dtype=torch.int32)
        counts_t = src.pin_memory().to(k.device, non_blocking=True) if k.is_cuda else src
    ka, ks, kt = pool_tensors(cache.k, k)
    va, vs, vt = pool_tensors(cache.v, k)
    _append_op(k, v, ka, ks, kt, va, vs, vt, cache.block_table, cache.lengths, counts_t, cache.k_format,
               cache.v_format, cache.page_size)


# ----------------------------------------------------------------------------- decode
def _block_m(rows: int) -> int:
    return decode_routing.block_m_for(rows)


_RESIDENT: dict[tuple, int] = {}  # (constexprs, warps, stages, device index): programs an SM holds


def _resident(launch: decode_routing.DecodeLaunch, args: tuple, consts: dict, device: torch.device) -> int:
    """Programs of the split kernel an SM holds at once, from the compiled kernel's
    registers and shared memory (once per compiled form; the launch's own count if set)."""
    if launch.programs_per_sm:
        return launch.programs_per_sm
    if device.type != "cuda":  # the interpreter compiles nothing: a nominal two
        return 2
    key = (tuple(consts.items()), launch.warps, launch.stages, device.index)
    if key not in _RESIDENT:
        k = decode_split_kernel.warmup(*args, grid=(1,), **consts, num_warps=launch.warps, num_stages=launch.stages)
        k._init_handles()  # loads the module: the register count is known from then on
        _RESIDENT[key] = decode_routing.resident_programs(k.n_regs, launch.warps, k.metadata.shared)
    return _RESIDENT[key]


def _triton_split(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, k_fmt, v_fmt, page_size, kv_heads,
                  max_len, scale, causal, launch, block_m, hw):
    """The Triton split kernel's partials: (o_acc, o_ml, splits)."""
    B, Hq, Sq, D = qb.shape
    group = Hq // kv_heads
    rows = group * Sq
    row_blocks = triton.cdiv(rows, block_m)
    consts = dict(GROUP=group, D=D, K_FMT=FORMAT_CODES[k_fmt], V_FMT=FORMAT_CODES[v_fmt], BLOCK_M=block_m,
                  BLOCK_N=launch.block_n, CAUSAL=causal, HAS_START=key_start is not None, ASM=hw and launch.asm,
                  HW=hw, ALIGNED=page_size % launch.block_n == 0)
    programs = B * kv_heads * row_blocks

    def args(split_tokens: int, o_acc: torch.Tensor, o_ml: torch.Tensor) -> tuple:
        return (qb, ka, ks, kt, va, vs, vt, table, lengths, key_start if key_start is not None else lengths, o_acc,
                o_ml, qb.stride(0), qb.stride(1), qb.stride(2), kv_heads, page_size, table.stride(0), Sq, rows,
                split_tokens, scale * LOG2E)

    resident = 1  # a fixed split count needs no occupancy
    if not launch.splits:
        # the plan fills the waves the compiled kernel really has (its registers decide); the
        # compile sees the partials' dtype and a split length of the same specialization (a
        # multiple of the key tile, as every plan's)
        f32 = torch.empty(0, dtype=torch.float32, device=qb.device)
        resident = _resident(launch, args(launch.block_n, f32, f32), consts, qb.device)
    n_split, split_tokens = decode_routing.split_plan(launch, max(max_len, 1), programs, _sms(qb.device), resident)
    o_acc = torch.empty((n_split, B, Hq, Sq, D), dtype=torch.float32, device=qb.device)
    o_ml = torch.empty((n_split, B, Hq, Sq, 2), dtype=torch.float32, device=qb.device)
    decode_split_kernel[(n_split, B * kv_heads, row_blocks)](
        *args(split_tokens, o_acc, o_ml), **consts, num_warps=launch.warps, num_stages=launch.stages)
    return o_acc, o_ml, n_split


def _cuda_split(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, k_fmt, v_fmt, page_size, kv_heads, max_len,
                scale, splits, stages, out, lse):
    """The CUDA split kernel (a split a warp, `stages` its ring's tiles) and its combine
    into out and lse."""
    from fp4attn.kernels.hopper import decode_cuda

    B, Hq, Sq, D = qb.shape
    group = Hq // kv_heads
    variant = decode_cuda.Variant(D, k_fmt, v_fmt, hi_rows=group > 8, stages=stages)
    plan = decode_routing.CUDA_LAUNCH
    if splits:  # warps' splits asked for: whole CTAs of them
        plan = dataclasses.replace(plan, splits=max(1, -(-splits // variant.warps)))
    ctas, cta_tokens = decode_routing.split_plan(plan, max(max_len, 1), B * kv_heads, _sms(qb.device),
                                                 decode_cuda.resident_ctas(variant))
    n_split = ctas * variant.warps
    o_acc = torch.empty((n_split, B, Hq, Sq, D), dtype=torch.float32, device=qb.device)
    o_ml = torch.empty((n_split, B, Hq, Sq, 2), dtype=torch.float32, device=qb.device)
    decode_cuda.launch_split(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, o_acc, o_ml, variant=variant,
                             kv_heads=kv_heads, page_size=page_size, split_tokens=cta_tokens // variant.warps,
                             ctas=ctas, qk_scale=scale * LOG2E)
    decode_cuda.launch_combine(variant, o_acc, o_ml, out, lse)


def _decode_impl(q: torch.Tensor, ka: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor, va: torch.Tensor,
                 vs: torch.Tensor, vt: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                 key_start: Optional[torch.Tensor], k_fmt: str, v_fmt: str, page_size: int, kv_heads: int,
                 max_len: int, scale: float, causal: bool, block_n: int = 0, warps: int = 0, stages: int = 0,
                 programs_per_sm: int = 0, asm: int = -1, splits: int = 0,
                 split_impl: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The body of the `fp4attn::decode` op. block_n, warps, stages, programs_per_sm, asm
    (0/1), splits, split_impl ("triton", "cuda" or "cuda:<ring stages>"): a launch other
    than the routing table's (0, -1 for asm, "": the table's)."""
    B, Hq, Sq, D = q.shape
    qb = q.to(torch.bfloat16).contiguous()
    group = Hq // kv_heads
    block_m = _block_m(group * Sq)
    launch = decode_routing.decode_launch(k_fmt, v_fmt, D, block_m)
    launch = decode_routing.DecodeLaunch(block_n or launch.block_n, warps or launch.warps, stages or launch.stages,
                                         programs_per_sm or launch.programs_per_sm, launch.min_split_tiles,
                                         launch.asm if asm < 0 else bool(asm), splits or launch.splits,
                                         split_impl or launch.kernel)
    hw = _on_gpu()
    kernel, _, ring = launch.kernel.partition(":")
    kernel = decode_routing.split_kernel(k_fmt, v_fmt, D, group, Sq, page_size, hw, kernel)
    out = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if kernel == "cuda":
        stages = decode_routing.parse_cuda_stages(ring) if ring else \
            decode_routing.cuda_stages(k_fmt, v_fmt)  # "cuda:<ring stages>"
        _cuda_split(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, k_fmt, v_fmt, page_size, kv_heads,
                    max_len, scale, launch.splits, stages, out, lse)
        return out, lse
    o_acc, o_ml, n_split = _triton_split(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, k_fmt, v_fmt,
                                         page_size, kv_heads, max_len, scale, causal, launch, block_m, hw)
    n_rows = B * Hq * Sq
    decode_combine_kernel[(triton.cdiv(n_rows, COMBINE_ROWS),)](
        o_acc, o_ml, out, lse, n_rows, n_split, D=D, SPLITS_P2=triton.next_power_of_2(n_split),
        BLOCK_R=COMBINE_ROWS, num_warps=4)
    return out, lse


# torch.compile traces the op through its fake; an eager call runs the body directly (the
# op's own dispatch costs ~46 us of host a call, more than a short decode's kernels)
_decode_op = torch.library.custom_op("fp4attn::decode", mutates_args=())(_decode_impl)


@_decode_op.register_fake
def _(q, ka, ks, kt, va, vs, vt, table, lengths, key_start, k_fmt, v_fmt, page_size, kv_heads, max_len, scale,
      causal, block_n=0, warps=0, stages=0, programs_per_sm=0, asm=-1, splits=0, split_impl=""):
    B, Hq, Sq, D = q.shape
    return q.new_empty((B, Hq, Sq, D)), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def hopper_decode(q: torch.Tensor, cache, *, scale: float, causal: bool, key_start: torch.Tensor | None = None,
                  launch: decode_routing.DecodeLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q (B, Hq, Sq, D) over `cache` (checked by `fp4attn.decode`):
    (out in q's dtype, lse float32). `launch`: instead of the routing table's (to
    measure one against another)."""
    ka, ks, kt = pool_tensors(cache.k, q)
    va, vs, vt = pool_tensors(cache.v, q)
    extra = ((launch.block_n, launch.warps, launch.stages, launch.programs_per_sm, int(launch.asm), launch.splits,
              launch.kernel) if launch is not None else (0, 0, 0, 0, -1, 0, ""))
    op = _decode_op if torch.compiler.is_compiling() else _decode_impl
    return op(q, ka, ks, kt, va, vs, vt, cache.block_table, cache.lengths, key_start, cache.k_format,
              cache.v_format, cache.page_size, cache.kv_heads, cache.max_length(), scale, causal, *extra)
