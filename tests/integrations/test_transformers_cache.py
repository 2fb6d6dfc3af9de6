"""transformers generation through fp4attn's quantized KV cache (CPU, reference decode):
a tiny random Llama-style model (GQA) generates with `FP4AttnCache`, each step's scores
those of the model run over the whole sequence, left-padded batches as their sequences
alone, the attention handed only the new tokens (no dequantized cache), and clear
errors for what the cache does not do."""

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp4attn.integrations.transformers_cache import FP4AttnCache, register  # noqa: E402
from tests.integrations.tiny_models import tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv("FP4ATTN_BACKEND", "reference")


def _llama():
    return tiny_llama(vocab_size=97, hidden_size=128, intermediate_size=256, max_positions=128)


def _cache_model():
    """The tiny Llama with fp4attn's cache attention registered and set."""
    register()
    model = _llama()
    model.set_attn_implementation("fp4attn-cache")
    return model


def _cache_kwarg(model, cache) -> dict:
    # transformers >= 5.2x names it `cache` (and still takes `past_key_values`)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def _generate(model, ids, mask, cache, steps=6):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                         return_dict_in_generate=True, output_scores=True, **_cache_kwarg(model, cache))
    return out.sequences, torch.stack(out.scores, 1)  # (B, steps, vocab)


def test_generate_through_the_cache_scores_as_the_model_over_the_whole_sequence():
    register()
    model = _llama()
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.ones_like(ids)
    model.set_attn_implementation("fp4attn-cache")
    seq, scores = _generate(model, ids, mask, FP4AttnCache(model.config, max_cache_len=32, k_format="bf16"))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(input_ids=seq).logits[:, ids.shape[1] - 1:-1]
    # bf16 cache, bf16 queries and P: about 1e-3 of the logits
    assert ((scores - full).norm() / full.norm()) < 2e-2


def test_quantized_formats_generate_and_stay_close_to_the_bf16_cache():
    model = _cache_model()
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.ones_like(ids)
    _, base = _generate(model, ids, mask, FP4AttnCache(model.config, max_cache_len=32, k_format="bf16"))
    for fmt in ("fp8", "nvfp4", "mxfp4"):
        _, got = _generate(model, ids, mask, FP4AttnCache(model.config, max_cache_len=32, k_format=fmt))
        assert torch.isfinite(got).all()
        # the first step's scores (later steps follow tokens that may differ)
        cos = torch.nn.functional.cosine_similarity(got[:, 0].flatten(), base[:, 0].flatten(), 0)
        assert cos > (0.999 if fmt == "fp8" else 0.98), (fmt, float(cos))


def test_a_left_padded_batch_generates_as_its_sequences_alone():
    model = _cache_model()
    ids = torch.randint(1, 97, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # sequence 1: 6 tokens, left-padded
    _, batched = _generate(model, ids, mask, FP4AttnCache(model.config, max_cache_len=32, k_format="nvfp4"))
    for b, keep in ((0, slice(0, 10)), (1, slice(4, 10))):
        one = ids[b:b + 1, keep]
        _, alone = _generate(model, one, torch.ones_like(one), FP4AttnCache(model.config, max_cache_len=32,
                                                                             k_format="nvfp4"))
        assert torch.allclose(batched[b], alone[0], rtol=1e-3, atol=1e-3), b


def test_the_attention_is_handed_the_new_tokens_only():
    model = _cache_model()
    seen = []
    import fp4attn.integrations.transformers_cache as tc

    original = tc.decode

    def spy(q, kv, **kwargs):
        seen.append((q.shape[2], kv.max_length()))
        return original(q, kv, **kwargs)

    tc.decode = spy
    try:
        ids = torch.randint(1, 97, (1, 5))
        _generate(model, ids, torch.ones_like(ids), FP4AttnCache(model.config, max_cache_len=16), steps=3)
    finally:
        tc.decode = original
    # per layer: the prompt's 5 rows over 5 cached tokens, then one row over 6, 7
    assert seen == [(5, 5)] * 2 + [(1, 6)] * 2 + [(1, 7)] * 2


def test_what_the_cache_does_not_do_is_refused():
    model = _cache_model()
    ids = torch.randint(1, 97, (1, 5))
    with pytest.raises(ValueError, match="needs fp4attn's cache"):
        model(input_ids=ids)
    with pytest.raises(NotImplementedError, match="num_beams=1"):
        model.generate(input_ids=ids, max_new_tokens=3, num_beams=2, do_sample=False,
                       **_cache_kwarg(model, FP4AttnCache(model.config, max_cache_len=16)))
    mask = torch.ones(1, 5, dtype=torch.long)
    mask[0, 2] = 0  # a hole
    with pytest.raises(ValueError, match="left-padded batches only"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **_cache_kwarg(model, FP4AttnCache(model.config, max_cache_len=16)))
