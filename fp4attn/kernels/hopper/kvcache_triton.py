"""Quantize-on-write into a KV cache: one fused Triton kernel per append.

One program takes BLOCK_T new tokens of one (sequence, KV head), reads their K and V
rows once, quantizes each row on its own (every scale is the token's: nothing waits for
other tokens or other programs) and writes the payloads at the tokens' places in the
pool, found through the block table from the sequence's length before the append. The
bytes are the reference's (`reference.kvcache.quantize_tokens`), by the same operation
order as the prefill quantizers (`kernels/quantize/`, whose helpers these are):
divisions `div_rn`, values rounded to the e4m3 and E2M1 grids before an exact cast.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice  # noqa: F401  (the helpers' IEEE forms)

from fp4attn.formats import constants
from fp4attn.kernels.hopper.decode_triton import BF16, FP8, NVFP4, _rows_of
from fp4attn.kernels.quantize.elements import (
    _abs_bits,
    _e2m1_code,
    _e2m1_value,
    _floor_log2,
    _pow2,
    _round_bf16,
)
from fp4attn.kernels.quantize.fp8 import _fp8_per_row
from fp4attn.kernels.quantize.nvfp4 import ONE_SIXTH, _nvfp4_block_scale
from fp4attn.reference.kvcache import MX_WINDOW as _MX_WINDOW

FP32_MAX = tl.constexpr(constants.FP32_MAX)
MX_WINDOW = tl.constexpr(_MX_WINDOW)


@triton.jit
def _packed(code, T: tl.constexpr, D: tl.constexpr):
    """Codes (T, D) int32 -> bytes (T, D / 2), element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(code, [T, D // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _store_nvfp4(x, rows, ok, A, S, TS, T: tl.constexpr, D: tl.constexpr, HW: tl.constexpr):
    """NVFP4 of each row of x (T, D) float32 with the row as the tensor: TransformerEngine's
    rule (`formats.nvfp4`) with amax the max |x| of the row's finite values, a block
    holding a NaN or Inf NaN (scale 0x7F, codes 0); the token scale S_dec, NaN for a
    row holding NaN or Inf (`reference.kvcache`)."""
    bits = _abs_bits(x)
    finite = tl.max(bits, axis=1) < 0x7F800000  # NaN and Inf above the largest finite
    amax = tl.max(tl.where(bits < 0x7F800000, bits, 0), axis=1).to(tl.float32, bitcast=True)
    one = tl.full(amax.shape, 1.0, tl.float32)
    s_enc = tl.minimum(tl.div_rn(one * 2688.0, amax), FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
    s_dec = tl.div_rn(one, s_enc)
    mult = s_enc * ONE_SIXTH
    xb = tl.reshape(x, [T, D // 16, 16])
    ax = tl.abs(xb)
    d, enc = _nvfp4_block_scale(tl.max(ax, axis=2), mult[:, None], s_dec[:, None], HW)
    d = tl.where(tl.max(tl.reshape(bits, [T, D // 16, 16]), axis=2) < 0x7F800000, d, float("nan"))
    mag = _e2m1_value(ax * enc[:, :, None])
    code = _e2m1_code(mag) | tl.where(xb.to(tl.int32, bitcast=True) < 0, 8, 0)
    code = tl.where((d != d)[:, :, None], 0, code)  # a NaN block's elements: code 0, the scale carries it
    okc = ok[:, None]
    tl.store(A + rows[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :], _packed(tl.reshape(code, [T, D]), T, D),
             mask=okc)
    tl.store(S + rows[:, None] * (D // 16) + tl.arange(0, D // 16)[None, :],
             d.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=okc)
    tl.store(TS + rows, tl.where(finite, s_dec, float("nan")), mask=ok)


@triton.jit
def _store_mxfp4(x, rows, ok, A, S, T: tl.constexpr, D: tl.constexpr):
    """MXFP4 of each row of x (T, D) float32 (`formats.mx`, floor rule): per 32 channels
    the E8M0 exponent of the finite entries, 0xFF for a block holding NaN or Inf, and
    the blocks below the token's window (`reference.kvcache.MX_WINDOW`) zeroed."""
    NB: tl.constexpr = D // 32
    xb = tl.reshape(x, [T, NB, 32])
    finite = tl.abs(xb) < float("inf")
    bad = tl.min(finite.to(tl.int32), axis=2) == 0
    fin = tl.where(finite, xb, 0.0)
    amax = tl.max(tl.abs(fin), axis=2)
    positive = amax > 0.0
    e = tl.where(positive, _floor_log2(tl.where(positive, amax, 1.0)) - 2, -127)
    e = tl.minimum(tl.maximum(e, -127), 127)
    y = fin * _pow2(-e)[:, :, None]
    code = _e2m1_code(_e2m1_value(tl.abs(y))) | tl.where(y.to(tl.int32, bitcast=True) < 0, 8, 0)
    e_tok = tl.max(tl.where(bad, -127, e), axis=1)
    flushed = (~bad) & (e < e_tok[:, None] - MX_WINDOW)
    code = tl.where(flushed[:, :, None], 0, code)
    okc = ok[:, None]
    tl.store(A + rows[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :], _packed(tl.reshape(code, [T, D]), T, D),
             mask=okc)
    tl.store(S + rows[:, None] * NB + tl.arange(0, NB)[None, :], tl.where(bad, 255, e + 127).to(tl.uint8), mask=okc)


@triton.jit
def _store_tokens(x, rows, ok, A, S, TS, FMT: tl.constexpr, T: tl.constexpr, D: tl.constexpr, HW: tl.constexpr):
    """Quantize rows x (T, D) float32 in format FMT and write them at pool rows `rows`."""
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    if FMT == BF16:
        if HW:
            y = x.to(tl.bfloat16)
        else:
            y = _round_bf16(x).to(tl.bfloat16)
        y = tl.where(tl.abs(y.to(tl.float32)) == float("inf"), float("nan"), y.to(tl.float32)).to(tl.bfloat16)
        tl.store(A + offs, y, mask=ok[:, None])
    elif FMT == FP8:
        y, scale = _fp8_per_row(x, 1, HW)
        tl.store(A + offs, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=ok[:, None])
        tl.store(TS + rows, scale, mask=ok)
    elif FMT == NVFP4:
        _store_nvfp4(x, rows, ok, A, S, TS, T, D, HW)
    else:
        _store_mxfp4(x, rows, ok, A, S, T, D)


@triton.jit
def kvcache_append_kernel(K, V, KA, KS, KT, VA, VS, VT, TABLE, LENS, COUNTS,
                          stride_b, stride_h, stride_s, S_NEW, HKV, PS, TABLE_STRIDE,
                          D: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, BLOCK_T: tl.constexpr,
                          HAS_COUNTS: tl.constexpr, HW: tl.constexpr):
    """Write new tokens K, V (B, HKV, S_NEW, D) (the same strides, the last 1) after each
    sequence's LENS[b] tokens: grid (cdiv(S_NEW, BLOCK_T), B * HKV). Sequence b takes
    COUNTS[b] tokens (HAS_COUNTS) or all S_NEW. LENS is read, not updated (the caller
    adds the counts after the kernel)."""
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    s = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if HAS_COUNTS:
        count = tl.load(COUNTS + b)
    else:
        count = S_NEW
    ok = s < count
    pos = tl.load(LENS + b) + s
    rows = _rows_of(TABLE, b, h, pos, ok, HKV, PS, TABLE_STRIDE)
    src = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + s[:, None].to(tl.int64) * stride_s \
        + tl.arange(0, D)[None, :]
    x = tl.load(K + src, mask=ok[:, None], other=0.0).to(tl.float32)
    _store_tokens(x, rows, ok, KA, KS, KT, K_FMT, BLOCK_T, D, HW)
    x = tl.load(V + src, mask=ok[:, None], other=0.0).to(tl.float32)
    _store_tokens(x, rows, ok, VA, VS, VT, V_FMT, BLOCK_T, D, HW)
