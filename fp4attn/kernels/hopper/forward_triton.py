"""Attention forward for Hopper (sm_90): FP8 or BF16 QK^T, e4m3 P, FP8 PV.

One program computes BLOCK_M query rows of one head against every visible key tile.
Recipes map to constexpr flags:

    QK_FP8   Q/K are e4m3 with per-token scales (fp8 recipes), else bf16 grid values
             of NVFP4 (exact in bf16) with the tensor scales in the same per-token slots
    P_MODE   0: FP8 P from exp2;  1: MXFP4 P by Direct-P;  2: MXFP4 P from exp2 + OCP;
             3: MXFP4 P by Direct-P with each 32-key block's top keys apart (`Recipe.p_sink`)
    SINK_TILES with P_MODE 3: only the first SINK_TILES key tiles build P so
             (`Recipe.p_sink_keys`), peeled before the loops, which run plain Direct-P
             (P_MODE 1) on the others; 0: every tile
    CAUSAL   query i sees keys j <= i + causal_offset
    KEY_BIAS a per-(batch, key) log2-unit bias is added to the scores (an SDPA key mask:
             0 / -inf for a boolean one), as `reference.forward.log2_bias` makes it
    P_HW_CVT FP8 P rounded by the packed hardware conversion (cvt.rn.satfinite); False
             is the same rounding in float32 bit arithmetic, which the interpreter tests
             run (inline PTX cannot run under the interpreter)
    WRITE_P  tests: every P tile's values (times 2**8, exact e4m3 values) to P_DBG
    VT_PADDED V^T's rows hold zero keys up to a whole tile (`KernelOperands.vt_keys_padded`),
             so the tail tile loads it without a mask
    PV_ADD   the tile's PV product on a fresh accumulator plus one float32 addition, rather
             than Triton's max_num_imprecise_acc promotion (same sums up to the FMA
             contraction of O's rescale; the latter makes ptxas serialize the wgmmas)
    TMA_KV   K and V^T tiles arrive by the tensor memory accelerator (host-built 2D
             descriptors K_DESC over (B*Hkv*Sk, D) and VT_DESC over (B*Hkv*D, keys); needs
             VT_PADDED), not by per-thread asynchronous copies: the copies' pipeline puts
             a CTA barrier in every iteration, where the warps wait for the slowest
             (ncu: barrier stalls 0.7-1.4 cycles per issued instruction). A tail tile's
             rows past Sk are the next head's keys or zeros; the mask hides their scores

QK^T of e4m3 Q/K takes the tensor core's own accumulation over all of D (the
`fast_accum` recipes' sums); each tile's PV is added into O in float32 (chained on the
tensor cores instead, the output drifted from the reference as rows got longer:
docs/notes/hopper-forward.md, "O accumulated in float32 per tile").

Tiles that need no mask (fully visible, inside Sk) run in a first loop without any
masking arithmetic; the diagonal and tail tiles run in a second, masked loop.
The reference (`fp4attn.reference.forward`) defines every value this kernel computes.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from fp4attn.kernels.common import (
    P_MODE_FP8_AFFINE_LAZY,
    P_MODE_MXFP4_DIRECTP_SINK,
    P_OFFSET_LOG2,
    P_OFFSET_LOG2_LAZY,
    key_tile_bounds,
    log2_scores,
    online_softmax_p,
)


class QueryRows(NamedTuple):
    """A program's query rows, as every key tile reads them."""

    q: tl.tensor  # (BLOCK_M, HEAD_DIM) Q values
    factor: tl.tensor  # (BLOCK_M,) q_scale * softmax_scale * log2 e: their scores in log2 units
    offs: tl.tensor  # (BLOCK_M,) their query indices
    p_dbg: tl.tensor  # WRITE_P: this head's (rows, Sk) P tile of P_DBG, rows p_stride apart
    p_stride: tl.tensor


class KeyHead(NamedTuple):
    """The keys a program reads: its (batch, K/V head)'s K, per-key scales, V^T and key
    bias, and which keys a row sees."""

    offs: tl.tensor  # (BLOCK_N,) the keys' offsets in a tile
    k: tl.tensor  # K (Sk, HEAD_DIM), rows k_stride apart
    k_stride: tl.tensor
    k_scale: tl.tensor  # KS (Sk,) per-key scales
    vt: tl.tensor  # V^T (HEAD_DIM, keys), rows vt_stride apart
    vt_stride: tl.tensor
    bias: tl.tensor  # KB (Sk,), read only with KEY_BIAS
    k_desc: tl.tensor_descriptor  # TMA_KV: K_DESC and VT_DESC, this head's first row of each
    vt_desc: tl.tensor_descriptor
    k_row: tl.tensor
    vt_row: tl.tensor
    Sk: tl.tensor  # the key count
    causal_offset: tl.tensor  # CAUSAL: query i sees keys j <= i + causal_offset


