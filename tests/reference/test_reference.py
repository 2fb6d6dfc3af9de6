"""The reference forward and backward: exactness where the recipe is exact, the tiling
rule, consistent normalization, range guard, causal alignment, GQA, LSE."""

import math

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.formats import E4M3, round_to_format
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS
from fp4attn.reference import build_p, reference_forward
from fp4attn.reference.forward import log2_scores
from fp4attn.reference.operands import quantize_qk, quantize_v

QUANT_RECIPES = ["directp", "nvfp4-fp8", "fp8-directp", "fp8", "train", "train-mxfp4pv"]


def _qkv(b, hq, hkv, sq, sk, d, seed=None, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    q = torch.randn(b, hq, sq, d, generator=g) * scale
    k = torch.randn(b, hkv, sk, d, generator=g) * scale
    v = torch.randn(b, hkv, sk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _exact(q, k, v, causal=False, gqa=False):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=gqa)


@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 113), (113, 3), (239, 1023), (128, 256)])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_recipe_matches_exact_attention(sq, sk, d):
    q, k, v = _qkv(2, 3, 3, sq, sk, d)
    out = fp4attn.attention(q, k, v, recipe="bf16")
    assert error_metrics(out, _exact(q, k, v))["rel_l2"] < 1e-2


@pytest.mark.parametrize("recipe", QUANT_RECIPES)
@pytest.mark.parametrize("causal", [False, True])
def test_quantized_recipes_close_to_exact(recipe, causal):
    q, k, v = _qkv(1, 4, 2, 239, 300, 64)
    out = fp4attn.attention(q, k, v, recipe=recipe, causal=causal, enable_gqa=True)
    m = error_metrics(out, _exact(q, k, v, causal, gqa=True))
    assert m["cos"] > (0.99 if recipe == "fp8" else 0.95), m


def test_output_equals_quantized_operator_in_one_tile():
    """Sk <= block_n: one tile, so out = (P_rep @ V_rep) / rowsum(P_rep) exactly as the
    recipe defines it (consistent normalization: the same values in both)."""
    q, k, v = _qkv(1, 2, 2, 17, 100, 64, seed=5)
    for name in ("directp", "nvfp4-fp8", "fp8-directp"):
        r = PRESETS[name]
        res = reference_forward(q, k, v, r, scale=0.125)
        t = log2_scores(quantize_qk(q, r.qk), quantize_qk(k, r.qk), 0.125, slice(None))
        x = t - t.amax(-1, keepdim=True)
        p = build_p(F.pad(x, (0, 28), value=-math.inf), r.p, r.p_build)[..., :100]
        want = (p @ quantize_v(v, r.v)) / p.sum(-1, keepdim=True)
        torch.testing.assert_close(res.out, want, rtol=1e-5, atol=1e-6)
        lse = (t.amax(-1) + torch.log2(p.sum(-1))) * math.log(2)
        torch.testing.assert_close(res.lse, lse, rtol=1e-6, atol=1e-6)


def test_fp8_p_is_e4m3_of_p_times_256():
    x = torch.tensor([[0.0, -1.0, -10.0, -17.0, -30.0, -math.inf]])
    p = build_p(x, "fp8", "exp2")
    want = round_to_format(torch.exp2(x) * 256, E4M3) / 256
    assert torch.equal(p, want) and p[0, -2].item() == 0.0  # 2**-30 * 256 underflows e4m3


@pytest.mark.parametrize("recipe", ["directp", "fp8-directp", "nvfp4-fp8", "fp8"])
def test_tiling_changes_only_rounding(recipe):
    q, k, v = _qkv(1, 2, 2, 64, 512, 64, seed=7)
    r = PRESETS[recipe]
    a = reference_forward(q, k, v, r, scale=0.125).out
    b = reference_forward(q, k, v, r.with_(block_n=512), scale=0.125).out
    assert error_metrics(a, b)["cos"] > 0.99


