"""The public attention function: validation, backend choice and autograd."""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import warnings
from typing import Literal, overload

import torch

from fp4attn import routing
from fp4attn._logging import log_once
from fp4attn.kvcache import KVCache
from fp4attn.recipes import DEFAULT_RECIPE, PRESETS, Recipe, get_recipe, inference_only_message
from fp4attn.reference.backward import reference_backward, refuse_double_backward
from fp4attn.reference.forward import ForwardResult, key_bias_of_mask, reference_forward
from fp4attn.reference.masks import causal_offset, key_mask_view, normalize_causal
from fp4attn.reference.operands import QKOperand

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: on the reference
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BACKENDS = routing.BACKENDS
BACKEND_ENV = routing.BACKEND_ENV  # overrides backend="auto"
HEAD_DIM_MULTIPLE = 16  # NVFP4 blocks of 16 run along the head dim
MAX_HEAD_DIM = 256


def _heads_shape(t: torch.Tensor) -> tuple[int, int, int]:
    """(heads, seq, head_dim) of an SDPA input (N..., H, L, E); a 2-D (L, E) is one head."""
    if t.ndim == 2:
        return 1, t.shape[0], t.shape[1]
    heads, seq, head_dim = t.shape[-3:]
    return heads, seq, head_dim


def _leading(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """The batch dims N... of SDPA's (N..., H, L, E) layout, q's, k's and v's broadcast."""
    lq, lk, lv = tuple(q.shape[:-3]), tuple(k.shape[:-3]), tuple(v.shape[:-3])
    if lq == lk == lv:  # every call that does not broadcast: torch.broadcast_shapes costs ~20 us of host time
        return lq
    return tuple(torch.broadcast_shapes(lq, lk, lv))


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: {DTYPES}")
        if t.ndim < 2:
            raise ValueError(f"{name} must be (N..., heads, seq, head_dim) as in SDPA (at least (seq, head_dim)); "
                             f"got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    (hq, _, d), (hkv, sk, dk), (hv, sv, _) = _heads_shape(q), _heads_shape(k), _heads_shape(v)
    try:
        _leading(q, k, v)
    except RuntimeError:
        raise ValueError(f"the batch dims of q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} (all but "
                         "the last three) do not broadcast") from None
    if (hv, sv) != (hkv, sk):
        raise ValueError(f"v {tuple(v.shape)} must have k's heads and keys {(hkv, sk)}; its head dim may differ")
    if dk != d:
        raise ValueError(f"k {tuple(k.shape)} must have q's head_dim {d}")
    if d % HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is not supported; accepted: multiples of {HEAD_DIM_MULTIPLE} up to "
                         f"{MAX_HEAD_DIM} (and 0)")
    if hkv == 0 and hq or hkv and hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"q has {hq} heads and k/v {hkv}: pass enable_gqa=True for grouped-query attention")


def _as_4d(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """An SDPA input (N..., H, L, E) as (B, H, L, E), B the product of the batch dims
    `lead` it broadcasts to (a view where it can be, as for every 4-D call)."""
    if t.ndim == 4 and tuple(t.shape[:1]) == lead:
        return t
    t = t.unsqueeze(0) if t.ndim == 2 else t
    t = t.expand(*lead, *t.shape[-3:])
    return t.reshape(math.prod(lead), *t.shape[-3:])


def _mask_as_4d(attn_mask: torch.Tensor | None, lead: tuple[int, ...]) -> torch.Tensor | None:
    """An attn_mask broadcastable to (N..., Hq, L, S) as one broadcastable to (B, Hq, L, S)."""
    if attn_mask is None or attn_mask.ndim <= 3 or (attn_mask.ndim == 4 and len(lead) == 1):
        return attn_mask
    if all(s == 1 for s in attn_mask.shape[:-3]):
        return attn_mask.reshape(attn_mask.shape[-3:])
    m = attn_mask.expand(*lead, *attn_mask.shape[-3:])
    return m.reshape(math.prod(lead), *m.shape[-3:])


def _validate_mask(attn_mask, q: torch.Tensor, sk: int, lead: tuple[int, ...]) -> None:
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; accepted: torch.bool (True attends) or a float "
                        "dtype (added to the scores)")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")
    target = (*lead, *_heads_shape(q)[:2], sk)
    try:
        ok = torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (N..., Hq, Sq, Sk) = "
                         f"{target}")


