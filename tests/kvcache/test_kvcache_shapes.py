"""KV cache head dims and failures: bf16 and FP8 caches take every head dim attention
takes (one scale per token), the 4-bit formats whole blocks (NVFP4 16 channels, MXFP4
32), said when the cache is made, `FP4AttnCache` included; a decode that raises leaves
the cache as it was (its lengths and pages), on every path."""

import importlib

import pytest
import torch

import fp4attn
from fp4attn.kvcache import KVCache
from fp4attn.reference.kvcache import HEAD_DIM_MULTIPLES


@pytest.mark.parametrize("fmt,dims", [("bf16", (16, 48, 80, 112, 256)), ("fp8", (16, 48, 80, 256)),
                                      ("nvfp4", (16, 48, 80)), ("mxfp4", (32, 96, 160))])
def test_every_head_dim_of_the_format(fmt, dims):
    g = torch.Generator().manual_seed(0)
    for d in dims:
        cache = KVCache(2, 2, d, 20, k_format=fmt)
        k, v = (torch.randn(2, 2, 5, d, generator=g) for _ in range(2))
        q = torch.randn(2, 4, 2, d, generator=g)
        out = fp4attn.decode(q, cache, k=k, v=v)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
            attn_mask=torch.ones(2, 5, dtype=torch.bool).tril(3))
        assert out.shape == q.shape and torch.isfinite(out).all(), (fmt, d)
        bound = {"bf16": 0.02, "fp8": 0.1, "nvfp4": 0.3, "mxfp4": 0.3}[fmt]
        assert float((out - want).norm() / want.norm()) < bound, (fmt, d)


@pytest.mark.parametrize("k_format,v_format,d,need", [("nvfp4", None, 24, "nvfp4: a multiple of 16"),
                                                       ("mxfp4", None, 48, "mxfp4: a multiple of 32"),
                                                       ("bf16", "mxfp4", 16, "bf16: any, mxfp4: a multiple of 32"),
                                                       ("fp8", None, 0, "fp8: any")])
def test_the_cache_says_each_formats_multiple_when_made(k_format, v_format, d, need):
    with pytest.raises(ValueError, match=f"KVCache: head_dim={d} .*accepted: .*{need}"):
        KVCache(1, 1, d, 8, k_format=k_format, v_format=v_format)
    assert HEAD_DIM_MULTIPLES == {"bf16": 1, "fp8": 1, "nvfp4": 16, "mxfp4": 32}


def test_fp4attn_cache_checks_at_construction():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from fp4attn.integrations.transformers_cache import FP4AttnCache

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=64, vocab_size=50)  # head dim 16
    FP4AttnCache(config, max_cache_len=32, k_format="bf16")
    FP4AttnCache(config, max_cache_len=32, k_format="nvfp4")
    with pytest.raises(ValueError, match="FP4AttnCache: head_dim=16 .*mxfp4: a multiple of 32"):
        FP4AttnCache(config, max_cache_len=32, k_format="mxfp4")
    with pytest.raises(ValueError, match="FP4AttnCache: k_format='fp4'"):
        FP4AttnCache(config, max_cache_len=32, k_format="fp4")
    with pytest.raises(ValueError, match="FP4AttnCache: max_cache_len=0"):
        FP4AttnCache(config, max_cache_len=0)


def _state(cache):
    return (list(cache.host_lengths), cache.lengths.tolist(), cache.block_table.clone(),
            list(getattr(cache, "_free", [])), list(getattr(cache, "_owner", [])))


@pytest.mark.parametrize("paged", [False, True])
def test_a_failed_decode_leaves_the_cache_as_it_was(paged, monkeypatch):
    g = torch.Generator().manual_seed(1)
    cache = KVCache(2, 1, 32, 16, k_format="nvfp4", page_size=4 if paged else None)
    cache.append(torch.randn(2, 1, 3, 32, generator=g), torch.randn(2, 1, 3, 32, generator=g))
    before = _state(cache)
    q = torch.randn(2, 2, 2, 32, generator=g)
    k, v = (torch.randn(2, 1, 2, 32, generator=g) for _ in range(2))

    def broken(*args, **kwargs):
        raise RuntimeError("the attention step failed")

    monkeypatch.setattr(importlib.import_module("fp4attn.decode"), "reference_decode", broken)
    with pytest.raises(RuntimeError, match="the attention step failed"):
        fp4attn.decode(q, cache, k=k, v=v)
    after = _state(cache)
    assert after[:2] == before[:2] and torch.equal(after[2], before[2]) and after[3:] == before[3:]
    monkeypatch.undo()
    # and the cache works on: the same step again gives what a fresh cache gives
    fresh = KVCache(2, 1, 32, 16, k_format="nvfp4", page_size=4 if paged else None)
    fresh.append(*(t for t in _first_append(cache)))
    assert torch.equal(fp4attn.decode(q, cache, k=k, v=v), fp4attn.decode(q, fresh, k=k, v=v))


def _first_append(cache):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 1, 3, 32, generator=g), torch.randn(2, 1, 3, 32, generator=g)


def test_a_failed_append_leaves_the_cache_as_it_was(monkeypatch):
    cache = KVCache(2, 1, 32, 16, k_format="fp8", page_size=4)
    cache.append(torch.randn(2, 1, 3, 32), torch.randn(2, 1, 3, 32))
    before = _state(cache)
    monkeypatch.setattr(KVCache, "_append_reference", lambda *a: (_ for _ in ()).throw(RuntimeError("write failed")))
    with pytest.raises(RuntimeError, match="write failed"):
        cache.append(torch.randn(2, 1, 4, 32), torch.randn(2, 1, 4, 32))
    after = _state(cache)
    assert after[:2] == before[:2] and torch.equal(after[2], before[2]) and after[3:] == before[3:]
