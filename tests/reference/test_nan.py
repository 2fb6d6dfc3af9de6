"""NaN and Inf propagate on the reference (reference/forward.py, "Non-finite values"): a
NaN or Inf in q, k or v, a NaN in a float mask, or scores that overflow, give NaN in
the output rows that depend on them (at least the affected query rows, at most their
(batch, head)) and in the gradients they feed, never a zero or a finite value, and
never anything in another (batch, head). Fully masked rows stay 0."""

import pytest
import torch

from fp4attn.api import attention

RECIPES = ("directp", "nvfp4-fp8", "fp8-directp", "fp8", "bf16", "nvfp4-fp8-robust", "directp-robust")


def _inputs(seed=0, shape=(2, 2, 40, 64)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).bfloat16() for _ in range(3)]


def _check(out, base, b, h, rows):
    """NaN in (b, h)'s `rows` (and nowhere outside (b, h)); everything outside (b, h)
    bit-identical to `base`."""
    assert bool(torch.isnan(out[b, h, rows]).any(-1).all()), "affected rows must be NaN"
    other = torch.ones(out.shape[:2], dtype=torch.bool)
    other[b, h] = False
    assert torch.equal(out[other].view(torch.int16), base[other].view(torch.int16))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nonfinite_operand_gives_nan_in_its_rows_only(recipe, value, where):
    q, k, v = _inputs()
    base = attention(q, k, v, recipe=recipe, backend="reference")
    x = {"q": q, "k": k, "v": v}[where].clone()
    x[1, 0, 7, 3] = value
    args = {"q": q, "k": k, "v": v, where: x}
    out = attention(args["q"], args["k"], args["v"], recipe=recipe, backend="reference")
    # a NaN/Inf query element spoils its row; a key's or value's spoils every row that sees it
    _check(out, base, 1, 0, [7] if where == "q" else slice(None))


@pytest.mark.parametrize("recipe", ["directp", "nvfp4-fp8", "fp8"])
def test_nan_in_a_float_mask_gives_a_nan_row(recipe):
    q, k, v = _inputs(1)
    mask = torch.zeros(2, 2, 40, 40)
    base = attention(q, k, v, recipe=recipe, attn_mask=mask, backend="reference")
    mask[0, 1, 5, 9] = float("nan")
    out = attention(q, k, v, recipe=recipe, attn_mask=mask, backend="reference")
    _check(out, base, 0, 1, [5])
    assert not bool(torch.isnan(out[0, 1, :5]).any()) and not bool(torch.isnan(out[0, 1, 6:]).any())


@pytest.mark.parametrize("recipe", ["directp", "nvfp4-fp8", "fp8", "bf16"])
def test_overflowing_scores_give_nan_as_sdpa(recipe):
    q, k, v = _inputs(2)
    q[0, 0, 3] = 3e38  # scores beyond float32: SDPA gives NaN for the row
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert bool(torch.isnan(want[0, 0, 3]).all())
    out = attention(q, k, v, recipe=recipe, backend="reference")
    assert bool(torch.isnan(out[0, 0, 3]).all()) and not bool(torch.isnan(out[1]).any())


@pytest.mark.parametrize("recipe", ["directp", "nvfp4-fp8", "fp8"])
def test_fully_masked_rows_stay_zero(recipe):
    q, k, v = _inputs(3)
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    mask[1, 0, 4] = False
    out = attention(q, k, v, recipe=recipe, attn_mask=mask, backend="reference")
    assert not bool(out[1, :, 4].any()) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("recipe", ["train", "train-mxfp4pv", "train-robust"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_the_gradients_of_its_head_only(recipe, where):
    q, k, v = _inputs(4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).bfloat16()

    def grads(q, k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, recipe=recipe, causal=True, backend="reference").backward(dout)
        return [t.grad for t in leaves]

    base = grads(q, k, v)
    args = {"q": q, "k": k, "v": v}
    args[where] = args[where].clone()
    args[where][0, 1, 2, 3] = float("nan")
    for name, got, want in zip("qkv", grads(args["q"], args["k"], args["v"]), base):
        # every gradient the NaN feeds is NaN in its head (dV depends on P and dO only, so
        # not on V); other (batch, head)s are untouched
        if not (where == "v" and name == "v"):
            assert bool(torch.isnan(got[0, 1]).any()), (name, where)
        assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
        assert torch.equal(got[0, 0].view(torch.int16), want[0, 0].view(torch.int16))
