"""Triton helpers shared by every GPU generation and by the Triton and Gluon kernels:
the scores in log2 units (`log2_scores`), one online-softmax step (`online_softmax_p`)
and the P builders it calls.

Each P builder takes x = t - m (log2 units, <= 0, -inf for masked keys) for a whole
tile and returns the represented P values, float32, already multiplied by
2**P_OFFSET_LOG2 and exactly on the e4m3 grid (so the caller's cast to e4m3 for the PV
product is exact); the forward's row sums of them are what consistent normalization
adds to l. Keys run along KEY_AXIS: 1 in the forward's (queries, keys) S tile, 0 in
the backward's (keys, queries) S^T tile. Rounding to the e4m3 grid is done on the float32 bits, so the
row sum needs no e4m3 -> float32 conversion. They reproduce
`fp4attn.reference.directp.build_p` value for value (see docs/numerics.md).

Everything stays float32 until the final cast: elementwise work on e4m3 tensors held
in the wgmma accumulator layout (an e4m3 -> fp32 upcast for the row sum, byte stores)
produced wrong tiles with Triton 3.6 on the H200
(docs/notes/hopper-forward.md).
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4attn.formats import constants
from fp4attn.reference import affine, directp, encoding
from fp4attn.routing import PMode


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The number of SMs of CUDA device `device` (looked up once per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


FP8_MIN_AMAX = tl.constexpr(constants.FP8_MIN_AMAX)
P_EMIN = tl.constexpr(encoding.P_EMIN)
P_OFFSET_LOG2 = tl.constexpr(encoding.P_OFFSET_LOG2)
# y >= T thresholds (reference/directp.py), each the float32 just at or above the log
T_QUARTER = tl.constexpr(directp.DIRECTP_THRESHOLDS[0])  # y > -2: code 1 (0.5)
T_075 = tl.constexpr(directp.DIRECTP_THRESHOLDS[1])  # y >= log2(0.75): code 2 (1.0)
T_125 = tl.constexpr(directp.DIRECTP_THRESHOLDS[2])  # y >= log2(1.25): code 3 (1.5)
T_175 = tl.constexpr(directp.DIRECTP_THRESHOLDS[3])  # y >= log2(1.75): code 4 (2.0)
T_25 = tl.constexpr(directp.DIRECTP_THRESHOLDS[4])  # y >= log2(2.5): code 5 (3.0)
T_35 = tl.constexpr(directp.DIRECTP_THRESHOLDS[5])  # y >= log2(3.5): code 6 (4.0)
T_5 = tl.constexpr(directp.DIRECTP_THRESHOLDS[6])  # y >= log2(5): code 7 (6.0)
# the affine builders (reference/affine.py): the rounding constant 1.5 * 2**23 and the
# FP8 map's offset; P modes 4 (FP8) and 5 (MXFP4) of `online_softmax_p`
AFFINE_MAGIC = tl.constexpr(affine.MAGIC)
AFFINE_K_FP8 = tl.constexpr(affine.K_FP8_F32)
# the P builders (`routing.PMode`) as the kernels' constexprs: a P_MODE is compared with these
P_MODE_FP8_EXP2 = tl.constexpr(PMode.FP8_EXP2.value)
P_MODE_MXFP4_DIRECTP = tl.constexpr(PMode.MXFP4_DIRECTP.value)
P_MODE_MXFP4_DIRECTP_SINK = tl.constexpr(PMode.MXFP4_DIRECTP_SINK.value)
P_MODE_FP8_AFFINE = tl.constexpr(PMode.FP8_AFFINE.value)  # the affine builders: this mode and those above it
P_MODE_MXFP4_AFFINE = tl.constexpr(PMode.MXFP4_AFFINE.value)
P_MODE_FP8_AFFINE_TRAINED = tl.constexpr(PMode.FP8_AFFINE_TRAINED.value)
# affine FP8 P with Recipe.rescale="lazy" (its own offset, reference/affine.K_FP8_LAZY)
P_MODE_FP8_AFFINE_LAZY = tl.constexpr(PMode.FP8_AFFINE_LAZY.value)
AFFINE_K_FP8_LAZY = tl.constexpr(affine.K_FP8_LAZY_F32)
P_OFFSET_LOG2_LAZY = tl.constexpr(affine.P_OFFSET_LOG2_LAZY)  # its bytes are P times 2**5
AFFINE_FP8_MAX_BYTE = tl.constexpr(affine.FP8_MAX_BYTE)


@triton.jit
def key_tile_bounds(start_m, Sk, causal_offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """(full, hi) of a forward program's query block `start_m`: keys below `full` are
    visible to every row of the block, in whole tiles of BLOCK_N (no mask needed); keys
    from `full` to `hi` are visible to some rows (masked tiles); causal: query i sees
    keys j <= i + causal_offset."""
    hi = Sk
    full = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        last = (start_m + 1) * BLOCK_M + causal_offset  # one past the last row's last key
        first = start_m * BLOCK_M + causal_offset + 1  # one past the first row's last key
        hi = tl.where(last < Sk, last, Sk)
        full = tl.where(first < full, first, full)
        full = tl.where(full > 0, full // BLOCK_N * BLOCK_N, 0)
    return full, hi


@triton.jit
def _key_blocks(n_keys: tl.constexpr, KEY_AXIS: tl.constexpr, key_block=None):
    """Each key's 32-key block number in a tile of `n_keys` keys along KEY_AXIS,
    broadcastable to the tile: `key_block` itself where the caller passes one (Gluon
    callers, in their layout), else made with tl.arange."""
    blk = key_block
    if blk is None:
        if KEY_AXIS == 1:
            blk = tl.arange(0, n_keys)[None, :] // 32
        else:
            blk = tl.arange(0, n_keys)[:, None] // 32
    return blk


@triton.jit
def _block_max_32(x, KEY_AXIS: tl.constexpr, key_block=None):
    """Max over each block of 32 keys of a tile whose keys run along KEY_AXIS (1 in the
    forward's S tile, 0 in the backward's S^T tile), broadcast back to every element of
    its block. key_block: each key's block number in the tile, broadcastable to x
    (made here with tl.arange when None; Gluon callers pass it in their layout).

    Done as one masked reduction per block: `tl.reshape` to (BLOCK_M, BLOCK_N // 32,
    32) grouped the wrong columns for a tile in the wgmma accumulator layout (Triton 3.6,
    H200; docs/notes/hopper-forward.md). On sm_90 the compiler reduces each block to the
    eight values a thread holds in it (same SASS size as the reshape, checked).
    """
    n_keys: tl.constexpr = x.shape[KEY_AXIS]
    blk = _key_blocks(n_keys, KEY_AXIS, key_block)
    out = x  # every element is overwritten: each key is in one block
    for b in tl.static_range(n_keys // 32):
        mb = tl.max(tl.where(blk == b, x, -float("inf")), axis=KEY_AXIS)
        mb = mb[:, None] if KEY_AXIS == 1 else mb[None, :]
        out = tl.where(blk == b, mb, out)
    return out


@triton.jit
def fp8_scale_inv(amax):
    """(scale, inverse) of e4m3 rows with absolute maximum amax, as
    `formats.fp8.fp8_scales`: amax / 448 and 448 / amax, correctly rounded; 1 and 1 for
    rows below FP8_MIN_AMAX (flushed, as all-zero rows)."""
    zero = amax < FP8_MIN_AMAX
    scale = tl.where(zero, 1.0, tl.div_rn(amax, 448.0))
    # 448 as a tensor of amax's shape by `where` (tl.full needs a layout under Gluon)
    inv = tl.where(zero, 1.0, tl.div_rn(tl.where(zero, 448.0, 448.0), amax))
    return scale, inv


@triton.jit
def round_e4m3(p):
    """Round non-negative float32 p <= 448 to the e4m3 grid, nearest even, on its bits:
    three mantissa bits at and above 2**-6 (e4m3's smallest normal), multiples of
    2**-9 below it."""
    b = p.to(tl.int32, bitcast=True)
    b = (b + ((1 << 19) - 1) + ((b >> 20) & 1)) & ~((1 << 20) - 1)
    # nearest-even integer of p * 512 < 8 by the 2**23 shift (IEEE adds, never reassociated)
    sub = ((p * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    return tl.where(p >= 0.015625, b.to(tl.float32, bitcast=True), sub)


@triton.jit
def round_e4m3_cvt(p):
    """round_e4m3 by the packed hardware conversion, GPU only (sm_89+): each pair goes
    to e4m3x2 (cvt.rn.satfinite: round to nearest even, as the bit arithmetic) and back
    through f16x2, so the values stay float32 and exactly on the e4m3 grid: four
    conversions per pair instead of about ten integer and float operations per element.
    The e4m3 bytes never leave the asm: e4m3 tensors in the wgmma accumulator layout
    with a float32 use were miscompiled by Triton 3.6 (docs/notes/hopper-forward.md)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 e8x2, lo, hi;
        .reg .b32 h2;
        cvt.rn.satfinite.e4m3x2.f32 e8x2, $3, $2;
        cvt.rn.f16x2.e4m3x2 h2, e8x2;
        mov.b32 {lo, hi}, h2;
        cvt.f32.f16 $0, lo;
        cvt.f32.f16 $1, hi;
        }""",
        "=r,=r,r,r", [p], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def p_fp8_exp2(x):
    """FP8 P: e4m3(2**x * 2**8), as float32 values."""
    return round_e4m3(tl.math.exp2(x + P_OFFSET_LOG2))


@triton.jit
def e2m1_classify(y):
    """Direct-P's classifier: the E2M1 value (0, 0.5, ..., 6) of a log2 score y relative
    to its block's exponent (y < 3), the number of the reference's thresholds y passes
    (`reference.directp.directp_classify`, test for test), as a chain of seven compares
    and selects. Shared by every generation's kernels."""
    v = tl.where(y >= T_QUARTER, 0.5, 0.0)
    v = tl.where(y >= T_075, 1.0, v)
    v = tl.where(y >= T_125, 1.5, v)
    v = tl.where(y >= T_175, 2.0, v)
    v = tl.where(y >= T_25, 3.0, v)
    v = tl.where(y >= T_35, 4.0, v)
    return tl.where(y >= T_5, 6.0, v)


