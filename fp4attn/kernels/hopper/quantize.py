"""Fused Triton quantizers: bf16/fp16/fp32 Q, K, V into the forward kernel's operand
layouts, and the training backward's e4m3 views, one pass over each operand after the
reductions its scales need: max |x| of each head (NVFP4 Q/K: one tensor scale per
(batch, head), so no item's values move another's codes) or of each head's channels
(FP8 V, dO) by `_abs_max_kernel`, or fused into a pass that reads the operand
anyway (`channel_amax=True`; smoothed K's from its channels' extremes in the pass that
makes its mean, `_key_mean_kernel`), from which the kernels compute the scales themselves;
MXFP4 V's head maximum of block exponents (`_v_kernel`, which reads V once). Every kernel
works on (heads, S, D) tiles of one head, so per-channel maxima are one atomic max per
channel and program, and nothing here waits for the GPU.

Maxima are kept as the int32 bits of |x| in float32: non-negative floats order as their
bits, NaN above +Inf, so `tl.atomic_max` over them is max |x| with NaN propagating,
`x.float().abs().max()` exactly, in any program order. The forward's statistics (NVFP4
Q/K's tensor amax, the robust means, extremes and sums, FP8 V's channel maxima, FP8 K's
tile maxima) are taken over the finite values (a NaN or Inf counting as 0), and a NaN or
Inf spoils only its own scale block or element (`reference.forward`, "Non-finite
values").

Each reproduces the reference quantizer bit for bit (`kernels/hopper/operands.py`
builds the same tensors from `fp4attn.formats`; tests compare them with
`torch.equal`): divisions are `div_rn` (IEEE, as torch's tensor division), and values
are rounded to the e4m3 / E2M1 grids by explicit arithmetic before the final, exact
cast.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4attn.formats import constants
from fp4attn.kernels.common import fp8_scale_inv, max_propagating_nan, round_e4m3, round_e4m3_cvt, sm_count
from fp4attn.kernels.hopper.operands import BLOCK_N, KernelOperands, qk_dtype
from fp4attn.recipes import Recipe
from fp4attn.reference import encoding

FP32_MAX = tl.constexpr(constants.FP32_MAX)
E2M1_EMAX = tl.constexpr(constants.E2M1_EMAX)
E8M0_EMIN = tl.constexpr(constants.E8M0_EMIN)
E8M0_EMAX = tl.constexpr(constants.E8M0_EMAX)
V_TOP = tl.constexpr(encoding.V_TOP)
V_WINDOW = tl.constexpr(encoding.V_WINDOW)
# 1 / 6 rounded to float32 (0x3E2AAAAB), the constant of the NVFP4 multiplier: a literal,
# where a division at run time took a reciprocal's dozen instructions in every program
ONE_SIXTH = tl.constexpr(0.1666666716337204)


@triton.jit
def _with_sign_of(mag, v):
    """mag carrying v's sign bit (so -0 stays -0, as torch.copysign in the reference)."""
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -mag, mag)


@triton.jit
def _e4m3_signed(v, HW_CVT: tl.constexpr):
    """float32 on the e4m3 grid, nearest even, saturating at +-448 (Inf too), NaN kept:
    by the packed hardware conversion (cvt.rn.satfinite, `round_e4m3_cvt`) on the GPU,
    or on the float32 bits (`round_e4m3`) where it cannot run (the interpreter). The bit
    arithmetic took about five times the instructions, and made the quantizers that
    round twice (the training's per-token view of V) instruction-bound."""
    if HW_CVT:
        return round_e4m3_cvt(v)
    r = _with_sign_of(round_e4m3(tl.minimum(tl.abs(v), 448.0)), v)
    return tl.where(v != v, v, r)


@triton.jit
def _abs_bits(x):
    """The float32 bits of |x| as int32: ordered as the magnitudes, NaN above +Inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _abs_bits_max(run, x, ok):
    """The running elementwise max of |x|'s bits (rows where ok) over a program's row
    blocks: no exchange between threads until `_channel_amax_flush`."""
    return tl.maximum(run, tl.where(ok, _abs_bits(x), 0))


@triton.jit
def _channel_amax_flush(CAMAX, run, D: tl.constexpr):
    """Atomic max of the running (rows, D) maximum's per-channel max into one head's D
    slots at CAMAX, as float32 bits. Relaxed: a max needs no ordering with the
    program's other memory operations (the default acq_rel put a MEMBAR.ALL.GPU beside
    every atomic); one per channel and program: with a program per 16 rows the dO
    pass's same-address atomics doubled its time."""
    tl.atomic_max(CAMAX + tl.arange(0, D), tl.max(run, axis=0), sem="relaxed")


