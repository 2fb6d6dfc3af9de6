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
