"""The forward kernel under the Triton interpreter (CPU): indexing across batches, heads
and GQA groups, as tests/test_backward_interpreter.py checks the backward. The output
and LSE of a (B=2, 4 query heads, 2 K/V heads) call equal, bit for bit, those of the
same operands cut into one call per batch and K/V head, with K and V^T by pointer loads
and by TMA, PV added by Triton's promotion and in float32, causal and not, lengths that
are and are not whole tiles, and each kind of P. The interpreter's values are not the
GPU's (its bf16 dot and fp8 casts differ), so the numbers are checked by the GPU tests
(test_hopper_forward.py); this one runs in CI."""

import textwrap

import pytest

from tests.interpreter import CALL_SHAPE, KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

SCRIPT = KERNEL_PATCHES + CALL_SHAPE + textwrap.dedent('''
    import dataclasses

    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import BLOCK_N, prepare_operands_fused
    from fp4attn.kernels.quantize.v_operand import quantize_v_t
    from fp4attn.recipes import PRESETS
    from fp4attn.routing import P_MODES, ForwardLaunch, override_launch

    # the Triton kernel with pointer loads, and with TMA and PV added in float32 (the
    # formulations the interpreter runs: e4m3 by bit arithmetic, no Gluon), taking turns
    # over the cases so that each meets both head dims and both maskings; the Q/K forms
    # (bf16 values of NVFP4 or FP8, e4m3 for fast accumulation) and P's (FP8, Direct-P)
    LAUNCHES = (ForwardLaunch(64, 4, 2), ForwardLaunch(64, 4, 2, tma_kv=True, pv_add=True))

    for i, (recipe, D, sq, sk, causal) in enumerate((
            ("fp8", 64, 128, 256, True), ("nvfp4-fp8", 128, 100, 200, False), ("directp", 128, 128, 128, True),
            ("fp8-fastacc", 64, 128, 130, True))):
        r = PRESETS[recipe]
        q = torch.randn(B, HQ, sq, D, generator=g).bfloat16()
        k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
        ops = prepare_operands_fused(q, k, v, r)
        if ops.q.dtype == torch.bfloat16:  # the interpreter's bf16 dot is wrong; float32 holds the same values
            ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())
        for launch in LAUNCHES[i % 2:i % 2 + 1]:
            def run(o):
                with override_launch(forward=launch):
                    return launch_forward(o, scale=D**-0.5, causal_offset=sk - sq if causal else None,
                                          p_mode=P_MODES[(r.p, r.p_build)])[:2]
            out, lse = run(ops)
            assert bool(torch.isfinite(out.float()).all()), (recipe, launch)
            for b in range(B):
                for h in range(HKV):
                    hq = slice(h * HQ // HKV, (h + 1) * HQ // HKV)
                    # V^T quantized per head gives the same values, in rows padded as the kernel reads them
                    vt, vs = quantize_v_t(v[b:b + 1, h:h + 1], r.v, pad_keys_to=BLOCK_N)
                    part = dataclasses.replace(
                        ops, q=ops.q[b:b + 1, hq].contiguous(), qs=ops.qs[b:b + 1, hq].contiguous(),
                        k=ops.k[b:b + 1, h:h + 1].contiguous(), ks=ops.ks[b:b + 1, h:h + 1].contiguous(),
                        vt=vt, vs=vs)
                    assert equal(vt.float(), ops.vt[b:b + 1, h:h + 1].float()), (recipe, "V^T per head")
                    o, l = run(part)
                    assert equal(out[b:b + 1, hq].float(), o.float()), (recipe, launch, "out", b, h)
                    assert equal(lse[b:b + 1, hq], l), (recipe, launch, "lse", b, h)
    print("ok")
''')


def test_forward_programs_read_their_own_batch_and_heads():
    run_under_interpreter(SCRIPT)


NUMERICS = KERNEL_PATCHES + textwrap.dedent('''
    import dataclasses
    import os
    import torch
    from fp4attn.routing import p_mode as p_mode_of
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.routing import ForwardLaunch, override_launch

    # the Triton kernel with pointer loads, and with TMA and PV added in float32 (the
    # formulations the interpreter runs: e4m3 by bit arithmetic, no Gluon)
    LAUNCHES = (ForwardLaunch(64, 4, 2), ForwardLaunch(64, 4, 2, tma_kv=True, pv_add=True))
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.metrics import error_metrics
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.masks import causal_offset

    g = torch.Generator().manual_seed(0)
    for launch in LAUNCHES:
        for name, D, sq, sk, causal in (("fp8", 64, 128, 256, "top_left"), ("nvfp4-fp8", 128, 100, 200, None),
                                        ("fp8-directp", 64, 64, 256, None),
                                        ("directp", 128, 128, 128, "bottom_right"),
                                        ("fp8-fastacc", 64, 128, 130, "top_left"),
                                        # the affine builders (P modes 4 and 5)
                                        ("fp8-affine", 128, 100, 200, "bottom_right"),
                                        ("fp8-ktile-affine-fastacc", 64, 128, 300, None),
                                        ("fp8-ktile-affine-lazy-fastacc", 64, 100, 400, "bottom_right"),
                                        ("directp-fast", 64, 128, 256, None)):
            r = PRESETS[name]
            q = torch.randn(1, 2, sq, D, generator=g).bfloat16()
            k, v = (torch.randn(1, 1, sk, D, generator=g).bfloat16() for _ in range(2))
            # the interpreter sums the e4m3 products in float32: the exact form's numbers
            exact = dataclasses.replace(r, fast_accum=False)
            ref = reference_forward(q, k, v, exact, scale=D**-0.5, causal=causal)
            ops = prepare_operands_fused(q, k, v, r)
            if ops.q.dtype == torch.bfloat16:
                ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())
            with override_launch(forward=launch):
                out, lse = launch_forward(ops, scale=D**-0.5, causal_offset=causal_offset(causal, sq, sk),
                                          p_mode=p_mode_of(r))[:2]
            seen = torch.isfinite(ref.lse)
            assert torch.equal(seen, torch.isfinite(lse)), (launch, name)
            lse_err = (lse[seen] - ref.lse[seen]).abs()
            out_err = error_metrics(out.float(), ref.out)["rel_l2"]
            # measured: every row within 1.4e-6, output 3.3e-3. A score that float32
            # summation order moves across a rounding threshold of P changes one code
            # and its row's LSE by up to about 0.1: a few such rows are allowed
            close = float((lse_err < 1e-5).float().mean())
            worst = float(lse_err.max())
            assert close > 0.99 and worst < 0.2 and out_err < 2e-2, (launch, name, close, worst, out_err)
    print("ok")
''')


def test_forward_matches_reference_under_the_interpreter():
    """The kernel's LSE and output against the reference forward of the same recipe, on
    the CPU: with FP8 P rounded on the float32 bits (`p_hw_cvt` 0) and the bf16 Q/K
    values handed over as float32, the interpreter computes the recipe's own P, so the
    LSE (the consistent row sums of P) agrees within 1.4e-6 on every row (bounds leave
    room for a code moved by summation order). The output is stored in bf16, which the
    interpreter rounds its own way (3.3e-3 relative to the float32 reference). A wrong
    scale, mask or tile bound shows at once."""
    run_under_interpreter(NUMERICS)
