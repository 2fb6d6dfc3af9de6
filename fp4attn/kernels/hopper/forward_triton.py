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


@triton.jit
def _tile(acc, l_i, m_i, q, a_i, k_ptr, ks_ptr, vt_ptr, kb_ptr, start_n, offs_m, offs_n, Sk, causal_offset,
          stride_kn, stride_vn, QK_FP8: tl.constexpr, P_MODE: tl.constexpr, MASK: tl.constexpr,
          CAUSAL: tl.constexpr, KEY_BIAS: tl.constexpr, P_HW_CVT: tl.constexpr, VT_PADDED: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
          WRITE_P: tl.constexpr, p_ptr, stride_pm, TMA_KV: tl.constexpr, k_desc, vt_desc, k_row, vt_row,
          PV_ADD: tl.constexpr):
    cols = start_n + offs_n
    offs_d = tl.arange(0, HEAD_DIM)
    # -- scores in log2 units: (Qv Kv^T) * (q_scale * softmax_scale * log2 e) * k_scale
    if TMA_KV:
        k = k_desc.load([k_row + start_n, 0])
    elif MASK:
        k = tl.load(k_ptr + cols[:, None] * stride_kn + offs_d[None, :], mask=(cols < Sk)[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + cols[:, None] * stride_kn + offs_d[None, :])
    if MASK:
        b_j = tl.load(ks_ptr + cols, mask=cols < Sk, other=0.0)
    else:
        b_j = tl.load(ks_ptr + cols)
    # fp8 wgmma accumulates with fewer bits than float32: fast_accum recipes take those sums
    s = tl.dot(q, tl.trans(k))
    t = log2_scores(s, a_i[:, None], b_j[None, :])
    if KEY_BIAS:  # added before hiding keys, as the reference does
        if MASK:
            t = t + tl.load(kb_ptr + cols, mask=cols < Sk, other=0.0)[None, :]
        else:
            t = t + tl.load(kb_ptr + cols)[None, :]
    if MASK:
        visible = cols[None, :] < Sk
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
        t = tl.where(visible, t, -float("inf"))
    # -- online softmax: exact running max, rescale every tile; P as exact e4m3 values
    # (times 2**8) and the consistent row sum
    p, alpha, m_new, l_i = online_softmax_p(t, m_i, l_i, P_MODE, P_HW_CVT, MASK or KEY_BIAS)
    if WRITE_P:  # tests: the P tile's values, float32, rows padded to BLOCK_M
        tl.store(p_ptr + offs_m[:, None] * stride_pm + cols[None, :], p, mask=(cols < Sk)[None, :])
    # -- PV on the FP8 tensor cores; V is stored transposed (D, S) so both are K-major
    if TMA_KV:
        vt = vt_desc.load([vt_row, start_n])
    elif MASK and not VT_PADDED:
        vt = tl.load(vt_ptr + offs_d[:, None] * stride_vn + cols[None, :], mask=(cols < Sk)[None, :], other=0.0)
    else:  # V^T rows padded with zero keys to whole tiles: no mask, 16-byte loads
        vt = tl.load(vt_ptr + offs_d[:, None] * stride_vn + cols[None, :])
    p8 = p.to(tl.float8e4nv)
    # each tile's PV added into O in float32 (module docstring)
    if PV_ADD:
        # the tile's product on its own accumulator, then one float32 addition
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
    else:
        # the same sums through Triton's promotion; its lowering reads the accumulator
        # inside the wgmma pipeline stage, and ptxas then serializes every wgmma of the
        # kernel (C7514: each of QK^T's eight bf16 wgmmas waits for the one before)
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
    return acc, l_i, m_new


@triton.jit
def attn_fwd_kernel(
    Q, K, QS, KS, VT, VS, O, LSE, P_DBG, KB, K_DESC, VT_DESC,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_om,
    stride_pb, stride_ph, stride_pm,
    H, GROUP, Sq, Sk, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_FP8: tl.constexpr, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, WRITE_P: tl.constexpr,
    KEY_BIAS: tl.constexpr = False, P_HW_CVT: tl.constexpr = False, VT_PADDED: tl.constexpr = False,
    TMA_KV: tl.constexpr = False, PV_ADD: tl.constexpr = False, SINK_TILES: tl.constexpr = 0,
):
    tl.static_assert(BLOCK_N % 32 == 0)  # MXFP4 P blocks of 32 keys never straddle tiles
    tl.static_assert(VT_PADDED or not TMA_KV)
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq

    q_ptr = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_ptr = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    vt_ptr = VT + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    qs_ptr = QS + (b.to(tl.int64) * H + h) * Sq
    ks_ptr = KS + (b.to(tl.int64) * (H // GROUP) + hk) * Sk
    p_ptr = P_DBG + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
    kb_ptr = KB + b.to(tl.int64) * Sk  # (B, Sk) key bias, read only with KEY_BIAS
    k_row = (b * (H // GROUP) + hk) * Sk  # this head's first row of K_DESC (TMA_KV)
    vt_row = (b * (H // GROUP) + hk) * HEAD_DIM  # and of VT_DESC

    q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    a_i = tl.load(qs_ptr + offs_m, mask=row_ok, other=0.0) * qk_scale
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    full, hi = key_tile_bounds(start_m, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    if P_MODE == P_MODE_MXFP4_DIRECTP_SINK and SINK_TILES > 0:
        # p_sink on the first key tiles only (attention sinks are the first tokens): they
        # run here, peeled, so that the loops below carry plain Direct-P's instructions.
        # Every program visits its tiles from key 0 upward, causal or not, so these come
        # first; the masked form serves a tile that some rows see only in part
        for i in tl.static_range(SINK_TILES):
            if i * BLOCK_N < hi:
                acc, l_i, m_i = _tile(acc, l_i, m_i, q, a_i, k_ptr, ks_ptr, vt_ptr, kb_ptr, i * BLOCK_N, offs_m,
                                      offs_n, Sk, causal_offset, stride_kn, stride_vd, QK_FP8, 3, True, CAUSAL,
                                      KEY_BIAS, P_HW_CVT, VT_PADDED, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_P, p_ptr,
                                      stride_pm, TMA_KV, K_DESC, VT_DESC, k_row, vt_row, PV_ADD)
        lo: tl.constexpr = SINK_TILES * BLOCK_N
        for start_n in range(lo, full, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, a_i, k_ptr, ks_ptr, vt_ptr, kb_ptr, start_n, offs_m, offs_n,
                                  Sk, causal_offset, stride_kn, stride_vd, QK_FP8, 1, False, CAUSAL, KEY_BIAS,
                                  P_HW_CVT, VT_PADDED, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_P, p_ptr, stride_pm,
                                  TMA_KV, K_DESC, VT_DESC, k_row, vt_row, PV_ADD)
        for start_n in range(tl.maximum(full, lo), hi, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, a_i, k_ptr, ks_ptr, vt_ptr, kb_ptr, start_n, offs_m, offs_n,
                                  Sk, causal_offset, stride_kn, stride_vd, QK_FP8, 1, True, CAUSAL, KEY_BIAS,
                                  P_HW_CVT, VT_PADDED, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_P, p_ptr, stride_pm,
                                  TMA_KV, K_DESC, VT_DESC, k_row, vt_row, PV_ADD)
    else:
        for start_n in range(0, full, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, a_i, k_ptr, ks_ptr, vt_ptr, kb_ptr, start_n, offs_m, offs_n,
                                  Sk, causal_offset, stride_kn, stride_vd, QK_FP8, P_MODE, False, CAUSAL, KEY_BIAS,
                                  P_HW_CVT, VT_PADDED, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_P, p_ptr, stride_pm,
                                  TMA_KV, K_DESC, VT_DESC, k_row, vt_row, PV_ADD)
        for start_n in range(full, hi, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, a_i, k_ptr, ks_ptr, vt_ptr, kb_ptr, start_n, offs_m, offs_n,
                                  Sk, causal_offset, stride_kn, stride_vd, QK_FP8, P_MODE, True, CAUSAL, KEY_BIAS,
                                  P_HW_CVT, VT_PADDED, BLOCK_M, BLOCK_N, HEAD_DIM, WRITE_P, p_ptr, stride_pm,
                                  TMA_KV, K_DESC, VT_DESC, k_row, vt_row, PV_ADD)

    # -- epilogue: V's per-channel scale and 1/l; LSE in natural log (the 2**8 P
    # offset, 2**5 for P mode 7, cancels in acc / l and is subtracted from the LSE)
    p_offset: tl.constexpr = P_OFFSET_LOG2_LAZY if P_MODE == P_MODE_FP8_AFFINE_LAZY else P_OFFSET_LOG2
    seen = l_i != 0.0  # 0 only for a row that saw no key; NaN (a NaN row) stays NaN
    vs = tl.load(VS + (b.to(tl.int64) * (H // GROUP) + hk) * HEAD_DIM + offs_d)
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None] * vs[None, :]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) - p_offset) * 0.6931471805599453,
                   -float("inf"))
    o_ptr = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_ptr + offs_m[:, None] * stride_om + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + (b.to(tl.int64) * H + h) * Sq + offs_m, lse, mask=row_ok)
