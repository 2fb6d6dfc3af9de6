"""The training backward kernels under the Triton interpreter (CPU): indexing across
batches, heads and GQA groups. Each program reads only its own batch, head and rows,
so the gradients of a (B=2, 4 query heads, 2 K/V heads) call equal, bit for bit, those
of the same operands cut into one call per batch and K/V head; a kernel that reads
another batch's or head's rows (as a scale once shadowing the batch index did) breaks
that. Run for pointer loads and TMA descriptors, causal and not, lengths that are and
are not whole tiles, both head dims, dQ by atomics, and FP8 and MXFP4 (Direct-P) P.
The interpreter's values are not the GPU's (its bf16 dot and fp8 casts differ), so the
numbers are checked by the GPU tests (test_hopper_backward.py); this one runs in CI."""

import textwrap

import pytest

from tests.interpreter import CALL_SHAPE, KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

SCRIPT = KERNEL_PATCHES + CALL_SHAPE + textwrap.dedent('''
    import dataclasses

    from fp4attn import routing
    from fp4attn.kernels.hopper import train_op

    kv_names = ("k", "ks", "v_t", "v_ts", "k_c", "k_cs")  # the operands of the K/V heads
    fp8, mxfp4 = ("fp8", "exp2", "fp8"), ("mxfp4", "directp", "mxfp4")  # train, train-mxfp4pv
    for D, sq, sk, causal, cfg, (p, p_build, v_fmt) in (
            (64, 128, 128, True, {}, fp8), (64, 128, 192, False, {}, fp8), (64, 100, 76, True, {}, fp8),
            (128, 128, 128, True, {}, fp8),
            (128, 128, 128, True, {}, mxfp4)):
        for tma in (False, True):
            # the Triton kernels (the Gluon ones do not run under the interpreter; a GPU
            # test holds them to the Triton ones bit for bit)
            routing.BACKWARD_LAUNCH[D] = dataclasses.replace(routing.BACKWARD_LAUNCH[D], tma=tma,
                                                             dkdv_gluon=False, dq_gluon=False, **cfg)
            q, dout, out = (torch.randn(B, HQ, sq, D, generator=g).bfloat16() for _ in range(3))
            k, v = (torch.randn(B, HKV, sk, D, generator=g).bfloat16() for _ in range(2))
            _, saved = train_op.quantize_for_training(q, k, v, v_fmt)
            # grid values in float32: the interpreter's bf16 dot is wrong, float32 holds them
            ops = train_op.backward_operands(dout, out, *saved, values_dtype=torch.float32)
            qd, kd = ops.q * ops.qs[..., None, None], ops.k * ops.ks[..., None, None]  # a tensor scale per head
            s = qd @ kd.repeat_interleave(HQ // HKV, 1).transpose(-1, -2) * D**-0.5
            if causal:
                s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
            lse = torch.logsumexp(s, -1)  # the LSE a forward would have saved

            def grads(bs, gs):
                # the operands of batch entries bs and K/V heads gs (their query heads hq)
                hq = slice(gs.start * HQ // HKV, gs.stop * HQ // HKV)
                heads = {name: t[bs, gs if name in kv_names else hq].contiguous() for name, t in ops._asdict().items()}
                return train_op.launch_backward(train_op.BackwardOperands(**heads), lse[bs, hq].contiguous(), p,
                                                p_build, sk - sq, causal, D**-0.5, (torch.float32,) * 3)

            whole = grads(slice(0, B), slice(0, HKV))
            assert all(bool(torch.isfinite(t).all()) and bool(t.abs().sum() > 0) for t in whole), (D, sq, sk)
            for b in range(B):
                for h in range(HKV):
                    part = grads(slice(b, b + 1), slice(h, h + 1))
                    hq = slice(h * HQ // HKV, (h + 1) * HQ // HKV)
                    for name, w, got in zip(("dq", "dk", "dv"), whole, part):
                        sub = w[b:b + 1, hq] if name == "dq" else w[b:b + 1, h:h + 1]
                        assert equal(sub, got), (D, sq, sk, causal, cfg, p, tma, name, b, h)
    print("ok")
''')


def test_backward_programs_read_their_own_batch_and_heads():
    run_under_interpreter(SCRIPT)


NUMERICS = KERNEL_PATCHES + textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn import routing
    from fp4attn.kernels.hopper import train_op
    from fp4attn.metrics import error_metrics
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.reference.backward import reference_backward
    from fp4attn.reference.masks import causal_offset

    g = torch.Generator().manual_seed(0)
    for name, D, sq, sk, causal, tma in (("train", 64, 128, 128, "top_left", True),
                                         ("train-mxfp4pv", 64, 100, 192, None, False),
                                         ("train", 128, 128, 64, "bottom_right", True),
                                         ("train", 128, 113, 239, "top_left", False)):
        r = PRESETS[name]
        q, dout = (torch.randn(1, 2, sq, D, generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(1, 1, sk, D, generator=g).bfloat16() for _ in range(2))
        fwd = reference_forward(q, k, v, r, scale=D**-0.5, causal=causal)
        out = fwd.out.bfloat16()
        want = reference_backward(fwd, out, dout, r, scale=D**-0.5, causal=causal)
        _, saved = train_op.quantize_for_training(q, k, v, r.v)
        # e4m3 by bit arithmetic: every value on its grid before the cast, which the
        # interpreter then does exactly (its own rounding of off-grid values is wrong)
        routing.BACKWARD_LAUNCH[D] = dataclasses.replace(routing.BACKWARD_LAUNCH[D], hw_cvt=False, tma=tma,
                                                         dkdv_gluon=False, dq_gluon=False)
        ops = train_op.backward_operands(dout, out, *saved, values_dtype=torch.float32)
        got = train_op.launch_backward(ops, fwd.lse, r.p, r.p_build, causal_offset(causal, sq, sk) or 0,
                                       causal is not None, D**-0.5, (torch.float32,) * 3)
        for grad, a, b in zip(("dq", "dk", "dv"), got, want):
            err = error_metrics(a, b)["rel_l2"]
            # measured 2e-7 to 4e-7; an FP8 code of P or dS that float32 summation order
            # moves across a rounding threshold changes one element by up to 1/8
            assert err < 2e-2, (name, D, sq, sk, causal, grad, err)
    print("ok")
''')


def test_backward_matches_reference_under_the_interpreter():
    """The kernels' gradients against the reference backward of the same recipe, on the
    CPU: with the e4m3 rounding done on the float32 bits (`hw_cvt=False`) and the bf16
    Q/K values handed over as float32, the interpreter computes the recipe's own values,
    and the gradients differ from the reference's by float32 summation order (2e-7 to
    4e-7 relative). A wrong scale, mask or tile bound shows at once."""
    run_under_interpreter(NUMERICS)
