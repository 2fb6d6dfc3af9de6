"""The KV cache append and the decode attention on Hopper as registered custom ops (each
with a fake implementation, so torch.compile traces through them), and their launchers.

The ops take the cache's pool tensors, never the `KVCache` object: a custom op's
arguments are tensors and plain values. Formats without block or token scales pass an
empty tensor in their place (never read).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Optional

import torch

from fp4attn.kernels.common import sm_count
from fp4attn.kernels.hopper import decode_cuda
from fp4attn.kernels.hopper.decode_triton import decode_combine_kernel, decode_split_kernel
from fp4attn.kernels.hopper.kvcache_triton import kvcache_append_kernel
from fp4attn.kernels.triton_launch import CachedLaunch
from fp4attn.reference.forward import LOG2E
from fp4attn.routing import decode as decode_routing

FORMAT_CODES = {"bf16": 0, "fp8": 1, "nvfp4": 2, "mxfp4": 3}  # decode_triton's BF16, FP8, NVFP4, MXFP4
APPEND_BLOCK_T = 16  # tokens a program quantizes: one step's new tokens fit one program
COMBINE_ROWS = 16


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


Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def cache_operands(cache) -> Operands:
    """The cache's pool tensors as the ops take them (K's three, then V's), made once per
    cache: its pools are never reallocated."""
    ops = cache._op_operands
    if ops is None:
        ops = cache._op_operands = (*pool_tensors(cache.k, cache.lengths), *pool_tensors(cache.v, cache.lengths))
    return ops


# ----------------------------------------------------------------------------- append
def _append_impl(k: torch.Tensor, v: torch.Tensor, ka: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor,
                 va: torch.Tensor, vs: torch.Tensor, vt: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                 counts: Optional[torch.Tensor], k_fmt: str, v_fmt: str, page_size: int) -> None:
    B, H, S, D = k.shape
    k, v = k.contiguous(), v.contiguous()
    # grids by integer arithmetic: triton.cdiv and next_power_of_2 are constexpr functions,
    # microseconds a call from Python
    grid = (-(-S // APPEND_BLOCK_T), B * H)
    kvcache_append_kernel[grid](
        k, v, ka, ks, kt, va, vs, vt, table, lengths, counts if counts is not None else lengths,
        k.stride(0), k.stride(1), k.stride(2), S, H, page_size, table.stride(0),
        D=D, K_FMT=FORMAT_CODES[k_fmt], V_FMT=FORMAT_CODES[v_fmt], BLOCK_T=APPEND_BLOCK_T,
        HAS_COUNTS=counts is not None, HW=decode_routing.append_route(k.device, D)[1], num_warps=4)
    lengths.add_(counts if counts is not None else S)


# torch.compile traces the op through its fake; an eager call runs the body directly, as
# the decode op's (the dispatch of a custom op that mutates its arguments costs more host
# time than the append's kernel)
_append_op = torch.library.custom_op("fp4attn::kvcache_append",
                                     mutates_args=("ka", "ks", "kt", "va", "vs", "vt", "lengths"))(_append_impl)


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
    if torch.compiler.is_compiling():  # traced: the op, its operands made in the graph
        _append_op(k, v, *pool_tensors(cache.k, k), *pool_tensors(cache.v, k), cache.block_table, cache.lengths,
                   counts_t, cache.k_format, cache.v_format, cache.page_size)
    else:
        _append_impl(k, v, *cache_operands(cache), cache.block_table, cache.lengths, counts_t, cache.k_format,
                     cache.v_format, cache.page_size)


# ----------------------------------------------------------------------------- decode
# The partials of the splits (o_acc, o_ml): one float32 buffer per (thread, device,
# stream), grown to the largest call and viewed per shape, instead of two allocations a
# call. Safe because one thread's calls on one stream run in the order it made them (a
# call's combine has read its partials before its next call's split writes them), and
# calls from other threads or on other streams never share a buffer; a call made while its
# stream is being captured into a CUDA graph allocates its own, which the graph's pool
# keeps for the graph's replays, so no graph ever holds a buffer that eager calls write or
# that is freed when the buffer grows.
_LOCAL = threading.local()  # .buffers: (device, stream) -> buffer; .views: (device, stream, shape) -> views


def _never() -> bool:
    return False


_capturing: Callable[[], bool]  # whether the current stream is being captured into a CUDA graph
try:
    from torch._C import _cuda_isCurrentStreamCapturing as _capturing
except ImportError:  # a torch built without CUDA
    _capturing = _never


def _partials(device: torch.device, stream: int, n_split: int, B: int, Hq: int, Sq: int,
              D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o_acc (n_split, B, Hq, Sq, D) and o_ml (n_split, B, Hq, Sq, 2), float32, unset."""
    if stream and _capturing():  # (stream 0, the default stream and the CPU's, is never captured)
        return (torch.empty((n_split, B, Hq, Sq, D), dtype=torch.float32, device=device),
                torch.empty((n_split, B, Hq, Sq, 2), dtype=torch.float32, device=device))
    views_of = getattr(_LOCAL, "views", None)
    if views_of is None:
        views_of = _LOCAL.views = {}
        _LOCAL.buffers = {}
    key = (device, stream, n_split, B, Hq, Sq, D)
    views = views_of.get(key)
    if views is None:
        n_acc, n_ml = n_split * B * Hq * Sq * D, n_split * B * Hq * Sq * 2
        buf = _LOCAL.buffers.get((device, stream))
        if buf is None or buf.numel() < n_acc + n_ml:
            buf = _LOCAL.buffers[(device, stream)] = torch.empty(n_acc + n_ml, dtype=torch.float32, device=device)
            views_of.clear()  # the views of a smaller buffer (it is freed with them)
        elif len(views_of) >= 64:
            views_of.clear()
        # o_ml starts n_acc floats in: a multiple of 256 bytes (D is 64 or 128), as aligned as
        # an allocation for the kernels' specializations
        views = views_of[key] = (buf[:n_acc].view(n_split, B, Hq, Sq, D),
                                 buf[n_acc:n_acc + n_ml].view(n_split, B, Hq, Sq, 2))
    return views


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


