"""Attention forward for datacenter Blackwell (sm_100a): NVFP4 or FP8 QK^T, Direct-P
MXFP4 or FP8 P, block-scaled FP4 or FP8 PV, all on the tensor cores (tcgen05).

One program computes BLOCK_M query rows of one head against every visible key tile.
Recipes map to constexpr flags:

    QK_FP4   Q/K are NVFP4: packed E2M1 codes (two per byte along the head dim) with an
             e4m3 decode scale per 16 channels, multiplied by `tl.dot_scaled` into
             `tcgen05.mma ... kind::mxf4nvf4.block_scale.scale_vec::4X`; the float32
             tensor scale (per token slot, as FP8's per-token scale) is applied to the
             product. Else e4m3 Q/K with per-token scales on the FP8 tensor cores
             (`kind::f8f6f4`).
    PV_FP4   P is MXFP4 built by Direct-P (E2M1 codes, an E8M0 scale per 32 keys) and V
             MXFP4 (E2M1 codes packed along the keys, an E8M0 scale per 32 keys and
             channel): `tl.dot_scaled` into `kind::mxf4.block_scale`. Else P is FP8 e4m3
             (exp2, times 2**8) and V e4m3 with a per-channel scale (`kind::f8f6f4`).
    BF16     (with QK_FP4 and PV_FP4 off) Q, K, V and P in bf16 (`kind::f16`), P = exp2
             rounded to bf16, l summing the exp2 values: the bf16 recipe, and the build
             the cost model is calibrated on against FlashAttention-4's BF16 forward.
    P_AFFINE P built by the affine map of the log-score (`reference.affine`: the paper's
             fast Direct-P for MXFP4 P, the e4m3 byte off one FMA for FP8 P) instead of
             the exact classifier (MXFP4) or exp2 (FP8); the rows' running point is the
             maximum snapped to the map's grid.
    HW_CVT   GPU builds: the E2M1 pairs are packed by `cvt.rn.satfinite.e2m1x2.f32` and
             FP8 P rounded by `cvt.rn.satfinite.e4m3x2.f32` (inline PTX); affine MXFP4 P
             in 128-row programs takes its scores and map two keys at a time
             (`mul.rn.ftz.f32x2`, `fma.rn.f32x2`) and its row sums from the code bytes
             (PRMT, dp4a). False (the interpreter, which runs no PTX) builds the same
             bytes and sums with integer and float32 arithmetic.
    CAUSAL   query i sees keys j <= i + causal_offset
    KEY_BIAS a per-(batch, key) log2-unit bias is added to the scores (an SDPA key mask)
    WRITE_P  tests: every tile's represented P values (float32, no offset) to P_DBG
    PIPELINED  the warp-specialized schedule (`tl.range(..., warp_specialize=True)`):
             Triton 3.6 splits the tile loop into partitions that run at once, a load
             and MMA-issue partition, the softmax (P building) partition and a
             correction partition that rescales O in tensor memory, with S double
             buffered in tensor memory so that the next tile's QK^T runs under this
             tile's softmax. O is accumulated by the PV product itself (`acc * alpha`
             passed as its accumulator): the same alpha * acc + P.V as the reference,
             its float32 additions in the tensor core's order. One loop covers every
             tile; the tiles that need the key/causal mask take it by a runtime branch.
             At D=128 K and V come by TMA (descriptors built in the kernel,
             `cp.async.bulk.tensor`) from a load partition of its own; their scale
             tiles, whose rows are narrower than a TMA box's 16 bytes, by cp.async.

Direct-P on this hardware (docs/notes/blackwell.md): a thread holds whole rows of the
S tile as it comes out of tensor memory, so the 32-key block maxima are in-thread
reductions; the E2M1 value is the count of the reference's thresholds passed
(`kernels.common`), packed two per byte by one conversion instruction, and no exp is
computed per element. The consistent row sum adds the block sums of the E2M1 values
times each block's power of two, the numbers the PV product consumes.

The reference (`fp4attn.reference.forward`) defines every value this kernel computes.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from fp4attn.kernels.common import (
    AFFINE_MAGIC,
    P_EMIN,
    P_MODE_FP8_AFFINE,
    P_MODE_MXFP4_AFFINE,
    P_OFFSET_LOG2,
    affine_reference_point,
    e2m1_classify,
    key_tile_bounds,
    log2_scores,
    max_propagating_nan,
    nvfp4_scores,
    p_fp8_affine,
    round_e4m3,
    round_e4m3_cvt,
)
from fp4attn.kernels.quantize.elements import _e2m1_code

MX_BLOCK = tl.constexpr(32)
# the head dim whose pipelined build loads K and V by TMA (docs/notes/blackwell.md)
TMA_HEAD_DIM = tl.constexpr(128)


@triton.jit
def _pack_e2m1_cvt(lo, hi):
    """Bytes of E2M1 pairs (lo in the low nibble) from float32 values already on the
    E2M1 grid (so the conversion is exact): one `cvt.rn.satfinite.e2m1x2.f32` per
    byte, four bytes per 32-bit result."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b8 b0, b1, b2, b3;
        cvt.rn.satfinite.e2m1x2.f32 b0, $5, $1;
        cvt.rn.satfinite.e2m1x2.f32 b1, $6, $2;
        cvt.rn.satfinite.e2m1x2.f32 b2, $7, $3;
        cvt.rn.satfinite.e2m1x2.f32 b3, $8, $4;
        mov.b32 $0, {b0, b1, b2, b3};
        }""",
        "=r,r,r,r,r,r,r,r,r", [lo, hi], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _log2_scores_x2(s, a, b):
    """`log2_scores` two scores at a time, GPU only (sm_100+): (s * a) * b by two
    `mul.rn.ftz.f32x2`, each lane rounded exactly as the scalar `mul.rn.ftz.f32` that
    `libdevice.mul_rn` compiles to here (the same flush of denormal products to zero),
    and never contracted: FMUL2, half the instructions of the scalar pair."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b64 s2, a2, b2, t2;
        mov.b64 s2, {$2, $3};
        mov.b64 a2, {$4, $5};
        mov.b64 b2, {$6, $7};
        mul.rn.ftz.f32x2 t2, s2, a2;
        mul.rn.ftz.f32x2 t2, t2, b2;
        mov.b64 {$0, $1}, t2;
        }""",
        "=r,=r,r,r,r,r,r,r", [s, a, b], dtype=tl.float32, is_pure=True, pack=2)


def _affine_group_ptx() -> str:
    """The PTX of `_affine_group_x2`: the eight keys' scores in $2-$9, C in $10; the code
    word out in $0, the value lanes in $1."""
    lines = [".reg .b64 two, den, sub, x, y;", ".reg .b32 a, b, c0, c1, c2, c3, c4, c5, c6, c7, w, t0, t1, l01, l23;",
             "mov.b64 two, 0x4000000040000000;", "mov.b64 y, {$10, $10};",
             # 2**-149 (the least denormal) and -MAGIC * 2**-149 in each lane
             "mov.b64 den, 0x0000000100000001;", "mov.b64 sub, 0x80C0000080C00000;"]
    for i in range(4):  # pair i: keys 2i, 2i + 1
        lines += [f"mov.b64 x, {{${2 + 2 * i}, ${3 + 2 * i}}};", "fma.rn.f32x2 x, x, two, y;",
                  "fma.rn.f32x2 x, x, den, sub;", "mov.b64 {a, b}, x;",
                  f"min.relu.s32 c{2 * i}, a, 7;", f"min.relu.s32 c{2 * i + 1}, b, 7;"]
    lines += ["cvt.pack.sat.u4.s32.b32 w, c7, c6, 0;", "cvt.pack.sat.u4.s32.b32 w, c5, c4, w;",
              "mov.b32 t0, 0x03020100;", "mov.b32 t1, 0x0C080604;", "prmt.b32 l23, t0, t1, w;",
              "cvt.pack.sat.u4.s32.b32 w, c3, c2, w;", "cvt.pack.sat.u4.s32.b32 $0, c1, c0, w;",
              "prmt.b32 l01, t0, t1, $0;", "add.u32 $1, l01, l23;"]
    return "{\n" + "\n".join(lines) + "\n}"


AFFINE_GROUP_PTX = tl.constexpr(_affine_group_ptx())


@triton.jit
def _affine_group_x2(k0, k1, k2, k3, k4, k5, k6, k7, c):
    """GPU only (sm_100+): the affine MXFP4 codes of groups of eight consecutive keys
    (log2 scores k0..k7, C the constant of their 32-key block), elementwise over the
    groups: (int32 words of the four code bytes, key 2i's code in the low nibble of byte
    i; int32 words of four byte lanes whose sum is twice the eight codes' E2M1 values).

    The map f = 2 t + C of a pair of keys by one `fma.rn.f32x2` (each lane rounded once,
    as the scalar FMA and the reference's `(2 t) + C`: 2 t is exact); a second one,
    (f - MAGIC) * 2**-149, is exact wherever f is in MAGIC's binade (f - MAGIC an integer
    k, k * 2**-149 a denormal whose bits are k) and negative below it (a -inf score
    included), so the int32 of its bits clamped to [0, 7] by `min.relu.s32` is the
    reference's clamp of f to [MAGIC, MAGIC + 7] (the map reaches 8 at most for a finite
    score; a NaN row's codes are not defined). `cvt.pack.sat.u4.s32.b32` packs two codes
    a nibble each into the bytes of the word, four calls a word. The values by one PRMT
    per four codes: a PRMT selector nibble's low three bits pick one of the eight bytes
    of its two sources, which hold twice the E2M1 values (0, 1, 2, 3, 4, 6, 8, 12) at
    the codes' places, and the low 16 bits of the word (two calls in: codes 4-7; four:
    codes 0-3) are the selector of four codes. A lane adds two values per group: at
    most 24, 96 over a block."""
    return tl.inline_asm_elementwise(AFFINE_GROUP_PTX, "=r,=r,r,r,r,r,r,r,r,r,r",
                                     [k0, k1, k2, k3, k4, k5, k6, k7, c], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def _split_eight(x, G: tl.constexpr):
    """The eight (rows, G) tensors of keys 8 g + j (j = 0..7) of x (rows, 8 G)."""
    BM: tl.constexpr = x.shape[0]
    x_e, x_o = tl.split(tl.reshape(x, (BM, G, 2, 2, 2)))  # key bit 0
    x_0, x_2 = tl.split(x_e)  # key bit 1
    x_1, x_3 = tl.split(x_o)
    k0, k4 = tl.split(x_0)  # key bit 2
    k2, k6 = tl.split(x_2)
    k1, k5 = tl.split(x_1)
    k3, k7 = tl.split(x_3)
    return k0, k1, k2, k3, k4, k5, k6, k7


@triton.jit
def _bytes_of_words(w):
    """The (rows, 4 G) uint8 bytes of int32 words w (rows, G), byte k of word g at 4 g + k
    (the compiler keeps the words as they are)."""
    BM: tl.constexpr = w.shape[0]
    G: tl.constexpr = w.shape[1]
    b0 = w.to(tl.uint8)
    b1 = (w >> 8).to(tl.uint8)
    b2 = (w >> 16).to(tl.uint8)
    b3 = (w >> 24).to(tl.uint8)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BM, 4 * G))


@triton.jit
def _byte_lane_sum(w):
    """GPU only: the sum of the four byte lanes of each int32 w (one dp4a with ones)."""
    return tl.inline_asm_elementwise(
        "dp4a.u32.u32 $0, $1, 0x01010101, 0;", "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _pack_e2m1(v, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr):
    """(BLOCK_M, BLOCK_N // 2) bytes of the E2M1 tile v, key 2i in the low nibble of
    byte i (the packing `tl.dot_scaled` reads)."""
    lo, hi = tl.split(tl.reshape(v, (BLOCK_M, BLOCK_N // 2, 2)))
    if HW_CVT:
        packed = _pack_e2m1_cvt(lo, hi)
    else:
        packed = (_e2m1_code(lo) | (_e2m1_code(hi) << 4)).to(tl.uint8)
    return packed


@triton.jit
def _directp_tile(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr):
    """Direct-P MXFP4 P of a tile of normalized log2 scores x (<= 0, -inf masked):
    (packed E2M1 codes (BLOCK_M, BLOCK_N // 2), E8M0 scales (BLOCK_M, BLOCK_N // 32),
    consistent row sums of the represented values, the represented values as float32).

    Per block of 32 keys e_b = floor(max x) - 2, y = x - e_b < 3, the E2M1 value the
    number of thresholds y passes (`reference.directp.directp_classify`, test for test);
    blocks with e_b below P_EMIN (or fully masked) are dropped: codes 0."""
    NB: tl.constexpr = BLOCK_N // MX_BLOCK
    xb = tl.reshape(x, (BLOCK_M, NB, MX_BLOCK))
    e_b = tl.floor(tl.max(xb, axis=2)) - 2.0  # -inf for a fully masked block
    keep = e_b >= P_EMIN
    # a dropped block gets e_b = 0: its y = x is below -13 (or -inf), under every
    # threshold, so its codes come out 0 without a per-element select
    e_b = tl.where(keep, e_b, 0.0)
    y = xb - e_b[:, :, None]
    v = e2m1_classify(y)
    e_i = e_b.to(tl.int32)
    pow2 = tl.where(keep, ((e_i + 127) << 23).to(tl.float32, bitcast=True), 0.0)
    # block sums of E2M1 values are exact (multiples of 0.5 up to 192); times 2**e_b exact
    row_sum = tl.sum(tl.sum(v, axis=2) * pow2, axis=1)
    scale = tl.where(keep, e_i + 127, 0).to(tl.uint8)
    v2 = tl.reshape(v, (BLOCK_M, BLOCK_N))
    return _pack_e2m1(v2, BLOCK_M, BLOCK_N, HW_CVT), scale, row_sum, v2 * tl.reshape(
        tl.broadcast_to(pow2[:, :, None], (BLOCK_M, NB, MX_BLOCK)), (BLOCK_M, BLOCK_N))


@triton.jit
def _affine_block_constants(bmax, m_ref):
    """The affine map's per-block constants from the 32-key block maxima bmax (rows,
    blocks) and the rows' reference point m_ref: (e_b, keep, C) with e_b = floor(max t -
    m~) - 2 (0 for a dropped block: below P_EMIN, or empty), keep whether the block is
    kept, C = (2 - 2 m~ - 2 e_b) + MAGIC (`reference.affine.affine_mxfp4_codes`)."""
    e_b = tl.floor(bmax - m_ref[:, None]) - 2.0  # -inf for an empty block
    keep = e_b >= P_EMIN
    e_b = tl.where(keep, e_b, 0.0)
    c = ((2.0 - m_ref[:, None] * 2.0) - e_b * 2.0) + AFFINE_MAGIC
    return e_b, keep, c


@triton.jit
def _affine_x2_row_sum(twice, e_b, keep):
    """The X2 path's consistent row sums and E8M0 scales from each block's twice-E2M1
    sum `twice` (an integer at most 384, from the code bytes): the float32 block sums
    twice * 2**(e_b - 1), exactly the interpreter path's, added as there."""
    e_i = e_b.to(tl.int32)
    half_pow2 = tl.where(keep, ((e_i + 126) << 23).to(tl.float32, bitcast=True), 0.0)
    row_sum = tl.sum(twice.to(tl.float32) * half_pow2, axis=1)
    return row_sum, tl.where(keep, e_i + 127, 0).to(tl.uint8)


