"""The quantizers of per-token FP8 Q/K in training (`train-fp8`): two passes over each of
Q and K, one in the forward and one before the backward, as the NVFP4 recipes' quantizing
pass and payload decode (`nvfp4.py`) are for `train`.

Forward (`quantize_qk_fp8_saved`), one pass over x: the per-token e4m3 view
(`formats.quantize_fp8(x, dim=-1)`: one float32 scale per row), written twice, as bf16
values for the forward kernel's bf16 QK^T (exact: every e4m3 value is a bf16 value; an
e4m3 operand would put QK^T on the FP8 tensor cores, whose sums are `fast_accum`'s) and
as e4m3 bytes for the backward (1 byte per element kept, not 2), together with the
channels' max |represented value| (e4m3 value x row scale), which the backward's
per-channel view needs before it can write a single element.

Backward (`fp8_qk_views`), one pass over the saved bytes: the values again in the dtype
the backward kernels multiply (bf16 on the GPU), and the per-channel e4m3 view of the
represented values (`reference.backward`'s `low_precision_view(q.dequantize(), -2,
"e4m3")`), stored transposed (D, S) as the dK and dQ products read it, its scales from
the recorded maxima.

Both reproduce the reference bit for bit (tests compare the bytes with `torch.equal`):
the represented value is the float32 product e4m3 x row scale, as `QKOperand.dequantize`
rounds it, and the view multiplies it by the channel's 448 / amax, as `quantize_fp8`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4attn.kernels.quantize.elements import _e4m3_signed, _hw_cvt
from fp4attn.kernels.quantize.fp8 import _fp8_channel_scales, _fp8_rows_kernel
from fp4attn.kernels.quantize.rows import CHANNEL_BLOCKS, _block_rows, _heads, _row_grid


@triton.jit
def _fp8_views_kernel(Y8, S_ROW, CAMAX, V, CT, CS, S, D: tl.constexpr, BLOCK_S: tl.constexpr,
                      HW_CVT: tl.constexpr):
    """From per-token e4m3 rows Y8 (G, S, D) with their scales S_ROW (G, S): the values
    into V (G, S, D) as V's dtype, and the per-channel FP8 of the represented values
    (value x row scale) stored transposed, CT (G, D, S) e4m3 and CS (G, D), from the
    channels' max |represented value| CAMAX (G, D) that the forward's pass
    (`_fp8_rows_kernel`, SAVED) recorded."""
    g = tl.program_id(1).to(tl.int64)
    s, rows = _block_rows(g, S, 0, BLOCK_S, 1)
    dd = tl.arange(0, D)
    ok = (s < S)[:, None]
    y = tl.load(Y8 + rows[:, None] * D + dd[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(V + rows[:, None] * D + dd[None, :], y.to(V.dtype.element_ty), mask=ok)
    row_scale = tl.load(S_ROW + rows, mask=s < S, other=0.0)
    scale, inv = _fp8_channel_scales(CAMAX + g * D, CS, D, False)
    if tl.program_id(0) == 0:
        tl.store(CS + g * D + dd, scale)
    # the represented value rounded first, then the channel's multiplier (the reference's
    # dequantize, then quantize_fp8's x * (448 / amax))
    out = _e4m3_signed(y * row_scale[:, None] * inv[None, :], HW_CVT)
    tl.store(CT + g * D * S + dd[None, :] * S + s[:, None], out.to(tl.float8e4nv), mask=ok)


def quantize_qk_fp8_saved(x: torch.Tensor):
    """Per-token FP8 of x (..., S, D) as the training forward keeps it, in one pass:
    (bf16 values (..., S, D) for the forward kernel, the same values as float8_e4m3fn
    bytes (..., S, D), float32 row scales (..., S), and the channels' max |value x row
    scale| per head (..., D) as int32 float bits, which `fp8_qk_views` needs). Values and
    scales are `formats.quantize_fp8(x, dim=-1)`'s: NaN scale for a row holding NaN or
    Inf, scale 1 and zeros below FP8_MIN_AMAX."""
    x3 = _heads(x)
    G, S, D = x3.shape
    y = torch.empty(x3.shape, device=x.device, dtype=torch.bfloat16)
    y8 = torch.empty(x3.shape, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((G, S), device=x.device, dtype=torch.float32)
    camax = torch.zeros((G, D), device=x.device, dtype=torch.int32)
    grid, block = _row_grid(S, G, CHANNEL_BLOCKS)
    # the quantizing pass of the inference recipes, keeping the bytes and the represented
    # values' channel maxima as well (SAVED)
    _fp8_rows_kernel[grid](x3, y, s, x3, s, camax, S, D=D, BLOCK_R=block, BLOCKS=CHANNEL_BLOCKS, WITH_DOT=False,
                           CHANNEL_AMAX=True, HW_CVT=_hw_cvt(), Y8=y8, SAVED=True, num_warps=4)
    return y.view(x.shape), y8.view(x.shape), s.view(x.shape[:-1]), camax.view(*x.shape[:-2], D)


def fp8_qk_views(values: torch.Tensor, scales: torch.Tensor, channel_amax: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16):
    """What the training backward reads of per-token FP8 Q or K, from what the forward
    kept (`quantize_qk_fp8_saved`'s e4m3 `values` (..., S, D), row `scales` (..., S) and
    `channel_amax` (..., D)), in one pass: (the values as `dtype`, bfloat16 or float32,
    both exact; the per-channel e4m3 view of the represented values transposed, (..., D,
    S) float8_e4m3fn; its float32 scales (..., D)), as `formats.quantize_fp8(values *
    scales[..., None], dim=-2)` makes them."""
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_qk_views: values are the saved float8_e4m3fn bytes, got {values.dtype}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_qk_views: dtype bfloat16 or float32, got {dtype}")
    if scales.shape != values.shape[:-1] or channel_amax.shape != (*values.shape[:-2], values.shape[-1]):
        raise ValueError(f"fp8_qk_views: values (..., S, D) with row scales (..., S) and channel maxima (..., D), "
                         f"got {tuple(values.shape)}, {tuple(scales.shape)}, {tuple(channel_amax.shape)}")
    y3 = _heads(values)
    G, S, D = y3.shape
    v = torch.empty((G, S, D), device=values.device, dtype=dtype)
    ct = torch.empty((G, D, S), device=values.device, dtype=torch.float8_e4m3fn)
    cs = torch.empty((G, D), device=values.device, dtype=torch.float32)
    grid, block = _row_grid(S, G, 1)
    _fp8_views_kernel[grid](y3, scales.contiguous().view(G, S), channel_amax.contiguous().view(G, D), v, ct, cs, S,
                            D=D, BLOCK_S=block, HW_CVT=_hw_cvt(), num_warps=4)
    lead = values.shape[:-2]
    return v.view(values.shape), ct.view(*lead, D, S), cs.view(*lead, D)