def _causal_argument(causal, is_causal):
    """`causal`, or SDPA's `is_causal` (a bool, top-left aligned) in its place; one of them."""
    if is_causal is None:
        return causal
    if causal is not None:
        raise ValueError(f"pass causal or is_causal, not both (got causal={causal!r}, is_causal={is_causal!r}); "
                         "is_causal=True (SDPA's name) is causal=True, top-left aligned")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool as in SDPA (True: query i sees keys j <= i, top-left aligned), "
                        f"got {is_causal!r}; for FlashAttention's bottom-right alignment pass causal='bottom_right'")
    return is_causal


def _check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r} is not supported: fp4attn applies no attention dropout; "
                         "accepted: 0.0 (a model passes its attention dropout in training mode: set it to 0)")


def _resolve_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def _mask_kind(attn_mask) -> tuple[str, torch.Tensor | None]:
    """("none", None), ("key", the mask as (b, 1, 1, Sk)) for a key-padding mask, or
    ("other", None): what the routing needs to know of a mask."""
    if attn_mask is None:
        return "none", None
    key_mask = key_mask_view(attn_mask)
    return ("other", None) if key_mask is None else ("key", key_mask)


class ReferenceFallbackWarning(UserWarning):
    """A GPU call that `backend="auto"` ran on the (slow) reference: the message says
    why and what would run it on the kernels."""


_WARNED: set[str] = set()  # the reasons already warned about


def _kernel_hint(q: torch.Tensor, rec: Recipe, mode: str | None, needs_grad: bool, attn_mask, keys: int,
                 r: routing.Route) -> str:
    """What would put the call on a kernel: each single change of the call (no gradients,
    the mask, the head dim, the recipe) that `routing.route` accepts."""
    if r.reason.startswith("Triton is not importable"):
        return "installing Triton would run it on the kernels"
    if r.reason in REFERENCE_ONLY_HINTS:
        return REFERENCE_ONLY_HINTS[r.reason]
    targets = sorted({t for f in routing.KERNEL_FAMILIES for t in f.targets}, key=lambda t: int(t[3:]))
    if not any(r.target in f.targets for f in routing.KERNEL_FAMILIES):
        return f"the kernels are built for {', '.join(targets)}"
    call = dict(device=q.device, head_dim=q.shape[-1], causal=mode is not None, needs_grad=needs_grad,
                mask=_mask_kind(attn_mask)[0], keys=keys)

    def runs(recipe: Recipe = rec, **change) -> bool:
        return routing.route(recipe, **{**call, **change}).backend == "triton"

    ways = []
    if needs_grad and runs(needs_grad=False):
        ways.append("no gradients (torch.no_grad(), or inputs that do not require grad: the forward kernels)")
    if call["mask"] == "other" and runs(mask="key"):
        ways.append("a key mask (broadcastable as (B, 1, 1, Sk), e.g. padding; causal=True for a causal mask)")
    elif call["mask"] != "none" and runs(mask="none"):
        ways.append("no attn_mask (causal=True for a causal mask)")
    dims = [d for d in range(routing.HOPPER_HEAD_DIMS[-1], 0, -16) if runs(head_dim=d)]
    if routing.kernel_head_dim(q.shape[-1]) is None and dims:
        ways.append(f"a head_dim the kernels take (multiples of 16 up to {dims[0]})")
    presets = [name for name, p in PRESETS.items() if p != rec and runs(p)]
    if presets:
        more = f" (and {len(presets) - 4} more presets)" if len(presets) > 4 else ""
        ways.append(f"recipe {', '.join(map(repr, presets[:4]))}{more}")
    if not ways:
        return "no single change of the gradients, mask, head dim or recipe would run it on the kernels"
    return "it would run on the kernels with " + "; or ".join(ways)


def _warn_reference(q, rec: Recipe, mode, needs_grad: bool, attn_mask, keys: int, r: routing.Route) -> None:
    """Warn, once per distinct reason, that `backend="auto"` runs a GPU call on the reference."""
    if r.reason in _WARNED:
        return
    _WARNED.add(r.reason)
    hint = _kernel_hint(q, rec, mode, needs_grad, attn_mask, keys, r)
    warnings.warn(f"fp4attn.attention runs recipe {rec.name!r} on the reference backend (pure PyTorch, far "
                  f"slower than the kernels): {r.reason}. {hint[0].upper()}{hint[1:]}. fp4attn.explain(...) "
                  "says the route; backend='reference' asks for the reference without this warning.",
                  ReferenceFallbackWarning, stacklevel=3)


