"""On the H200: the rules of reference/forward.py ("Non-finite values") and the robust
quantizers, through the Hopper kernels.

- isolation: a batch item's output (and, for the training recipes, gradients) is
  bit-identical whatever the other items hold;
- NaN/Inf: the NaN rows of the kernels' output are the reference's (a NaN in q, k, a
  float key mask, an Inf, an overflowing score), never in another (batch, head);
- the fused robust quantizers give `reference.forward.robust_qk`'s values and scales
  bit for bit, and the key-mean pass `robust.key_mean`'s (the scripts of
  test_robust_interpreter.py, on CUDA tensors).
"""

import pytest
import torch

from fp4attn.api import attention
from tests.test_robust_interpreter import KEY_MEAN as KEY_MEAN_SCRIPT
from tests.test_robust_interpreter import SCRIPT as ROBUST_SCRIPT

pytestmark = pytest.mark.gpu


def _inputs(seed, shape=(3, 4, 200, 128), hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g)
    k, v = (torch.randn(shape[0], hkv, *shape[2:], generator=g) for _ in range(2))
    return [t.bfloat16().cuda() for t in (q, k, v)]


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("recipe", ["nvfp4-fp8", "directp", "fp8-directp", "fp8"])
def test_forward_item_is_bit_identical_whatever_the_others_hold(recipe):
    q, k, v = _inputs(0)
    base = attention(q, k, v, recipe=recipe, enable_gqa=True, backend="triton")
    for which in range(3):
        args = [q.clone(), k.clone(), v.clone()]
        args[which][1:] *= 500.0
        args[which][2, 0, 3, 5] = float("nan")
        out = attention(*args, recipe=recipe, enable_gqa=True, backend="triton")
        assert torch.equal(_bits(out[0]), _bits(base[0])), (recipe, "qkv"[which])


def test_training_gradients_of_an_item_are_bit_identical_whatever_the_others_hold():
    q, k, v = _inputs(1, shape=(2, 4, 256, 128))
    dout = torch.randn(q.shape, device="cuda").bfloat16()

    def grads(q, k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, recipe="train", causal=True, enable_gqa=True, backend="triton").backward(dout)
        return [t.grad for t in leaves]

    base = grads(q, k, v)
    q1, k1, v1 = q.clone(), k.clone(), v.clone()
    for t in (q1, k1, v1):
        t[1] *= 300.0
    for got, want in zip(grads(q1, k1, v1), base):
        assert torch.equal(_bits(got[0]), _bits(want[0]))


@pytest.mark.parametrize("recipe", ["nvfp4-fp8", "directp", "fp8-directp", "fp8"])
@pytest.mark.parametrize("case", ["nan-q", "nan-k", "inf-q", "overflow", "nan-mask"])
def test_nan_rows_are_the_references(recipe, case):
    from fp4attn.recipes import get_recipe
    from fp4attn.reference import reference_forward

    q, k, v = _inputs(2, shape=(2, 2, 192, 128), hkv=2)
    mask = None
    if case == "nan-q":
        q[1, 0, 9, 5] = float("nan")
    elif case == "nan-k":
        k[1, 0, 9, 5] = float("nan")
    elif case == "inf-q":
        q[1, 0, 9, 5] = float("inf")
    elif case == "overflow":
        q[1, 0, 9] = 3e38
    else:
        mask = torch.zeros(2, 1, 1, 192, device="cuda")
        mask[1, 0, 0, 9] = float("nan")
    out = attention(q, k, v, recipe=recipe, attn_mask=mask, backend="triton")
    ref = reference_forward(q, k, v, get_recipe(recipe), scale=128**-0.5, attn_mask=mask)
    want = torch.isnan(ref.out).any(-1)
    assert bool(want[1, 0, 9]) and not bool(want[0].any())
    assert torch.equal(torch.isnan(out.float()).any(-1), want), (recipe, case)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_training_nan_reaches_its_heads_gradients_only(where):
    q, k, v = _inputs(3, shape=(2, 2, 128, 128))
    dout = torch.randn(q.shape, device="cuda").bfloat16()
    args = {"q": q, "k": k, "v": v}
    args[where] = args[where].clone()
    args[where][0, 1, 2, 3] = float("nan")
    leaves = [args[n].clone().requires_grad_() for n in "qkv"]
    attention(*leaves, recipe="train", causal=True, backend="triton").backward(dout)
    for name, t in zip("qkv", leaves):
        if not (where == "v" and name == "v"):
            assert bool(torch.isnan(t.grad[0, 1]).any()), (where, name)
        assert bool(torch.isfinite(t.grad[1]).all()) and bool(torch.isfinite(t.grad[0, 0]).all()), (where, name)


def test_robust_quantizers_are_the_reference_on_the_gpu():
    exec(compile(ROBUST_SCRIPT, "robust_script", "exec"), {"DEVICE": "cuda"})


def test_key_mean_kernel_is_the_reference_on_the_gpu():
    """`key_mean` bit for bit against `robust.key_mean` (the interpreter test's cases, and
    a bench-sized K: 8 programs a head adding float64 sums in whatever order they run)."""
    from fp4attn.kernels.quantize.statistics import key_mean
    from fp4attn.reference import robust

    exec(compile(KEY_MEAN_SCRIPT, "key_mean_script", "exec"), {"DEVICE": "cuda"})
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(2, 8, 4096, 128, device="cuda", generator=g)
    k += 4 * torch.randn(2, 8, 1, 128, device="cuda", generator=g)
    k[..., 17] *= 100.0
    k = k.bfloat16()
    for _ in range(3):  # the atomics' order differs from run to run; the bits may not
        assert torch.equal(key_mean(k).view(torch.int32), robust.key_mean(k).view(torch.int32))