class TileFlags(NamedTuple):
    """The kernel's constexpr flags a key tile reads (the module docstring's)."""

    CAUSAL: tl.constexpr
    KEY_BIAS: tl.constexpr
    P_HW_CVT: tl.constexpr
    VT_PADDED: tl.constexpr
    BLOCK_N: tl.constexpr
    HEAD_DIM: tl.constexpr
    WRITE_P: tl.constexpr
    TMA_KV: tl.constexpr
    PV_ADD: tl.constexpr


@triton.jit
def _tile(acc, l_i, m_i, rows, keys, start_n, P_MODE: tl.constexpr, MASK: tl.constexpr, flags):
    """One key tile from key start_n on: the running (acc, l_i, m_i) after it. MASK: the
    keys past Sk and (CAUSAL) past a row's diagonal hidden, a tile of the second loop."""
    cols = start_n + keys.offs
    offs_d = tl.arange(0, flags.HEAD_DIM)
    Sk = keys.Sk
    # -- scores in log2 units: (Qv Kv^T) * (q_scale * softmax_scale * log2 e) * k_scale
    if flags.TMA_KV:
        k = keys.k_desc.load([keys.k_row + start_n, 0])
    elif MASK:
        k = tl.load(keys.k + cols[:, None] * keys.k_stride + offs_d[None, :], mask=(cols < Sk)[:, None],
                    other=0.0)
    else:
        k = tl.load(keys.k + cols[:, None] * keys.k_stride + offs_d[None, :])
    if MASK:
        b_j = tl.load(keys.k_scale + cols, mask=cols < Sk, other=0.0)
    else:
        b_j = tl.load(keys.k_scale + cols)
    # fp8 wgmma accumulates with fewer bits than float32: fast_accum recipes take those sums
    s = tl.dot(rows.q, tl.trans(k))
    t = log2_scores(s, rows.factor[:, None], b_j[None, :])
    if flags.KEY_BIAS:  # added before hiding keys, as the reference does
        if MASK:
            t = t + tl.load(keys.bias + cols, mask=cols < Sk, other=0.0)[None, :]
        else:
            t = t + tl.load(keys.bias + cols)[None, :]
    if MASK:
        visible = cols[None, :] < Sk
        if flags.CAUSAL:
            visible = visible & (cols[None, :] <= rows.offs[:, None] + keys.causal_offset)
        t = tl.where(visible, t, -float("inf"))
    # -- online softmax: exact running max, rescale every tile; P as exact e4m3 values
    # (times 2**8) and the consistent row sum
    p, alpha, m_new, l_i = online_softmax_p(t, m_i, l_i, P_MODE, flags.P_HW_CVT, MASK or flags.KEY_BIAS)
    if flags.WRITE_P:  # tests: the P tile's values, float32, rows padded to BLOCK_M
        tl.store(rows.p_dbg + rows.offs[:, None] * rows.p_stride + cols[None, :], p,
                 mask=(cols < Sk)[None, :])
    # -- PV on the FP8 tensor cores; V is stored transposed (D, S) so both are K-major
    if flags.TMA_KV:
        vt = keys.vt_desc.load([keys.vt_row, start_n])
    elif MASK and not flags.VT_PADDED:
        vt = tl.load(keys.vt + offs_d[:, None] * keys.vt_stride + cols[None, :], mask=(cols < Sk)[None, :],
                     other=0.0)
    else:  # V^T rows padded with zero keys to whole tiles: no mask, 16-byte loads
        vt = tl.load(keys.vt + offs_d[:, None] * keys.vt_stride + cols[None, :])
    p8 = p.to(tl.float8e4nv)
    # each tile's PV added into O in float32 (module docstring)
    if flags.PV_ADD:
        # the tile's product on its own accumulator, then one float32 addition
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
    else:
        # the same sums through Triton's promotion; its lowering reads the accumulator
        # inside the wgmma pipeline stage, and ptxas then serializes every wgmma of the
        # kernel (C7514: each of QK^T's eight bf16 wgmmas waits for the one before)
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None], max_num_imprecise_acc=flags.BLOCK_N)
    return acc, l_i, m_new