@triton.jit
def _directp_block_exponent(mx):
    """Direct-P's block exponent and scale from a block's max x (any shape): e_b =
    floor(max x) - 2, 0 with scale 0 for a dropped block (below P_EMIN, or -inf when fully
    masked), and scale = 2**(e_b + 8), the exact factor of the block's E2M1 codes."""
    e_b = tl.floor(mx) - 2.0
    keep = e_b >= P_EMIN
    e_b = tl.where(keep, e_b, 0.0)
    return e_b, tl.where(keep, ((e_b.to(tl.int32) + (P_OFFSET_LOG2 + 127)) << 23).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def p_mxfp4_directp(x, KEY_AXIS: tl.constexpr, key_block=None):
    """MXFP4 P by Direct-P, as exact e4m3 values E2M1 * 2**(e_b + 8).

    Per 32-key block e_b = floor(max x) - 2 and y = x - e_b < 3; the E2M1 value is the
    number of the reference's thresholds y passes, as a chain of selects (seven compares
    and seven selects per element, the reference's `directp_classify` test for test),
    times 2**(e_b + 8), which is 0 for a dropped block. No exp is computed. The
    exponent-and-mantissa assembly this replaces (floor, fraction, two fraction tests,
    integer exponent, saturation, the sub-normal selects) took about twice the
    instructions per element (docs/notes/hopper-forward.md).
    """
    e_b, scale = _directp_block_exponent(_block_max_32(x, KEY_AXIS, key_block))
    return e2m1_classify(x - e_b) * scale


@triton.jit
def p_mxfp4_exp2(x, KEY_AXIS: tl.constexpr, key_block=None):
    """MXFP4 P from float32 exp2 and OCP rounding (the baseline Direct-P replaces):
    e_b = floor(log2 max p) - 2 from the bits of max p, then RNE to E2M1 of p / 2**e_b."""
    p = tl.math.exp2(x)
    pb = _block_max_32(p, KEY_AXIS, key_block)
    e_b = ((pb.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 2
    keep = (pb > 0.0) & (e_b >= P_EMIN)
    e_b = tl.where(keep, e_b, 0)
    q = p * ((127 - e_b) << 23).to(tl.float32, bitcast=True)  # p / 2**e_b, exact
    # RNE to one mantissa bit for q >= 1: add half an ulp of that grid (ties to even)
    qb = q.to(tl.int32, bitcast=True)
    qb = (qb + ((1 << 21) - 1) + ((qb >> 22) & 1)) & ~((1 << 22) - 1)
    normal = tl.minimum(qb.to(tl.float32, bitcast=True), 6.0)
    sub = libdevice.rint(q * 2.0) * 0.5  # 0, 0.5, 1 below 1 (ties to even)
    v = tl.where(keep, tl.where(q >= 1.0, normal, sub), 0.0)
    return v * ((e_b + P_OFFSET_LOG2 + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bcast_keys(v, KEY_AXIS: tl.constexpr):
    """A per-row (per-query) vector of a reduction along KEY_AXIS, as a tile axis again."""
    return v[:, None] if KEY_AXIS == 1 else v[None, :]


@triton.jit
def p_mxfp4_directp_sink(x, KEY_AXIS: tl.constexpr, key_block=None, HW_CVT: tl.constexpr = False):
    """Direct-P MXFP4 P with each 32-key block's top keys outside its shared scale
    (`Recipe.p_sink`, reference/directp.py): the keys that tie the block's maximum get
    the FP8 P value e4m3(2**(x + 8)), the others Direct-P codes under the exponent of
    the block's next largest key. On Hopper both are e4m3 values of the one P tile.
    HW_CVT: the top keys' e4m3 rounding by the packed hardware conversion (GPU only, the
    same RNE as `round_e4m3`, which the interpreter runs).

    Per score: the top's max, the rest's compare, select and max, the codes, the top's
    compare and select (docs/notes/robust-numerics.md, "p_sink's instructions"); the
    rest's exponent and scale and the top's exp2 and rounding on the reduced per-row
    values, once per block and row."""
    n_keys: tl.constexpr = x.shape[KEY_AXIS]
    blk = _key_blocks(n_keys, KEY_AXIS, key_block)
    top_x = x  # every element is overwritten: each key is in one block
    top_p = x
    e_b = x
    scale = x
    for b in tl.static_range(n_keys // 32):
        in_b = blk == b
        mb = tl.max(tl.where(in_b, x, -float("inf")), axis=KEY_AXIS)
        # the rest's max over x < mb: the keys that tie the top drop out, and so do a
        # fully masked block's -inf keys and a NaN row's keys (the compare is false)
        below = tl.where(in_b & (x < _bcast_keys(mb, KEY_AXIS)), x, -float("inf"))
        eb, sb = _directp_block_exponent(tl.max(below, axis=KEY_AXIS))  # dropped when only the top is left
        # the top key's FP8 value once per block and row, not an exp2 per element; the
        # offset as an exact product after the exp2, as the reference: exp2(x + 8) rounds
        # x + 8 first, which moved 2**(x + 8) across e4m3 midpoints (38, 50, 108, 232)
        pb = tl.math.exp2(mb) * (2.0 ** P_OFFSET_LOG2)
        if HW_CVT:
            pb = round_e4m3_cvt(pb)
        else:
            pb = round_e4m3(pb)
        top_x = tl.where(in_b, _bcast_keys(mb, KEY_AXIS), top_x)
        top_p = tl.where(in_b, _bcast_keys(pb, KEY_AXIS), top_p)
        e_b = tl.where(in_b, _bcast_keys(eb, KEY_AXIS), e_b)
        scale = tl.where(in_b, _bcast_keys(sb, KEY_AXIS), scale)
    # the codes from x, not from the rest's tile (a top key's code is replaced), so that
    # tile dies in the reduction. The top test is a compare of its own, not the rest's
    # predicate: 64 predicates per thread kept alive across the reduction were stored
    # to and reloaded from registers (P2R, ISETP: two instructions where a compare is
    # one). A fully masked block needs no test: its keys tie top_x = -inf, whose top_p
    # is e4m3(2**-inf) = 0, the value Direct-P gives them
    return tl.where(x == top_x, top_p, e2m1_classify(x - e_b) * scale)


@triton.jit
def build_p_tile(x, P_MODE: tl.constexpr, KEY_AXIS: tl.constexpr, key_block=None, HW_CVT: tl.constexpr = False):
    """P by the recipe's builder (the kernels' P_MODE, `routing.PMode`): FP8 from exp2,
    MXFP4 by Direct-P, MXFP4 from exp2, MXFP4 by Direct-P with the blocks' top keys apart
    (`Recipe.p_sink`); key_block as in `_block_max_32`."""
    if P_MODE == P_MODE_FP8_EXP2:
        p = p_fp8_exp2(x)
    elif P_MODE == P_MODE_MXFP4_DIRECTP:
        p = p_mxfp4_directp(x, KEY_AXIS, key_block)
    elif P_MODE == P_MODE_MXFP4_DIRECTP_SINK:
        p = p_mxfp4_directp_sink(x, KEY_AXIS, key_block, HW_CVT)
    else:
        p = p_mxfp4_exp2(x, KEY_AXIS, key_block)
    return p


@triton.jit
def affine_reference_point(m, P_MODE: tl.constexpr):
    """The affine builders' reference point m~ of rows with (finite) running max m:
    `reference.affine.snap_max`, operation for operation (float32, IEEE rounding). P_MODE
    6 (trained affine FP8 P) snaps to the integers: the backward rebuilds these codes from
    the LSE (`p_fp8_affine_rebuilt`)."""
    if P_MODE == P_MODE_FP8_AFFINE:
        c = (AFFINE_K_FP8 - m * 8.0) + AFFINE_MAGIC
        m_ref = (AFFINE_K_FP8 - (c - AFFINE_MAGIC)) * 0.125
    elif P_MODE == P_MODE_FP8_AFFINE_LAZY:
        c = (AFFINE_K_FP8_LAZY - m * 8.0) + AFFINE_MAGIC
        m_ref = (AFFINE_K_FP8_LAZY - (c - AFFINE_MAGIC)) * 0.125
    elif P_MODE == P_MODE_FP8_AFFINE_TRAINED:
        m_ref = tl.math.ceil(m)
    else:
        m_ref = tl.math.ceil(m * 2.0) * 0.5
    return m_ref


@triton.jit
def _prmt_low_bytes(f):
    """The low bytes of four float32s packed into one register (two PRMTs a pair, one
    more for the four: 0.75 per score), as uint8 elements, GPU only."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi;
        prmt.b32 lo, $1, $2, 0x0040;
        prmt.b32 hi, $3, $4, 0x0040;
        prmt.b32 $0, lo, hi, 0x5410;
        }""",
        "=r,r,r,r,r", [f], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _affine_fp8_field(t, m_ref, K: tl.constexpr = AFFINE_K_FP8):
    """The affine FP8 map (offset K) of log2 scores t from reference points m_ref
    (broadcast against t): f = 8 t + C with C = (K - 8 m~) + MAGIC (one rounding: 8 t is
    exact, so an FMA and the separate product round alike), clamped at MAGIC by a
    NaN-propagating max, and v, f's bits shifted left by 20: the float32 of e4m3(f's low
    byte) * 2**-120, exactly (the e4m3 fields land on float32's, its subnormals on
    float32 denormals)."""
    f = tl.maximum(t * 8.0 + ((K - m_ref * 8.0) + AFFINE_MAGIC), AFFINE_MAGIC, propagate_nan=tl.PropagateNan.ALL)
    v = (f.to(tl.int32, bitcast=True) << 20).to(tl.float32, bitcast=True)
    return f, v


@triton.jit
def lazy_reference_point(t, m_i, m_tile):
    """Recipe.rescale="lazy" (`reference.affine.lazy_reference_point`): a row keeps its
    point m_i while every byte of the tile measured from it fits (fl(8 t + C) - MAGIC <=
    126, NaN-propagating), else it takes the snapped running maximum m_tile."""
    f = t * 8.0 + tl.expand_dims((AFFINE_K_FP8_LAZY - m_i * 8.0) + AFFINE_MAGIC, 1)
    top = tl.reduce(f, 1, max_propagating_nan) - AFFINE_MAGIC
    keeps = (m_i > -float("inf")) & (top <= AFFINE_FP8_MAX_BYTE)
    return tl.where(keeps, m_i, affine_reference_point(m_tile, P_MODE_FP8_AFFINE_LAZY))


@triton.jit
def p_fp8_affine(t, m_ref, HW_PACK: tl.constexpr, K: tl.constexpr = AFFINE_K_FP8):
    """FP8 P by the affine map (reference/affine.py): f = 8 t + C (one rounding: 8 t is
    exact, so an FMA and the separate product round alike), clamped at MAGIC by a
    NaN-propagating max (a NaN row keeps NaN: the canonical NaN's low byte is 0xFF, e4m3
    NaN), and the e4m3 byte is f's low byte. Returns (P, row sum of its values): P the
    exact e4m3 values (times 2**8) as float32, or with HW_PACK the e4m3 tile itself,
    its bytes packed by PRMT (GPU only). The values come from the byte without a
    conversion: f's bits shifted left by 20 are the float32 of e4m3(byte) * 2**-120,
    exactly, subnormal bytes and byte 0 included (the e4m3 fields land on float32's, and
    e4m3's subnormals on float32 denormals); the row sum is scaled back once per row."""
    f, v = _affine_fp8_field(t, tl.expand_dims(m_ref, 1), K)
    if HW_PACK:
        # the GPU's canonical NaN 0x7FFFFFFF has the low byte 0xFF (e4m3 NaN) and shifted
        # is a NaN value: a NaN row stays NaN in P and in its sum without a select
        p = _prmt_low_bytes(f).to(tl.float8e4nv, bitcast=True)
    else:
        # any NaN's bits (the interpreter's 0x7FC00000 shifts to 0): NaN by a select
        v = tl.where(f == f, v, f)
        p = v * (2.0 ** 120)
    row_sum = tl.sum(v, axis=1) * (2.0 ** 120)
    return p, row_sum


@triton.jit
def p_fp8_affine_rebuilt(t, lse2):
    """The trained affine FP8 P (P_MODE 6) of log2 scores t rebuilt from the rows' LSE in
    log2 units (lse2, broadcast against t; +inf for rows without keys): the forward's
    codes measured from the integer m~ = ceil(lse2), e4m3(byte) * 2**-8, times
    2**(m~ - lse2). The forward measured them from its integer running maximum, and an
    integer shift of the reference moves each byte by 8 (a power of two), so this is the
    forward's normalized P exactly wherever the byte stays normal (`reference.backward`).
    No exponential per score; NaN scores or a NaN LSE give NaN."""
    live = lse2 != float("inf")  # a NaN LSE stays NaN through m~ and the factor
    m_ref = tl.where(live, tl.math.ceil(lse2), 0.0)
    factor = tl.where(live, tl.math.exp2(m_ref - lse2), 0.0)
    f, v = _affine_fp8_field(t, m_ref)
    v = tl.where(f == f, v, f)  # a NaN's bits need not shift to a NaN
    return v * (2.0 ** 112) * factor


@triton.jit
def p_mxfp4_affine(t, m_ref, key_block=None):
    """MXFP4 P by the paper's affine classifier (reference/affine.py): per 32-key block
    e_b = floor(max t - m~) - 2 as Direct-P's, the E2M1 code clamp(RNE(2 t + C) - MAGIC,
    0, 7) from one rounding, and its value from the code's bits: code << 22 is the
    float32 of E2M1(code) * 2**-126, exactly (the subnormal code 1 a float32 denormal),
    times 2**126 and the block's 2**(e_b + 8)."""
    tb = _block_max_32(t, 1, key_block)
    e_b = tl.floor(tb - tl.expand_dims(m_ref, 1)) - 2.0
    keep = e_b >= P_EMIN
    e_b = tl.where(keep, e_b, 0.0)
    scale = tl.where(keep, ((e_b.to(tl.int32) + (P_OFFSET_LOG2 + 127)) << 23).to(tl.float32, bitcast=True), 0.0)
    c = ((2.0 - tl.expand_dims(m_ref, 1) * 2.0) - e_b * 2.0) + AFFINE_MAGIC
    f = tl.minimum(tl.maximum(t * 2.0 + c, AFFINE_MAGIC, propagate_nan=tl.PropagateNan.ALL), AFFINE_MAGIC + 7.0,
                   propagate_nan=tl.PropagateNan.ALL)
    v = (f.to(tl.int32, bitcast=True) << 22).to(tl.float32, bitcast=True) * (2.0 ** 126)
    # a NaN score: f is NaN and its bits are not a code; P is NaN, as the reference's
    return tl.where(f == f, v * scale, f)


@triton.jit
def log2_scores(s, a, b):
    """Scores in log2 units from the raw product s: (s * a) * b with a the query's
    scale (q_scale * softmax_scale * log2 e) and b the key's, both already broadcast
    along their axis. mul_rn: rounded products, never contracted into an FMA with the
    `t - m` that follows; with an FMA the row maximum's own x came out at -1 ulp instead
    of 0, which moves floor(max x) and with it a whole MXFP4 block's exponent."""
    return libdevice.mul_rn(libdevice.mul_rn(s, a), b)


@triton.jit
def nvfp4_scores(a, a_sc, bt, b_sc, zero_rows):
    """The raw score product A B^T of two NVFP4 operands (Blackwell only), before the
    tensor scales (`log2_scores` applies them): a (M, D/2) and bt (D/2, N) E2M1 codes
    packed two a byte along the head dim (element 2i in the low nibble: the payload
    `formats.nvfp4` and the training quantizers store), a_sc (M, D/16) and b_sc (N, D/16)
    e4m3 block scales. `tl.dot_scaled` lowers it to the block-scaled FP4 product
    (`tcgen05.mma ... kind::mxf4nvf4.block_scale.scale_vec::4X` on sm_100, block-scaled
    mma.sync on sm_120). Every product of two NVFP4 grid values is exact in float32, so
    this is the bf16 product of the decoded values up to float32 summation order.

    The accumulator starts from zero_rows (M,) broadcast, a zero the compiler cannot
    fold: Triton 3.6 fails to build a block-scaled MMA in a loop whose accumulator is a
    constant zero ("'ttng.tmem_alloc' op uninitialized alloc must have a mutable memdesc
    type" in TritonGPUOptimizeAccumulatorInit; `acc=None` too). Callers take it from a
    scale the scores are multiplied by anyway, so a NaN there only gives the NaN scores
    that scale would."""
    M: tl.constexpr = a.shape[0]
    N: tl.constexpr = bt.shape[1]
    acc = zero_rows[:, None] + tl.zeros((M, N), tl.float32)
    return tl.dot_scaled(a, a_sc, "e2m1", bt, b_sc, "e2m1", acc)


@triton.jit
def max_propagating_nan(a, b):
    """max(a, b) with a NaN in either giving NaN (`tl.reduce` combiner; tl.max drops NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def online_softmax_p(t, m_i, l_i, P_MODE: tl.constexpr, P_HW_CVT: tl.constexpr, ROWS_MAY_BE_EMPTY: tl.constexpr,
                     key_block=None):
    """One tile of the exact-max online softmax on masked log2 scores t (queries, keys):
    (P as exact e4m3 values times 2**8, the rescale factor alpha, the new running max,
    the new row sum of the represented P values). ROWS_MAY_BE_EMPTY: a row may have
    seen no key yet (max -inf), so it is normalized by 0 instead. P_HW_CVT rounds FP8 P
    by the packed hardware conversion (RNE, as `round_e4m3`); key_block as in
    `_block_max_32` (Gluon callers pass it). P_MODE 4 and 5 are the affine builders
    (`p_fp8_affine`, `p_mxfp4_affine`), which take t itself and return the snapped
    reference point as the running max; with P_HW_CVT, P_MODE 4's P is the e4m3 tile.
    P_MODE 7 is P_MODE 4 with Recipe.rescale="lazy" (`lazy_reference_point`).
    (Row sums on the tensor cores were measured no faster and removed:
    docs/notes/hopper-forward.md, "Row sums on the tensor cores".)"""
    # NaN propagates through the running max (tl.max would drop it): a NaN score, from a
    # NaN in q, k or a float mask, makes its row NaN (reference/forward.py); a score
    # that overflows to +inf leaves the row's softmax undefined, NaN as in SDPA
    nan_ok: tl.constexpr = tl.PropagateNan.ALL
    m_new = tl.maximum(m_i, tl.reduce(t, 1, max_propagating_nan), propagate_nan=nan_ok)
    if ROWS_MAY_BE_EMPTY:
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    else:
        m_use = m_new
    m_use = tl.where(m_new == float("inf"), float("nan"), m_use)
    if P_MODE >= P_MODE_FP8_AFFINE:
        # the affine builders (P from t, no exp): the reference point is m snapped to the
        # map's grid, and that is what later tiles are measured from (the row keeps -inf
        # until it sees a key)
        if P_MODE == P_MODE_FP8_AFFINE_LAZY:
            # rescale="lazy": the row's point stays while the tile's bytes fit above it
            m_use = lazy_reference_point(t, m_i, m_use)
        else:
            m_use = affine_reference_point(m_use, P_MODE)
        alpha = tl.math.exp2(m_i - m_use)
        if P_MODE == P_MODE_FP8_AFFINE_LAZY:
            p, row_sum = p_fp8_affine(t, m_use, P_HW_CVT, AFFINE_K_FP8_LAZY)
        elif P_MODE == P_MODE_FP8_AFFINE or P_MODE == P_MODE_FP8_AFFINE_TRAINED:
            p, row_sum = p_fp8_affine(t, m_use, P_HW_CVT)
        else:
            p = p_mxfp4_affine(t, m_use, key_block)
            row_sum = tl.sum(p, axis=1)
        l_i = l_i * alpha + row_sum
        m_new = tl.where(m_new == -float("inf"), m_new, m_use)
    else:
        alpha = tl.math.exp2(m_i - m_use)
        x = t - tl.expand_dims(m_use, 1)
        if P_MODE == P_MODE_FP8_EXP2 and P_HW_CVT:
            p = round_e4m3_cvt(tl.math.exp2(x + P_OFFSET_LOG2))
        else:
            p = build_p_tile(x, P_MODE, 1, key_block, P_HW_CVT)
        l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i
