"""The Hopper Triton forward and its fused quantizers under the Triton interpreter (CPU):
NaN and Inf propagate as the reference defines (reference/forward.py, "Non-finite
values": the NaN rows of the kernel's output and LSE are the reference's), and a batch
item's operands and output are bit-identical whatever the other items hold. The GPU
tests of the same rules are in test_forward.py / tests/kernels/test_quantize.py."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.interpreter

SCRIPT = KERNEL_PATCHES + textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn.routing import P_MODES
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.routing import ForwardLaunch, override_launch

    def run(q, k, v, r, causal, p_mode=None):
        ops = prepare_operands_fused(q, k, v, r)
        ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())  # the interpreter's bf16 dot is wrong
        with override_launch(forward=ForwardLaunch(64, 4, 2)):
            return ops, launch_forward(ops, scale=0.125, causal_offset=0 if causal else None,
                                       p_mode=P_MODES[(r.p, r.p_build)] if p_mode is None else p_mode)[:2]

    def bits(t):
        return t.contiguous().view(torch.uint8)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 64, generator=g).bfloat16() for _ in range(3))
    # NVFP4 Q/K (a NaN or Inf makes the head's tensor scale NaN) and FP8 Q/K with
    # Direct-P (a NaN key's scores alone are NaN: the row max must carry them)
    cases = {"nvfp4-fp8": (("q", float("nan")), ("q", float("inf")), ("q", 3e38)),
             "fp8-directp": (("k", float("nan")), ("q", 3e38))}
    for name, changes in cases.items():
        r = PRESETS[name]
        _, (base, base_lse) = run(q, k, v, r, False)
        for where, value in changes:
            args = {"q": q.clone(), "k": k.clone(), "v": v}
            if value == 3e38:
                args["q"][1, 0, 9] = value  # its scores overflow float32
            else:
                args[where][1, 0, 9, 5] = value
            _, (out, lse) = run(args["q"], args["k"], args["v"], r, False)
            ref = reference_forward(args["q"], args["k"], args["v"], r, scale=0.125)
            want_nan = torch.isnan(ref.out).any(-1)
            assert bool(want_nan[1, 0, 9]), (name, where, value)
            assert torch.equal(torch.isnan(out.float()).any(-1), want_nan), (name, where, value)
            assert torch.equal(torch.isnan(lse), torch.isnan(ref.lse)), (name, where, value)
            other = torch.ones(2, 2, dtype=torch.bool)
            other[1, 0] = False
            assert torch.equal(bits(out[other]), bits(base[other])), (name, where, value)

    # isolation of the fused quantizers: item 0's operands, whatever item 1 holds
    for name in ("nvfp4-fp8", "fp8-directp"):
        r = PRESETS[name]
        ops0, _ = run(q, k, v, r, True)
        q1, k1, v1 = q.clone(), k.clone(), v.clone()
        for t in (q1, k1, v1):
            t[1] *= 300.0
            t[1, 1, 3, 7] = float("nan")
        ops1, _ = run(q1, k1, v1, r, True)
        for f in ("q", "k", "qs", "ks", "vt", "vs"):
            assert torch.equal(bits(getattr(ops0, f)[0]), bits(getattr(ops1, f)[0])), (name, f)

    # Direct-P with the blocks' top keys apart (P_MODE 3, Recipe.p_sink): the reference's
    # P codes, so its LSE within float32 summation order, on rows with a sink key
    r = PRESETS["directp"].with_(p_sink=True)
    qs, ks, vs = (t.clone() for t in (q, k, v))
    ks[:, :, 3] = qs[:, :, :].mean(2) * 6.0  # key 3 takes most of every row's probability
    _, (out, lse) = run(qs, ks, vs, r, False, p_mode=3)
    ref = reference_forward(qs, ks, vs, r, scale=0.125)
    assert float((lse - ref.lse).abs().max()) < 1e-4, float((lse - ref.lse).abs().max())
    err = float((out.float() - ref.out).norm() / ref.out.norm())
    assert err < 1e-2, err
    print("ok")
''')


def test_nan_and_isolation_under_the_interpreter():
    run_under_interpreter(SCRIPT)