@triton.jit
def attn_fwd_kernel(
    Q, K, QS, KS, VT, VS, O, LSE, P_DBG, KB, K_DESC, VT_DESC,
    q_strides, k_strides, vt_strides, o_strides, p_strides, call,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_FP8: tl.constexpr, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WRITE_P: tl.constexpr,
    KEY_BIAS: tl.constexpr = False, P_HW_CVT: tl.constexpr = False, VT_PADDED: tl.constexpr = False,
    TMA_KV: tl.constexpr = False, PV_ADD: tl.constexpr = False, SINK_TILES: tl.constexpr = 0,
):
    """Q (B, H, Sq, D), K (B, Hkv, Sk, D) e4m3 or bf16 with per-token scales QS (B, H,
    Sq), KS (B, Hkv, Sk) float32; V^T (B, Hkv, D, keys) e4m3 with per-channel scales VS
    (B, Hkv, D); O (B, H, Sq, D) bf16, LSE (B, H, Sq) float32; P_DBG (B, H, Sq padded to
    BLOCK_M, Sk) float32 (WRITE_P), KB (B, Sk) float32 (KEY_BIAS). q_strides, k_strides,
    vt_strides, o_strides, p_strides: each tensor's (batch, head, row) strides, V^T's row
    a channel (the last dim contiguous); call: (H, GROUP, Sq, Sk, causal_offset,
    qk_scale), the query heads, the query heads per K/V head, the query and key counts,
    the causal diagonal's offset and softmax_scale * log2 e."""
    tl.static_assert(BLOCK_N % 32 == 0)  # MXFP4 P blocks of 32 keys never straddle tiles
    tl.static_assert(VT_PADDED or not TMA_KV)
    H, GROUP, Sq, Sk, causal_offset, qk_scale = call
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq

    # (written out, not shared with the Blackwell forward: `kernel_args`)
    q_ptr = Q + b.to(tl.int64) * q_strides[0] + h.to(tl.int64) * q_strides[1]
    k_ptr = K + b.to(tl.int64) * k_strides[0] + hk.to(tl.int64) * k_strides[1]
    vt_ptr = VT + b.to(tl.int64) * vt_strides[0] + hk.to(tl.int64) * vt_strides[1]
    qs_ptr = QS + (b.to(tl.int64) * H + h) * Sq
    ks_ptr = KS + (b.to(tl.int64) * (H // GROUP) + hk) * Sk
    p_ptr = P_DBG + b.to(tl.int64) * p_strides[0] + h.to(tl.int64) * p_strides[1]
    kb_ptr = KB + b.to(tl.int64) * Sk  # (B, Sk) key bias, read only with KEY_BIAS
    k_row = (b * (H // GROUP) + hk) * Sk  # this head's first row of K_DESC (TMA_KV)
    vt_row = (b * (H // GROUP) + hk) * HEAD_DIM  # and of VT_DESC

    q = tl.load(q_ptr + offs_m[:, None] * q_strides[2] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    a_i = tl.load(qs_ptr + offs_m, mask=row_ok, other=0.0) * qk_scale
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    rows = QueryRows(q, a_i, offs_m, p_ptr, p_strides[2])
    keys = KeyHead(offs_n, k_ptr, k_strides[2], ks_ptr, vt_ptr, vt_strides[2], kb_ptr, K_DESC, VT_DESC, k_row,
                   vt_row, Sk, causal_offset)
    flags: tl.constexpr = TileFlags(CAUSAL, KEY_BIAS, P_HW_CVT, VT_PADDED, BLOCK_N, HEAD_DIM, WRITE_P, TMA_KV,
                                    PV_ADD)

    full, hi = key_tile_bounds(start_m, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    if P_MODE == P_MODE_MXFP4_DIRECTP_SINK and SINK_TILES > 0:
        # p_sink on the first key tiles only (attention sinks are the first tokens): they
        # run here, peeled, so that the loops below carry plain Direct-P's instructions.
        # Every program visits its tiles from key 0 upward, causal or not, so these come
        # first; the masked form serves a tile that some rows see only in part
        for i in tl.static_range(SINK_TILES):
            if i * BLOCK_N < hi:
                acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, i * BLOCK_N, 3, True, flags)
        lo: tl.constexpr = SINK_TILES * BLOCK_N
        for start_n in range(lo, full, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, 1, False, flags)
        for start_n in range(tl.maximum(full, lo), hi, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, 1, True, flags)
    else:
        for start_n in range(0, full, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, P_MODE, False, flags)
        for start_n in range(full, hi, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, P_MODE, True, flags)

    # -- epilogue: V's per-channel scale and 1/l; LSE in natural log (the 2**8 P
    # offset, 2**5 for P mode 7, cancels in acc / l and is subtracted from the LSE)
    p_offset: tl.constexpr = P_OFFSET_LOG2_LAZY if P_MODE == P_MODE_FP8_AFFINE_LAZY else P_OFFSET_LOG2
    seen = l_i != 0.0  # 0 only for a row that saw no key; NaN (a NaN row) stays NaN
    vs = tl.load(VS + (b.to(tl.int64) * (H // GROUP) + hk) * HEAD_DIM + offs_d)
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None] * vs[None, :]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) - p_offset) * 0.6931471805599453,
                   -float("inf"))
    o_ptr = O + b.to(tl.int64) * o_strides[0] + h.to(tl.int64) * o_strides[1]
    tl.store(o_ptr + offs_m[:, None] * o_strides[2] + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + (b.to(tl.int64) * H + h) * Sq + offs_m, lse, mask=row_ok)
