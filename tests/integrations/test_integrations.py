"""patch_sdpa, transformers and torch.compile, on tiny randomly initialised models."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import fp4attn
from fp4attn.metrics import error_metrics
from tests.integrations.tiny_models import tiny_llama


def _qkv(*shape):
    return tuple(torch.randn(shape) for _ in range(3))


def test_patch_sdpa_routes_and_restores():
    q, k, v = _qkv(1, 2, 40, 64)
    original = F.scaled_dot_product_attention
    with fp4attn.patch_sdpa(recipe="fp8") as rec:
        assert rec.name == "fp8"
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention is original
    assert torch.equal(out, fp4attn.attention(q, k, v, causal=True, recipe="fp8"))


def test_patch_sdpa_falls_back_visibly():
    q, k, v = _qkv(1, 2, 40, 24)  # head_dim 24 is not a multiple of 16
    with fp4attn.patch_sdpa():
        with pytest.warns(UserWarning, match="falling back to PyTorch SDPA for head_dim 24"):
            out = F.scaled_dot_product_attention(q, k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same reason warns once
            F.scaled_dot_product_attention(q, k, v)
        with pytest.warns(UserWarning, match="dropout_p=0.1"):
            F.scaled_dot_product_attention(*_qkv(1, 2, 8, 64), dropout_p=0.1)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


transformers = pytest.importorskip("transformers")


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return BertModel(cfg).eval()


def _llama():
    return tiny_llama(vocab_size=100, hidden_size=64, intermediate_size=128, max_positions=64)


def _padded_batch():
    ids = torch.randint(1, 100, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 5:] = 0
    return ids, mask


@pytest.mark.parametrize("make", [_bert, _llama], ids=["bert-encoder", "llama-decoder-gqa"])
def test_transformers_attention_implementation(make):
    from fp4attn.integrations.transformers import register

    assert "fp4attn-bf16" in register()
    ids, mask = _padded_batch()
    model = make()
    want = model(input_ids=ids, attention_mask=mask)[0]
    model.set_attn_implementation("fp4attn-bf16")
    got = model(input_ids=ids, attention_mask=mask)[0]
    keep = mask.bool()
    assert error_metrics(got[keep], want[keep])["rel_l2"] < 2e-2  # padded positions masked as in SDPA
    model.set_attn_implementation("fp4attn")
    fast = model(input_ids=ids, attention_mask=mask)[0]
    assert error_metrics(fast[keep], want[keep])["cos"] > 0.95


def test_torch_compile_fullgraph_training_recipe_backward():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 40, 64))
    f = torch.compile(lambda a, b, c: fp4attn.attention(a, b, c, recipe="train", causal=True), fullgraph=True,
                      backend="aot_eager")
    f(q, k, v).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fp4attn.attention(q, k, v, recipe="train", causal=True).sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert error_metrics(g, t.grad)["cos"] > 0.9999


def test_transformers_rejects_dropout():
    from fp4attn.integrations.transformers import make_attention_forward

    f = make_attention_forward("fp8")
    q, k, v = _qkv(1, 2, 8, 64)
    with pytest.raises(ValueError, match="no attention dropout"):
        f(torch.nn.Module(), q, k, v, None, dropout=0.1)


def test_torch_compile_fullgraph_model():
    from fp4attn.integrations.transformers import register

    register()
    model = _bert()
    model.set_attn_implementation("fp4attn-fp8")
    ids, mask = _padded_batch()
    with torch.no_grad():  # inference: `fp8` has no backward
        eager = model(input_ids=ids, attention_mask=mask)[0]
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = compiled(input_ids=ids, attention_mask=mask)[0]
    assert error_metrics(got, eager)["cos"] > 0.9999