# calls only the reference takes, whatever the recipe: (reason, what would run the kernels)
FLOAT64_REASON = "float64 inputs (the kernels read bf16, fp16 or fp32)"
VALUE_DIM_REASON = "a value head dim unlike the query/key one (the kernels take one head dim)"
REFERENCE_ONLY_HINTS = {FLOAT64_REASON: "inputs in bfloat16, float16 or float32 would run on the kernels",
                        VALUE_DIM_REASON: "values with the queries' head dim would run on the kernels"}


def _route(backend: str, q: torch.Tensor, recipe: Recipe, causal: str | None, needs_grad: bool,
           attn_mask, keys: int, value_dim: int | None = None) -> tuple[routing.Route, torch.Tensor | None]:
    """The call's route (`fp4attn.routing`) and the attn_mask as a key mask for the
    kernels, or None. The mask's content is looked at once, and not at all when the
    reference was asked for. float64 inputs and a value head dim `value_dim` unlike q's
    go to the reference."""
    requested = routing.requested_backend(backend)
    if attn_mask is not None and requested == "reference":
        kind, key_mask = "other", None
    else:
        kind, key_mask = _mask_kind(attn_mask)
    r = routing.route(recipe, device=q.device, head_dim=q.shape[-1], causal=causal is not None,
                      needs_grad=needs_grad, mask=kind, backend=requested, keys=keys)
    only = FLOAT64_REASON if q.dtype not in KERNEL_DTYPES else (
        VALUE_DIM_REASON if value_dim not in (None, q.shape[-1]) else None)
    if only is not None and r.backend != "reference":
        if requested == "triton":
            raise ValueError(f"backend='triton' cannot run this call: {only}")
        r = routing.Route("reference", "reference", r.target, only)
    if r.backend != "reference":
        try:
            _launcher(r)
        except ImportError as e:  # Triton missing
            if requested == "triton":
                raise ValueError(f"backend='triton' cannot run recipe {recipe.name!r}: Triton is not importable "
                                 f"({e})") from e
            r = routing.Route("reference", "reference", r.target, f"Triton is not importable ({e})")
    if r.backend == "reference" and requested == "auto" and not torch.compiler.is_compiling():
        # logging is a side effect a compiled graph cannot hold
        log_once(f"recipe {recipe.name!r} runs on the reference backend: {r.reason}")
    return r, key_mask


def _checked(q, k, v, attn_mask, causal, recipe, enable_gqa, is_causal=None,
             dropout_p=0.0) -> tuple[Recipe, str | None, bool]:
    """The arguments `attention` and `explain` share, validated: (the recipe, the causal
    mode, whether any of q, k, v or a float attn_mask requires grad)."""
    rec = get_recipe(recipe)
    mode = normalize_causal(_causal_argument(causal, is_causal))
    _check_dropout(dropout_p)
    _validate(q, k, v, enable_gqa)
    _validate_mask(attn_mask, q, k.shape[-2], _leading(q, k, v))
    return rec, mode, any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))


def _launcher(route: routing.Route):
    """The function that runs a kernel route: its family's launcher, imported."""
    if route.family is None:
        raise ValueError(f"a {route.backend!r} route ({route.kernel}) names no kernel family to launch")
    return _imported(route.family.launcher)


