"""SDPA's shapes and dtypes, as SDPA takes them (`fp4attn.attention` against
`F.scaled_dot_product_attention`, recipe bf16 on the reference): any number of batch dims
(N..., H, L, E), 3-D (H, L, E) and 2-D (L, E) included, batch dims that broadcast,
empty tensors (no batch item, head, query, key or channel), a value head dim unlike the
query/key one (on the reference, warned as every fallback), float64 (the recipes quantize
its float32 rounding); the output and the gradients in SDPA's shapes."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn import routing
from fp4attn.metrics import error_metrics

SDPA = F.scaled_dot_product_attention


def _t(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


def _close(got, want, bound=2e-2):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.numel() and want.abs().max() > 0:
        assert error_metrics(got.double(), want.double())["rel_l2"] < bound
    else:
        assert torch.equal(got, want)


SHAPES = {
    "4-D": ((2, 4, 50, 64), (2, 4, 70, 64), (2, 4, 70, 64)),
    "3-D": ((4, 50, 64), (4, 70, 64), (4, 70, 64)),
    "2-D": ((50, 64), (70, 64), (70, 64)),
    "5-D": ((2, 3, 4, 50, 64), (2, 3, 4, 70, 64), (2, 3, 4, 70, 64)),
    "broadcast": ((2, 3, 4, 50, 64), (1, 3, 4, 70, 64), (3, 4, 70, 64)),
    "value dim": ((2, 4, 50, 64), (2, 4, 70, 64), (2, 4, 70, 40)),
    "value dim 3-D": ((4, 50, 32), (4, 70, 32), (4, 70, 96)),
    "no channel": ((2, 4, 50, 0), (2, 4, 70, 0), (2, 4, 70, 32)),
    "no query": ((2, 4, 0, 64), (2, 4, 70, 64), (2, 4, 70, 64)),
    "no key": ((2, 4, 50, 64), (2, 4, 0, 64), (2, 4, 0, 64)),
    "no batch": ((0, 4, 50, 64), (0, 4, 70, 64), (0, 4, 70, 64)),
    "no head": ((2, 0, 50, 64), (2, 0, 70, 64), (2, 0, 70, 64)),
    "no value channel": ((2, 4, 50, 64), (2, 4, 70, 64), (2, 4, 70, 0)),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_as_sdpa(name, causal):
    q, k, v = (_t(*s) for s in SHAPES[name])
    want = SDPA(q.double(), k.double(), v.double(), is_causal=causal).float()
    out, lse = fp4attn.attention(q, k, v, is_causal=causal, recipe="bf16", return_lse=True)
    _close(out, want)
    assert lse.shape == out.shape[:-1]


@pytest.mark.parametrize("name", ["3-D", "5-D", "broadcast", "value dim", "no key", "no channel"])
def test_gradients_as_sdpa(name):
    shapes = SHAPES[name]
    leaves = [_t(*s).requires_grad_() for s in shapes]
    dout_shape = SDPA(*(t.detach() for t in leaves)).shape
    dout = _t(*dout_shape, seed=5)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    SDPA(*ref, is_causal=True).backward(dout.double())
    fp4attn.attention(*leaves, is_causal=True, recipe="bf16").backward(dout)
    for got, want in zip(leaves, ref):
        assert got.grad is not None and got.grad.shape == got.shape
        _close(got.grad, want.grad.float(), bound=3e-2)


def test_grouped_query_attention_3d():
    q, k, v = _t(8, 40, 64), _t(2, 60, 64), _t(2, 60, 64)
    _close(fp4attn.attention(q, k, v, is_causal=True, enable_gqa=True, recipe="bf16"),
           SDPA(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True).float())


@pytest.mark.parametrize("mask_shape", [(50, 70), (4, 50, 70), (2, 3, 1, 50, 70), (3, 4, 1, 70), (1, 1, 1, 1, 70)])
def test_masks_over_batch_dims(mask_shape):
    q, k, v = _t(2, 3, 4, 50, 64), _t(2, 3, 4, 70, 64), _t(2, 3, 4, 70, 64)
    mask = _t(*mask_shape, seed=9) > -1.0
    _close(fp4attn.attention(q, k, v, attn_mask=mask, recipe="bf16"),
           SDPA(q.double(), k.double(), v.double(), attn_mask=mask).float())
    with pytest.raises(ValueError, match=r"does not broadcast to \(N\.\.\., Hq, Sq, Sk\)"):
        fp4attn.attention(q, k, v, attn_mask=torch.ones(5, 1, 1, 70, dtype=torch.bool))


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "nvfp4-fp8"])
def test_float64(recipe):
    q, k, v = (_t(2, 4, 50, 64, dtype=torch.float64) for _ in range(3))
    out = fp4attn.attention(q, k, v, is_causal=True, recipe=recipe)
    assert out.dtype == torch.float64
    # the recipe quantizes the float32 rounding of the inputs
    assert torch.equal(out, fp4attn.attention(q.float(), k.float(), v.float(), is_causal=True, recipe=recipe).double())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fp4attn.attention(*leaves, recipe="bf16").sum().backward()
    assert all(t.grad.dtype == torch.float64 for t in leaves)


def test_the_kernels_route_what_they_take_and_warn_for_the_rest(monkeypatch):
    """As on a Hopper GPU (FP4ATTN_TARGET=sm_90 with the interpreter's CPU tensors, no
    kernel runs here): a 5-D call routes to the kernels; float64 and a value head dim
    unlike q's go to the reference, said by explain and warned once each."""
    import fp4attn.api as api

    monkeypatch.setenv(routing.TARGET_ENV, "sm_90")
    monkeypatch.setenv(routing.INTERPRET_ENV, "1")
    monkeypatch.delenv(routing.BACKEND_ENV, raising=False)
    monkeypatch.setattr(api, "_WARNED", set())
    # the launchers are not imported (Triton would build their kernels for the interpreter here)
    monkeypatch.setattr(api, "_launcher", lambda spec: None)
    q = _t(2, 3, 4, 64, 64).bfloat16()
    assert fp4attn.explain(q, q, q, recipe="fp8")["backend"] == "triton"
    for args, reason, hint in (((q.double(), q.double(), q.double()), "float64 inputs", "bfloat16, float16 or float32"),
                               ((q, q, q[..., :32]), "a value head dim unlike", "values with the queries' head dim")):
        info = fp4attn.explain(*args, recipe="fp8")
        assert info["backend"] == "reference" and reason in info["reason"], info
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fp4attn.attention(*args, recipe="fp8")
        (w,) = [w for w in seen if issubclass(w.category, fp4attn.ReferenceFallbackWarning)]
        assert reason in str(w.message) and hint.lower() in str(w.message).lower()
        with pytest.raises(ValueError, match="backend='triton' cannot run this call"):
            fp4attn.attention(*args, recipe="fp8", backend="triton")


def test_patch_sdpa_takes_what_attention_takes():
    q, k, v = _t(4, 50, 64), _t(4, 70, 64), _t(4, 70, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp4attn.patch_sdpa(recipe="bf16"):
            got = SDPA(q, k, v, is_causal=True)
    assert torch.equal(got, fp4attn.attention(q, k, v, is_causal=True, recipe="bf16"))
    with pytest.warns(UserWarning, match="falling back to PyTorch SDPA for head_dim 8"):
        with fp4attn.patch_sdpa(recipe="bf16"):
            SDPA(q[..., :8], k[..., :8], v)
