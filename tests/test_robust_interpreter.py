"""The fused Hopper quantizers of the outlier-robust recipes under the Triton interpreter
(CPU): K smoothing, 4-or-6 NVFP4 block scales and the per-(batch, KV head) FP8 fallback
give the Q/K values and row scales of `reference.forward.robust_qk` bit for bit (the
same numbers on the GPU: test_robust_hopper.py)."""

import textwrap

import pytest

from tests.interpreter import KERNEL_PATCHES, run_under_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
import torch
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS
from fp4attn.reference.forward import robust_qk

def same(a, b, name):
    x, y = a.float(), b.float()
    nan = torch.isnan(x)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    assert torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan]), (name, (x[~nan] != y[~nan]).sum())

g = torch.Generator().manual_seed(0)
DEVICE = globals().get("DEVICE", "cpu")
q = torch.randn(2, 4, 70, 64, generator=g).bfloat16().to(DEVICE)
k = (torch.randn(2, 2, 70, 64, generator=g) + 3 * torch.randn(2, 2, 1, 64, generator=g)).bfloat16().to(DEVICE)
v = torch.randn(2, 2, 70, 64, generator=g).bfloat16().to(DEVICE)
q[1, 2:] *= 3  # sharp logits in (batch 1, KV head 1): its Q/K fall back to FP8
k[0, 1, 5, 7] = 40.0
for name in ("nvfp4-fp8-robust", "train-robust"):
    r = PRESETS[name]
    qo, ko, sc, fb = robust_qk(q, k, r, 0.125)
    ops = prepare_operands_fused(q, k, v, r, scale=0.125)
    if fb is not None:
        assert fb.tolist() == [[False, False], [False, True]], fb
    same(qo.values.bfloat16(), ops.q, name + " q")
    same(ko.values.bfloat16(), ops.k, name + " k")
    same(qo.scale.expand(*q.shape[:-1], 1)[..., 0], ops.qs, name + " qs")
    same(ko.scale.expand(*k.shape[:-1], 1)[..., 0], ops.ks, name + " ks")
# the training's packed payload (train-robust: smoothing and 4-or-6 scales) is
# `formats.quantize_nvfp4`'s bytes of the smoothed K
from fp4attn.formats import quantize_nvfp4
from fp4attn.kernels.hopper.quantize import key_mean, quantize_qk_nvfp4
from fp4attn.reference import robust
mean = key_mean(k)
_, _, codes, bscale, _ = quantize_qk_nvfp4(k, packed=True, channel_amax=True, mean=mean, four_over_six=True)
want = quantize_nvfp4(robust.smooth(k, robust.key_mean(k)), scale_dims=2, four_over_six=True)
assert torch.equal(codes, want.data) and torch.equal(bscale.view(torch.uint8), want.scale.view(torch.uint8))
print("ok")
''')


def test_robust_quantizers_are_the_reference_under_the_interpreter():
    run_under_interpreter(KERNEL_PATCHES + SCRIPT)


FORWARD = textwrap.dedent('''
    import dataclasses
    import torch
    from fp4attn.cli.accuracy import make_inputs
    from fp4attn.kernels.hopper.forward_op import launch_forward
    from fp4attn.routing import p_mode as _p_mode
    from fp4attn.kernels.hopper.quantize import prepare_operands_fused
    from fp4attn.recipes import PRESETS
    from fp4attn.reference import reference_forward
    from fp4attn.routing import ForwardLaunch, override_launch

    # the robust presets through the Triton forward: the fused quantizers' operands and
    # P_MODE 3 give the reference's LSE (within float32 summation order) and output
    for name, case in (("nvfp4-fp8-robust", "mixture"), ("directp-robust", "sink")):
        r = PRESETS[name]
        q, k, v = (t.bfloat16() for t in make_inputs(case, (1, 2, 64, 64), 7, "cpu"))
        k[:, 1] *= 0.3  # one head under the fallback threshold, one over it
        ops = prepare_operands_fused(q, k, v, r, scale=0.125)
        ops = dataclasses.replace(ops, q=ops.q.float(), k=ops.k.float())  # the interpreter's bf16 dot is wrong
        with override_launch(forward=ForwardLaunch(64, 4, 2)):
            out, lse = launch_forward(ops, scale=0.125, causal_offset=None, p_mode=_p_mode(r))[:2]
        ref = reference_forward(q, k, v, r, scale=0.125)
        assert float((lse - ref.lse).abs().max()) < 1e-4, (name, float((lse - ref.lse).abs().max()))
        err = float((out.float() - ref.out).norm() / ref.out.norm())
        assert err < 1e-2, (name, err)
    print("ok")
''')


def test_robust_presets_run_the_hopper_forward_as_the_reference():
    run_under_interpreter(KERNEL_PATCHES + FORWARD)


def test_hopper_kernels_refuse_robust_fields_they_do_not_apply():
    """A robust field the kernels lack is a reason (for the routing) and an error at the
    launcher, never another recipe's numbers."""
    from fp4attn.kernels.hopper.forward_op import hopper_robust_unsupported
    from fp4attn.kernels.hopper.train_op import TRAIN_ROBUST_FIELDS
    from fp4attn.recipes import PRESETS, robust_unsupported_reason

    assert hopper_robust_unsupported(PRESETS["nvfp4-fp8-robust"]) is None
    assert hopper_robust_unsupported(PRESETS["directp-robust"]) is None
    assert "rotate_qk" in hopper_robust_unsupported(PRESETS["nvfp4-fp8"].with_(rotate_qk="hadamard"))
    assert "smooth_v" in hopper_robust_unsupported(PRESETS["directp"].with_(smooth_v=True))
    assert "exp2" in hopper_robust_unsupported(PRESETS["directp"].with_(p_build="exp2", p_sink=True))
    assert robust_unsupported_reason(PRESETS["train-robust"], TRAIN_ROBUST_FIELDS) is None
    assert "qk_fallback" in robust_unsupported_reason(PRESETS["train"].with_(qk_fallback="fp8"), TRAIN_ROBUST_FIELDS)