@functools.cache
def _imported(path: str):
    """The object at "module:name", imported once (a call pays no import lookup; a
    failed import raises again at the next call)."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def explain(
    query: torch.Tensor,
    key: torch.Tensor | KVCache,
    value: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | None = None,
    *,
    scale: float | None = None,
    causal: bool | str | None = None,
    recipe: str | Recipe = DEFAULT_RECIPE,
    enable_gqa: bool = False,
    backend: str = "auto",
    needs_grad: bool | None = None,
) -> dict:
    """What `fp4attn.attention` would run for these arguments, and why, without running it.

    Returns a plain dict: "backend" ("triton" or "reference"), "kernel" (the kernels'
    names, or "reference"), "target" ("sm_90", "sm_100", ..., or "cpu"; the
    FP4ATTN_TARGET environment variable overrides it), "reason", "launcher" (the
    function that would run), "recipe" (its name), "needs_grad"; on the Hopper kernels
    also "plan": for each kernel the plan its launcher executes (`routing.ForwardPlan`,
    `routing.BackwardPlan`: kernel, P mode, launch variant, why), the backward's for
    lengths that are whole tiles. Works on any device;
    `needs_grad` defaults to whether any of q, k, v requires grad. Arguments are
    `attention`'s (less `return_lse`), validated as `attention` validates them.

    `explain(q, cache)`, a `fp4attn.KVCache` in the key's place: what `fp4attn.decode(q,
    cache)` would run (`explain_decode` of fp4attn/decode.py; `backend` as decode's).
    """
    if isinstance(key, KVCache):
        from fp4attn.decode import explain_decode

        return explain_decode(query, key, backend=backend)
    if value is None:
        raise TypeError("explain: value is required (or a fp4attn.KVCache in the key's place, for decode)")
    rec, mode, requires_grad = _checked(query, key, value, attn_mask, causal, recipe, enable_gqa, is_causal,
                                        dropout_p)
    _resolve_scale(scale, query.shape[-1] or 1)
    q, k, v, attn_mask, _ = _sdpa_as_4d(query, key, value, attn_mask)
    grad = requires_grad if needs_grad is None else bool(needs_grad)
    # an inference-only recipe runs its forward as without gradients; its backward raises
    r, _ = _route(backend, q, rec, mode, grad and rec.grad is not None, attn_mask, k.shape[-2], v.shape[-1])
    out = {**r.as_dict(), "recipe": rec.name, "needs_grad": grad}
    if grad and rec.grad is None:
        out["reason"] = f"{out['reason']}; a backward through it raises: {inference_only_message(rec)}"
    return out


def _sdpa_as_4d(q, k, v, attn_mask):
    """SDPA's layout (N..., H, L, E), any number of batch dims (3-D: (H, L, E), 2-D:
    (L, E)), as fp4attn's (B, H, L, E) with the batch dims flattened (broadcast first),
    the attn_mask to match; with the shape the output takes back (N..., Hq, L, Ev)."""
    lead = _leading(q, k, v)
    q4, k4, v4 = (_as_4d(t, lead) for t in (q, k, v))
    out_shape = (*lead, *q4.shape[1:3], v4.shape[-1]) if q.ndim > 2 else (q.shape[0], v4.shape[-1])
    return q4, k4, v4, _mask_as_4d(attn_mask, lead), out_shape


class _Zeros(torch.autograd.Function):
    """The output of an attention without work (no query row, key, head or value
    channel, as SDPA gives it: zeros), with zero gradients for its inputs."""

    @staticmethod
    def forward(ctx, shape, like, *inputs):
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        return like.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.specs))


class _InferenceOnly(torch.autograd.Function):
    """The output of an inference-only recipe's forward, attached to the inputs that
    require grad so that a backward through it raises `inference_only_message` instead
    of leaving them without a gradient."""

    @staticmethod
    def forward(ctx, out, recipe: Recipe, *inputs):
        ctx.recipe = recipe
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(inference_only_message(ctx.recipe))


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, recipe: Recipe, causal: str | None, scale: float, attn_mask):
        res = reference_forward(q, k, v, recipe, scale=scale, causal=causal, attn_mask=attn_mask)
        out = res.out.to(q.dtype)
        ctx.recipe, ctx.causal, ctx.scale = recipe, causal, scale
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.attn_mask = attn_mask
        ctx.save_for_backward(res.q.values, res.q.scale, res.k.values, res.k.scale, res.v, out, res.lse)
        ctx.mark_non_differentiable(res.lse)
        return out, res.lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        refuse_double_backward("fp4attn.attention")
        qv, qs, kv, ks, v_rep, out, lse = ctx.saved_tensors
        fwd = ForwardResult(out.float(), lse, QKOperand(qv, qs), QKOperand(kv, ks), v_rep)
        mask_grad = ctx.needs_input_grad[6]  # a float attn_mask that requires grad: a learned score bias
        dq, dk, dv, *dmasks = reference_backward(fwd, out, dout, ctx.recipe, scale=ctx.scale,
                                                 causal=ctx.causal, attn_mask=ctx.attn_mask, mask_grad=mask_grad)
        dmask = dmasks[0].to(ctx.attn_mask.dtype) if mask_grad else None
        return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), dv.to(ctx.dtypes[2]), None, None, None, dmask


def _kernel_attention(route: routing.Route, q, k, v, rec: Recipe, mode: str | None, scale: float, key_mask,
                      needs_grad: bool):
    """The route's kernels on a call: head dims below the kernel's zero-padded (exact,
    `routing.kernel_head_dim`; the inference launchers are told the caller's head dim,
    which the Q/K fallback's statistic and the rotation depend on), a key mask as the
    kernel's key bias."""
    launch = _launcher(route)
    offset = causal_offset(mode, q.shape[-2], k.shape[-2])
    d, dk = q.shape[-1], routing.kernel_head_dim(q.shape[-1])
    qp, kp, vp = (t if dk == d else torch.nn.functional.pad(t, (0, dk - d)) for t in (q, k, v))
    if needs_grad:
        out, lse = launch(qp, kp, vp, rec, scale=scale, causal_offset=offset)
    else:
        key_bias = None if key_mask is None else key_bias_of_mask(key_mask, q.shape[0], k.shape[-2])
        out, lse, _ = launch(qp, kp, vp, rec, scale=scale, causal_offset=offset, key_bias=key_bias, head_dim=d)
    out = out.to(q.dtype)
    return (out if dk == d else out[..., :d].contiguous()), lse


# the return's type follows return_lse (a type checker's view; the function is the last one)
@overload
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = ...,
              dropout_p: float = ..., is_causal: bool | None = ..., *, scale: float | None = ...,
              causal: bool | str | None = ..., recipe: str | Recipe = ..., enable_gqa: bool = ...,
              return_lse: Literal[False] = ..., backend: str = ...) -> torch.Tensor: ...
@overload
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = ...,
              dropout_p: float = ..., is_causal: bool | None = ..., *, scale: float | None = ...,
              causal: bool | str | None = ..., recipe: str | Recipe = ..., enable_gqa: bool = ...,
              return_lse: Literal[True], backend: str = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = ...,
              dropout_p: float = ..., is_causal: bool | None = ..., *, scale: float | None = ...,
              causal: bool | str | None = ..., recipe: str | Recipe = ..., enable_gqa: bool = ...,
              return_lse: bool, backend: str = ...) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | None = None,
    *,
    scale: float | None = None,
    causal: bool | str | None = None,
    recipe: str | Recipe = DEFAULT_RECIPE,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Low-precision scaled dot-product attention in SDPA's layout.

    Computes softmax(q k^T * scale) v with the operands in the formats of `recipe`
    (see `fp4attn.PRESETS` and docs/numerics.md). Takes SDPA's arguments with SDPA's
    names, order and meaning (`query`, `key`, `value`, `attn_mask`, `dropout_p`,
    `is_causal`; keyword-only `scale`, `enable_gqa`), so a call of
    `torch.nn.functional.scaled_dot_product_attention` runs as written with
    `fp4attn.attention` in its place.

    Args:
        query: (B, Hq, Sq, D) queries q, bfloat16, float16 or float32.
        key: (B, Hkv, Sk, D) keys k, same dtype and device as q.
        value: (B, Hkv, Sk, D) values v.
        attn_mask: as SDPA's: boolean (True attends) or float (added to the scaled
            scores), broadcastable to (B, Hq, Sq, Sk). Rows that attend to nothing give
            output 0 (SDPA gives NaN). The kernels take key masks (broadcastable as
            (B, 1, 1, Sk), e.g. padding) in the forward; other masks, and any mask
            with a backward, run on the reference.
        dropout_p: 0.0 only (SDPA's default): fp4attn applies no attention dropout;
            anything else raises.
        is_causal: SDPA's flag: True is causal=True (top-left aligned). Pass it or
            `causal`, not both.
        causal: None or False (not causal); True or "top_left" (SDPA's `is_causal`:
            query i sees keys j <= i); "bottom_right" (FlashAttention's: query i sees
            j <= i + Sk - Sq).
        scale: softmax scale; None means 1 / sqrt(D).
        recipe: a preset name (`fp4attn.PRESETS`: "fp8", "nvfp4-fp8-robust", "directp",
            "train", ...; the "-fastacc" ones sum QK^T on the FP8 tensor cores, faster
            and not exact, see `Recipe.fast_accum`) or a `fp4attn.Recipe`. The default,
            `fp4attn.DEFAULT_RECIPE` ("fp8-affine-fastacc"), keeps FP8's accuracy on
            real activations and has kernels on every GPU target (`recipes.DEFAULT_RECIPE`
            says why); it is inference-only.
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention).
        return_lse: also return the log-sum-exp, float32 (B, Hq, Sq), natural log of
            the softmax denominator of the scaled scores; -inf for rows seeing no key.
            On the Triton training kernels it carries no gradient (only the output's
            gradient reaches q, k, v).
        backend: "auto" (the Triton kernels where they run the recipe: CUDA sm_90,
            head_dim a multiple of 16 up to 128 (below 64 or 128 zero-padded, which
            is exact), key masks only; with gradients, the training recipes
            "train", "train-robust", "train-mxfp4pv" and "train-fp8"; else the
            reference, and a call on the GPU warns then (outside torch.compile's
            tracing), once per distinct reason, with what would run it on the kernels:
            `ReferenceFallbackWarning`), "triton"
            (an error if the kernels cannot run the call) or "reference" (the
            pure-PyTorch definition). The FP4ATTN_BACKEND environment variable
            overrides "auto".

    Returns:
        The output (B, Hq, Sq, D) in q's dtype, and the LSE if `return_lse`.

    Gradients flow for recipes with a backward (`recipe.grad` not None:
    `recipes.training_presets()`, "train", "train-robust", ..., "bf16"), to q, k, v and to a
    float attn_mask that requires grad (on the reference). An inference-only recipe runs
    its forward kernels whether or not the inputs require grad, and a backward through
    its output raises, naming the training presets; so does a second derivative
    (create_graph=True).
    """
    rec, mode, requires_grad = _checked(query, key, value, attn_mask, causal, recipe, enable_gqa, is_causal,
                                        dropout_p)
    s = _resolve_scale(scale, query.shape[-1] or 1)
    q, k, v, mask, out_shape = _sdpa_as_4d(query, key, value, attn_mask)
    grad_inputs = [t for t in (query, key, value, attn_mask) if t is not None and t.requires_grad]
    if 0 in (q.shape[0], q.shape[1], q.shape[2], k.shape[2], v.shape[-1]):
        # no query row, head, key or value channel: SDPA's zeros (a row that sees no key
        # is 0 here too), the LSE -inf
        lse = torch.full(out_shape[:-1], -math.inf, device=q.device)
        if torch.is_grad_enabled() and grad_inputs:
            out = _Zeros.apply(out_shape, query, *grad_inputs)
        else:
            out = query.new_zeros(out_shape)
        return (out, lse) if return_lse else out
    if q.shape[-1] == 0:
        # no query/key channel: every score is 0 (SDPA's uniform softmax): 16 zero channels
        # give the same scores, and the scale no longer matters
        q, k = (torch.nn.functional.pad(t, (0, HEAD_DIM_MULTIPLE)) for t in (q, k))
    # an inference-only recipe whose inputs require grad (a model in eval mode outside
    # torch.no_grad()) runs its forward kernels as without gradients; only a backward
    # through its output raises (`_InferenceOnly`)
    inference_only = torch.is_grad_enabled() and requires_grad and rec.grad is None
    needs_grad = torch.is_grad_enabled() and requires_grad and not inference_only
    r, key_mask = _route(backend, q, rec, mode, needs_grad, mask, k.shape[-2], v.shape[-1])
    if (r.backend == "reference" and (q.is_cuda or routing.interpreting()) and not torch.compiler.is_compiling()
            and routing.requested_backend(backend) == "auto"):
        _warn_reference(q, rec, mode, needs_grad, mask, k.shape[-2], r)
    if q.dtype not in KERNEL_DTYPES:  # float64: the recipes quantize its float32 rounding
        q, k, v = q.float(), k.float(), v.float()
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        if r.backend == "triton":
            out, lse = _kernel_attention(r, q, k, v, rec, mode, s, key_mask, needs_grad)
        else:
            out, lse = _ReferenceAttention.apply(q, k, v, rec, mode, s, mask)
    if inference_only:
        out = _InferenceOnly.apply(out, rec, *grad_inputs)
    out, lse = out.to(query.dtype).reshape(out_shape), lse.reshape(out_shape[:-1])
    return (out, lse) if return_lse else out
