"""The Hopper Triton forward and its fused quantizers under the Triton interpreter (CPU):
a NaN or Inf reaches the rows the reference says (tests/reference/test_nan_rows.py), and every
other entry is bit for bit the kernel's output on the same inputs with a 0 in its place
(the statistics are the finite values'):

- in q or k: exactly the reference's rows, output and LSE;
- in v: the reference's entries (channel c of the rows that attend to its key, or to a
  key of its MXFP4 block), and besides them only channel c of rows of the query tiles
  that read its key tile: a kernel multiplies a masked key's P, 0, by V's NaN there
  (as SDPA's own kernels do); the LSE is untouched.

The quantizers of the preset families: NVFP4 Q/K, per-token FP8 Q (e4m3 products), FP8 K
per tile, FP8 and MXFP4 V, the robust presets' fused statistics; not causal and causal in
both alignments, GQA (every preset on the reference: tests/reference/test_nan_rows.py). The GPU test is
tests/reference/test_nan_rows.py's test_nonfinite_rows_on_the_gpu."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

SCRIPT = KERNEL_PATCHES + textwrap.dedent('''
    import math
    import sys

    import torch

    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.routing import ForwardLaunch, override_launch, p_mode, p_sink_tiles

    B, HQ, HKV, SQ, SK, D = 1, 2, 1, 100, 160, 64
    SCALE, BLOCK_M, KEY_TILE = 0.125, 64, 128

    def run(q, k, v, r, offset):
        ops = prepare_operands_fused(q, k, v, r, scale=SCALE)
        with override_launch(forward=ForwardLaunch(BLOCK_M, 4, 2)):
            out, lse, _ = launch_forward(ops, scale=SCALE, causal_offset=offset, p_mode=p_mode(r),
                                         sink_tiles=p_sink_tiles(r))
        return out.float(), lse

    def bits(t):
        return t.contiguous().view(torch.int32)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, SQ, D, generator=g).bfloat16()
    k, v = (torch.randn(B, HKV, SK, D, generator=g).bfloat16() for _ in range(2))
    POS = {"q": (0, 1, 30, 5), "k": (0, 0, 40, 9), "v": (0, 0, 140, 33)}
    for where, pos in POS.items():  # zeros there: the unspoiled run is the base of every case
        {"q": q, "k": k, "v": v}[where][pos] = 0.0
    r = PRESETS[RECIPE]
    for causal, offset in ((None, None), ("top_left", 0), ("bottom_right", SK - SQ)):
        base, base_lse = run(q, k, v, r, offset)
        for where, value in (("q", math.nan), ("q", math.inf), ("k", -math.inf), ("k", math.nan),
                             ("v", math.inf), ("v", math.nan)):
            case = (RECIPE, causal, where, value)
            args = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
            args[where][POS[where]] = value
            out, lse = run(args["q"], args["k"], args["v"], r, offset)
            ref = reference_forward(args["q"], args["k"], args["v"], r, scale=SCALE, causal=causal)
            want, want_lse = torch.isnan(ref.out), torch.isnan(ref.lse)
            got, got_lse = torch.isnan(out), torch.isnan(lse)
            # (key 140 is past every row's keys top-left: then nothing may be NaN)
            assert bool(want.any()) or (where, causal) == ("v", "top_left"), case
            if where == "v":
                c, j0 = POS["v"][3], POS["v"][2] // KEY_TILE * KEY_TILE
                i, j = torch.arange(SQ)[:, None], torch.arange(j0, j0 + KEY_TILE)[None, :]
                vis = (j < SK) & (True if offset is None else j <= i + offset)
                reads = torch.stack([vis[m:m + BLOCK_M].any() for m in range(0, SQ, BLOCK_M)])
                allowed = reads.repeat_interleave(BLOCK_M)[:SQ]  # rows whose query tile reads the key tile
                extra = got & ~want
                assert bool((got | ~want).all()), case
                assert not extra[..., :c].any() and not extra[..., c + 1:].any(), case
                assert not extra[..., ~allowed, :].any() and not got_lse.any(), case
            else:
                assert torch.equal(got, want) and torch.equal(got_lse, want_lse), case
            assert torch.equal(bits(out)[~got], bits(base)[~got]), case
            assert torch.equal(bits(lse)[~got_lse], bits(base_lse)[~got_lse]), case
    print("ok")
''')


@pytest.mark.parametrize("recipe", ["nvfp4-fp8", "directp", "fp8-ktile-affine-lazy-fastacc", "nvfp4-fp8-robust"])
def test_nonfinite_rows_under_the_interpreter(recipe):
    run_under_interpreter(f"RECIPE = {recipe!r}\n" + SCRIPT, timeout=900)