@pytest.mark.parametrize("recipe", QUANT_RECIPES + ["bf16"])
def test_range_guard_extreme_logits(recipe):
    """Logits near +-1000 and a row maximum that arrives only in the last key tile:
    finite output matching exact softmax over the same quantized scores."""
    q, k, v = _qkv(1, 2, 2, 40, 512, 64, seed=11)
    q, k = q * 14, k * 14  # logit std ~200 with scale 1/8: |logits| reach ~800
    k[..., :384, :] *= 0.01  # the first three tiles sit far below the row maximum
    r = PRESETS[recipe]
    res = reference_forward(q, k, v, r, scale=0.125)
    assert bool(torch.isfinite(res.out).all()) and bool(torch.isfinite(res.lse).all())
    t = log2_scores(quantize_qk(q, r.qk), quantize_qk(k, r.qk), 0.125, slice(None))
    assert float(t.abs().max()) * math.log(2) > 500
    want = torch.softmax(t.double() * math.log(2), -1) @ quantize_v(v, r.v).double()
    assert error_metrics(res.out, want)["cos"] > 0.97


def test_rows_below_max_in_first_tiles():
    """The first tiles of a row sit 1000 below its maximum: they must vanish, not NaN."""
    q = torch.ones(1, 1, 4, 64)
    k = torch.zeros(1, 1, 512, 64)
    k[..., 400, :] = 125.0  # score 1000 at one key of the last tile
    v = torch.randn(1, 1, 512, 64)
    for name in QUANT_RECIPES:
        out = fp4attn.attention(q, k, v, recipe=name, scale=0.125)
        r = PRESETS[name]
        torch.testing.assert_close(out[0, 0], quantize_v(v, r.v)[0, 0, 400].expand(4, 64), rtol=0.2, atol=0.2)


def test_causal_alignments():
    q, k, v = _qkv(1, 2, 2, 50, 80, 64)
    top = fp4attn.attention(q, k, v, recipe="bf16", causal=True)
    assert error_metrics(top, _exact(q, k, v, causal=True))["rel_l2"] < 1e-2
    mask = torch.ones(50, 80, dtype=torch.bool).tril(diagonal=30)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    bottom = fp4attn.attention(q, k, v, recipe="bf16", causal="bottom_right")
    assert error_metrics(bottom, want)["rel_l2"] < 1e-2


def test_bottom_right_rows_without_keys():
    q, k, v = _qkv(1, 1, 1, 10, 4, 64)
    out, lse = fp4attn.attention(q, k, v, recipe="directp", causal="bottom_right", return_lse=True)
    assert torch.equal(out[0, 0, :6], torch.zeros(6, 64))
    assert bool((lse[0, 0, :6] == -math.inf).all()) and bool(torch.isfinite(lse[0, 0, 6:]).all())


@pytest.mark.parametrize("recipe", QUANT_RECIPES + ["bf16"])
def test_gqa_equals_repeated_heads(recipe):
    q, k, v = _qkv(2, 6, 2, 33, 70, 64)
    a = fp4attn.attention(q, k, v, recipe=recipe, enable_gqa=True)
    b = fp4attn.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), recipe=recipe)
    assert torch.equal(a, b)