class _TritonSplit:
    """A route whose split kernel is the Triton one, on one device: its constexprs and
    occupancy per (causal, key_start given), found at the first such call."""

    made_by = None

    def __init__(self, route: decode_routing.DecodeRoute, device: torch.device):
        self.route, self.device = route, device
        self.sms = _sms(device)
        self.forms: dict[tuple[bool, bool], tuple[dict, int]] = {}
        self.split = CachedLaunch(decode_split_kernel)  # Triton's binder once per specialization
        self.combine = CachedLaunch(decode_combine_kernel)

    def _form(self, causal: bool, has_start: bool, args) -> tuple[dict, int]:
        route, launch = self.route, self.route.launch
        assert launch is not None
        consts = dict(GROUP=route.group, D=route.head_dim, K_FMT=FORMAT_CODES[route.k_format],
                      V_FMT=FORMAT_CODES[route.v_format], BLOCK_M=route.block_m, BLOCK_N=launch.block_n, CAUSAL=causal,
                      HAS_START=has_start, ASM=route.hw and launch.asm, HW=route.hw,
                      ALIGNED=route.page_size % launch.block_n == 0)
        resident = 1  # a fixed split count needs no occupancy
        if not launch.splits:
            # the plan fills the waves the compiled kernel really has (its registers decide); the
            # compile sees the partials' dtype and a split length of the same specialization (a
            # multiple of the key tile, as every plan's)
            f32 = torch.empty(0, dtype=torch.float32, device=self.device)
            resident = _resident(launch, args(launch.block_n, f32, f32), consts, self.device)
        form = self.forms[(causal, has_start)] = (consts, resident)
        return form

    def __call__(self, qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, max_len, scale, causal, out, lse,
                 stream):
        route, launch = self.route, self.route.launch
        assert launch is not None
        B, Hq, Sq, D = qb.shape
        kv_heads, rows = route.kv_heads, route.group * Sq

        def args(split_tokens: int, o_acc: torch.Tensor, o_ml: torch.Tensor) -> tuple:
            return (qb, ka, ks, kt, va, vs, vt, table, lengths, key_start if key_start is not None else lengths,
                    o_acc, o_ml, qb.stride(0), qb.stride(1), qb.stride(2), kv_heads, route.page_size,
                    table.stride(0), Sq, rows, split_tokens, scale * LOG2E)

        form = self.forms.get((causal, key_start is not None)) or self._form(causal, key_start is not None, args)
        consts, resident = form
        n_split, split_tokens = route.split_plan(max_len, self.sms, resident)
        o_acc, o_ml = _partials(self.device, stream, n_split, B, Hq, Sq, D)
        self.split((n_split, B * kv_heads, -(-rows // route.block_m)), args(split_tokens, o_acc, o_ml), consts, stream,
                   num_warps=launch.warps, num_stages=launch.stages)
        n_rows = B * Hq * Sq
        self.combine((-(-n_rows // COMBINE_ROWS), 1, 1), (o_acc, o_ml, out, lse, n_rows, n_split),
                     dict(D=D, SPLITS_P2=1 << (n_split - 1).bit_length(), BLOCK_R=COMBINE_ROWS), stream, num_warps=4)


class _CudaSplit:
    """A route whose split kernel is the CUDA C++ one (a split a warp, its ring of
    `route.ring` tiles), on one device: the variant, its occupancy and its loaded kernels."""

    def __init__(self, route: decode_routing.DecodeRoute, device: torch.device):
        self.route, self.device = route, device
        self.sms = _sms(device)
        # the variant's class as it was found: a timing-only build swaps it
        # (tools/probe_decode_bound.py), which a later call sees (`_executor`)
        self.made_by = decode_cuda.Variant
        variant = decode_cuda.Variant(route.head_dim, route.k_format, route.v_format, hi_rows=route.group > 8,
                                      stages=route.ring)
        self.warps = variant.warps
        self.resident = decode_cuda.resident_ctas(variant)
        self.launcher = decode_cuda.Launcher(variant, device)

    def __call__(self, qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, max_len, scale, causal, out, lse,
                 stream):
        B, Hq, Sq, D = qb.shape
        ctas, cta_tokens = self.route.split_plan(max_len, self.sms, self.resident)
        n_split = ctas * self.warps
        o_acc, o_ml = _partials(self.device, stream, n_split, B, Hq, Sq, D)
        self.launcher.split(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, o_acc, o_ml,
                            kv_heads=self.route.kv_heads, page_size=self.route.page_size,
                            split_tokens=cta_tokens // self.warps, ctas=ctas, qk_scale=scale * LOG2E, stream=stream)
        self.launcher.combine(o_acc, o_ml, out, lse, stream=stream)


_EXECUTORS: dict[tuple, _TritonSplit | _CudaSplit] = {}  # (route, device)


def _executor(route: decode_routing.DecodeRoute, device: torch.device) -> _TritonSplit | _CudaSplit:
    """The route made concrete on `device`, once."""
    ex = _EXECUTORS.get((route, device))
    if ex is None or (route.kernel == "cuda" and ex.made_by is not decode_cuda.Variant):
        if route.backend != "triton":
            raise ValueError(f"the decode kernels do not run this call: {route.reason}")
        if len(_EXECUTORS) >= 256:  # routes a process has measured (`with_launch`): a bound
            _EXECUTORS.clear()
        ex = _EXECUTORS[(route, device)] = (_CudaSplit if route.kernel == "cuda" else _TritonSplit)(route, device)
    return ex


def run_route(route: decode_routing.DecodeRoute, q: torch.Tensor, ka: torch.Tensor, ks: torch.Tensor,
              kt: torch.Tensor, va: torch.Tensor, vs: torch.Tensor, vt: torch.Tensor, table: torch.Tensor,
              lengths: torch.Tensor, key_start: Optional[torch.Tensor], max_len: int, scale: float,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q over the cache's pool tensors as `route` says: its split
    kernel over the splits its plan gives `max_len`, then the combine; (out in q's dtype,
    lse float32)."""
    device = q.device
    ex = _executor(route, device)
    B, Hq, Sq, D = q.shape
    qb = q if q.dtype is torch.bfloat16 and q.is_contiguous() else q.to(torch.bfloat16).contiguous()
    out = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=device)
    stream = decode_cuda.current_stream(device.index) if device.type == "cuda" else 0
    ex(qb, ka, ks, kt, va, vs, vt, table, lengths, key_start, max_len, scale, causal, out, lse, stream)
    return out, lse


def _decode_impl(q: torch.Tensor, ka: torch.Tensor, ks: torch.Tensor, kt: torch.Tensor, va: torch.Tensor,
                 vs: torch.Tensor, vt: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                 key_start: Optional[torch.Tensor], k_fmt: str, v_fmt: str, page_size: int, kv_heads: int,
                 max_len: int, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of the `fp4attn::decode` op: the route of this form of call (decided once,
    `decode_routing.decode_route`), executed."""
    B, Hq, Sq, D = q.shape
    route = decode_routing.decode_route(q.device, B, kv_heads, Hq, Sq, D, k_fmt, v_fmt, page_size, "triton")
    return run_route(route, q, ka, ks, kt, va, vs, vt, table, lengths, key_start, max_len, scale, causal)


# torch.compile traces the op through its fake; an eager call runs the route directly (the
# op's own dispatch costs ~46 us of host a call, more than a short decode's kernels). Its
# arguments are what a route needs; a launch to measure is passed by Python
# (`hopper_decode(launch=...)`), never through the op.
_decode_op = torch.library.custom_op("fp4attn::decode", mutates_args=())(_decode_impl)


@_decode_op.register_fake
def _(q, ka, ks, kt, va, vs, vt, table, lengths, key_start, k_fmt, v_fmt, page_size, kv_heads, max_len, scale,
      causal):
    B, Hq, Sq, D = q.shape
    return q.new_empty((B, Hq, Sq, D)), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def hopper_decode(q: torch.Tensor, cache, *, scale: float, causal: bool, key_start: torch.Tensor | None = None,
                  launch: decode_routing.DecodeLaunch | None = None,
                  route: decode_routing.DecodeRoute | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q (B, Hq, Sq, D) over `cache` (checked by `fp4attn.decode`):
    (out in q's dtype, lse float32). `route`: the call's route, where the caller has it
    (`fp4attn.decode`); `launch`: a launch other than the routing table's, to measure one
    against another (`decode_routing.with_launch`; eager calls only)."""
    if torch.compiler.is_compiling():  # traced: the op, its operands made in the graph
        if launch is not None:
            raise ValueError("hopper_decode: a launch to measure runs eagerly, not under torch.compile")
        return _decode_op(q, *pool_tensors(cache.k, q), *pool_tensors(cache.v, q), cache.block_table, cache.lengths,
                          key_start, cache.k_format, cache.v_format, cache.page_size, cache.kv_heads,
                          cache.max_length(), scale, causal)
    ops = cache_operands(cache)
    if route is None:
        B, Hq, Sq, D = q.shape
        route = decode_routing.decode_route(q.device, B, cache.kv_heads, Hq, Sq, D, cache.k_format, cache.v_format,
                                            cache.page_size, "triton")
    if launch is not None:
        route = decode_routing.with_launch(route, launch)
    return run_route(route, q, *ops, cache.block_table, cache.lengths, key_start, cache.max_length(), scale, causal)
