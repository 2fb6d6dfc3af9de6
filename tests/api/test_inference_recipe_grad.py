"""An inference-only recipe whose inputs require grad (a model in eval mode outside
torch.no_grad()) runs its forward kernels as without gradients, and a backward through
its output raises, naming every preset that trains (from the preset table)."""

import pytest
import torch

import fp4attn
from fp4attn.recipes import PRESETS, inference_only_message, training_presets

INFERENCE = [name for name, r in PRESETS.items() if r.grad is None]


def test_the_message_names_every_training_preset():
    want = [name for name, r in PRESETS.items() if r.grad is not None]
    assert training_presets() == want and {"train", "train-robust", "train-fp8", "train-affine", "bf16"} <= set(want)
    msg = inference_only_message(PRESETS["fp8"])
    assert all(repr(name) in msg for name in want) and "'fp8' is inference-only" in msg
    assert not any(repr(name) in msg.split("one (")[1] for name in INFERENCE)


@pytest.mark.parametrize("recipe", ["fp8", "directp", fp4attn.DEFAULT_RECIPE])
def test_forward_runs_and_backward_raises(recipe):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        want = fp4attn.attention(q, k, v, recipe=recipe, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fp4attn.attention(*leaves, recipe=recipe, causal=True)
    assert torch.equal(out.detach(), want) and out.requires_grad
    with pytest.raises(RuntimeError, match=f"recipe '{recipe}' is inference-only") as e:
        out.float().sum().backward()
    assert all(repr(name) in str(e.value) for name in training_presets())
    # a learned float mask alone requiring grad: the same
    mask = torch.zeros(1, 1, 40, 40, requires_grad=True)
    out = fp4attn.attention(q, k, v, attn_mask=mask, recipe=recipe)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.float().sum().backward()


def test_explain_routes_the_forward_as_without_gradients(monkeypatch):
    import fp4attn.api as api

    # routed as on a Hopper GPU; the launchers are not imported (Triton would build their
    # kernels for the interpreter in this process)
    monkeypatch.setattr(api, "_launcher", lambda spec: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FP4ATTN_TARGET", "sm_90")
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for name in INFERENCE:
        with_grad = fp4attn.explain(q, k, v, recipe=name)
        without = fp4attn.explain(q, k, v, recipe=name, needs_grad=False)
        assert with_grad["needs_grad"] and with_grad["kernel"] == without["kernel"], name
        assert with_grad["backend"] == "triton" and "a backward through it raises" in with_grad["reason"], name
    assert fp4attn.explain(q, k, v, recipe="train")["needs_grad"]


def test_reference_backward_names_the_training_presets():
    from fp4attn.reference import reference_backward, reference_forward

    q, k, v = (torch.randn(1, 1, 16, 32) for _ in range(3))
    fwd = reference_forward(q, k, v, PRESETS["fp8"], scale=0.2)
    with pytest.raises(RuntimeError, match="'train-affine'"):
        reference_backward(fwd, fwd.out, torch.ones_like(fwd.out), PRESETS["fp8"], scale=0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [fp4attn.DEFAULT_RECIPE, "fp8", "fp8-ktile-affine-lazy-fastacc", "directp"])
def test_inference_recipe_with_grad_runs_its_kernels_on_the_gpu(recipe):
    import warnings

    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        want = fp4attn.attention(q, k, v, recipe=recipe, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp4attn.ReferenceFallbackWarning)
        out = fp4attn.attention(*leaves, recipe=recipe, causal=True)
    assert torch.equal(out.detach(), want)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.float().sum().backward()
