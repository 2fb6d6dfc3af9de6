"""`fp4attn.decode`: attention of new query rows over a quantized KV cache."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Literal, overload

import torch

from fp4attn._logging import log_once
from fp4attn.api import ReferenceFallbackWarning
from fp4attn.kvcache import KVCache, check_input
from fp4attn.reference import robust
from fp4attn.reference.decode import P_HALF_FORMATS, reference_decode
from fp4attn.routing import decode as decode_routing

MAX_QUERY_ROWS = 16  # new tokens per sequence and step the decode path is built for (speculative decoding)


@functools.lru_cache(maxsize=16)
def _warn_once(message: str) -> None:
    """A GPU call that backend="auto" runs on the reference: warned once per reason, as
    `fp4attn.attention` warns (`ReferenceFallbackWarning`); on the CPU it is logged."""
    warnings.warn(message, ReferenceFallbackWarning, stacklevel=4)


def _check(q, cache, scale, key_start) -> float:
    if not isinstance(cache, KVCache):
        raise TypeError(f"decode: cache must be a fp4attn.KVCache, got {type(cache).__name__}")
    check_input("decode", "q", q, cache.device)
    if q.ndim != 4:
        raise ValueError(f"decode: q must be 4-D (batch, heads, new tokens, head_dim); got shape {tuple(q.shape)}")
    b, hq, sq, d = q.shape
    if b != cache.batch or d != cache.head_dim or hq == 0 or hq % cache.kv_heads:
        raise ValueError(f"decode: q has shape {tuple(q.shape)}; accepted: (batch={cache.batch}, a multiple of the "
                         f"cache's kv_heads={cache.kv_heads}, new tokens, head_dim={cache.head_dim})")
    if not 1 <= sq:
        raise ValueError(f"decode: q holds {sq} query rows; accepted: at least 1")
    if key_start is not None:
        if not isinstance(key_start, torch.Tensor) or key_start.shape != (b,) or key_start.dtype not in (
                torch.int32, torch.int64) or key_start.device != cache.device:
            raise ValueError(f"decode: key_start must be an int32 or int64 tensor of shape ({b},) on {cache.device}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"decode: scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def _route(q: torch.Tensor, cache: KVCache, backend: str) -> decode_routing.DecodeRoute:
    b, hq, sq, d = q.shape
    return decode_routing.decode_route(q.device, b, cache.kv_heads, hq, sq, d, cache.k_format, cache.v_format,
                                       cache.page_size, backend)


def explain_decode(q: torch.Tensor, cache: KVCache, *, backend: str = "auto") -> dict:
    """What `fp4attn.decode(q, cache)` would run, and why, without running it (also
    `fp4attn.explain(q, cache)`): the call's route (`decode_routing.DecodeRoute.as_dict`,
    the record the call itself executes), a plain dict with "backend" ("triton" or
    "reference"), "kernel" ("hopper.decode_cuda" or "hopper.decode_triton", the split
    kernel, or "reference"), "target", "reason", "launcher", "formats" (K/V) and, on the
    kernels, "launch" (the split kernel's tile, warps and pipeline stages)."""
    _check(q, cache, None, None)
    return _route(q, cache, backend).as_dict()


# the return's type follows return_lse (a type checker's view; the function is the last one)
@overload
def decode(q: torch.Tensor, cache: KVCache, *, k: torch.Tensor | None = ..., v: torch.Tensor | None = ...,
           counts=..., causal: bool = ..., scale: float | None = ..., key_start: torch.Tensor | None = ...,
           return_lse: Literal[False] = ..., backend: str = ...) -> torch.Tensor: ...
@overload
def decode(q: torch.Tensor, cache: KVCache, *, k: torch.Tensor | None = ..., v: torch.Tensor | None = ...,
           counts=..., causal: bool = ..., scale: float | None = ..., key_start: torch.Tensor | None = ...,
           return_lse: Literal[True], backend: str = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def decode(q: torch.Tensor, cache: KVCache, *, k: torch.Tensor | None = ..., v: torch.Tensor | None = ...,
           counts=..., causal: bool = ..., scale: float | None = ..., key_start: torch.Tensor | None = ...,
           return_lse: bool, backend: str = ...) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def decode(
    q: torch.Tensor,
    cache: KVCache,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    counts=None,
    causal: bool = True,
    scale: float | None = None,
    key_start: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q's new rows over a KV cache, after appending k and v to it.

    The decode step of generation, as FlashAttention's `flash_attn_with_kvcache`: the
    new tokens' keys and values (if given) are quantized into the cache, then every
    query row attends to its sequence's cached tokens. The numerics are defined by
    `fp4attn.reference.decode` (bf16 operands, float32 sums, bf16 P).

    Args:
        q: (B, Hq, Sq, D) queries, bfloat16, float16 or float32 (rounded to bf16), on
            the cache's device; Hq a multiple of the cache's KV heads (GQA: all query
            heads of a KV head read its cache once). Sq up to 16 is the decode path
            (speculative decoding); more rows run too, each 16 (or 64 / group) rows
            reading the cache again.
        cache: the `fp4attn.KVCache` of this layer.
        k, v: (B, Hkv, S_new, D) new keys and values to append first (`KVCache.append`),
            or None.
        counts: with k and v, the tokens each sequence takes (`KVCache.append`).
        causal: query row r of sequence b sees keys j <= L_b - Sq + r (bottom-right:
            the new rows are the last Sq tokens of the sequence), where L_b is its
            length after the append. False: every row sees all L_b keys.
        scale: softmax scale; None means 1 / sqrt(D).
        key_start: optional int tensor (B,): sequence b attends only to keys j >=
            key_start[b] (left padding).
        return_lse: also return the log-sum-exp, float32 (B, Hq, Sq), natural log.
        backend: "auto" (the Hopper kernels on sm_90 at head dims 64 and 128, else the
            reference: a GPU call then warns, `fp4attn.ReferenceFallbackWarning`, once
            per reason; a CPU call logs it), "triton" (an error where the kernels cannot
            run), or "reference". FP4ATTN_BACKEND overrides "auto".

    Returns:
        The output (B, Hq, Sq, D) in q's dtype (and the LSE if `return_lse`). A row that
        sees no key is 0 (LSE -inf). A NaN or Inf in an appended token reaches only
        the rows that read it (`reference.decode`). A call that raises leaves the cache
        as it was (the append taken back).
    """
    s = _check(q, cache, scale, key_start)
    if (k is None) != (v is None):
        raise ValueError("decode: pass both k and v to append, or neither")
    if torch.compiler.is_compiling():
        # traced: the backend only; the op decides the rest where it runs (`_decode_impl`)
        route = None
        chosen, why = decode_routing.backend_for(q.device, cache.head_dim, backend)
    else:
        route = _route(q, cache, backend)  # decided once per form of call: a step's layers share it
        chosen, why = route.backend, route.reason
    undo = cache._append(k, v, counts) if k is not None else None
    try:
        return _attend(q, cache, s, causal, key_start, return_lse, backend, chosen, why, route)
    except BaseException:
        cache._undo(undo)  # a failed decode leaves the cache as it was
        raise


@functools.cache
def _kernels():
    """The decode op's module, imported at the first kernel call (an import statement on
    every call costs more than the rest of the call's Python)."""
    from fp4attn.kernels.hopper import decode_op

    return decode_op


def _attend(q, cache, s, causal, key_start, return_lse, backend, chosen, why, route):
    """`decode` after its append: the new rows over the cache."""
    out_dtype, q_in, s_in = q.dtype, q, s
    if cache.rotate_k:  # q' . k' = block * (q . k): the scale divided by the block (exact)
        q = robust.rotate(q)
        s = s * robust.rotation_scale(cache.head_dim)
    if chosen == "triton":
        if route is None:  # traced by torch.compile
            from fp4attn.kernels.hopper.decode_op import hopper_decode
        else:
            hopper_decode = _kernels().hopper_decode
        out, lse = hopper_decode(q, cache, scale=s, causal=causal, key_start=key_start, route=route)
        if out.dtype != out_dtype:
            out = out.to(out_dtype)
    else:
        if backend == "auto" and not torch.compiler.is_compiling():
            message = f"fp4attn.decode runs on the reference backend (pure PyTorch, far slower than the kernels): {why}"
            (_warn_once if q.is_cuda else log_once)(message)
        kb, ks, vb, vs = cache.reference_operands()
        lengths = torch.tensor(cache.host_lengths, device=q.device)
        res = reference_decode(q, kb, ks, vb, vs, lengths, scale=s, causal=causal, key_start=key_start,
                               p_half=cache.v_format in P_HALF_FORMATS)
        out, lse = res.out.to(out_dtype), res.lse
    if cache.smooth_k and return_lse:
        # the scores were q . (k - mean): the LSE of q . k is that plus scale * q . mean
        qg = q_in.bfloat16().float().reshape(q.shape[0], cache.kv_heads, -1, q.shape[-1])
        shift = torch.einsum("bgrd,bgd->bgr", qg, cache.k_mean)
        lse = lse + s_in * shift.reshape(lse.shape)
    return (out, lse) if return_lse else out