@triton.jit
def _affine_mxfp4_tile(tb, bmax, m_ref, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, X2: tl.constexpr):
    """MXFP4 P by the paper's affine classifier (`reference.affine.affine_mxfp4_codes`,
    operation for operation) from log2 scores tb (BLOCK_M, blocks, 32) with their block
    maxima bmax and the rows' reference point m_ref: (packed E2M1 codes, E8M0 scales,
    consistent row sums, the represented values as float32).

    Per block e_b = floor(max t - m~) - 2 and C = (2 - 2 m~ - 2 e_b) + MAGIC, then one
    FMA f = 2 t + C clamped to [MAGIC, MAGIC + 7]: f's bits are MAGIC's plus the code, so
    the byte of a pair is the low byte of lo + 16 hi (MAGIC's low byte is 0) and the
    code's E2M1 value is the float32 of its bits shifted left by 22, times 2**-126
    (code 1 a denormal): integer and float32 arithmetic the interpreter runs alike, no
    conversion instruction. A dropped block (e_b below P_EMIN, or empty) takes e_b = 0:
    its 2 (t - m~) + 2 is then below -26, so every code clamps to 0 without a select.

    X2 (GPU, sm_100's 128-row programs): the same codes from `_affine_group_x2`, the map
    two keys at a time, and each block's sum of E2M1 values from its code bytes as an
    integer (twice the sum, at most 384: exact) times 2**(e_b - 1), the float32 block
    sums of the other path exactly (docs/notes/blackwell.md, "Affine Direct-P on
    Blackwell"). A NaN row's codes and sum are not defined there; its alpha is NaN,
    and so are its l, O and LSE, as on the other path."""
    NB: tl.constexpr = BLOCK_N // MX_BLOCK
    e_b, keep, c = _affine_block_constants(bmax, m_ref)
    nan_ok: tl.constexpr = tl.PropagateNan.ALL
    f = tl.minimum(tl.maximum(tb * 2.0 + c[:, :, None], AFFINE_MAGIC, propagate_nan=nan_ok), AFFINE_MAGIC + 7.0,
                   propagate_nan=nan_ok)
    bits = tl.reshape(f.to(tl.int32, bitcast=True), (BLOCK_M, BLOCK_N))
    if X2:
        G: tl.constexpr = BLOCK_N // 8  # groups of eight keys, four to a block
        k0, k1, k2, k3, k4, k5, k6, k7 = _split_eight(tl.reshape(tb, (BLOCK_M, BLOCK_N)), G)
        c_g = tl.reshape(tl.broadcast_to(c[:, :, None], (BLOCK_M, NB, MX_BLOCK // 8)), (BLOCK_M, G))
        words, lanes = _affine_group_x2(k0, k1, k2, k3, k4, k5, k6, k7, c_g)
        packed = _bytes_of_words(words)
    else:
        lo, hi = tl.split(tl.reshape(bits, (BLOCK_M, BLOCK_N // 2, 2)))
        packed = (lo + (hi << 4)).to(tl.uint8)
    # E2M1(code) * 2**-126 from the bits; a block's sum of 32 of them is exact, and so is
    # its product with 2**(e_b + 126)
    v = (bits << 22).to(tl.float32, bitcast=True)
    e_i = e_b.to(tl.int32)
    pow2 = tl.where(keep, ((e_i + 253) << 23).to(tl.float32, bitcast=True), 0.0)
    if X2:  # the same float32 block sums: (twice their E2M1 sum) * 2**(e_b - 1)
        twice = _byte_lane_sum(tl.sum(tl.reshape(lanes, (BLOCK_M, NB, MX_BLOCK // 8)), axis=2))
        row_sum, scale = _affine_x2_row_sum(twice, e_b, keep)
    else:
        row_sum = tl.sum(tl.sum(tl.reshape(v, (BLOCK_M, NB, MX_BLOCK)), axis=2) * pow2, axis=1)
        scale = tl.where(keep, e_i + 127, 0).to(tl.uint8)
    p_val = tl.reshape(tl.reshape(v, (BLOCK_M, NB, MX_BLOCK)) * pow2[:, :, None], (BLOCK_M, BLOCK_N))
    return packed, scale, row_sum, p_val


@triton.jit
def _hide_keys(t, key_ok, cols, start_n, offs_m, causal_offset, Sk, CAUSAL: tl.constexpr,
               TILE_OFFSETS: tl.constexpr = False):
    """Scores of keys past Sk, or (causal) past a row's last key, set to -inf: one
    comparison per score against the row's last visible key. TILE_OFFSETS: the same
    predicate as cols - start_n <= last - start_n, whose left side (the keys' offsets
    in the tile) is a constant per register: no index add per score."""
    if CAUSAL:
        last = tl.minimum(offs_m + causal_offset, Sk - 1)
        if TILE_OFFSETS:
            visible = (cols - start_n)[None, :] <= (last - start_n)[:, None]
        else:
            visible = cols[None, :] <= last[:, None]
    else:
        visible = key_ok[None, :]
    return tl.where(visible, t, -float("inf"))


@triton.jit
def _running_point(m_i, m_new, ROWS_MAY_BE_EMPTY: tl.constexpr, P_AFFINE: tl.constexpr, PV_FP4: tl.constexpr):
    """The online softmax's point P is measured from and the rescale factor of the rows'
    running max m_i -> m_new: (m_use, alpha). A row that saw no key yet (max -inf, where
    ROWS_MAY_BE_EMPTY) is measured from 0, a +inf max makes its row NaN
    (reference/forward.py); the affine builders snap the point to their grid."""
    if ROWS_MAY_BE_EMPTY:  # a row may have seen no key yet
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    else:
        m_use = m_new
    m_use = tl.where(m_new == float("inf"), float("nan"), m_use)
    if P_AFFINE:  # the affine map's reference point: the max snapped to its grid
        m_use = affine_reference_point(m_use, P_MODE_MXFP4_AFFINE if PV_FP4 else P_MODE_FP8_AFFINE)
    return m_use, tl.math.exp2(m_i - m_use)


@triton.jit
def _carry(l_i, alpha, p_sum, m_new, m_use, P_AFFINE: tl.constexpr):
    """The row sum and running max carried to the next tile: l alpha + this tile's sum;
    the affine builders measure later tiles from m~ (a row that saw no key keeps -inf)."""
    l_i = l_i * alpha + p_sum
    if P_AFFINE:
        m_new = tl.where(m_new == -float("inf"), m_new, m_use)
    return l_i, m_new


@triton.jit
def _rescale(acc, alpha, HALVES: tl.constexpr):
    """acc * alpha per row; with HALVES the two column halves separately (the same
    products), so the correction partition holds half a row of O at a time."""
    if HALVES:
        BM: tl.constexpr = acc.shape[0]
        BD: tl.constexpr = acc.shape[1]
        a0, a1 = acc.reshape([BM, 2, BD // 2]).permute(0, 2, 1).split()
        a0 = a0 * alpha[:, None]
        a1 = a1 * alpha[:, None]
        return tl.join(a0, a1).permute(0, 2, 1).reshape([BM, BD])
    else:
        return acc * alpha[:, None]


class QueryRows(NamedTuple):
    """A program's query rows, as every key tile reads them."""

    q: tl.tensor  # (BLOCK_M, HEAD_DIM / 2) NVFP4 codes or (BLOCK_M, HEAD_DIM) e4m3 / bf16 values
    q_sc: tl.tensor  # QK_FP4: (BLOCK_M, HEAD_DIM / 16) e4m3 block scales; else None
    factor: tl.tensor  # (BLOCK_M,) q_scale * softmax_scale * log2 e: their scores in log2 units
    zero: tl.tensor  # (BLOCK_M,) the zero the fresh PV accumulators start from (the kernel's comment)
    offs: tl.tensor  # (BLOCK_M,) their query indices
    p_dbg: tl.tensor  # WRITE_P: this head's (rows, Sk) P tile of P_DBG, rows p_stride apart
    p_stride: tl.tensor


class KeyHead(NamedTuple):
    """The keys a program reads: its (batch, K/V head)'s K, V with their scales, the key
    bias, and which keys a row sees."""

    k: tl.tensor  # K (Sk, HEAD_DIM / 2) codes or (Sk, HEAD_DIM) values, rows k_stride apart
    k_stride: tl.tensor
    k_sc: tl.tensor  # QK_FP4: K's block scales (Sk, HEAD_DIM / 16), rows k_sc_stride apart
    k_sc_stride: tl.tensor
    k_scale: tl.tensor  # KS (Sk,) per-key scales (NVFP4: the head's tensor scale in every slot)
    v: tl.tensor  # V (HEAD_DIM, keys / 2) codes or V^T (HEAD_DIM, keys), rows v_stride apart
    v_stride: tl.tensor
    v_sc: tl.tensor  # PV_FP4: V's E8M0 scales (HEAD_DIM, keys / 32), rows v_sc_stride apart
    v_sc_stride: tl.tensor
    bias: tl.tensor  # KB (Sk,), read only with KEY_BIAS
    k_desc: tl.tensor_descriptor  # TMA: K and V by these descriptors (built where PIPELINED)
    v_desc: tl.tensor_descriptor
    Sk: tl.tensor  # the key count
    causal_offset: tl.tensor  # CAUSAL: query i sees keys j <= i + causal_offset
    full: tl.tensor  # the tiles from key `full` on need the mask (`key_tile_bounds`)


class TileFlags(NamedTuple):
    """The kernel's constexpr flags a key tile reads (the module docstring's; TMA: K and V
    by the descriptors, the pipelined kernel's at TMA_HEAD_DIM)."""

    QK_FP4: tl.constexpr
    PV_FP4: tl.constexpr
    HW_CVT: tl.constexpr
    CAUSAL: tl.constexpr
    KEY_BIAS: tl.constexpr
    WRITE_P: tl.constexpr
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    HEAD_DIM: tl.constexpr
    PIPELINED: tl.constexpr
    P_AFFINE: tl.constexpr
    BF16: tl.constexpr
    TMA: tl.constexpr


@triton.jit
def _tile(acc, l_i, m_i, rows, keys, start_n, MASK: tl.constexpr, flags):
    """One key tile from key start_n on: the running (acc, l_i, m_i) after it. MASK: a
    tile past `full` (the non-pipelined kernel's second loop, masked loads and scores);
    PIPELINED: every tile, loads masked by the key count (a predicate on the copies) and
    scores by the mask where start_n >= full. TMA: K and V by the descriptors k_desc,
    v_desc (keys past Sk read as zeros, as the masked loads' `other`), the same bytes as
    the pointer loads."""
    BLOCK_M: tl.constexpr = flags.BLOCK_M
    BLOCK_N: tl.constexpr = flags.BLOCK_N
    HEAD_DIM: tl.constexpr = flags.HEAD_DIM
    PIPELINED: tl.constexpr = flags.PIPELINED
    P_AFFINE: tl.constexpr = flags.P_AFFINE
    PV_FP4: tl.constexpr = flags.PV_FP4
    TMA: tl.constexpr = flags.TMA
    CAUSAL: tl.constexpr = flags.CAUSAL
    Sk = keys.Sk
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n
    key_ok = cols < Sk
    MASK_LOADS: tl.constexpr = MASK or PIPELINED
    # -- scores in log2 units: (Qv Kv^T) * (q_scale * softmax_scale * log2 e) * k_scale
    if flags.QK_FP4:
        offs_h = tl.arange(0, HEAD_DIM // 2)
        offs_s = tl.arange(0, HEAD_DIM // 16)
        # K^T codes (D/2, BLOCK_N), packed along the head dim; scales (BLOCK_N, D/16) e4m3
        kt_ptrs = keys.k + cols[None, :] * keys.k_stride + offs_h[:, None]
        ksc_ptrs = keys.k_sc + cols[:, None] * keys.k_sc_stride + offs_s[None, :]
        if TMA:
            kt = tl.trans(keys.k_desc.load([start_n, 0]))
            k_sc = tl.load(ksc_ptrs, mask=key_ok[:, None], other=0.0)
        elif MASK_LOADS:
            kt = tl.load(kt_ptrs, mask=key_ok[None, :], other=0)
            k_sc = tl.load(ksc_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            k_sc = tl.load(ksc_ptrs)
        s = nvfp4_scores(rows.q, rows.q_sc, kt, k_sc, rows.zero)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        k_ptrs = keys.k + cols[:, None] * keys.k_stride + offs_d[None, :]
        if TMA:
            k = keys.k_desc.load([start_n, 0])
        elif MASK_LOADS:
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(rows.q, tl.trans(k))
    # affine MXFP4 P on sm_100 (HW_CVT, 128-row programs: a thread holds its rows' keys
    # in order, from tensor memory): scores and map two keys at a time, the row sums
    # from the code bytes (`_affine_mxfp4_tile`); consumer Blackwell's 32- and 64-row
    # mma.sync programs keep the scalar path (grouping their keys by eight spills)
    AFFINE_X2: tl.constexpr = flags.HW_CVT and P_AFFINE and PV_FP4 and BLOCK_M == 128
    a_i = rows.factor
    if flags.QK_FP4:
        # NVFP4's tensor scale is one number per (batch, head), in every token's slot: one
        # scalar load instead of a row of 64-128 per-key values in every thread
        if AFFINE_X2:
            t = _log2_scores_x2(s, a_i[:, None], tl.load(keys.k_scale))
        else:
            t = log2_scores(s, a_i[:, None], tl.load(keys.k_scale))
    else:
        if MASK_LOADS:
            b_j = tl.load(keys.k_scale + cols, mask=key_ok, other=0.0)
        else:
            b_j = tl.load(keys.k_scale + cols)
        if AFFINE_X2:
            t = _log2_scores_x2(s, a_i[:, None], b_j[None, :])
        else:
            t = log2_scores(s, a_i[:, None], b_j[None, :])
    if flags.KEY_BIAS:  # added before hiding keys, as the reference does
        if MASK_LOADS:
            t = t + tl.load(keys.bias + cols, mask=key_ok, other=0.0)[None, :]
        else:
            t = t + tl.load(keys.bias + cols)[None, :]
    if MASK:
        t = _hide_keys(t, key_ok, cols, start_n, rows.offs, keys.causal_offset, Sk, CAUSAL, AFFINE_X2)
    if PIPELINED:
        if AFFINE_X2 and not CAUSAL:
            # the key mask on every tile (key_ok is all true below `full`): no branch, whose
            # merge cost register moves to rebuild the two-wide pairs, about one a score
            t = _hide_keys(t, key_ok, cols, start_n, rows.offs, keys.causal_offset, Sk, CAUSAL)
        elif start_n >= keys.full:
            t = _hide_keys(t, key_ok, cols, start_n, rows.offs, keys.causal_offset, Sk, CAUSAL, AFFINE_X2)
    # -- online softmax: exact running max, rescale every tile. NaN propagates through
    # the max (tl.max would drop it): a NaN score makes its row NaN, and a score that
    # overflows to +inf leaves the row undefined, NaN (reference/forward.py)
    if P_AFFINE and PV_FP4:  # the row max from the 32-key block maxima P needs anyway
        tb = tl.reshape(t, (BLOCK_M, BLOCK_N // MX_BLOCK, MX_BLOCK))
        bmax = tl.reduce(tb, 2, max_propagating_nan)
        m_new = tl.maximum(m_i, tl.reduce(bmax, 1, max_propagating_nan), propagate_nan=tl.PropagateNan.ALL)
    else:
        m_new = tl.maximum(m_i, tl.reduce(t, 1, max_propagating_nan), propagate_nan=tl.PropagateNan.ALL)
    m_use, alpha = _running_point(m_i, m_new, MASK or flags.KEY_BIAS or PIPELINED, P_AFFINE, PV_FP4)
    # V tiles are stored with keys padded by zeros to whole tiles: no mask
    if PV_FP4:
        if P_AFFINE:
            p_codes, p_sc, p_sum, p_val = _affine_mxfp4_tile(tb, bmax, m_use, BLOCK_M, BLOCK_N, AFFINE_X2)
        else:
            p_codes, p_sc, p_sum, p_val = _directp_tile(t - m_use[:, None], BLOCK_M, BLOCK_N, flags.HW_CVT)
        offs_kh = tl.arange(0, BLOCK_N // 2)
        offs_kb = tl.arange(0, BLOCK_N // 32)
        offs_d = tl.arange(0, HEAD_DIM)
        # V codes (BLOCK_N/2, D) packed along the keys; scales (D, BLOCK_N/32) E8M0
        if TMA:
            v = tl.trans(keys.v_desc.load([0, start_n // 2]))
        else:
            v = tl.load(keys.v + offs_d[None, :] * keys.v_stride + (start_n // 2 + offs_kh)[:, None])
        v_sc = tl.load(keys.v_sc + offs_d[:, None] * keys.v_sc_stride + (start_n // 32 + offs_kb)[None, :])
        if PIPELINED:
            acc = tl.dot_scaled(p_codes, p_sc, "e2m1", v, v_sc, "e2m1", _rescale(acc, alpha, HEAD_DIM == 128))
        else:
            pv_init = rows.zero[:, None] + tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            pv = tl.dot_scaled(p_codes, p_sc, "e2m1", v, v_sc, "e2m1", pv_init)
    else:
        tl.static_assert(P_OFFSET_LOG2 == 8)
        # BF16: P = exp2 rounded to bf16; l sums exp2 itself (the bf16 recipe's consistent_norm=False)
        if flags.BF16:
            p32 = tl.math.exp2(t - m_use[:, None])
            p_sum = tl.sum(p32, axis=1)
            p = p32.to(tl.bfloat16)
            p_val = p.to(tl.float32)
        else:
            if P_AFFINE:  # e4m3 bytes off one affine map (kernels.common; the tile itself with HW_CVT)
                p, p_sum = p_fp8_affine(t, m_use, flags.HW_CVT)
            elif flags.HW_CVT:
                p = round_e4m3_cvt(tl.math.exp2(t - m_use[:, None] + P_OFFSET_LOG2))
                p_sum = tl.sum(p, axis=1)
            else:
                p = round_e4m3(tl.math.exp2(t - m_use[:, None] + P_OFFSET_LOG2))
                p_sum = tl.sum(p, axis=1)
            p_val = p.to(tl.float32) * 0.00390625  # p / 2**P_OFFSET_LOG2
            p = p.to(tl.float8e4nv)
        offs_d = tl.arange(0, HEAD_DIM)
        if TMA:
            vt = keys.v_desc.load([0, start_n])
        else:
            # V^T (D, BLOCK_N) e4m3 or bf16
            vt = tl.load(keys.v + offs_d[:, None] * keys.v_stride + cols[None, :])
        if PIPELINED:
            acc = tl.dot(p, tl.trans(vt), _rescale(acc, alpha, HEAD_DIM == 128))
        else:
            pv_init = rows.zero[:, None] + tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            pv = tl.dot(p, tl.trans(vt), pv_init)
    if flags.WRITE_P:
        tl.store(rows.p_dbg + rows.offs[:, None] * rows.p_stride + cols[None, :], p_val, mask=key_ok[None, :])
    if not PIPELINED:  # each tile's PV on a fresh accumulator, added into O in float32
        acc = acc * alpha[:, None] + pv
    l_i, m_new = _carry(l_i, alpha, p_sum, m_new, m_use, P_AFFINE)
    return acc, l_i, m_new


@triton.jit
def attn_fwd_sm100_kernel(
    Q, QSC, K, KSC, QS, KS, V, VSC, VS, O, LSE, P_DBG, KB,
    q_strides, q_sc_strides, k_strides, k_sc_strides, v_strides, v_sc_strides, o_strides, p_strides, call,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_FP4: tl.constexpr, PV_FP4: tl.constexpr, CAUSAL: tl.constexpr, HW_CVT: tl.constexpr,
    KEY_BIAS: tl.constexpr = False, WRITE_P: tl.constexpr = False, PIPELINED: tl.constexpr = False,
    P_AFFINE: tl.constexpr = False, BF16: tl.constexpr = False,
):
    """Q (B, H, Sq, D/2) uint8 codes or (B, H, Sq, D) e4m3; QSC (B, H, Sq, D/16) e4m3
    block scales (NVFP4 only); K, KSC likewise at Hkv heads; QS (B, H, Sq), KS (B, Hkv,
    Sk) float32 per-token scales (NVFP4: the tensor scale of the (batch, head) in every
    slot, read once). V: MXFP4 codes
    (B, Hkv, D, Skp/2) packed along the keys with VSC (B, Hkv, D, Skp/32) E8M0, or V^T
    e4m3 (B, Hkv, D, Skp) with VS (B, Hkv, D) float32 per-channel scales; Skp is Sk
    padded with zero keys to whole tiles. O (B, H, Sq, D) bf16, LSE (B, H, Sq) float32.
    q_strides ... p_strides: each tensor's (batch, head, row) strides, V's row a channel
    (the last dim contiguous); call: (H, GROUP, Sq, Sk, causal_offset, qk_scale), as the
    Hopper forward's (`hopper.forward_triton.attn_fwd_kernel`)."""
    tl.static_assert(BLOCK_N % 32 == 0)  # MXFP4 P blocks of 32 keys never straddle tiles
    H, GROUP, Sq, Sk, causal_offset, qk_scale = call
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // H
    h = off_bh % H
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Sq

    # (written out, not shared with the Hopper forward: `kernel_args`)
    k_ptr = K + b.to(tl.int64) * k_strides[0] + hk.to(tl.int64) * k_strides[1]
    ksc_ptr = KSC + b.to(tl.int64) * k_sc_strides[0] + hk.to(tl.int64) * k_sc_strides[1]
    v_ptr = V + b.to(tl.int64) * v_strides[0] + hk.to(tl.int64) * v_strides[1]
    vsc_ptr = VSC + b.to(tl.int64) * v_sc_strides[0] + hk.to(tl.int64) * v_sc_strides[1]
    qs_ptr = QS + (b.to(tl.int64) * H + h) * Sq
    ks_ptr = KS + (b.to(tl.int64) * (H // GROUP) + hk) * Sk
    p_ptr = P_DBG + b.to(tl.int64) * p_strides[0] + h.to(tl.int64) * p_strides[1]
    kb_ptr = KB + b.to(tl.int64) * Sk  # (B, Sk) key bias, read only with KEY_BIAS

    q_ptr = Q + b.to(tl.int64) * q_strides[0] + h.to(tl.int64) * q_strides[1]
    if QK_FP4:
        offs_h = tl.arange(0, HEAD_DIM // 2)
        offs_s = tl.arange(0, HEAD_DIM // 16)
        q = tl.load(q_ptr + offs_m[:, None] * q_strides[2] + offs_h[None, :], mask=row_ok[:, None], other=0)
        qsc_ptr = QSC + b.to(tl.int64) * q_sc_strides[0] + h.to(tl.int64) * q_sc_strides[1]
        q_sc = tl.load(qsc_ptr + offs_m[:, None] * q_sc_strides[2] + offs_s[None, :], mask=row_ok[:, None],
                       other=0.0)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + offs_m[:, None] * q_strides[2] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q_sc = None
    a_i = tl.load(qs_ptr + offs_m, mask=row_ok, other=0.0) * qk_scale
    # the products' fresh accumulators start from this zero: Triton 3.6 fails to build a
    # block-scaled MMA in a loop whose accumulator is a constant zero ("uninitialized
    # alloc must have a mutable memdesc type" in its accumulator-init pass); a zero it
    # cannot fold (a NaN scale gives NaN, as the row's scores would) builds
    zero_m = a_i * 0.0
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    full, hi = key_tile_bounds(start_m, Sk, causal_offset, CAUSAL, BLOCK_M, BLOCK_N)
    # K and V by TMA in the pipelined kernel at D=128 (TMA_HEAD_DIM): its load partition
    # shrinks from 4 warps computing cp.async addresses to 2 issuing two bulk copies a
    # tile; at D=64 the copies are small and the cost model gives TMA no gain
    TMA: tl.constexpr = PIPELINED and HEAD_DIM == TMA_HEAD_DIM
    # (built wherever the kernel is pipelined, used where TMA: a None in their place
    # made Triton 3.6 drop the warp specialization of the D=64 loop)
    k_desc = None
    v_desc = None
    if PIPELINED:
        skp = tl.cdiv(Sk, BLOCK_N) * BLOCK_N
        if QK_FP4:
            k_desc = tl.make_tensor_descriptor(k_ptr, [Sk, HEAD_DIM // 2], [k_strides[2], 1],
                                               [BLOCK_N, HEAD_DIM // 2])
        else:
            k_desc = tl.make_tensor_descriptor(k_ptr, [Sk, HEAD_DIM], [k_strides[2], 1], [BLOCK_N, HEAD_DIM])
        if PV_FP4:
            v_desc = tl.make_tensor_descriptor(v_ptr, [HEAD_DIM, skp // 2], [v_strides[2], 1],
                                               [HEAD_DIM, BLOCK_N // 2])
        else:
            v_desc = tl.make_tensor_descriptor(v_ptr, [HEAD_DIM, skp], [v_strides[2], 1], [HEAD_DIM, BLOCK_N])
    rows = QueryRows(q, q_sc, a_i, zero_m, offs_m, p_ptr, p_strides[2])
    keys = KeyHead(k_ptr, k_strides[2], ksc_ptr, k_sc_strides[2], ks_ptr, v_ptr, v_strides[2], vsc_ptr,
                   v_sc_strides[2], kb_ptr, k_desc, v_desc, Sk, causal_offset, full)
    flags: tl.constexpr = TileFlags(QK_FP4, PV_FP4, HW_CVT, CAUSAL, KEY_BIAS, WRITE_P, BLOCK_M, BLOCK_N,
                                    HEAD_DIM, PIPELINED, P_AFFINE, BF16, TMA)
    if PIPELINED:
        # one loop (Triton 3.6 fails to build a second loop on the tensor-memory O, in
        # TritonGPUHoistTMEMAlloc, and a plain one after the partitions spills)
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True, disallow_acc_multi_buffer=True):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, False, flags)
    else:
        for start_n in range(0, full, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, False, flags)
        for start_n in range(full, hi, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, rows, keys, start_n, True, flags)

    # -- epilogue: 1/l, V's per-channel scale (FP8 V); LSE in natural log (FP8 P's 2**8
    # offset cancels in acc / l and is subtracted from the LSE)
    offs_d = tl.arange(0, HEAD_DIM)
    seen = m_i != -float("inf")  # NaN rows stay NaN; only rows that saw no key are 0
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None]
    if PV_FP4:
        lse2 = m_i + tl.math.log2(tl.where(seen, l_i, 1.0))
    else:
        vs = tl.load(VS + (b.to(tl.int64) * (H // GROUP) + hk) * HEAD_DIM + offs_d)
        out = out * vs[None, :]
        lse2 = m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) - (0.0 if BF16 else P_OFFSET_LOG2)
    lse = tl.where(seen, lse2 * 0.6931471805599453, -float("inf"))
    o_ptr = O + b.to(tl.int64) * o_strides[0] + h.to(tl.int64) * o_strides[1]
    tl.store(o_ptr + offs_m[:, None] * o_strides[2] + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + (b.to(tl.int64) * H + h) * Sq + offs_m, lse, mask=row_ok)