def test_lse_matches_logsumexp():
    q, k, v = _qkv(1, 2, 2, 37, 300, 128)
    _, lse = fp4attn.attention(q, k, v, recipe="bf16", return_lse=True, causal=True)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(128)
    s = s.masked_fill(~torch.ones(37, 300, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=2e-2)


def test_nan_input_gives_nan_output():
    q, k, v = _qkv(1, 1, 1, 8, 64, 64)
    v[0, 0, 3, 5] = float("nan")
    for name in QUANT_RECIPES:
        assert bool(torch.isnan(fp4attn.attention(q, k, v, recipe=name)).any())


def test_mxfp4_v_window_flushes_far_blocks():
    v = torch.ones(1, 1, 64, 64)
    v[..., 32:, :] = 2.0**-20  # 20 octaves below the first block
    rep = quantize_v(v, "mxfp4")
    assert bool((rep[..., :32, :] == 1).all()) and bool((rep[..., 32:, :] == 0).all())
    v[..., 32:, :] = 2.0**-10  # inside the 14-octave window: kept exactly
    assert bool((quantize_v(v, "mxfp4")[..., 32:, :] == 2.0**-10).all())


@pytest.mark.parametrize("recipe,min_cos", [("train", 0.95), ("train-mxfp4pv", 0.85), ("bf16", 0.999)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_against_fp32_autograd(recipe, min_cos, causal):
    q, k, v = _qkv(1, 4, 2, 113, 200, 64)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fp4attn.attention(*leaves, recipe=recipe, causal=causal, enable_gqa=True).backward(dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True).backward(dout)
    for got, want in zip(leaves, ref):
        assert got.grad.shape == want.shape and got.grad.dtype == want.dtype
        assert error_metrics(got.grad, want.grad)["cos"] > min_cos


def test_backward_grad_dtype_follows_inputs():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 16, 32, 64, dtype=torch.bfloat16))
    fp4attn.attention(q, k, v, recipe="train").float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16


def test_inference_recipe_backward_raises():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 8, 32, 64))
    out = fp4attn.attention(q, k, v, recipe="directp")
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_attn_mask_matches_sdpa(kind):
    q, k, v = _qkv(2, 2, 2, 37, 150, 64)
    if kind == "bool":
        mask = torch.rand(2, 1, 37, 150) > 0.3
        mask[..., 0] = True  # every row attends to something
    else:
        mask = torch.randn(1, 2, 37, 150)
    out = fp4attn.attention(q, k, v, recipe="bf16", attn_mask=mask)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          attn_mask=mask if kind == "bool" else mask.double())
    assert error_metrics(out, want)["rel_l2"] < 1e-2
    q8 = fp4attn.attention(q, k, v, recipe="fp8", attn_mask=mask)
    assert error_metrics(q8, want)["cos"] > 0.99


def test_attn_mask_backward_and_errors():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 16, 40, 64))
    mask = torch.ones(16, 40, dtype=torch.bool).tril()
    fp4attn.attention(q, k, v, recipe="bf16", attn_mask=mask).sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=mask).sum().backward()
    assert error_metrics(q.grad, ref[0].grad)["cos"] > 0.999
    with pytest.raises(ValueError, match="does not broadcast"):
        fp4attn.attention(q, k, v, attn_mask=torch.ones(3, 40, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask has dtype"):
        fp4attn.attention(q, k, v, attn_mask=torch.ones(16, 40, dtype=torch.int32))


def test_backward_of_peaked_attention_is_finite():
    """Sharp attention underflows P, so whole dS tiles are ~1e-40: their FP8 views must
    flush (FP8_MIN_AMAX), not overflow their inverse scale into 0 * inf = NaN (the
    failure that ended GPU training runs before the flush)."""
    from fp4attn import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen) for _ in range(3))
    q, k = (q * 6).requires_grad_(), (k * 6).requires_grad_()
    v.requires_grad_()
    for recipe in ("train", "train-mxfp4pv"):
        out = attention(q, k, v, recipe=recipe, causal=True, backend="reference")
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        assert all(bool(torch.isfinite(g).all()) for g in grads), recipe


@pytest.mark.parametrize("recipe", ["train", "train-mxfp4pv", "bf16"])
def test_backward_in_query_chunks_equals_one_step(recipe, monkeypatch):
    """The reference backward walks the queries in chunks (bounded memory); the gradients
    do not depend on the chunk (64 or all rows), causal or masked, with GQA."""
    import fp4attn.reference.backward as bwd
    from fp4attn.reference import reference_forward
    from fp4attn.reference.backward import reference_backward

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 200, 64, generator=gen)
    k, v = (torch.randn(1, 2, 230, 64, generator=gen) for _ in range(2))
    dout = torch.randn(1, 4, 200, 64, generator=gen)
    mask = torch.rand(1, 1, 200, 230, generator=gen) > 0.2
    rec = fp4attn.PRESETS[recipe]
    for causal, attn_mask in (("bottom_right", None), (None, mask)):
        fwd = reference_forward(q, k, v, rec, scale=0.125, causal=causal, attn_mask=attn_mask)
        grads = []
        for chunk in (64, 4096):
            monkeypatch.setattr(bwd, "QUERY_CHUNK", chunk)
            grads.append(reference_backward(fwd, fwd.out, dout, rec, scale=0.125, causal=causal, attn_mask=attn_mask))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