@triton.jit
def _block_rows(g, S, i, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr):
    """The positions s in head g (int64) of this program's i-th block of BLOCK_R rows
    (BLOCKS blocks a program, grid (cdiv(S, BLOCK_R * BLOCKS), G)), and their row indices
    g * S + s (int64) in a (G, S, ...) tensor."""
    s = (tl.program_id(0) * BLOCKS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
    return s, g * S + s


@triton.jit
def _row_block(X, g, S, i, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr, D: tl.constexpr):
    """Block i of this program's BLOCKS blocks of BLOCK_R rows of X (G, S, D) in head g,
    as stored, rows past S (and a block i past the last) zero: a program that loads
    block i + 1 before it works on block i keeps twice the bytes in flight (the passes
    here are bound by memory parallelism, not by bandwidth or issue)."""
    s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(X + offs, mask=((s < S) & (i < BLOCKS))[:, None], other=0.0)


@triton.jit
def _last_program_of_head(COUNT, g):
    """Whether this program is the last of head g's programs (axis 0 of the grid) to get
    here, by an acq_rel count at COUNT + g (int32, starting at 0), after a barrier so that
    the count follows every thread's earlier atomics. The last one's acquire then makes
    all the head's atomics visible to it: it reads their results from L2 (`.cg`)."""
    tl.debug_barrier()
    return tl.atomic_add(COUNT + g, 1, sem="acq_rel") == tl.num_programs(0) - 1


@triton.jit
def _fallback_choice(sq_k, g, SQ_Q, FB_Q, FB_K, S, S_Q, D_STAT, GROUP, GROUP_P2: tl.constexpr, SCALE, LIMIT):
    """The Q/K fallback choice of K head g (`reference.forward.robust_qk`) from its
    finished float64 sum of squares sq_k: whether the largest `robust.logit_std_of_sums`
    of its GROUP query heads (g * GROUP + j, their sums of squares in SQ_Q) is above
    LIMIT, NaN counting as not above (torch's amax propagates it), with every float64
    operation of the reference in its order (IEEE div, sqrt and products: the same
    float64 numbers). D_STAT is the head dim the statistic divides by: the caller's, not
    the kernel's where zero channels pad it (they add nothing to the sums). Stored as
    int8 into FB_K (G,) and FB_Q (G * GROUP,)."""
    j = tl.arange(0, GROUP_P2)
    ok = j < GROUP
    sq_q = tl.load(SQ_Q + g * GROUP + j, mask=ok, other=0.0)
    spread = SCALE * tl.sqrt(sq_q / S_Q * (sq_k / S) / D_STAT)
    nan = tl.max(tl.where(ok & (spread != spread), 1, 0), axis=0)
    over = tl.max(tl.where(ok & (spread > LIMIT), 1, 0), axis=0)
    fb = (over > nan).to(tl.int8)
    tl.store(FB_K + g, fb)
    tl.store(FB_Q + g * GROUP + j, tl.full([GROUP_P2], 0, tl.int8) + fb, mask=ok)


@triton.jit
def _abs_max_kernel(X, AMAX, MEAN, SUMSQ, S, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCKS: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, HAS_MEAN: tl.constexpr = False, SUM_SQ: tl.constexpr = False,
                    CHOICE: tl.constexpr = False, COUNT=None, SQ_Q=None, FB_Q=None, FB_K=None, S_Q=1, D_STAT=1,
                    GROUP=1, GROUP_P2: tl.constexpr = 1, SCALE: tl.float64 = 1.0, LIMIT: tl.float64 = 1.0,
                    FINITE: tl.constexpr = False):
    """max |x| of X (G, S, D) as float32 bits, BLOCKS blocks of BLOCK_S rows a program:
    per head and channel into AMAX (G, D), or per head into AMAX (G,); AMAX starts at 0
    (+0.0). HAS_MEAN: of x - MEAN (G, D) (float32, one rounding: `robust.smooth`).
    SUM_SQ: also each head's sum of x**2 into SUMSQ (G,) float64 (squares of the float32
    values and their sums in float64, `robust.logit_std`: exact for bf16 inputs in
    practice, so the order of the adds does not matter; not so for x - MEAN, whose
    float32 values carry up to 24 bits: at S = 4096 the order of the adds, the atomics'
    order too, can show in the sums' last bits, which moves the fallback choice only for
    a spread within about 1e-15 of its threshold).
    FINITE: of the finite values only (a NaN or Inf counts as 0, in the sums of squares
    too), as the NVFP4 tensor scale and the robust statistics take them.
    CHOICE (K, with SUM_SQ, after the pass over Q that summed SQ_Q): the last program of
    each head (COUNT (G,) int32 zeros) makes the head's fallback choice
    (`_fallback_choice`: FB_K, FB_Q) from the finished sums: no launch of its own."""
    g = tl.program_id(1).to(tl.int64)
    # the running max of |x| as floats, NaN propagating (one FMNMX.NAN an element, |x| a
    # free operand modifier; the bits' mask, select and integer max took three); rows
    # past S are 0
    run = tl.zeros([BLOCK_S, D], tl.float32)
    # the squares summed in float64 within each thread (8 contiguous channels a load)
    # and across threads once at the end: a sum per row and block had 8 shuffles per row
    sq = tl.zeros([BLOCK_S, D // 8], tl.float64)
    # with the squares, the next block's load issued before this block's work (H200,
    # (8, 16, 4096, 128): 0.054 -> 0.048 ms; the max alone is faster without, 0.044 ms)
    PREFETCH: tl.constexpr = SUM_SQ
    if PREFETCH:
        nxt = _row_block(X, g, S, 0, BLOCK_S, BLOCKS, D)
    for i in range(BLOCKS):
        s, rows = _block_rows(g, S, i, BLOCK_S, BLOCKS)
        ok = (s < S)[:, None]
        if PREFETCH:
            x = nxt.to(tl.float32)
            nxt = _row_block(X, g, S, i + 1, BLOCK_S, BLOCKS, D)
        else:
            x = _row_block(X, g, S, i, BLOCK_S, BLOCKS, D).to(tl.float32)
        if HAS_MEAN:
            x = tl.where(ok, x - tl.load(MEAN + g * D + tl.arange(0, D))[None, :], 0.0)
        if FINITE:
            x = tl.where(tl.abs(x) < float("inf"), x, 0.0)
        run = tl.maximum(run, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        if SUM_SQ:
            x64 = x.to(tl.float64)
            sq += tl.sum(tl.reshape(x64 * x64, [BLOCK_S, D // 8, 8]), axis=2)
    if SUM_SQ:
        tl.atomic_add(SUMSQ + g, tl.sum(tl.sum(sq, axis=1), axis=0), sem="relaxed")
    run = _abs_bits(run)
    if PER_CHANNEL:
        _channel_amax_flush(AMAX + g * D, run, D)
    else:
        tl.atomic_max(AMAX + g, tl.max(tl.max(run, axis=1), axis=0), sem="relaxed")
    if CHOICE:
        if _last_program_of_head(COUNT, g):
            _fallback_choice(tl.load(SUMSQ + g, cache_modifier=".cg"), g, SQ_Q, FB_Q, FB_K, S, S_Q, D_STAT, GROUP,
                             GROUP_P2, SCALE, LIMIT)


@triton.jit
def _round_bf16(x):
    """float32 x rounded to bf16 (nearest even, overflowing to Inf; NaN as torch's CPU
    conversion gives it, 0x7FC0), as float32, on the bits: the interpreter's bf16 cast
    truncates."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x != x, 0x7FC00000, b).to(tl.float32, bitcast=True)  # NaN: torch's 0x7FC0


@triton.jit
def _ordered_bits(x):
    """float32 x as int32 bits whose unsigned order is x's order (-0 just below +0): the
    sign bit set for a positive x, every bit inverted for a negative one. 0 is the
    lowest key (a negative NaN's), so a zero-filled buffer starts an unsigned max."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, ~b, b | -2147483648)


@triton.jit
def _from_ordered_bits(u):
    """The float32 of `_ordered_bits` u (int32)."""
    return tl.where(u < 0, u & 0x7FFFFFFF, ~u).to(tl.float32, bitcast=True)


@triton.jit
def _pairwise_sum(x, N: tl.constexpr):
    """`robust.pairwise_sum` of x (N,), N a power of two: entries i and i + n / 2 added
    for i < n / 2, level by level, each a reduction of two entries (one add, in either
    order the same bits; a reduction's own order over more is unspecified). The halves,
    not neighbours: pairing neighbours made Triton hold the whole vector in every thread
    (243 registers at D = 64)."""
    for _ in tl.static_range(N.bit_length() - 1):
        x = tl.sum(tl.reshape(x, [2, x.shape[0] // 2]), axis=0)
    return tl.sum(x, axis=0)  # one entry


@triton.jit
def _key_block_stats(x, x_hi, x_lo, acc, sq, hi, lo, FOLD: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                     STATS: tl.constexpr, CHOICE: tl.constexpr):
    """One block (FOLD * H, D) of the key pass added into its running tiles (H, D): x's
    float64 sums (and, with CHOICE, of its squares, exact: a float32 has 24 significant
    bits), with STATS the maxima of x_hi and minima of x_lo (x, or x with the rows past
    the head's end at -Inf and +Inf)."""
    x64 = x.to(tl.float64)
    acc += tl.sum(tl.reshape(x64, [FOLD, H, D]), axis=0)
    if STATS:
        hi = tl.maximum(hi, tl.max(tl.reshape(x_hi, [FOLD, H, D]), axis=0))
        lo = tl.minimum(lo, tl.min(tl.reshape(x_lo, [FOLD, H, D]), axis=0))
    if CHOICE:
        sq += tl.sum(tl.reshape(x64 * x64, [FOLD, H, D]), axis=0)
    return acc, sq, hi, lo


@triton.jit
def _key_mean_kernel(X, SUM, COUNT, MEAN, S, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCKS: tl.constexpr,
                     HW_CVT: tl.constexpr = True, FOLD: tl.constexpr = 1, STATS: tl.constexpr = False, EXT=None,
                     AMAX=None, CHOICE: tl.constexpr = False, SUMSQ=None, SQ_Q=None, FB_Q=None, FB_K=None, S_Q=1,
                     D_STAT=1, GROUP=1, GROUP_P2: tl.constexpr = 1, SCALE: tl.float64 = 1.0,
                     LIMIT: tl.float64 = 1.0):
    """`robust.key_mean` of X (G, S, D) into MEAN (G, D) float32, reading X once: each
    program's float64 sums per channel (BLOCKS blocks of BLOCK_S rows) added into SUM (G,
    D) float64 zeros; the head's last program (COUNT (G,) int32 zeros) divides the
    finished sums by S and rounds as torch does: float64 -> float32 -> bf16 (nearest
    even, both), then float32. On the GPU by the conversions torch's CUDA tensors use
    (cvt.rn: a NaN mean is bf16 0x7FFF there), under the interpreter (HW_CVT False) on
    the bits as torch's CPU conversion (`_round_bf16`).

    The same bits as the reference's `sum(dtype=torch.float64)` whatever the order of
    the adds, as long as every partial sum is exact: the sum of S values that are all
    multiples of the smallest one's ulp u and below 2**(e + 1) needs log2(S) + e + 1 -
    log2(u) <= 53 bits. bf16 has 8 significant bits, so that is a channel whose values
    span less than 2**(45 - log2(S)) (2**33 at S = 4096); fp16 (11 bits, 2**-24 ..
    65504) is always exact up to S = 8192. A wider channel (fp32 inputs, or bf16 values
    from 1e-6 to 1e4) may round differently in the last float64 bit, which the float32
    and bf16 roundings almost always absorb. NaN and Inf give NaN or Inf as the
    reference's (Inf + -Inf is NaN in any order).

    STATS: in the same pass each channel's largest and smallest x (EXT (G, 2, D) int32
    zeros, `_ordered_bits` under an unsigned atomic max: the max's key, the min's key
    inverted), from which the last program stores the head's max |x - mean| (the NVFP4
    tensor amax of smoothed K, `robust.smooth`) into AMAX (G,) as float32 bits, as
    `abs_max_bits(x, mean=...)` gives it without a second pass over X: x - mean is one
    float32 rounding, which is monotonic in x, so over the keys max fl(x - m) = fl(max x
    - m) and min fl(x - m) = fl(min x - m), and max |x - m| is the larger magnitude of
    the two (-0 and +0 give the same |.|). Every statistic is of the finite values: a NaN
    or Inf counts as 0 in the sums (`robust.key_mean`) and is left out of the extremes,
    and a non-finite difference out of the amax (the NVFP4 amax of the finite values of
    x - mean): a channel with no finite value, or whose mean rounds to Inf, adds nothing.
    (Where x - mean overflows for a finite x and mean, both of magnitude near float32's
    largest, the reference leaves out only the keys that overflow; here the extreme's
    difference goes, and the amax can fall short of the reference's.)
    CHOICE (with STATS, after the pass over Q that summed SQ_Q): also each channel's
    float64 sum of x**2 (SUMSQ (G, D) zeros), from which the last program makes
    `robust.smoothed_sum_sq` (every operation rounded once: IEEE `_rn` forms, which are
    never contracted into an FMA) and the head's fallback choice (`_fallback_choice`)."""
    g = tl.program_id(1).to(tl.int64)
    # the running tiles of (BLOCK_S / FOLD, D): a block's FOLD parts of rows are one
    # thread's registers in the load's layout (`_key_pass_block`), so they are added (or
    # maxed) within the thread before the running tiles, which then take 1 / FOLD of the
    # registers (unfolded, the full pass took 124 at D = 128: four programs an SM)
    H: tl.constexpr = BLOCK_S // FOLD
    acc = tl.zeros([H, D], tl.float64)
    sq = tl.zeros([H, D], tl.float64)
    hi = tl.full([H, D], float("-inf"), tl.float32)
    lo = tl.full([H, D], float("inf"), tl.float32)
    # the blocks wholly inside the head first, without the row test that the maxima
    # and minima need at its end (two selects an element of the pass's eleven)
    whole = tl.minimum(tl.maximum(S - tl.program_id(0) * BLOCKS * BLOCK_S, 0) // BLOCK_S, BLOCKS)
    nxt = _row_block(X, g, S, 0, BLOCK_S, BLOCKS, D)
    for i in range(whole):
        x = nxt.to(tl.float32)
        nxt = _row_block(X, g, S, i + 1, BLOCK_S, BLOCKS, D)
        # a NaN or Inf: 0 in the sums, out of the extremes (-Inf and +Inf in them)
        fin = tl.abs(x) < float("inf")
        acc, sq, hi, lo = _key_block_stats(tl.where(fin, x, 0.0), tl.where(fin, x, float("-inf")),
                                           tl.where(fin, x, float("inf")), acc, sq, hi, lo, FOLD, H, D, STATS, CHOICE)
    for i in range(whole, BLOCKS):
        s, _ = _block_rows(g, S, i, BLOCK_S, BLOCKS)
        ok = (s < S)[:, None]
        x = nxt.to(tl.float32)
        nxt = _row_block(X, g, S, i + 1, BLOCK_S, BLOCKS, D)
        # rows past S (zeros) and non-finite values: -Inf and +Inf in the extremes, which
        # no finite value of the head can be outranked by
        fin = tl.abs(x) < float("inf")
        use = ok & fin
        acc, sq, hi, lo = _key_block_stats(tl.where(fin, x, 0.0), tl.where(use, x, float("-inf")),
                                           tl.where(use, x, float("inf")), acc, sq, hi, lo, FOLD, H, D, STATS, CHOICE)
    dd = g * D + tl.arange(0, D)
    tl.atomic_add(SUM + dd, tl.sum(acc, axis=0), sem="relaxed")
    if STATS:
        ext = EXT.to(tl.pointer_type(tl.uint32)) + g * 2 * D + tl.arange(0, D)
        tl.atomic_max(ext, _ordered_bits(tl.max(hi, axis=0)).to(tl.uint32, bitcast=True), sem="relaxed")
        tl.atomic_max(ext + D, (~_ordered_bits(tl.min(lo, axis=0))).to(tl.uint32, bitcast=True), sem="relaxed")
    if CHOICE:
        tl.atomic_add(SUMSQ + dd, tl.sum(sq, axis=0), sem="relaxed")
    if _last_program_of_head(COUNT, g):
        total = tl.load(SUM + dd, cache_modifier=".cg")
        m = (total / S).to(tl.float32)
        m = m.to(tl.bfloat16).to(tl.float32) if HW_CVT else _round_bf16(m)
        tl.store(MEAN + dd, m)
        if STATS:
            e = EXT + g * 2 * D + tl.arange(0, D)
            top = _from_ordered_bits(tl.load(e, cache_modifier=".cg"))
            bottom = _from_ordered_bits(~tl.load(e + D, cache_modifier=".cg"))
            # of the finite differences only: a channel without a finite value (top -Inf),
            # or whose mean rounded to Inf, adds nothing
            hi_d, lo_d = _abs_bits(top - m), _abs_bits(bottom - m)
            amax = tl.maximum(tl.where(hi_d < 0x7F800000, hi_d, 0), tl.where(lo_d < 0x7F800000, lo_d, 0))
            tl.store(AMAX + g, tl.max(amax, axis=0))
            if CHOICE:
                m64 = m.to(tl.float64)
                t = libdevice.sub_rn(tl.load(SUMSQ + dd, cache_modifier=".cg"), libdevice.mul_rn(m64 * 2.0, total))
                t = libdevice.add_rn(t, libdevice.mul_rn(m64 * S, m64))
                t = tl.maximum(t, 0.0, propagate_nan=tl.PropagateNan.ALL)
                _fallback_choice(_pairwise_sum(t, D), g, SQ_Q, FB_Q, FB_K, S, S_Q, D_STAT, GROUP, GROUP_P2, SCALE,
                                 LIMIT)


@triton.jit
def _fp8_channel_scales(AMAX, SCALE, D: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Per-channel FP8 scales of one head from its channels' max |x| (D float32 bits at
    AMAX), as `formats.fp8.fp8_scales`: (scale, NaN for a channel holding a NaN or Inf;
    multiplier 448 / amax). With HAS_SCALE, of max |x| * SCALE, which is max |x * SCALE|
    (rounding is monotonic)."""
    amax = tl.load(AMAX + tl.arange(0, D)).to(tl.float32, bitcast=True)
    nonfinite = (amax != amax) | (amax == float("inf"))
    if HAS_SCALE:
        amax = amax * tl.load(SCALE)
    scale, inv = fp8_scale_inv(amax)
    return tl.where(nonfinite, float("nan"), scale), inv


@triton.jit
def _e2m1_value(a):
    """E2M1 value (0 .. 6) nearest to non-negative a, ties to the even code, saturating
    at 6: a + c rounds a to the grid's spacing at a when c is 2**23 times that spacing
    (0.5 below 2, 1 in [2, 4), 2 in [4, 6]: c = max(2**22, a's power of two times
    2**22), from a's exponent bits), and subtracting c again is exact. The add's ties
    go to the even multiple of the spacing, which is E2M1's even code (0.25 -> 0, 0.75
    -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Five instructions (sm_90
    SASS: FMNMX, LOP3, VIADDMNMX, two FADD); rounding the bits to one mantissa bit at
    and above 1 and the 2**23 shift below it took nine."""
    a = tl.minimum(a, 6.0)
    c = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) + (22 << 23), 0x4A800000)
    c = c.to(tl.float32, bitcast=True)
    return (a + c) - c


@triton.jit
def _e2m1_code(v):
    """E2M1 magnitude code (0 .. 7, int32) of a value on the E2M1 grid: from 1 up its
    float32 exponent and mantissa bit ((e + 127) * 2 + m - 252: 1 -> 2, 6 -> 7), below
    it 0.5 -> 1, 0 -> 0."""
    return tl.where(v >= 1.0, (v.to(tl.int32, bitcast=True) >> 22) - 252, (v > 0.0).to(tl.int32))


@triton.jit
def _e2m1_magnitude(c):
    """The value (0, 0.5, 1, 1.5, 2, 3, 4, 6) of E2M1 magnitude code c (int32, 0 .. 7)."""
    return tl.where(c <= 4, c.to(tl.float32) * 0.5, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))


@triton.jit
def _fp8_per_row(x, AXIS: tl.constexpr, HW_CVT: tl.constexpr):
    """FP8 e4m3 of a float32 tile with one scale per row along AXIS, as
    `formats.fp8.quantize_fp8`: (values on the e4m3 grid, as float32; scale). scale =
    amax / 448, element = e4m3(x * (448 / amax)); rows below FP8_MIN_AMAX get scale 1;
    a row holding NaN or Inf gets scale NaN."""
    bad = tl.sum((x != x).to(tl.int32), axis=AXIS) > 0
    amax = tl.max(tl.abs(x), axis=AXIS)
    amax = tl.where(bad, float("nan"), amax)
    scale, inv = fp8_scale_inv(amax)
    nonfinite = bad | (amax == float("inf"))
    y = _e4m3_signed(x * tl.expand_dims(inv, AXIS), HW_CVT)
    return y, tl.where(nonfinite, float("nan"), scale)


@triton.jit
def _fp8_rows_kernel(X, Y, S_OUT, O, DOT, CAMAX, S, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr,
                     WITH_DOT: tl.constexpr, CHANNEL_AMAX: tl.constexpr, HW_CVT: tl.constexpr, Y8=None,
                     SAVED: tl.constexpr = False):
    """Per-row FP8 of X (G, S, D), BLOCKS blocks of BLOCK_R rows a program, stored as Y's
    dtype (e4m3, or bf16, which holds every e4m3 value), scales into S_OUT (G, S); with
    WITH_DOT also the row dot products DOT = sum(X * O) (the backward's delta =
    rowsum(dO * O), fused into the pass that reads dO); with CHANNEL_AMAX also each
    head's per-channel max |x| into CAMAX (G, D) (float32 bits, starting at 0), for the
    per-channel view of the same X.
    SAVED (the training forward's Q and K, `quantize_train_fp8`): the values also as e4m3
    bytes into Y8, and CHANNEL_AMAX's maxima of the represented values (value x row
    scale, float32) instead of x, from which the backward's per-channel view of them is
    made (NaN above Inf, so a NaN row's channels are NaN)."""
    g = tl.program_id(1).to(tl.int64)
    run = tl.zeros([BLOCK_R, D], tl.int32)
    for i in range(BLOCKS):
        s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
        offs = rows[:, None] * D + tl.arange(0, D)[None, :]
        ok = (s < S)[:, None]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        y, scale = _fp8_per_row(x, 1, HW_CVT)
        tl.store(S_OUT + rows, scale, mask=s < S)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
        if SAVED:
            tl.store(Y8 + offs, y.to(tl.float8e4nv), mask=ok)
        if WITH_DOT:
            o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(DOT + rows, tl.sum(x * o, axis=1), mask=s < S)
        if CHANNEL_AMAX:
            run = _abs_bits_max(run, y * scale[:, None] if SAVED else x, ok)
    if CHANNEL_AMAX:
        _channel_amax_flush(CAMAX + g * D, run, D)


@triton.jit
def _fp8_tiles_kernel(X, Y, S_OUT, S, D: tl.constexpr, TILE: tl.constexpr, HW_CVT: tl.constexpr):
    """FP8 of X (G, S, D) with one scale per TILE rows (`reference.operands.quantize_fp8_tiles`):
    a program per (tile, head), its TILE x D values one block of `_fp8_per_row`'s
    arithmetic (amax over the whole tile's finite values; rows past S count as zeros), the
    scale stored for each of its rows into S_OUT (G, S), the values as Y's dtype, a NaN or
    Inf as NaN (`formats.quantize_fp8(finite_scale=True)`)."""
    g = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    ok = (rows < S)[:, None]
    offs = (g * S + rows)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    # `_fp8_per_row`'s arithmetic with the tile as the block: the maxima over both axes
    bits = _abs_bits(x)  # NaN and Inf (bits at or above Inf's) count as 0
    amax = tl.max(tl.max(tl.where(bits < 0x7F800000, bits, 0), axis=1), axis=0).to(tl.float32, bitcast=True)
    scale, inv = fp8_scale_inv(amax)
    # NaN and Inf stored as NaN: x - x is +0 for a finite x, NaN otherwise (`_v_kernel`)
    y = _e4m3_signed(x * inv - (x - x), HW_CVT)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(S_OUT + g * S + rows, tl.zeros([TILE], tl.float32) + scale, mask=rows < S)


@triton.jit
def _nvfp4_tensor_scales(AMAX):
    """(multiplier, decode scale, decode scale as the kernels read it) of an NVFP4
    tensor (one head) whose max |x| (float32 bits) is at AMAX, as `formats.nvfp4`
    computes them (TransformerEngine's rule): S_enc = min(448 * 6 / amax, FP32_MAX), 1
    where that is 0; decode 1 / S_enc; multiplier S_enc * (1 / 6). Every operation is a
    single IEEE-rounded one (no product meets an add, so nothing is contracted into an
    FMA). amax is that of the head's finite values (`abs_max_bits(..., finite=True)`)."""
    amax = tl.load(AMAX).to(tl.float32, bitcast=True)
    one = tl.full(amax.shape, 1.0, tl.float32)
    s_enc = tl.minimum(tl.div_rn(one * 2688.0, amax), FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)
    s_dec = tl.div_rn(one, s_enc)
    return s_enc * ONE_SIXTH, s_dec, s_dec, s_enc


@triton.jit
def _nvfp4_block_offsets(rows, D: tl.constexpr):
    """Element offsets of rows of D contiguous elements seen as (rows, D / 16 blocks, 16)."""
    return rows[:, None, None] * D + tl.arange(0, D // 16)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]


@triton.jit
def _nvfp4_row_block(X, g, S, i, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr, D: tl.constexpr):
    """`_row_block` seen as (BLOCK_R, D / 16 blocks, 16)."""
    s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
    return tl.load(X + _nvfp4_block_offsets(rows, D), mask=((s < S) & (i < BLOCKS))[:, None, None], other=0.0)


@triton.jit
def _row_offsets(rows, N: tl.constexpr):
    """Offsets of rows of N contiguous entries, (rows, N): the payload's code bytes
    (N = D / 2) and block scales (N = D / 16)."""
    return rows[:, None] * N + tl.arange(0, N)[None, :]


@triton.jit
def _nvfp4_block_scale(amax_b, mult, s_dec, HW_CVT: tl.constexpr):
    """(decode scale d, encode multiplier) of blocks (rows, blocks) with max |x| amax_b
    scaled by `mult` (S_enc / top): d = e4m3(min(amax_b * mult, 448)), the multiplier
    min(1 / (d * s_dec), FP32_MAX) (`formats.nvfp4`). The e4m3 rounding by the
    hardware's saturating conversion where HW_CVT (`_e4m3_signed`: 448 and NaN as the
    clamp gives them; the bit arithmetic was 2.5 instructions an element of the 4-or-6
    pass, whose two threads a block both round its two candidates)."""
    # a NaN block maximum gives a NaN scale (torch's clamp propagates NaN; tl.minimum
    # must be told to)
    nan_ok: tl.constexpr = tl.PropagateNan.ALL
    d = tl.minimum(amax_b * mult, FP32_MAX, propagate_nan=nan_ok)
    if HW_CVT:
        d = _e4m3_signed(d, True)
    else:
        d = round_e4m3(tl.minimum(d, 448.0, propagate_nan=nan_ok))
    enc = tl.minimum(tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d * s_dec), FP32_MAX, propagate_nan=nan_ok)
    return d, enc


@triton.jit
def _signed(mag, x):
    """Non-negative (or NaN) mag with x's sign, as `_with_sign_of(mag, x)` gives it: -mag
    for a negative x (sign bit set, -0 included), except +0 for mag = 0 (Triton's -mag
    is 0 - mag). The sign bit by one bitwise op, and + 0 (-0 + 0 = +0, any other value
    unchanged): two instructions instead of a compare, a subtraction and a select."""
    b = mag.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
    return b.to(tl.float32, bitcast=True) + 0.0


@triton.jit
def _nvfp4_rows_kernel(X, Y, AMAX, SDEC, CODES, BSCALE, CAMAX, MEAN, FB, S, D: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCKS: tl.constexpr, PACKED: tl.constexpr, CHANNEL_AMAX: tl.constexpr,
                       HAS_MEAN: tl.constexpr = False, FOUR_OVER_SIX: tl.constexpr = False,
                       FALLBACK: tl.constexpr = False, HW_CVT: tl.constexpr = True):
    """NVFP4 grid values (E2M1 x E4M3 block scale, without the tensor scale) of X (G, S,
    D) as bf16, in TransformerEngine's operation order (formats/nvfp4.py), each head's
    tensor scale from its finite values' max |x| at AMAX (G,), a block holding a NaN or
    Inf NaN (scale 0x7F, codes 0); SDEC (G, S) gets the head's decode scale in every
    row's slot. With PACKED also the payload
    as `quantize_nvfp4` stores it: CODES (G, S, D / 2) uint8, two E2M1 codes a byte,
    element 2i in the low nibble; BSCALE (G, S, D / 16) the e4m3 block scales. With
    CHANNEL_AMAX also each head's per-channel max |grid value| into CAMAX (G, D)
    (float32 bits, starting at 0). BLOCKS blocks of BLOCK_R rows a program.

    The outlier-robust forms (`reference.forward.robust_qk`): HAS_MEAN quantizes x - MEAN
    (G, D) (K smoothing); FOUR_OVER_SIX scales each block to 4 or 6, whichever has the
    smaller largest error (`formats.quantize_nvfp4(four_over_six=True)`); FALLBACK: the
    heads whose FB (G,) int8 is 1 are quantized per token to FP8 instead (values as bf16,
    the row scales into SDEC; not with PACKED or CHANNEL_AMAX)."""
    g = tl.program_id(1).to(tl.int64)
    mult, s_dec, s_dec_out, s_enc = _nvfp4_tensor_scales(AMAX + g)
    run = tl.zeros([BLOCK_R, D], tl.int32)
    mu = tl.zeros([BLOCK_R, D // 16, 16], tl.float32)
    if HAS_MEAN:
        # loaded for every row of the tile, in its layout (L1 hits), not (1, D) then moved
        # across threads through shared memory
        mu = tl.load(MEAN + g * D + _nvfp4_block_offsets(tl.zeros([BLOCK_R], tl.int64), D)).to(tl.float32)
    fp8_head = False
    if FALLBACK:
        fp8_head = tl.load(FB + g) != 0
    # several blocks a program: the next block's load issued before this block's work
    # (`_row_block`)
    PREFETCH: tl.constexpr = BLOCKS > 1
    if PREFETCH:
        nxt = _nvfp4_row_block(X, g, S, 0, BLOCK_R, BLOCKS, D)
    for i in range(BLOCKS):
        s, rows = _block_rows(g, S, i, BLOCK_R, BLOCKS)
        offs = _nvfp4_block_offsets(rows, D)
        ok = (s < S)[:, None, None]
        if PREFETCH:
            x = nxt.to(tl.float32)
            nxt = _nvfp4_row_block(X, g, S, i + 1, BLOCK_R, BLOCKS, D)
        else:
            x = _nvfp4_row_block(X, g, S, i, BLOCK_R, BLOCKS, D).to(tl.float32)
        if HAS_MEAN:
            x = x - mu
        if fp8_head:
            y8, sc = _fp8_per_row(tl.reshape(x, [BLOCK_R, D]), 1, HW_CVT)
            tl.store(SDEC + rows, sc, mask=s < S)
            tl.store(Y + _row_offsets(rows, D), y8.to(tl.bfloat16), mask=(s < S)[:, None])
        else:
            tl.store(SDEC + rows, tl.full([BLOCK_R], 0.0, tl.float32) + s_dec_out, mask=s < S)
            # on magnitudes: |x * enc| is |x| * enc exactly (rounding is symmetric), and
            # the sign goes back on at the end
            ax = tl.abs(x)
            # NaN or Inf in a block makes its maximum NaN or Inf, and the block NaN (its
            # scale; the codes are 0): a finite block's maximum is the plain one
            amax_b = tl.reduce(ax, 2, max_propagating_nan)
            d, enc = _nvfp4_block_scale(amax_b, mult, s_dec, HW_CVT)
            mag = _e2m1_value(ax * enc[:, :, None])
            if FOUR_OVER_SIX:
                # the 4-scaled candidate, and the larger error of each (`formats.nvfp4.
                # _block_error`: max |e2m1 * d - x * S_enc| over the block) on magnitudes:
                # |mag * d - |x| * S_enc| is |(+-mag) * d - x * S_enc| (x * S_enc rounded
                # alone). E2M1 (at most 2 significant bits) times e4m3 (4 bits, at least
                # 2**-9) is exact in float32, so an FMA contraction of the difference
                # rounds as the reference's two operations
                d4, enc4 = _nvfp4_block_scale(amax_b, s_enc * 0.25, s_dec, HW_CVT)
                mag4 = _e2m1_value(ax * enc4[:, :, None])
                t = libdevice.mul_rn(ax, s_enc)
                err4 = tl.max(tl.abs(mag4 * d4[:, :, None] - t), axis=2)
                better = err4 < tl.max(tl.abs(mag * d[:, :, None] - t), axis=2)
                d = tl.where(better, d4, d)
                mag = tl.where(better[:, :, None], mag4, mag)
            d = tl.where(amax_b < float("inf"), d, float("nan"))
            # the signed E2M1 value times d, as from y = x * enc: y has x's sign (enc > 0),
            # or is NaN only where d is (a NaN head)
            val = _signed(mag, x) * d[:, :, None]
            tl.store(Y + offs, val.to(tl.bfloat16), mask=ok)
            if CHANNEL_AMAX:
                run = _abs_bits_max(run, tl.reshape(val, [BLOCK_R, D]), (s < S)[:, None])
            if PACKED:
                # the elements of a NaN block (d is NaN) get code 0 (E2M1 has no NaN;
                # the block scale carries it)
                code = _e2m1_code(mag) | tl.where(x.to(tl.int32, bitcast=True) < 0, 8, 0)
                code = tl.where((d != d)[:, :, None], 0, code)
                lo, hi = tl.split(tl.reshape(code, [BLOCK_R, D // 2, 2]))
                rok = (s < S)[:, None]
                tl.store(CODES + _row_offsets(rows, D // 2), (lo | (hi << 4)).to(tl.uint8), mask=rok)
                tl.store(BSCALE + _row_offsets(rows, D // 16), d.to(tl.float8e4nv), mask=rok)
    if CHANNEL_AMAX:
        _channel_amax_flush(CAMAX + g * D, run, D)


@triton.jit
def _nvfp4_decode_kernel(CODES, BSCALE, Y, CT, CS, SCALE, CAMAX, S, D: tl.constexpr, BLOCK_S: tl.constexpr,
                         CHANNELS: tl.constexpr, HW_CVT: tl.constexpr):
    """The grid values (E2M1 x block scale) of packed NVFP4 rows (G, S, D / 2) into Y
    (G, S, D) as Y's dtype: the inverse of `_nvfp4_rows_kernel`'s payload, the same
    values as its Y. With CHANNELS also the per-channel FP8 of the dequantized values
    (grid values times the head's tensor decode scale SCALE (G,)), stored transposed: CT (G, D, S)
    e4m3 and CS (G, D), from the channels' max |grid value| CAMAX (G, D) that the
    quantizing pass recorded (the backward's Q/K views for dK = dS^T Q and dQ = dS K)."""
    g = tl.program_id(1).to(tl.int64)
    s, rows = _block_rows(g, S, 0, BLOCK_S, 1)
    rok = (s < S)[:, None]
    b = tl.load(CODES + _row_offsets(rows, D // 2), mask=rok, other=0).to(tl.int32)
    code = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_S, D // 16, 16])
    d = tl.load(BSCALE + _row_offsets(rows, D // 16), mask=rok, other=0.0).to(tl.float32)
    mag = _e2m1_magnitude(code & 7)
    val = tl.where(code >= 8, -mag, mag) * d[:, :, None]
    tl.store(Y + _nvfp4_block_offsets(rows, D), val.to(Y.dtype.element_ty), mask=rok[:, :, None])
    if CHANNELS:
        dd = tl.arange(0, D)
        scale, inv = _fp8_channel_scales(CAMAX + g * D, SCALE + g, D, True)
        if tl.program_id(0) == 0:
            tl.store(CS + g * D + dd, scale)
        out = _e4m3_signed(tl.reshape(val, [BLOCK_S, D]) * tl.load(SCALE + g) * inv[None, :], HW_CVT)
        tl.store(CT + g * D * S + dd[None, :] * S + s[:, None], out.to(tl.float8e4nv), mask=rok)


@triton.jit
def _floor_log2(a):
    """floor(log2 a) as int32 for positive finite float32 a, exact, subnormals included:
    they are scaled by 2**64 first (exact), so that their exponent field counts."""
    small = a < 1.1754943508222875e-38  # 2**-126, the smallest normal
    b = tl.where(small, a * 18446744073709551616.0, a).to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 127 - tl.where(small, 64, 0)


@triton.jit
def _pow2(e):
    """Exact float32 2**e for int32 e in [-149, 127] (`formats.minifloat.pow2`)."""
    normal = (tl.maximum(e + 127, 1) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _mx_exponents(v):
    """Per 32-key block and channel of a (NB, 32, D) float32 tile: the shared MXFP4
    exponent of its finite entries (`formats.mx.mx_exponent`, floor rule) and whether all
    of them are finite, (NB, 1, D)."""
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-inf and NaN
    amax = tl.max(tl.where(finite, a, 0.0), axis=1, keep_dims=True)
    all_finite = tl.min(finite.to(tl.int32), axis=1, keep_dims=True) != 0
    positive = amax > 0.0
    e = tl.where(positive, _floor_log2(tl.where(positive, amax, 1.0)) - E2M1_EMAX, E8M0_EMIN)
    return tl.minimum(tl.maximum(e, E8M0_EMIN), E8M0_EMAX), all_finite


@triton.jit
def _v_kernel(V, VT, VS, SCALE, STATS_AT, Y, YS, WORK, G, S, S_ROW, D: tl.constexpr, BLOCK_S: tl.constexpr,
              MXFP4: tl.constexpr, HAS_SCALE: tl.constexpr, TOKENS: tl.constexpr, HW_CVT: tl.constexpr,
              STATS: tl.constexpr, QUANT: tl.constexpr):
    """V (S, D) of each head -> e4m3 V^T (D, S) in rows of S_ROW >= S keys (zero past S)
    and the per-channel scales VS (G, D), written by each head's first block.

    A program takes one block of BLOCK_S keys of one head, in the order of a ticket drawn
    from WORK[0] (G * cdiv(S_ROW, BLOCK_S) blocks). STATS: the head's statistic from the
    block into STATS_AT by an atomic max: FP8, each channel's max |v| (G, D), float32
    bits; MXFP4, the largest exponent of a finite 32-key block (G,), less E8M0_EMIN (so
    that zeros start it). QUANT: the block's values from the finished statistic. With
    both, the block stays in registers between them: the program counts itself into
    WORK[1 + g] and waits until all its head's blocks are counted, so V is read once (a
    pass for the maxima and a pass for the values read it twice). The tickets make the
    wait safe: every block of an earlier ticket belongs to a program that is running or
    done, so a head waits only on programs that run, provided the GPU holds a head's
    blocks at once (`ONE_PASS_BLOCKS_PER_SM`). Longer heads take two launches, STATS then
    QUANT, as do heads of more than one block under the interpreter, which runs programs
    one after another.

    FP8: e4m3(v * inv[d]), with v first multiplied by the scalar SCALE if HAS_SCALE, a NaN
    or Inf stored as NaN; the per-channel scales from each channel's max |v| over its
    finite values (STATS; given maxima are used as they are) as `formats.fp8.fp8_scales`
    computes them (`_fp8_channel_scales`): `formats.quantize_fp8(finite_scale=True)`.
    MXFP4: E2M1 of v * 2**-e times 2**(e - c), e the block's exponent (`_mx_exponents`)
    and c from the head's largest finite exponent (`reference.operands.v_window`):
    blocks more than V_WINDOW below it are flushed to +0, non-finite blocks are NaN.
    TOKENS: also the per-token FP8 of V's represented values (V^T's values times VS),
    Y (G, S, D) e4m3 and YS (G, S): the training backward's view of V in
    dP = dO V^T, from the tile already in registers."""
    NB: tl.constexpr = BLOCK_S // 32
    n_blocks = tl.cdiv(S_ROW, BLOCK_S)
    if STATS and QUANT:
        item = tl.atomic_add(WORK, 1, sem="relaxed")
    else:
        item = tl.program_id(0)
    bh = (item // n_blocks).to(tl.int64)
    b = item % n_blocks
    s = b * BLOCK_S + tl.arange(0, NB)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    dd = tl.arange(0, D)
    ok = s < S
    v = tl.load(V + bh * S * D + s * D + d, mask=ok, other=0.0).to(tl.float32)
    if STATS:
        if MXFP4:
            e, finite = _mx_exponents(v)
            top = tl.max(tl.max(tl.max(tl.where(finite, e, E8M0_EMIN), axis=2), axis=1), axis=0)
            tl.atomic_max(STATS_AT + bh, top - E8M0_EMIN, sem="relaxed")
        else:
            # of the finite values: NaN and Inf (bits at or above Inf's) count as 0
            bits = _abs_bits(v)
            _channel_amax_flush(STATS_AT + bh * D, tl.reshape(tl.where(bits < 0x7F800000, bits, 0), [BLOCK_S, D]), D)
        if QUANT:
            # the count follows every thread's atomics (the barrier, then a release), and
            # the reads of the statistic follow the count (acquire, which also drops the
            # L1's lines; MXFP4's one word is read `.cg`, from L2, besides)
            tl.debug_barrier()
            tl.atomic_add(WORK + 1 + bh, 1, sem="release")
            counted = tl.atomic_add(WORK + 1 + bh, 0, sem="acquire")
            while counted < n_blocks:
                counted = tl.atomic_add(WORK + 1 + bh, 0, sem="acquire")
    if QUANT:
        if MXFP4:
            e, finite = _mx_exponents(v)  # again: fewer registers held through the wait
            e_max = tl.load(STATS_AT + bh, cache_modifier=".cg") + E8M0_EMIN
            c = tl.minimum(tl.maximum(e_max - V_TOP, -126), 126)
            osc = _pow2(tl.minimum(tl.maximum(e - c, -149), 127))
            osc = tl.where(finite & (e < e_max - V_WINDOW), 0.0, osc)
            osc = tl.where(finite, osc, float("nan"))
            y = v * _pow2(-tl.minimum(tl.maximum(e, -127), 127))
            mag = _e2m1_value(tl.abs(y))
            out = _with_sign_of(mag, y) * osc
            out = tl.where(osc == 0.0, 0.0, out)  # a flushed block is +0, as the reference's masked_fill
            vs = tl.full([D], 0.0, tl.float32) + _pow2(c)
        else:
            vs, inv = _fp8_channel_scales(STATS_AT + bh * D, SCALE, D, HAS_SCALE)
            if HAS_SCALE:
                v = v * tl.load(SCALE)
            # NaN and Inf as NaN: v - v is +0 for a finite v (x - +0 is x, -0 included) and NaN
            # for NaN or Inf (no select held across the conversion)
            out = _e4m3_signed(v * inv[None, None, :] - (v - v), HW_CVT)
        if b == 0:
            tl.store(VS + bh * D + dd, vs)
        out = tl.where(ok, out, 0.0)  # the rows' padding past S (a NaN block's too) is zero
        tl.store(VT + bh * D * S_ROW + d * S_ROW + s, out.to(tl.float8e4nv), mask=s < S_ROW)
        if TOKENS:
            # the represented values exactly as the reference's (one float32 product)
            y, ys = _fp8_per_row(out * vs[None, None, :], 2, HW_CVT)
            tok = b * BLOCK_S + tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
            tl.store(YS + bh * S + tok, ys, mask=tok < S)
            tl.store(Y + bh * S * D + s * D + d, y.to(tl.float8e4nv), mask=ok)


def _hw_cvt() -> bool:
    """Whether the kernels round to e4m3 by the hardware conversion: everywhere but
    under the Triton interpreter, which cannot run its inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x (..., S, D) as a contiguous (G, S, D), G the product of the leading dims (a
    1-D x is one row)."""
    S = x.shape[-2] if x.dim() > 1 else 1
    return x.contiguous().view(-1, S, x.shape[-1])


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints, `triton.cdiv`'s value without its call wrapper:
    Triton 3.6 wraps it (and `next_power_of_2`) as a constexpr function, about 3 us a
    call on the host, and a robust quantization made 17 such calls."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), `triton.next_power_of_2`'s value
    for n >= 1, without its call wrapper (`_cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


def _row_grid(S: int, G: int, blocks: int, most: int = 16) -> tuple[tuple[int, int], int]:
    """Grid and rows per block of a (G, S, D) row kernel whose programs take `blocks`
    blocks of up to `most` rows (fewer for a short head): several where the programs
    end in one atomic per channel."""
    block = min(most, _next_pow2(S))
    return (_cdiv(S, block * blocks), G), block


# row blocks per program of the passes that record maxima: one atomic per channel per 8
# blocks of rows
CHANNEL_BLOCKS = 8


def abs_max_bits(x: torch.Tensor, per_channel: bool, out: torch.Tensor | None = None,
                 mean: torch.Tensor | None = None, sum_sq: torch.Tensor | None = None,
                 finite: bool = False) -> torch.Tensor:
    """max |x| as the int32 bits of a float32, NaN if x holds one: per head and channel
    of x (..., S, D) as (..., D) (`per_channel`), or per head as (...,); into `out`
    (int32 zeros of G * D or G elements, G the product of the leading dims) if given.
    `mean` (G * D float32): of x - mean per head and channel. `sum_sq` (G float64
    zeros): also each head's float64 sum of squares added into it. `finite`: of the
    finite values only (a NaN or Inf counting as 0), the sums of squares too."""
    x3 = _heads(x)
    G, S, D = x3.shape
    amax = torch.zeros((G, D) if per_channel else (G,), device=x.device, dtype=torch.int32) if out is None else out
    grid, block = _row_grid(S, G, CHANNEL_BLOCKS, most=32)
    none = amax  # pointer arguments the call does not read
    _abs_max_kernel[grid](x3, amax, mean if mean is not None else none, sum_sq if sum_sq is not None else none, S,
                          D=D, BLOCK_S=block, BLOCKS=CHANNEL_BLOCKS, PER_CHANNEL=per_channel,
                          HAS_MEAN=mean is not None, SUM_SQ=sum_sq is not None, FINITE=finite, num_warps=4)
    return amax.view(*x.shape[:-2], D) if per_channel else amax.view(x.shape[:-2])


def quantize_qk_fp8(x: torch.Tensor, dot_with: torch.Tensor | None = None, dtype: torch.dtype = torch.float8_e4m3fn,
                    channel_amax: bool = False):
    """Per-token FP8 of x (..., S, D): (e4m3 values as `dtype`, float8_e4m3fn or
    bfloat16; scales (..., S)); with `dot_with` (same shape) also the row sums of
    x * dot_with in float32; with `channel_amax` also max |x| per head and channel
    (..., D), as `abs_max_bits(x, per_channel=True)` (for a per-channel view of x)."""
    if dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"quantize_qk_fp8: dtype float8_e4m3fn or bfloat16, got {dtype}")
    x3 = _heads(x)
    G, S, D = x3.shape
    y = torch.empty(x3.shape, device=x.device, dtype=dtype)
    s = torch.empty((G, S), device=x.device, dtype=torch.float32)
    dot = torch.empty((G, S) if dot_with is not None else 0, device=x.device, dtype=torch.float32)
    camax = torch.zeros((G, D) if channel_amax else 0, device=x.device, dtype=torch.int32)
    other = _heads(dot_with) if dot_with is not None else x3
    blocks = CHANNEL_BLOCKS if channel_amax else 1
    grid, block = _row_grid(S, G, blocks)
    _fp8_rows_kernel[grid](x3, y, s, other, dot, camax, S, D=D, BLOCK_R=block, BLOCKS=blocks,
                           WITH_DOT=dot_with is not None, CHANNEL_AMAX=channel_amax, HW_CVT=_hw_cvt(), num_warps=4)
    out = (y.view(x.shape), s.view(x.shape[:-1]))
    if dot_with is not None:
        out += (dot.view(x.shape[:-1]),)
    if channel_amax:
        out += (camax.view(*x.shape[:-2], D),)
    return out


def quantize_k_fp8_tiles(x: torch.Tensor, tile: int, dtype: torch.dtype = torch.float8_e4m3fn):
    """FP8 of x (..., S, D) with one scale per `tile` tokens (`Recipe.k_scale="tile"`):
    (e4m3 values as `dtype`, scales (..., S), each tile's repeated per token)."""
    if dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise ValueError(f"quantize_k_fp8_tiles: dtype float8_e4m3fn or bfloat16, got {dtype}")
    x3 = _heads(x)
    G, S, D = x3.shape
    y = torch.empty(x3.shape, device=x.device, dtype=dtype)
    s = torch.empty((G, S), device=x.device, dtype=torch.float32)
    _fp8_tiles_kernel[(_cdiv(S, tile), G)](x3, y, s, S, D=D, TILE=tile, HW_CVT=_hw_cvt(), num_warps=8)
    return y.view(x.shape), s.view(x.shape[:-1])


def quantize_qk_nvfp4(x: torch.Tensor, packed: bool = False, channel_amax: bool = False, *,
                      mean: torch.Tensor | None = None, four_over_six: bool = False,
                      fallback: torch.Tensor | None = None, amax: torch.Tensor | None = None):
    """NVFP4 of x (..., S, D) along D with one tensor scale per head, that is per index
    of the leading dims (`formats.quantize_nvfp4(x, scale_dims=x.ndim - 2)`): (bf16 grid
    values without the tensor scale, the head's tensor decode scale broadcast to (...,
    S), from the head's finite values, a block holding a NaN or Inf NaN, as
    `reference.operands.quantize_qk`); with
    `packed` also the payload, (codes (..., S, D / 2) uint8, block scales (..., S, D /
    16) float8_e4m3fn), byte for byte that `quantize_nvfp4`'s data and scale; with
    `channel_amax` also max |grid value| per head and channel (..., D) as float32 bits (what `decode_nvfp4_rows(..., channels_scale=...)` needs).

    The outlier-robust forms (`reference.forward.robust_qk`): `mean` (..., 1, D) float32
    is subtracted first (K smoothing); `four_over_six` picks 4 or 6 per block; `fallback`
    (bool or int8 0/1, one per head) quantizes those heads per token to FP8 instead (inference only:
    not with `packed` or `channel_amax`). `amax`: the heads' max |x - mean| bits over
    the finite values from `abs_max_bits(..., finite=True)`, if already computed."""
    if fallback is not None and (packed or channel_amax):
        raise ValueError("quantize_qk_nvfp4: the FP8 fallback heads have no NVFP4 payload (packed, channel_amax)")
    x3 = _heads(x)
    G, S, D = x3.shape
    mean3 = mean.reshape(G * D).float().contiguous() if mean is not None else None
    # both maxima start at zero: one buffer, one fill; the channel maxima (an output)
    # first, at the buffer's aligned start
    n_camax = G * D if channel_amax else 0
    zeros = torch.zeros(n_camax + (G if amax is None else 0), device=x.device, dtype=torch.int32)
    camax = zeros[:n_camax]
    if amax is None:  # the row kernel computes the tensor scales from it
        amax = abs_max_bits(x3, per_channel=False, out=zeros[n_camax:], mean=mean3, finite=True)
    amax = amax.reshape(G).contiguous()
    y = torch.empty(x3.shape, device=x.device, dtype=torch.bfloat16)
    s_dec = torch.empty((G, S), device=x.device, dtype=torch.float32)
    codes = torch.empty((G, S, D // 2) if packed else 0, device=x.device, dtype=torch.uint8)
    bscale = torch.empty((G, S, D // 16) if packed else 0, device=x.device, dtype=torch.float8_e4m3fn)
    # the 4-or-6 pass is bound by its arithmetic's latency: several blocks a program,
    # each block's work beside the next one's load (H200, (8, 16, 4096, 128): 0.107 ->
    # 0.101 ms a tensor); the plain pass is faster with one block a program
    blocks = CHANNEL_BLOCKS if channel_amax or four_over_six else 1
    grid, block = _row_grid(S, G, blocks)
    fb = fallback.reshape(G).to(torch.int8).contiguous() if fallback is not None else amax
    _nvfp4_rows_kernel[grid](x3, y, amax, s_dec, codes, bscale, camax, mean3 if mean3 is not None else amax, fb, S,
                             D=D, BLOCK_R=block, BLOCKS=blocks, PACKED=packed, CHANNEL_AMAX=channel_amax,
                             HAS_MEAN=mean3 is not None, FOUR_OVER_SIX=four_over_six,
                             FALLBACK=fallback is not None, HW_CVT=_hw_cvt(), num_warps=4)
    out = (y.view(x.shape), s_dec.view(x.shape[:-1]))
    if packed:
        out += (codes.view(*x.shape[:-1], D // 2), bscale.view(*x.shape[:-1], D // 16))
    if channel_amax:
        out += (camax.view(*x.shape[:-2], D),)
    return out


def decode_nvfp4_rows(codes: torch.Tensor, bscale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      channels_scale: torch.Tensor | None = None, channel_amax: torch.Tensor | None = None):
    """Grid values (..., S, D) as `dtype` (bfloat16 or float32; both hold them exactly)
    of a packed NVFP4 payload (`quantize_qk_nvfp4(..., packed=True)`'s codes and block
    scales), without the tensor scale.

    With `channels_scale` (the tensor decode scales, float32, one per head: (...,) or
    (..., S) as `quantize_qk_nvfp4` returns them, whose first column is read) and
    `channel_amax` (the channels' max |grid value| per head, (..., D) float32 bits, from
    `quantize_qk_nvfp4(..., channel_amax=True)`), also the per-channel FP8 of the
    dequantized values in the same pass, as `quantize_v_t(values, "fp8",
    scale=channels_scale)` makes it: (values, e4m3 (..., D, S), scales (..., D))."""
    D = codes.shape[-1] * 2
    if bscale.shape[-1] * 16 != D or codes.dtype != torch.uint8 or bscale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"decode_nvfp4_rows: codes (..., D/2) uint8 and block scales (..., D/16) float8_e4m3fn, "
                         f"got {tuple(codes.shape)} {codes.dtype} and {tuple(bscale.shape)} {bscale.dtype}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"decode_nvfp4_rows: dtype bfloat16 or float32, got {dtype}")
    channels = channels_scale is not None
    if channels != (channel_amax is not None):
        raise ValueError("decode_nvfp4_rows: channels_scale and channel_amax go together (the per-channel view)")
    c3, b3 = _heads(codes), _heads(bscale)
    G, S, _ = c3.shape
    y = torch.empty((G, S, D), device=codes.device, dtype=dtype)
    ct = torch.empty((G, D, S) if channels else 0, device=codes.device, dtype=torch.float8_e4m3fn)
    cs = torch.empty((G, D) if channels else 0, device=codes.device, dtype=torch.float32)
    none = cs  # pointer arguments the decode alone does not read
    head_scale = _per_head(channels_scale, G, S) if channels else none
    grid, block = _row_grid(S, G, 1)
    _nvfp4_decode_kernel[grid](
        c3, b3, y, ct, cs, head_scale, channel_amax.contiguous() if channels else none,
        S, D=D, BLOCK_S=block, CHANNELS=channels, HW_CVT=_hw_cvt(), num_warps=4)
    values = y.view(*codes.shape[:-1], D)
    if not channels:
        return values
    lead = codes.shape[:-2]
    return values, ct.view(*lead, D, S), cs.view(*lead, D)


def _per_head(scale: torch.Tensor, G: int, S: int) -> torch.Tensor:
    """One float32 per head (G,) from per-head (G) or per-row (G * S, every row of a
    head the same) tensor decode scales."""
    if scale.numel() == G * S:
        scale = scale.reshape(G, S)[:, 0]
    elif scale.numel() != G:
        raise ValueError(f"tensor decode scales: one per head ({G}) or per row ({G * S}), got {tuple(scale.shape)}")
    return scale.reshape(G).float().contiguous()


# keys and warps a program of `_v_kernel` by head dim (the per-token view: 32 keys, 4
# warps; at 64 keys it took 167 registers). H100, V read once at (8, 16, 4096, 128)
# (tools/probe_v_quant.py, log/h100-v-read-once/): FP8 0.101 ms with 128 keys and 4 warps
# (154 registers), 0.116 with 64, 0.133 with 128 keys and 8 warps (a bf16 copy of V: 0.094);
# MXFP4 0.193, 0.313, 0.354; read twice, 0.126 to 0.142 (FP8) and 0.215 to 0.360 (MXFP4)
V_PROGRAM = {64: (128, 4), 128: (128, 4)}
# V read once waits on its head's blocks, so they must be resident together: a head of at
# most half a block per SM (8448 keys on 132 SMs) is safe even while up to three other
# such launches run on other streams (an SM holds two to three of these programs: a stuck
# set of launches would need each of them to hold fewer than a head's blocks)
ONE_PASS_BLOCKS_PER_SM = 0.5


def quantize_v_t(v: torch.Tensor, fmt: str, scale: torch.Tensor | None = None, pad_keys_to: int = 1,
                 channel_amax: torch.Tensor | None = None, tokens: bool = False, one_pass: bool | None = None):
    """V (B, H, S, D) as e4m3 V^T (B, H, D, S) and its per-channel scale (B, H, D): FP8 per
    channel, or MXFP4 inside its e4m3 window (`reference.operands.quantize_v`).

    `scale` (FP8 only): a float32 scalar tensor; quantize v * scale (rounded in float32,
    as the reference's dequantized NVFP4 values) without materializing the product.
    `pad_keys_to`: V^T's rows are allocated with a multiple of this many keys, zero past
    S, and V^T is returned as the (B, H, D, S) view of them: a kernel can then read
    whole key tiles without a mask, and rows start 16-byte aligned whatever S is (an
    unaligned row stride made the forward load V^T a byte at a time).
    `channel_amax` (FP8 only): max |v| per head and channel, (B, H, D) float32 bits,
    when a pass over v has recorded it (`quantize_qk_fp8(..., channel_amax=True)`);
    computed here otherwise.
    `tokens`: also the per-token FP8 of V's represented values (V^T's values times the
    scales), (B, H, S, D) e4m3 and (B, H, S): the training backward's view of V, made
    from the tile in registers instead of a pass over V^T.
    `one_pass`: whether V is read once (its statistic and values in one launch,
    `_v_kernel`) or twice (two launches; the same bytes); None: once where that is safe
    (a head of one block of a program's keys; on the GPU, of at most
    `ONE_PASS_BLOCKS_PER_SM` such blocks per SM)."""
    if (scale is not None or channel_amax is not None) and fmt != "fp8":
        raise ValueError(f"quantize_v_t: `scale` and `channel_amax` are for fmt='fp8' only, got fmt={fmt!r}")
    if not isinstance(pad_keys_to, int) or pad_keys_to < 1:
        raise ValueError(f"quantize_v_t: pad_keys_to must be a positive int (1: no padding), got {pad_keys_to!r}")
    B, H, S, D = v.shape
    G = B * H
    s_row = _cdiv(S, pad_keys_to) * pad_keys_to
    block_s, warps = (32, 4) if tokens else V_PROGRAM.get(D, (64, 4))
    n_blocks = _cdiv(s_row, block_s)
    # a head of one block never waits (and so runs under the interpreter too)
    resident = n_blocks == 1 or (_hw_cvt() and v.is_cuda and n_blocks <= ONE_PASS_BLOCKS_PER_SM * sm_count(v.device))
    if one_pass is None:
        one_pass = resident
    elif one_pass and not resident:
        raise ValueError(f"quantize_v_t: one_pass needs a head of one {block_s}-key block, or the GPU and at most "
                         f"{ONE_PASS_BLOCKS_PER_SM} such blocks a head per SM ({n_blocks} blocks a head here)")
    vc = v.contiguous()
    vt = torch.empty((B, H, D, s_row), device=v.device, dtype=torch.float8_e4m3fn)
    vs = torch.empty((B, H, D), device=v.device, dtype=torch.float32)
    y = torch.empty((B, H, S, D) if tokens else 0, device=v.device, dtype=torch.float8_e4m3fn)
    ys = torch.empty((B, H, S) if tokens else 0, device=v.device, dtype=torch.float32)
    if channel_amax is not None:  # the statistic given: the values alone
        stats = tickets = channel_amax.contiguous()  # (no tickets read)
        passes = [dict(STATS=False, QUANT=True)]
    else:
        # the statistic (FP8: G x D maxima; MXFP4: G exponents) and the one-launch form's
        # tickets and counts, in one buffer of zeros
        n_stats = G * D if fmt == "fp8" else G
        work = torch.zeros(n_stats + 1 + G, device=v.device, dtype=torch.int32)
        stats, tickets = work[:n_stats], work[n_stats:]
        if one_pass:
            passes = [dict(STATS=True, QUANT=True)]  # V read once (`_v_kernel`)
        else:
            passes = [dict(STATS=True, QUANT=False), dict(STATS=False, QUANT=True)]
    args = (vc, vt, vs, scale if scale is not None else vs, stats, y, ys, tickets, G, S, s_row)
    consts = dict(D=D, BLOCK_S=block_s, MXFP4=fmt == "mxfp4", HAS_SCALE=scale is not None, TOKENS=tokens,
                  HW_CVT=_hw_cvt(), num_warps=warps)
    for flags in passes:
        _v_kernel[(G * n_blocks,)](*args, **consts, **flags)
    out = ((vt[..., :S] if s_row > S else vt), vs)
    return out + (y, ys) if tokens else out


FUSED_ROBUST_FIELDS = ("smooth_k", "qk_four_over_six", "qk_fallback")  # what the fused quantizers apply


# rows a program of the key pass: 1024, one float64 atomic add per channel and program.
# On the H200 at (8, 16, 4096, 128) the full pass (mean, extremes, sums of squares,
# choice) took 0.086 ms with 512 rows a program, 0.072 with 1024 and 0.105 with 2048
# (too few programs); the mean alone 47 us with 256 rows, 41 us with 512 (a bf16 copy of
# K, read and write, takes 68 us)
KEY_PASS_ROWS = 1024


def _key_pass_block(S: int, D: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCKS, FOLD) of `_key_mean_kernel` for K (G, S, D) of `itemsize`
    bytes: blocks of twice the rows that one layout tile of its 4 warps covers (16-byte
    loads of D / vec threads, the other threads of a warp and the warps over rows: 8
    rows at D = 128 in bf16, 16 at D = 64), so that a block is two rows a thread, folded
    (FOLD 2) into running tiles of one; fewer rows and no fold for a short head, and no
    more blocks a program than the head has (a power of two: few builds), where a short
    head's program went through KEY_PASS_ROWS / BLOCK_S blocks, all but the first masked
    (1024 at S = 1)."""
    vec = max(1, min(16 // itemsize, D))
    tile_rows = max(1, 32 // max(1, min(32, D // vec))) * 4
    block = min(2 * tile_rows, _next_pow2(S))
    blocks = min(max(1, KEY_PASS_ROWS // block), _next_pow2(_cdiv(S, block)))
    return block, blocks, 2 if block == 2 * tile_rows else 1


def _zero_views(device: torch.device, *parts: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """Zero-filled 1-D tensors of (numel, dtype) each, views of one buffer (one fill for
    all of them), each starting 16-byte aligned (as the JIT specializes pointers)."""
    starts, n = [], 0
    for numel, dtype in parts:
        starts.append(n)
        n += -(-numel * dtype.itemsize // 16) * 16
    buf = torch.zeros(max(n // 8, 2), device=device, dtype=torch.int64).view(torch.uint8)
    return [buf[o:o + numel * dtype.itemsize].view(dtype) for o, (numel, dtype) in zip(starts, parts)]


def key_mean(k: torch.Tensor, amax: bool = False):
    """`robust.key_mean` of k (..., S, D) on the GPU, bit for bit, as float32 (..., 1, D):
    one pass over k (bf16, fp16 or fp32) with float64 sums per head and channel
    (`_key_mean_kernel`; no float64 copy of k). With `amax` also, from the same pass,
    each head's max |k - mean| (`robust.smooth`) as float32 bits (...,), what
    `quantize_qk_nvfp4(k, mean=..., amax=...)` takes: (mean, amax)."""
    x3 = _heads(k)
    G, S, D = x3.shape
    mean, amax_bits = _key_pass(x3, amax)
    mean = mean.view(*k.shape[:-2], 1, D)
    return (mean, amax_bits.view(k.shape[:-2])) if amax else mean


def _key_pass_work(G: int, D: int, stats: bool, choice: bool) -> list[tuple[int, torch.dtype]]:
    """The zero-filled buffers of `_key_pass` for G heads of D channels, as `_zero_views`
    parts: float64 sums and sums of squares, the channels' extremes, the counts."""
    return [(G * D, torch.float64), (G * D if choice else 0, torch.float64), (2 * G * D if stats else 0, torch.int32),
            (G, torch.int32)]


def _key_pass(x3: torch.Tensor, stats: bool, choice: dict | None = None,
              work: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one pass over K (G, S, D) of `_key_mean_kernel`: its mean (G, D) and, with
    `stats`, its heads' max |k - mean| bits (G,) (else an empty tensor); `choice`: the
    kernel's fallback arguments (SQ_Q, FB_Q, FB_K, S_Q, GROUP, GROUP_P2, SCALE, LIMIT),
    for the last program of each head to make the Q/K fallback choice. `work`: the
    zero-filled buffers (`_key_pass_work`) if the caller has them."""
    G, S, D = x3.shape
    if work is None:
        work = _zero_views(x3.device, *_key_pass_work(G, D, stats, choice is not None))
    sums, sums_sq, ext, count = work
    i32 = torch.int32
    mean = torch.empty((G, D), device=x3.device, dtype=torch.float32)
    amax = torch.empty(G if stats else 0, device=x3.device, dtype=i32)
    block, blocks, fold = _key_pass_block(S, D, x3.element_size())
    grid = (_cdiv(S, block * blocks), G)
    _key_mean_kernel[grid](x3, sums, count, mean, S, D=D, BLOCK_S=block, BLOCKS=blocks, HW_CVT=_hw_cvt(),
                           FOLD=fold, STATS=stats, EXT=ext if stats else sums, AMAX=amax if stats else sums,
                           CHOICE=choice is not None, SUMSQ=sums_sq if choice else sums,
                           **(choice or {}), num_warps=4)
    return mean, amax


def robust_qk_operands(q: torch.Tensor, k: torch.Tensor, recipe: Recipe, scale: float | None,
                       head_dim: int | None = None):
    """NVFP4 Q and K of a recipe with fused robust fields (FUSED_ROBUST_FIELDS), as
    `reference.forward.robust_qk` computes them: (qv, qs, kv, ks), the kernel's layouts,
    and the (B, Hkv) heads that took the FP8 fallback (None without it). `head_dim`: the
    caller's head dim where q and k are zero-padded to the kernel's (`routing.kernel_head_dim`):
    the fallback's statistic divides by it, as the reference of the unpadded inputs does.

    With `smooth_k`, two reads of K: one pass (`_key_pass`) makes its mean, the maximum
    of K - mean (from each channel's largest and smallest key) and, under
    `qk_fallback`, its sums of squares (`robust.smoothed_sum_sq`), and the last program
    of each K head makes the fallback choice from them and Q's sums of squares (the pass
    over Q that makes Q's maximum runs first); then the quantizing pass. Without
    `smooth_k` the maxima (and sums of squares) of Q and K are passes of
    `_abs_max_kernel`, the K one making the choice."""
    if recipe.qk != "nvfp4":
        raise ValueError(f"robust_qk_operands: the fused robust quantizers are NVFP4's, got qk={recipe.qk!r}")
    choice = recipe.qk_fallback is not None
    if choice and scale is None:
        raise ValueError("robust_qk_operands: qk_fallback needs the softmax scale")
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if head_dim is not None and not 0 < head_dim <= D:
        raise ValueError(f"robust_qk_operands: head_dim={head_dim} for inputs padded to {D} channels; accepted: "
                         f"1 to {D}")
    Gq, Gk = B * H, B * Hkv
    f64, i32 = torch.float64, torch.int32
    smooth = recipe.smooth_k
    # every sum, maximum and count of the call in one fill
    key_work = _key_pass_work(Gk, D, True, choice) if smooth else []
    zeros = _zero_views(q.device, (Gq if choice else 0, f64), (Gq, i32), (Gk if choice and not smooth else 0, f64),
                        (0 if smooth else Gk, i32), (Gk if choice and not smooth else 0, i32), *key_work)
    sq_q, amax_q, sq_k, amax_k, count = zeros[:5]
    abs_max_bits(q, per_channel=False, out=amax_q, sum_sq=sq_q if choice else None, finite=True)
    fb_q = fb_k = mean = None
    if choice:
        fb = torch.empty(Gq + Gk, device=q.device, dtype=torch.int8)
        fb_q, fb_k = fb[:Gq], fb[Gq:]
        group = H // Hkv
        args = dict(SQ_Q=sq_q, FB_Q=fb_q, FB_K=fb_k, S_Q=Sq, D_STAT=head_dim or D, GROUP=group,
                    GROUP_P2=_next_pow2(group), SCALE=float(scale),
                    LIMIT=float(recipe.qk_fallback_logit_std))
    k3 = _heads(k)
    if smooth:
        mean, amax_k = _key_pass(k3, True, args if choice else None, zeros[5:])
        mean = mean.view(B, Hkv, 1, D)
    elif choice:
        grid, block = _row_grid(Sk, Gk, CHANNEL_BLOCKS, most=32)
        _abs_max_kernel[grid](k3, amax_k, amax_k, sq_k, Sk, D=D, BLOCK_S=block, BLOCKS=CHANNEL_BLOCKS,
                              PER_CHANNEL=False, HAS_MEAN=False, SUM_SQ=True, CHOICE=True, COUNT=count,
                              FINITE=True, **args, num_warps=4)
    else:
        abs_max_bits(k3, per_channel=False, out=amax_k, finite=True)
    f46 = recipe.qk_four_over_six
    qv, qs = quantize_qk_nvfp4(q, four_over_six=f46, fallback=fb_q, amax=amax_q)
    kv, ks = quantize_qk_nvfp4(k, mean=mean, four_over_six=f46, fallback=fb_k, amax=amax_k)
    return qv, qs, kv, ks, (fb_k.view(torch.bool).view(B, Hkv) if choice else None)


def prepare_operands_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe,
                           scale: float | None = None, head_dim: int | None = None) -> KernelOperands:
    """The same tensors as `operands.prepare_operands`, from fused kernels; for a recipe
    with outlier-robust fields (only FUSED_ROBUST_FIELDS; `qk_fallback` needs the softmax
    `scale`, and for zero-padded inputs the caller's `head_dim`: `robust_qk_operands`)
    those of `reference.forward.robust_qk`. `Recipe.p_sink` is the forward's (P_MODE 3);
    the other robust fields are refused, never dropped."""
    other = [f for f in ("rotate_qk", "smooth_v") if getattr(recipe, f)]
    if other:
        raise ValueError(f"prepare_operands_fused: {', '.join(other)} are not applied by the fused quantizers")
    if any(getattr(recipe, f) not in (False, None) for f in FUSED_ROBUST_FIELDS):
        qv, qs, kv, ks, _ = robust_qk_operands(q, k, recipe, scale, head_dim)
        vt, vs = quantize_v_t(v, recipe.v, pad_keys_to=BLOCK_N)
        return KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True)
    if recipe.qk == "fp8":
        qk = functools.partial(quantize_qk_fp8, dtype=qk_dtype(recipe))
    else:
        qk = quantize_qk_nvfp4
    qv, qs = qk(q)
    tiles = recipe.k_scale == "tile"
    kv, ks = quantize_k_fp8_tiles(k, BLOCK_N, qk_dtype(recipe)) if tiles else qk(k)
    vt, vs = quantize_v_t(v, recipe.v, pad_keys_to=BLOCK_N)
    return KernelOperands(qv, kv, qs, ks, vt, vs, vt_keys_padded=True, k_tile_scales=tiles)
