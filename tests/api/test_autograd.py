"""Autograd through `fp4attn.attention` beyond dQ, dK, dV.

- A second derivative (create_graph=True) raises, as SDPA's fused backwards do: the
  training backwards are first-order, and they used to hand back wrong second
  derivatives silently (cos 0.36 to the true ones for `bf16`, about 0 for `train`).
- A float attn_mask that requires grad (a learned score bias) gets its gradient, dS in
  natural units summed over the dims the mask broadcasts along; it used to get none.
"""

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.metrics import error_metrics

TRAIN = ["bf16", "train", "train-mxfp4pv", "train-fp8"]


def _qkv(b=1, hq=2, hkv=2, sq=40, sk=72, d=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g).to(dtype).requires_grad_()
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


@pytest.mark.parametrize("recipe", TRAIN)
def test_double_backward_raises(recipe):
    q, k, v = _qkv()
    out = fp4attn.attention(q, k, v, recipe=recipe, causal=True)
    with pytest.raises(RuntimeError, match="has no double backward: torch.autograd.grad"):
        torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)


@pytest.mark.parametrize("recipe", TRAIN)
def test_first_order_backward_unchanged_by_the_guard(recipe):
    """create_graph=False still gives the gradients (the guard looks at grad mode only)."""
    q, k, v = _qkv()
    out = fp4attn.attention(q, k, v, recipe=recipe)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


def _mask_grad(recipe, mask, q, k, v, causal=False, dout=None):
    mask = mask.detach().clone().requires_grad_()
    out = fp4attn.attention(q, k, v, attn_mask=mask, recipe=recipe, causal=causal, enable_gqa=True)
    out.backward(dout if dout is not None else torch.ones_like(out))
    return mask.grad


def _exact_mask_grad(mask, q, k, v, causal=False, dout=None):
    """float64 autograd of SDPA's math: the gradient an additive mask should get."""
    m = mask.detach().double().requires_grad_()
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    kd, vd = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
    if causal:  # SDPA takes no mask together with is_causal: fold the causal mask in
        sq, sk = q.shape[-2], k.shape[-2]
        hidden = torch.ones(sq, sk, dtype=torch.bool).triu(1)
        m_full = m.masked_fill(hidden, float("-inf"))
    else:
        m_full = m
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m_full)
    out.backward(dout.double() if dout is not None else torch.ones_like(out))
    return m.grad


# mask shapes for (B, Hq, Sq, Sk) = (2, 4, 40, 72): full, per head, key padding, 2-D,
# 1-D over the keys, and broadcast over the keys
MASK_SHAPES = [(2, 4, 40, 72), (4, 40, 72), (2, 1, 1, 72), (40, 72), (72,), (2, 4, 40, 1)]


@pytest.mark.parametrize("shape", MASK_SHAPES[:-1], ids=str)
def test_float_mask_gets_its_gradient(shape):
    """bf16 recipe (bf16 gradient products): the mask's gradient agrees with float64
    autograd of exact attention. (A mask constant over the keys has gradient 0 in exact
    arithmetic, rowsum(dS) = 0: checked below as a sum of the full mask's gradient.)"""
    q, k, v = _qkv(b=2, hq=4, hkv=2)
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    dout = torch.randn(2, 4, 40, 32, generator=torch.Generator().manual_seed(2))
    got = _mask_grad("bf16", mask, q, k, v, dout=dout)
    want = _exact_mask_grad(mask, q, k, v, dout=dout)
    assert got is not None and got.shape == mask.shape and got.dtype == mask.dtype
    m = error_metrics(got, want)
    assert m["cos"] > 0.9995 and m["rel_l2"] < 0.02, m  # measured 0.99999 and 0.0022-0.0034


@pytest.mark.parametrize("recipe, floor", [("train", 0.98), ("train-mxfp4pv", 0.95)])  # measured 0.992, 0.979
@pytest.mark.parametrize("causal", [False, True])
def test_float_mask_gradient_fp8_recipes(recipe, floor, causal):
    """The FP8-gradient recipes: same check with their own (looser) agreement."""
    q, k, v = _qkv(sq=64, sk=64)
    mask = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    dout = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(4))
    got = _mask_grad(recipe, mask, q, k, v, causal=causal, dout=dout)
    want = _exact_mask_grad(mask, q, k, v, causal=causal, dout=dout)
    assert error_metrics(got, want)["cos"] > floor


@pytest.mark.parametrize("shape", MASK_SHAPES[1:], ids=str)
def test_broadcast_mask_gradient_is_the_sum_of_the_full_one(shape):
    """A mask broadcast along a dim gets the sum of the gradients its copies would get."""
    q, k, v = _qkv(b=2, hq=4, hkv=2)
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    full = mask.expand(2, 4, 40, 72).contiguous()
    got = _mask_grad("train", mask, q, k, v)
    g_full = _mask_grad("train", full, q, k, v)
    pad = (1,) * (4 - len(shape)) + tuple(shape)
    want = g_full.sum(dim=[d for d in range(4) if pad[d] == 1], keepdim=True).reshape(shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_mask_gradient_without_qkv_gradients():
    """Only the mask requires grad: the call still records a backward (and `explain`
    says a backward is needed, which keeps the call off the forward-only kernels)."""
    q, k, v = (t.detach() for t in _qkv())
    mask = torch.zeros(2, 40, 72, requires_grad=True)
    assert fp4attn.explain(q, k, v, attn_mask=mask, recipe="train")["needs_grad"]
    fp4attn.attention(q, k, v, attn_mask=mask, recipe="train").sum().backward()
    assert mask.grad is not None and bool(torch.isfinite(mask.grad).all()) and bool(mask.grad.abs().sum() > 0)


def test_mask_gradient_in_the_masks_dtype_and_zero_where_hidden():
    """A bf16 mask gets a bf16 gradient; keys the mask hides (-inf) get exactly 0."""
    q, k, v = _qkv()
    mask = torch.zeros(40, 72, dtype=torch.bfloat16)
    mask[:, 50:] = float("-inf")
    grad = _mask_grad("bf16", mask, q, k, v, dout=torch.randn(1, 2, 40, 32))
    assert grad.dtype == torch.bfloat16
    assert bool((grad[:, 50:] == 0).all()) and bool(grad[:, :50].abs().sum() > 0)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["train", "train-fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_double_backward_raises_on_the_hopper_training_kernels(causal, recipe):
    q, k, v = (t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in _qkv(sq=128, sk=128, d=64))
    assert fp4attn.explain(q, k, v, recipe=recipe, causal=causal)["backend"] == "triton"
    out = fp4attn.attention(q, k, v, recipe=recipe, causal=causal)
    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.autograd.grad(out.float().square().sum(), (q, k, v), create_graph=True)
    # and first order still runs on the kernels
    out = fp4attn.attention(q, k, v, recipe=recipe, causal=causal)
    assert all(g is not None for g in torch.autograd.grad(out.float().square().sum(), (q, k, v)))
