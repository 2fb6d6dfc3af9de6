"""Attention backward of the training recipes in Triton, built for Hopper (sm_90; the
Hopper training runs it where its Gluon kernels do not, `hopper.train_op`) and for
Blackwell (`blackwell.train_op`, with QK_FP4 below).

P is rebuilt from the forward's saved Q/K and its LSE; no score tile from the forward
is kept. Q and K arrive as bf16 values, exact for both training formats (NVFP4's grid
values, decoded from the saved packed payload, with one tensor scale per head; per-token
FP8's e4m3 values, widened from the saved bytes, with a scale per query and per key:
ROW_SCALES), so S is a bf16 product scaled as the forward scales it.
The gradient products run on the FP8 tensor cores with e4m3 views, each view scaled
per row of its product's contraction dim (`fp4attn.reference.backward` defines every
value):

    dkdv program (BLOCK_N keys of one K/V head, over every query tile of the heads
    that share it):
        S^T  = K Q^T                         bf16, scores as the forward's (x scales)
        P^T  = 2**(t - lse)                  fp32; P_r^T its FP8 / MXFP4 form
        dV  += P_r^T  dO_c                   dO_c: e4m3 per channel, stored (D, Sq)
        dP^T = V_t dO_t^T                    e4m3 per token (both K-major)
        dS^T = P^T (dP^T - delta)
        dK  += e4m3(dS^T per key, 64 queries) Q_c          Q_c: e4m3 per channel, (D, Sq)
    dq program (BLOCK_M queries of one head, over its visible key tiles):
        dQ  += e4m3(dS per query row, 64 keys) K_c         K_c: e4m3 per channel, (D, Sk)

Each program owns its outputs, so the backward is deterministic (no atomics); GQA
sums dK and dV over the query heads of a group inside one program (dQ added by the
dkdv program with atomics instead of a dq kernel was measured slower and removed:
docs/notes/hopper-train.md, "dQ by atomics"). Rows that see no
key (LSE -inf) get a log2 LSE of +inf, so their P is 0 without a per-element test; only
tiles on the causal diagonal or past Sk build a mask (MASK). The kernels read the
forward's LSE and write the gradients in their dtype, so that nothing runs between the
operand quantizers and them, or after them (each launch costs host time, which bounds
the attention of a small batch: tools/profile_train_step.py).

HW_CVT: the e4m3 operands (P_r for FP8 P, and dS) are rounded by the hardware's packed
conversion (cvt.rn.satfinite, round-to-nearest-even with saturation, as the reference)
instead of the float32 bit arithmetic the forward needs for its row sums.

QK_FP4 (Blackwell only: sm_90 has no FP4 tensor cores, and Triton 3.6 cannot build an
NVFP4 `dot_scaled` for it): Q and K arrive as the forward's saved NVFP4 payloads, packed
E2M1 codes (B, heads, S, D/2) with e4m3 block scales QSC, KSC (B, heads, S, D/16), and
the scores are the block-scaled FP4 product of those (`kernels.common.nvfp4_scores`,
`tcgen05.mma ... kind::mxf4nvf4`) instead of a bf16 product of their grid values: the
same exact products summed in float32. The tensor scales multiply the float32 product
as before. tcgen05 has that product for 128 rows only (M = 128): the dq kernel takes
BLOCK_M = 128; the dkdv kernel, whose programs hold 64 keys (S^T's rows), forms S = Q K^T
of two 64-query tiles at once and takes each tile's P^T from it (`_dkdv_tiles_fp4`;
docs/notes/blackwell.md, "The training backward's score products"). Off (the default,
QSC and KSC None), the kernels build as they did.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4attn.kernels.common import (
    P_OFFSET_LOG2,
    build_p_tile,
    fp8_scale_inv,
    log2_scores,
    nvfp4_scores,
    p_fp8_affine_rebuilt,
    round_e4m3,
)
from fp4attn.reference.backward import DS_BLOCK
from fp4attn.reference.forward import LOG2E as _LOG2E

LOG2E = tl.constexpr(_LOG2E)
P_OFFSET = tl.constexpr(float(2**P_OFFSET_LOG2.value))  # FP8 P's fixed scale, 2**8


@triton.jit
def e4m3_rows(x, AXIS: tl.constexpr, HW_CVT: tl.constexpr):
    """FP8 e4m3 view of a tile with one scale per row along AXIS: (e4m3 tile, scale), as
    `formats.fp8.quantize_fp8` (scale = amax / 448, element = e4m3(x * (448 / amax)),
    rows below FP8_MIN_AMAX scale 1 and zero; NaN stays NaN)."""
    scale, inv = fp8_scale_inv(tl.max(tl.abs(x), axis=AXIS))
    y = x * (inv[:, None] if AXIS == 1 else inv[None, :])
    if HW_CVT:
        out = y.to(tl.float8e4nv)
    else:
        mag = round_e4m3(tl.minimum(tl.abs(y), 448.0))
        # NaN stays NaN (tl.minimum would turn it into 448), so it reaches the gradient
        out = tl.where(y != y, y, tl.where(y < 0.0, -mag, mag)).to(tl.float8e4nv)
    return out, scale


@triton.jit
def _token_tile(T, head_row, start, rows, ok, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Rows head_row + rows (rows = start + 0..BLOCK) of a token-major operand, (B * heads
    * S, HEAD_DIM): by TMA (T a descriptor; whole tiles only, so no row of another head
    is read) or by pointer loads with the rows past the head's length (not `ok`) zero."""
    if TMA:
        tile = T.load([(head_row + start).to(tl.int32), 0])
    else:
        d = tl.arange(0, HEAD_DIM)
        tile = tl.load(T + (head_row + rows[:, None]) * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    return tile


@triton.jit
def _nvfp4_token_tile(T, TSC, head_row, rows, ok, HEAD_DIM: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The NVFP4 payload of rows head_row + rows of a token-major operand (QK_FP4): codes
    (B * heads * S, D/2) uint8 as a (rows, D/2) tile, or TRANSPOSED (D/2, rows), the right
    operand of a product over the head dim; block scales (B * heads * S, D/16) e4m3 as
    (rows, D/16) either way, as `tl.dot_scaled` takes both operands' scales. Rows past
    the head's length (not `ok`) are zero codes with zero scales."""
    h = tl.arange(0, HEAD_DIM // 2)
    sb = tl.arange(0, HEAD_DIM // 16)
    if TRANSPOSED:
        codes = tl.load(T + (head_row + rows[None, :]) * (HEAD_DIM // 2) + h[:, None], mask=ok[None, :], other=0)
    else:
        codes = tl.load(T + (head_row + rows[:, None]) * (HEAD_DIM // 2) + h[None, :], mask=ok[:, None], other=0)
    scales = tl.load(TSC + (head_row + rows[:, None]) * (HEAD_DIM // 16) + sb[None, :], mask=ok[:, None], other=0.0)
    return codes, scales


@triton.jit
def _channel_tile(T, first_row, start, cols, ok, length, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Columns `cols` (= start + 0..BLOCK) of rows first_row .. first_row + HEAD_DIM of a
    channel-major operand, (B * heads * HEAD_DIM, length): by TMA (whole tiles only) or
    by pointer loads with the columns past the length (not `ok`) zero."""
    if TMA:
        tile = T.load([first_row.to(tl.int32), start])
    else:
        d = tl.arange(0, HEAD_DIM)
        tile = tl.load(T + first_row * length + d[:, None] * length + cols[None, :], mask=ok[None, :], other=0.0)
    return tile


@triton.jit
def token_scales(S, first_row, offs, ok, factor, AXIS: tl.constexpr):
    """Per-token scales of FP8 Q or K (ROW_SCALES): those of tokens `offs` of the head
    whose first row is `first_row` in S (B, heads, length), times `factor` (rounded, as
    the reference's scale products), as a vector along AXIS of a score tile (0: one per
    row of the tile, 1: one per column); tokens past the length (not `ok`) get 0, whose
    scores the tile's mask or the LSE hides."""
    s = tl.load(S + first_row + offs, mask=ok, other=0.0) * factor
    return s[:, None] if AXIS == 0 else s[None, :]


@triton.jit
def p_r(xt, pt, P_MODE: tl.constexpr, HW_CVT: tl.constexpr, KEY_AXIS: tl.constexpr = 0):
    """P in the recipe's P format times 2**8, as e4m3 (keys along KEY_AXIS)."""
    if P_MODE == 0 or P_MODE == 6:  # P_MODE 6: pt is the e4m3 grid already (exact)
        p256 = pt * P_OFFSET  # exact: the reference's exp2(x) * 2**8
        if HW_CVT:
            pr = p256.to(tl.float8e4nv)
        else:
            pr = round_e4m3(p256).to(tl.float8e4nv)
    else:
        pr = build_p_tile(xt, P_MODE, KEY_AXIS).to(tl.float8e4nv)
    return pr


@triton.jit
def _dkdv_tile(dk, dv, k, v, k_scale, v_s, offs_n, start_m, offs_mb, row_off, hd_off, Sq, Sk, causal_offset,
               q_scale, Q, QS, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C, Q_CS,
               HEAD_DIM: tl.constexpr, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
               HW_CVT: tl.constexpr, TMA: tl.constexpr, ROW_SCALES: tl.constexpr, pt=None, pr=None,
               P_GIVEN: tl.constexpr = False):
    offs_m = start_m + offs_mb
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    if not P_GIVEN:  # (P_GIVEN: this tile's P^T, and MXFP4 P's P_r^T, from `_dkdv_tiles_fp4`)
        q = _token_tile(Q, row_off, start_m, offs_m, row_ok, HEAD_DIM, TMA)
        lse2 = _lse2(LSE + row_off + offs_m, row_ok)
        if ROW_SCALES:  # q_scale is scale * log2 e: times this tile's queries' own scales
            q_scale = token_scales(QS, row_off, offs_m, row_ok, q_scale, 1)
        tt = log2_scores(tl.dot(k, tl.trans(q)), q_scale, k_scale)
        if MASK:
            visible = (offs_n < Sk)[:, None]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
            tt = tl.where(visible, tt, -float("inf"))
        xt = tt - lse2[None, :]
        if P_MODE == 6:  # trained affine FP8 P: the forward's codes, no exponential
            pt = p_fp8_affine_rebuilt(tt, lse2[None, :])
        else:
            pt = tl.math.exp2(xt)
    # dV += P_r^T dO_c (P_r times 2**8; dO_c's channel scale differs per query head)
    do_c = _channel_tile(DO_C, hd_off, start_m, offs_m, row_ok, Sq, HEAD_DIM, TMA)
    do_cs = tl.load(DO_CS + hd_off + offs_d)
    if not P_GIVEN:
        pr = p_r(xt, pt, P_MODE, HW_CVT)
    elif P_MODE == 0 or P_MODE == 6:  # from P^T alone
        pr = p_r(None, pt, P_MODE, HW_CVT)
    dv += tl.dot(pr, tl.trans(do_c)) * do_cs[None, :]
    # dP^T = V_t dO_t^T on per-token e4m3 views
    do_t = _token_tile(DO_T, row_off, start_m, offs_m, row_ok, HEAD_DIM, TMA)
    do_s = tl.load(DO_TS + row_off + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_off + offs_m, mask=row_ok, other=0.0)
    dpt = tl.dot(v, tl.trans(do_t)) * v_s[:, None] * do_s[None, :]
    dst = pt * (dpt - delta[None, :])
    # dK += dS^T Q_c: dS^T in e4m3 with one scale per key over this query tile
    ds_g, ds_s = e4m3_rows(dst, 1, HW_CVT)
    q_c = _channel_tile(Q_C, hd_off, start_m, offs_m, row_ok, Sq, HEAD_DIM, TMA)
    q_cs = tl.load(Q_CS + hd_off + offs_d)
    dk += tl.dot(ds_g, tl.trans(q_c)) * ds_s[:, None] * q_cs[None, :]
    return dk, dv


@triton.jit
def _transposed_halves(x, BLOCK_M: tl.constexpr):
    """The transposes of x's two BLOCK_M-row tiles: x (2 * BLOCK_M, N) -> two (N, BLOCK_M)."""
    return tl.split(tl.reshape(tl.trans(x), (x.shape[1], 2, BLOCK_M)).permute(0, 2, 1))


@triton.jit
def _dkdv_tiles_fp4(dk, dv, kt, k_sc, v, k_scale, v_s, start_n, offs_n, start_m, offs_mb, row_off, hd_off, Sq, Sk,
                    causal_offset, q_scale, Q, QSC, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C, Q_CS,
                    HEAD_DIM: tl.constexpr, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
                    HW_CVT: tl.constexpr):
    """`_dkdv_tile` of the two query tiles at start_m and start_m + BLOCK_M (QK_FP4). S =
    Q K^T of both by one block-scaled FP4 product of the NVFP4 payloads, their 128 queries
    as its rows: tcgen05's block-scaled MMA has M = 128, and S^T would have the program's
    64 keys (128-key programs spill). P is built on S, one query a row, each element by
    `_dkdv_tile`'s operations (its LSE one register a thread; MXFP4 P's 32-key blocks in
    one thread's row, no shuffles); then each tile's P^T (and MXFP4 P_r^T) goes through
    the rest of `_dkdv_tile`, the tiles in query order: dK and dV as two calls of
    `_dkdv_tile` on the bf16 S^T, up to S's float32 summation order."""
    BLOCK_M: tl.constexpr = offs_mb.shape[0]
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    P_FROM_PT: tl.constexpr = P_MODE == 0 or P_MODE == 6  # P_r is P times 2**8 in e4m3 (else MXFP4 P)
    offs_m = start_m + tl.arange(0, 2 * BLOCK_M)
    row_ok = offs_m < Sq
    q, q_sc = _nvfp4_token_tile(Q, QSC, row_off, offs_m, row_ok, HEAD_DIM, False)
    # S's accumulator: a zero the compiler cannot fold (`nvfp4_scores`), from this step's
    # query indices: from the head's scale, a loop invariant, the compiler kept the zero
    # tile in registers across the loop
    zero_m = offs_m.to(tl.float32) * 0.0
    t = log2_scores(nvfp4_scores(q, q_sc, kt, k_sc, zero_m), q_scale, k_scale)
    lse2 = _lse2(LSE + row_off + offs_m, row_ok)
    if MASK:
        # offs_n < Sk and offs_n <= offs_m + causal_offset, on the keys' offsets in the
        # block (a constant a register) against a bound a row: 64 key indices in
        # registers spilled the causal builds
        key = tl.arange(0, BLOCK_N)[None, :]
        visible = key < Sk - start_n
        if CAUSAL:
            visible = visible & (key <= (offs_m + causal_offset - start_n)[:, None])
        t = tl.where(visible, t, -float("inf"))
    x = t - lse2[:, None]
    if P_MODE == 6:  # trained affine FP8 P: the forward's codes, no exponential
        p = p_fp8_affine_rebuilt(t, lse2[:, None])
    else:
        p = tl.math.exp2(x)
    pt0, pt1 = _transposed_halves(p, BLOCK_M)
    pr0 = None
    pr1 = None
    if not P_FROM_PT:
        pr0, pr1 = _transposed_halves(p_r(x, p, P_MODE, HW_CVT, 1), BLOCK_M)
    # the tiles one after the other by a loop: unrolled, the compiler interleaved them
    # (both tiles' products in tensor memory at once, 512 columns, and spills)
    for j in range(2):
        pr = None
        if not P_FROM_PT:
            pr = tl.where(j == 0, pr0, pr1)
        dk, dv = _dkdv_tile(dk, dv, None, v, k_scale, v_s, offs_n, start_m + j * BLOCK_M, offs_mb, row_off, hd_off,
                            Sq, Sk, causal_offset, q_scale, Q, None, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C, Q_CS,
                            HEAD_DIM, P_MODE, CAUSAL, MASK, HW_CVT, False, False, tl.where(j == 0, pt0, pt1), pr,
                            True)
    return dk, dv


@triton.jit
def _dkdv_step(dk, dv, k, k_sc, v, k_scale, v_s, start_n, offs_n, start_m, offs_mb, row_off, hd_off, Sq, Sk,
               causal_offset, q_scale, Q, QS, QSC, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C, Q_CS,
               HEAD_DIM: tl.constexpr, P_MODE: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
               HW_CVT: tl.constexpr, TMA: tl.constexpr, ROW_SCALES: tl.constexpr, QK_FP4: tl.constexpr):
    """One step of the dK/dV kernel's query loop at start_m: two 64-query tiles with the
    scores by the FP4 product (QK_FP4, `_dkdv_tiles_fp4`), else one (`_dkdv_tile`)."""
    if QK_FP4:
        dk, dv = _dkdv_tiles_fp4(dk, dv, k, k_sc, v, k_scale, v_s, start_n, offs_n, start_m, offs_mb, row_off, hd_off,
                                 Sq, Sk, causal_offset, q_scale, Q, QSC, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C,
                                 Q_CS, HEAD_DIM, P_MODE, CAUSAL, MASK, HW_CVT)
    else:
        dk, dv = _dkdv_tile(dk, dv, k, v, k_scale, v_s, offs_n, start_m, offs_mb, row_off, hd_off, Sq, Sk,
                            causal_offset, q_scale, Q, QS, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C, Q_CS,
                            HEAD_DIM, P_MODE, CAUSAL, MASK, HW_CVT, TMA, ROW_SCALES)
    return dk, dv


@triton.jit
def lse_log2(lse):
    """The forward's LSE in log2 units (rounded alone, never contracted into the
    subtraction that follows), +inf for rows that see no key (LSE -inf), so that their
    P is 0 without a test per element; NaN stays NaN."""
    return tl.where(lse == -float("inf"), float("inf"), libdevice.mul_rn(lse, LOG2E))


@triton.jit
def _lse2(ptrs, rows_ok):
    """`lse_log2` of the rows loaded from ptrs, +inf for rows past Sq (not rows_ok)."""
    return lse_log2(tl.load(ptrs, mask=rows_ok, other=-float("inf")))


@triton.jit
def causal_query_tiles(start_n, Sq, causal_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """(lo, mid) for the key block at start_n: its query tiles start at multiples of
    BLOCK_M from lo, those in [lo, mid) straddle the causal diagonal (masked) and those
    in [mid, Sq) see every key of the block; (0, 0) when not CAUSAL."""
    lo = 0
    mid = 0
    if CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        mid = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M, Sq)
        mid = tl.maximum(mid, lo)
    return lo, mid


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, QS, KS, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, V_T, V_TS, Q_C, Q_CS, DK, DV, call,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    P_MODE: tl.constexpr, CAUSAL: tl.constexpr, HW_CVT: tl.constexpr = True, TMA: tl.constexpr = False,
    ROW_SCALES: tl.constexpr = False, QK_FP4: tl.constexpr = False, QSC=None, KSC=None,
):
    """Layouts (contiguous): Q (B, H, Sq, D) bf16, K (B, Hkv, Sk, D) bf16 (NVFP4 grid
    values, or FP8 Q/K's e4m3 values); QS (B, H) / KS (B, Hkv) fp32, the tensor decode
    scales of NVFP4 Q and K per head, or with ROW_SCALES QS (B, H, Sq) / KS (B, Hkv, Sk),
    FP8 Q/K's per-token scales; LSE (the forward's,
    -inf for rows that see no key) and DELTA (B, H, Sq) fp32; DO_T (B, H, Sq, D) e4m3
    with DO_TS (B, H, Sq); DO_C (B, H, D, Sq) e4m3 with DO_CS (B, H, D); V_T (B, Hkv, Sk,
    D) e4m3 with V_TS (B, Hkv, Sk); Q_C (B, H, D, Sq) e4m3 with Q_CS (B, H, D). DK, DV
    (B, Hkv, Sk, D): float32 sums stored in their dtype (the gradients').

    TMA: Q, DO_T, DO_C and Q_C are descriptors (`train_op.backward_descriptors`) and
    Sq is a multiple of BLOCK_M. QK_FP4: Q and K are NVFP4 codes with their block scales
    QSC and KSC, as `attn_bwd_dq_kernel`'s, and each step takes two query tiles
    (`_dkdv_tiles_fp4`); BLOCK_M 64."""
    H, GROUP, Sq, Sk, causal_offset, qk_scale, sm_scale = call  # `kernel_args.BACKWARD_CALL`
    tl.static_assert(not QK_FP4 or not (TMA or ROW_SCALES), "QK_FP4: NVFP4 payloads by pointer loads, one scale a head")
    tl.static_assert(not QK_FP4 or 2 * BLOCK_M == 128, "QK_FP4: tcgen05's block-scaled MMA has 128 rows")
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)  # (b, kv head)
    Hkv = H // GROUP
    b = off_bh // Hkv
    hk = off_bh % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_mb = tl.arange(0, BLOCK_M)
    key_ok = offs_n < Sk

    kv_off = (b.to(tl.int64) * Hkv + hk) * Sk
    # the program's own keys, loaded once (pointer loads: a tail block is masked): QK_FP4,
    # their codes as the right operand of S = Q K^T, (D/2, BLOCK_N), with their block scales
    if QK_FP4:
        k, k_sc = _nvfp4_token_tile(K, KSC, kv_off, offs_n, key_ok, HEAD_DIM, True)
    else:
        k = _token_tile(K, kv_off, start_n, offs_n, key_ok, HEAD_DIM, False)
        k_sc = None
    if ROW_SCALES:  # the program's keys' own scales
        k_scale = token_scales(KS, kv_off, offs_n, key_ok, 1.0, 0)
    else:
        k_scale = tl.load(KS + off_bh)  # the head's tensor scale
    v = _token_tile(V_T, kv_off, start_n, offs_n, key_ok, HEAD_DIM, False)
    v_s = tl.load(V_TS + kv_off + offs_n, mask=key_ok, other=0.0)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # query tiles start at multiples of BLOCK_M (dS's scale block for dK): [lo, mid)
    # straddle the causal diagonal, [mid, Sq) see every key of this block (rows past Sq
    # have P = 0 through their log2 LSE of +inf); a block that runs past Sk masks every tile
    lo, mid = causal_query_tiles(start_n, Sq, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    mid = tl.where(start_n + BLOCK_N > Sk, Sq, mid)
    STEP: tl.constexpr = 2 * BLOCK_M if QK_FP4 else BLOCK_M
    if QK_FP4:  # whole steps of two tiles mask [lo, mid); a tile past mid or Sq adds zeros
        mid = lo + tl.cdiv(mid - lo, STEP) * STEP
    for g in range(GROUP):
        h = hk * GROUP + g
        if ROW_SCALES:
            q_scale = qk_scale  # each tile multiplies in its queries' scales
        else:
            q_scale = tl.load(QS + b * H + h) * qk_scale  # this query head's tensor scale, times scale * log2 e
        row_off = (b.to(tl.int64) * H + h) * Sq
        hd_off = (b.to(tl.int64) * H + h) * HEAD_DIM
        for start_m in range(lo, mid, STEP):
            dk, dv = _dkdv_step(dk, dv, k, k_sc, v, k_scale, v_s, start_n, offs_n, start_m, offs_mb, row_off, hd_off,
                                Sq, Sk, causal_offset, q_scale, Q, QS, QSC, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C,
                                Q_CS, HEAD_DIM, P_MODE, CAUSAL, True, HW_CVT, TMA, ROW_SCALES, QK_FP4)
        for start_m in range(mid, Sq, STEP):
            dk, dv = _dkdv_step(dk, dv, k, k_sc, v, k_scale, v_s, start_n, offs_n, start_m, offs_mb, row_off, hd_off,
                                Sq, Sk, causal_offset, q_scale, Q, QS, QSC, LSE, DELTA, DO_T, DO_TS, DO_C, DO_CS, Q_C,
                                Q_CS, HEAD_DIM, P_MODE, CAUSAL, False, HW_CVT, TMA, ROW_SCALES, QK_FP4)
    out = (kv_off + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + out, (dv * (1.0 / P_OFFSET)).to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _dq_tile(dq, q, q_scale, k_scale, lse2, delta, do_t, do_s, offs_m, start_n, offs_nb, kv_off, kvd_off, Sk,
             causal_offset, K, KS, V_T, V_TS, K_C, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
             HW_CVT: tl.constexpr, TMA: tl.constexpr, ROW_SCALES: tl.constexpr,
             q_sc=None, KSC=None, zero_m=None, QK_FP4: tl.constexpr = False, P_MODE: tl.constexpr = 0):
    offs_n = start_n + offs_nb
    key_ok = offs_n < Sk
    if QK_FP4:  # S = Q K^T by the block-scaled FP4 product of the saved payloads
        kt, k_sc = _nvfp4_token_tile(K, KSC, kv_off, offs_n, key_ok, HEAD_DIM, True)
        s = nvfp4_scores(q, q_sc, kt, k_sc, zero_m)
    else:
        k = _token_tile(K, kv_off, start_n, offs_n, key_ok, HEAD_DIM, TMA)
        if ROW_SCALES:  # this tile's keys' own scales
            k_scale = token_scales(KS, kv_off, offs_n, key_ok, 1.0, 1)
        s = tl.dot(q, tl.trans(k))
    t = log2_scores(s, q_scale, k_scale)
    if MASK:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        t = tl.where(visible, t, -float("inf"))
    if P_MODE == 6:
        p = p_fp8_affine_rebuilt(t, lse2[:, None])
    else:
        p = tl.math.exp2(t - lse2[:, None])
    v = _token_tile(V_T, kv_off, start_n, offs_n, key_ok, HEAD_DIM, TMA)
    v_s = tl.load(V_TS + kv_off + offs_n, mask=key_ok, other=0.0)
    dp = tl.dot(do_t, tl.trans(v)) * do_s[:, None] * v_s[None, :]
    ds = p * (dp - delta[:, None])
    # dQ += dS K_c: dS in e4m3 with one scale per query row over this key tile
    ds_g, ds_s = e4m3_rows(ds, 1, HW_CVT)
    k_c = _channel_tile(K_C, kvd_off, start_n, offs_n, key_ok, Sk, HEAD_DIM, TMA)
    return dq + tl.dot(ds_g, tl.trans(k_c)) * ds_s[:, None]


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, QS, KS, LSE, DELTA, DO_T, DO_TS, V_T, V_TS, K_C, K_CS, DQ, call,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HW_CVT: tl.constexpr = True, TMA: tl.constexpr = False, ROW_SCALES: tl.constexpr = False,
    QK_FP4: tl.constexpr = False, QSC=None, KSC=None, P_MODE: tl.constexpr = 0,
):
    """Layouts as `attn_bwd_dkdv_kernel` (ROW_SCALES likewise); K_C (B, Hkv, D, Sk) e4m3
    with K_CS (B, Hkv, D).
    DQ (B, H, Sq, D) in the gradient's dtype. TMA: K, V_T and K_C are descriptors and Sk
    is a multiple of BLOCK_N. QK_FP4: Q (B, H, Sq, D/2) and K (B, Hkv, Sk, D/2) uint8
    NVFP4 codes with QSC (B, H, Sq, D/16) and KSC (B, Hkv, Sk, D/16) e4m3 block scales,
    QS and KS their tensor scales per head; pointer loads, BLOCK_M 128. P_MODE: 6 (trained
    affine FP8 P) rebuilds P by the affine map (`p_fp8_affine_rebuilt`), any other by
    exp2 (dS takes the unrounded P there)."""
    H, GROUP, Sq, Sk, causal_offset, qk_scale, sm_scale = call  # `kernel_args.BACKWARD_CALL`
    tl.static_assert(not QK_FP4 or not (TMA or ROW_SCALES), "QK_FP4: NVFP4 payloads by pointer loads, one scale a head")
    tl.static_assert(not QK_FP4 or BLOCK_M == 128, "QK_FP4: tcgen05's block-scaled MMA has 128 rows")
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    hk = h // GROUP
    Hkv = H // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    row_off = (b.to(tl.int64) * H + h) * Sq
    kv_off = (b.to(tl.int64) * Hkv + hk) * Sk
    kvd_off = (b.to(tl.int64) * Hkv + hk) * HEAD_DIM  # this head's first row of K_C

    # the program's own queries, loaded once (pointer loads: a tail block is masked)
    if QK_FP4:
        q, q_sc = _nvfp4_token_tile(Q, QSC, row_off, offs_m, row_ok, HEAD_DIM, False)
    else:
        q = _token_tile(Q, row_off, start_m, offs_m, row_ok, HEAD_DIM, False)
        q_sc = None
    if ROW_SCALES:  # the program's queries' own scales; each key tile loads its keys'
        q_scale = token_scales(QS, row_off, offs_m, row_ok, qk_scale, 0)
        k_scale = 1.0
    else:
        q_scale = tl.load(QS + off_bh) * qk_scale  # the heads' tensor scales
        k_scale = tl.load(KS + b * Hkv + hk)
    lse2 = _lse2(LSE + row_off + offs_m, row_ok)
    zero_m = None
    if QK_FP4:  # S's accumulator: a zero the compiler cannot fold (`nvfp4_scores`), from the query scale
        zero_m = tl.zeros([BLOCK_M], tl.float32) + q_scale * 0.0
    delta = tl.load(DELTA + row_off + offs_m, mask=row_ok, other=0.0)
    do_t = _token_tile(DO_T, row_off, start_m, offs_m, row_ok, HEAD_DIM, False)
    do_s = tl.load(DO_TS + row_off + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # key tiles [0, full) are visible to every row of this block; [full, hi) are masked
    # (rows past Sq have P = 0 through their log2 LSE of +inf)
    hi = Sk
    full = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + causal_offset, Sk), 0)
        full = tl.minimum(tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N, full)
    for start_n in range(0, full, BLOCK_N):
        dq = _dq_tile(dq, q, q_scale, k_scale, lse2, delta, do_t, do_s, offs_m, start_n, offs_nb, kv_off, kvd_off, Sk,
                      causal_offset, K, KS, V_T, V_TS, K_C, HEAD_DIM, CAUSAL, False, HW_CVT, TMA, ROW_SCALES,
                      q_sc, KSC, zero_m, QK_FP4, P_MODE)
    for start_n in range(full, hi, BLOCK_N):
        dq = _dq_tile(dq, q, q_scale, k_scale, lse2, delta, do_t, do_s, offs_m, start_n, offs_nb, kv_off, kvd_off, Sk,
                      causal_offset, K, KS, V_T, V_TS, K_C, HEAD_DIM, CAUSAL, True, HW_CVT, TMA, ROW_SCALES,
                      q_sc, KSC, zero_m, QK_FP4, P_MODE)
    k_cs = tl.load(K_CS + kvd_off + offs_d)
    dq = dq * k_cs[None, :] * sm_scale
    tl.store(DQ + (row_off + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


def operand_tile(t, channel_major: bool):
    """A contiguous backward loop operand as the 2-D matrix its TMA descriptor covers,
    and the descriptor's tile: token-major (B, heads, S, D) as (B*heads*S, D) in tiles
    of (DS_BLOCK, D), channel-major (B, heads, D, S) as (B*heads*D, S) in tiles of (D,
    DS_BLOCK). Shared by the Triton kernels' descriptors (`train_op.backward_descriptors`)
    and the Gluon kernels' (`backward_gluon.descriptors`)."""
    block = [t.shape[-2], DS_BLOCK] if channel_major else [DS_BLOCK, t.shape[-1]]
    return t.view(-1, t.shape[-1]), block
