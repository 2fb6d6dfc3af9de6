"""Batch isolation on the reference: every quantization scale spans at most one (batch,
head), so a batch item's output and gradients are bit-identical whatever the other
items hold (outliers a thousand times larger, zeros, NaN). The Hopper quantizers' side
is in tests/kernels/test_quantize.py (under the interpreter and on the GPU)."""

import pytest
import torch

from fp4attn.api import attention
from fp4attn.formats import quantize_nvfp4

INFERENCE = ("directp", "nvfp4-fp8", "fp8", "nvfp4-fp8-robust", "directp-robust")
TRAINING = ("train", "train-mxfp4pv", "train-robust")


def _inputs(seed, shape=(3, 2, 45, 64), hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g)
    k, v = (torch.randn(shape[0], hkv, *shape[2:], generator=g) for _ in range(2))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _disturb(x, how):
    """x with every batch item but the first changed."""
    y = x.clone()
    if how == "outlier":
        y[1:, :, 3, 5] = 3e4
        y[1:] *= 7.0
    elif how == "zero":
        y[1:] = 0
    else:
        y[1:, 0, 0, 0] = float("nan")
    return y


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("recipe", INFERENCE)
@pytest.mark.parametrize("how", ["outlier", "nan"])
def test_forward_item_is_bit_identical_whatever_the_others_hold(recipe, how):
    q, k, v = _inputs(1)
    causal = recipe.startswith("directp")
    base = attention(q, k, v, recipe=recipe, causal=causal, backend="reference")
    for which in range(3):
        args = [q, k, v]
        args[which] = _disturb(args[which], how)
        out = attention(*args, recipe=recipe, causal=causal, backend="reference")
        assert torch.equal(_bits(out[0]), _bits(base[0])), (recipe, how, "qkv"[which])


@pytest.mark.parametrize("recipe", TRAINING)
def test_gradients_of_an_item_are_bit_identical_whatever_the_others_hold(recipe):
    q, k, v = _inputs(2, shape=(2, 4, 40, 64), hkv=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).bfloat16()

    def grads(q, k, v, dout):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, recipe=recipe, causal=True, enable_gqa=True, backend="reference").backward(dout)
        return [t.grad for t in leaves]

    base = grads(q, k, v, dout)
    for which in range(4):
        args = [q, k, v, dout]
        args[which] = _disturb(args[which], "outlier")
        for got, want in zip(grads(*args), base):
            assert torch.equal(_bits(got[0]), _bits(want[0])), (recipe, which)


def test_nvfp4_scale_dims_quantizes_each_slice_alone():
    """quantize_nvfp4(x, scale_dims=2): each (batch, head)'s codes, block scales and
    tensor scale are those of quantizing that slice by itself; scale_dims=0 is one
    tensor scale over everything (TransformerEngine's rule)."""
    x = torch.randn(2, 3, 33, 64, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, 6).reshape(
        2, 3, 1, 1)
    whole = quantize_nvfp4(x, scale_dims=2)
    assert whole.global_scale.shape == (2, 3, 1, 1, 1)
    for b in range(2):
        for h in range(3):
            alone = quantize_nvfp4(x[b, h])
            assert torch.equal(whole.data[b, h], alone.data)
            assert torch.equal(whole.scale[b, h].view(torch.uint8), alone.scale.view(torch.uint8))
            assert torch.equal(whole.global_scale[b, h].reshape(()), alone.global_scale)
    err = (whole.dequantize() - x).flatten(2).norm(dim=-1) / x.flatten(2).norm(dim=-1)
    assert bool((err < 0.15).all()), err  # every slice at its own scale, small or large
    assert quantize_nvfp4(x).global_scale.shape == ()
    with pytest.raises(ValueError, match="scale_dims"):
        quantize_nvfp4(x, dim=1, scale_dims=2)  # the blocked dim must come after the scaled ones
    with pytest.raises(ValueError, match="scale_dims"):
        quantize_nvfp4(x, scale_dims=4)
