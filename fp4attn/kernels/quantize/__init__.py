"""The operand quantizers: Triton passes that turn bf16, fp16 or fp32 Q, K, V (and dO) into
the attention kernels' operands, bit for bit the reference's (`fp4attn.reference.operands`
over `fp4attn.formats`; the tests compare them with `torch.equal`). Plain Triton (the e4m3
conversion aside, sm_89 and later), shared by every architecture's kernels:

    elements.py    element arithmetic: e4m3, bf16 and E2M1 rounding, E2M1 codes, powers of two
    rows.py        what every pass shares: row blocks of one head, per-channel maxima, grids
    statistics.py  the reductions before a quantizing pass: max |x|, K's mean and extremes,
                   the Q/K FP8 fallback choice
    fp8.py         FP8 e4m3 Q/K per token or per key tile, FP8 channel scales
    nvfp4.py       NVFP4 Q/K (4-or-6 blocks, smoothed K, FP8 fallback heads), the payload's decode
    mxfp4.py       MXFP4's block exponent
    v_operand.py   V^T: FP8 per channel or MXFP4 inside its e4m3 window, V read once
    robust.py      outlier-robust NVFP4 Q/K: the statistics' passes, then the quantizing ones
    fp8_train.py   train-fp8's per-token Q/K as the forward keeps them, and the backward's views

The Hopper forward's operands are assembled from these by
`kernels.hopper.operands.prepare_operands_fused`.

One pass over each operand follows the reductions its scales need: max |x| of each head
(NVFP4 Q/K: one tensor scale per (batch, head), so no item's values move another's codes)
or of each head's channels (FP8 V, dO) by `statistics._abs_max_kernel`, or fused into a
pass that reads the operand anyway (`channel_amax=True`; smoothed K's from its channels'
extremes in the pass that makes its mean, `statistics._key_mean_kernel`), from which the
kernels compute the scales themselves; MXFP4 V's head maximum of block exponents
(`v_operand._v_kernel`, which reads V once). Every kernel works on (heads, S, D) tiles of
one head, so per-channel maxima are one atomic max per channel and program, and nothing
here waits for the GPU.

Maxima are kept as the int32 bits of |x| in float32: non-negative floats order as their
bits, NaN above +Inf, so `tl.atomic_max` over them is max |x| with NaN propagating,
`x.float().abs().max()` exactly, in any program order. The forward's statistics (NVFP4
Q/K's tensor amax, the robust means, extremes and sums, FP8 V's channel maxima, FP8 K's
tile maxima) are taken over the finite values (a NaN or Inf counting as 0), and a NaN or
Inf spoils only its own scale block or element (`reference.forward`, "Non-finite
values").

Divisions are `div_rn` (IEEE, as torch's tensor division), and values are rounded to the
e4m3 / E2M1 grids by explicit arithmetic before the final, exact cast.
"""
