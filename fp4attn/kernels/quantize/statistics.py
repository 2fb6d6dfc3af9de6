"""The reductions a quantizing pass needs first, all over the finite values (a NaN or Inf
counts as 0: `reference.forward`, "Non-finite values"):

- max |x| per head, or per head and channel (`_abs_max_kernel`, `abs_max_bits`): NVFP4's
  tensor amax (`formats.nvfp4.quantize_nvfp4`), FP8's channel maxima
  (`formats.fp8.fp8_scales`), with each head's sum of squares where the FP8 fallback
  needs it (`reference.robust.logit_std`);
- K's mean over the keys, and from the same pass the maximum of K - mean and the
  smoothed sums of squares (`_key_mean_kernel`, `key_mean`: `reference.robust.key_mean`,
  `smooth`, `smoothed_sum_sq`, `pairwise_sum`);
- the Q/K FP8 fallback choice, made by the last program of each K head from the
  finished sums (`_fallback_choice`: `reference.forward.robust_qk`,
  `reference.robust.logit_std_of_sums`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4attn.kernels.quantize.elements import _abs_bits, _hw_cvt, _round_bf16
from fp4attn.kernels.quantize.rows import (
    CHANNEL_BLOCKS,
    _block_rows,
    _cdiv,
    _channel_amax_flush,
    _heads,
    _last_program_of_head,
    _next_pow2,
    _row_block,
    _row_grid,
    _zero_views,
)


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


def abs_max_bits(x: torch.Tensor, per_channel: bool, out: torch.Tensor | None = None,
                 mean: torch.Tensor | None = None, sum_sq: torch.Tensor | None = None,
                 finite: bool = False, choice: dict | None = None) -> torch.Tensor:
    """max |x| as the int32 bits of a float32, NaN if x holds one: per head and channel
    of x (..., S, D) as (..., D) (`per_channel`), or per head as (...,); into `out`
    (int32 zeros of G * D or G elements, G the product of the leading dims) if given.
    `mean` (G * D float32): of x - mean per head and channel. `sum_sq` (G float64
    zeros): also each head's float64 sum of squares added into it. `finite`: of the
    finite values only (a NaN or Inf counting as 0), the sums of squares too.
    `choice` (with `sum_sq`, per head): the kernel's fallback arguments (COUNT, SQ_Q,
    FB_Q, FB_K, S_Q, D_STAT, GROUP, GROUP_P2, SCALE, LIMIT), for the last program of
    each head to make the Q/K fallback choice from the finished sums (`_fallback_choice`)."""
    x3 = _heads(x)
    G, S, D = x3.shape
    amax = torch.zeros((G, D) if per_channel else (G,), device=x.device, dtype=torch.int32) if out is None else out
    grid, block = _row_grid(S, G, CHANNEL_BLOCKS, most=32)
    none = amax  # pointer arguments the call does not read
    _abs_max_kernel[grid](x3, amax, mean if mean is not None else none, sum_sq if sum_sq is not None else none, S,
                          D=D, BLOCK_S=block, BLOCKS=CHANNEL_BLOCKS, PER_CHANNEL=per_channel,
                          HAS_MEAN=mean is not None, SUM_SQ=sum_sq is not None, FINITE=finite,
                          **(dict(CHOICE=True, **choice) if choice else {}), num_warps=4)
    return amax.view(*x.shape[:-2], D) if per_channel else amax.view(x.shape[:-2])


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
