"""`fp4attn.attention` in place of `torch.nn.functional.scaled_dot_product_attention`, by
name: SDPA's argument names (`query`, `key`, `value`, `attn_mask`, `dropout_p`,
`is_causal`, `scale`, `enable_gqa`) with SDPA's meaning, exactly as transformers' and
diffusers' SDPA call sites pass them."""

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.metrics import error_metrics

SDPA = F.scaled_dot_product_attention


def _close(got, want, bound=2e-2):
    """bf16 operands and P against SDPA in float32: rel L2 about 4e-3; a wrong mask,
    alignment or scale moves it past 0.1."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert error_metrics(got.float(), want.float())["rel_l2"] < bound


@pytest.fixture
def sdpa_is_fp4attn(monkeypatch):
    """Every `F.scaled_dot_product_attention` call runs `fp4attn.attention` (recipe bf16,
    the reference) with the caller's own arguments; records per call the keyword names
    passed, fp4attn's output and SDPA's own for the same arguments."""
    calls = []

    def replaced(*args, **kwargs):
        out = fp4attn.attention(*args, **kwargs, recipe="bf16", backend="reference")
        calls.append((sorted(kwargs), out, SDPA(*args, **kwargs)))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", replaced)
    return calls


def test_sdpa_names_mean_what_they_mean_in_sdpa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 32, generator=gen)
    k, v = (torch.randn(2, 2, 9, 32, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, 5, 9, generator=gen) > 0.3
    mask[..., 0] = True
    kw = dict(recipe="bf16", backend="reference")
    cases = [dict(is_causal=True, enable_gqa=True),  # top-left aligned, Sq < Sk
             dict(attn_mask=mask, dropout_p=0.0, scale=0.3, enable_gqa=True),
             dict(attn_mask=mask.float().log(), dropout_p=0, is_causal=False, enable_gqa=True)]
    for case in cases:
        _close(fp4attn.attention(query=q, key=k, value=v, **case, **kw), SDPA(q, k, v, **case))
    # SDPA's positional order: attn_mask, dropout_p, is_causal
    assert torch.equal(fp4attn.attention(q, k, v, mask, 0.0, False, enable_gqa=True, **kw),
                       fp4attn.attention(q, k, v, attn_mask=mask, enable_gqa=True, **kw))
    top_left = fp4attn.attention(q, k, v, causal="top_left", enable_gqa=True, **kw)
    assert torch.equal(fp4attn.attention(q, k, v, is_causal=True, enable_gqa=True, **kw), top_left)
    assert not torch.equal(fp4attn.attention(q, k, v, causal="bottom_right", enable_gqa=True, **kw), top_left)
    info = fp4attn.explain(query=q, key=k, value=v, is_causal=True, dropout_p=0.0, scale=0.3, enable_gqa=True)
    assert info["backend"] == "reference"


def test_sdpa_names_refuse_what_fp4attn_does_not_do():
    q = torch.randn(1, 2, 8, 32)
    for kwargs, exc, match in [
        (dict(dropout_p=0.1), ValueError, r"dropout_p=0\.1 is not supported.*accepted: 0\.0"),
        (dict(dropout_p=True), ValueError, r"dropout_p=True .*accepted: 0\.0"),
        (dict(is_causal=True, causal=True), ValueError, "pass causal or is_causal, not both"),
        (dict(is_causal=False, causal="bottom_right"), ValueError, "not both"),
        (dict(is_causal="bottom_right"), TypeError, "is_causal must be a bool.*causal='bottom_right'"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    ]:
        with pytest.raises(exc, match=match):
            fp4attn.attention(q, q, q, **kwargs)
        with pytest.raises(exc, match=match):
            fp4attn.explain(q, q, q, **kwargs)


def test_transformers_sdpa_call_sites(sdpa_is_fp4attn):
    """transformers' `sdpa_attention_forward` (the "sdpa" attention of every model):
    causal with GQA by `enable_gqa`, a padding mask with K/V repeated, a scale; its
    dropout in training mode raises."""
    sdpa_forward = pytest.importorskip("transformers.integrations.sdpa_attention").sdpa_attention_forward

    class Module(torch.nn.Module):
        is_causal, num_key_value_groups = True, 2

    module = Module().eval()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 7, 64, generator=gen)
    k, v = (torch.randn(2, 2, 7, 64, generator=gen) for _ in range(2))
    pad = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    pad[1, ..., 5:] = False
    pad[1, :, 5:, 0] = True
    for mask, scaling in ((None, None), (pad, 0.2)):
        out, _ = sdpa_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling)
        assert out.shape == (2, 7, 4, 64)
    kinds = [names for names, _, _ in sdpa_is_fp4attn]
    assert kinds == [["attn_mask", "dropout_p", "enable_gqa", "is_causal", "scale"],
                     ["attn_mask", "dropout_p", "is_causal", "scale"]]
    for _, got, want in sdpa_is_fp4attn:
        _close(got, want)
    module.train()
    with pytest.raises(ValueError, match=r"dropout_p=0\.1 is not supported"):
        sdpa_forward(module, q, k, v, None, dropout=0.1)


def test_diffusers_sdpa_call_sites(sdpa_is_fp4attn):
    """diffusers' native attention backend (`query=`, `key=`, `value=`, `attn_mask`,
    `dropout_p`, `is_causal`, `scale`, `enable_gqa`, in (B, S, H, D)) and its
    `AttnProcessor2_0` (`attn_mask`, `dropout_p=0.0`, `is_causal=False`); each output
    equals SDPA's for the same call."""
    dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 12, 4, 32, generator=gen)
    k, v = (torch.randn(2, 12, 2, 32, generator=gen) for _ in range(2))
    out = dispatch._native_attention(q, k, v, dropout_p=0.0, is_causal=True, scale=0.25, enable_gqa=True)
    assert out.shape == q.shape
    attn = Attention(query_dim=64, heads=2, dim_head=32, processor=AttnProcessor2_0())
    hidden = torch.randn(2, 10, 64, generator=gen)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, 6:] = False
    with torch.no_grad():
        attn(hidden)
        attn(hidden, attention_mask=keep)
    assert [names for names, _, _ in sdpa_is_fp4attn] == [
        ["attn_mask", "dropout_p", "enable_gqa", "is_causal", "key", "query", "scale", "value"],
        ["attn_mask", "dropout_p", "is_causal"], ["attn_mask", "dropout_p", "is_causal"]]
    for _, got, want in sdpa_is_fp4attn:
        _close(got, want)
