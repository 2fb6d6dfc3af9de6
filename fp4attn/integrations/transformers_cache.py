"""Hugging Face transformers: generation through fp4attn's quantized KV cache.

    from fp4attn.integrations.transformers_cache import FP4AttnCache, register
    register()
    model.set_attn_implementation("fp4attn-cache")
    cache = FP4AttnCache(model.config, max_cache_len=4096, k_format="nvfp4")
    model.generate(input_ids, attention_mask=mask, past_key_values=cache, ...)

`FP4AttnCache` is a transformers `Cache` whose layers each hold an `fp4attn.KVCache`
(preallocated for `max_cache_len`, created at the first update with the model's batch,
heads and device). A layer's `update` quantizes the new keys and values into it and
hands the attention function the new tokens only, marked with their cache: the
"fp4attn-cache" attention function then runs `fp4attn.decode` over the whole cache.
No dequantized copy of the cache is made, at any step.

The prompt (the first forward, many query rows) runs through the same decode path, so
every token's attention reads the quantized cache; its rows beyond 16 a program re-read
the cache (`fp4attn.decode`). Left-padded batches work: the 2-D padding mask
transformers passes becomes each sequence's first visible key (`decode(key_start=)`);
a mask of any other form (holes, right padding) is refused, as is beam search (the
cache does not reorder).
"""

from __future__ import annotations

import functools

import torch

from fp4attn.decode import decode
from fp4attn.kvcache import KVCache, check_head_dim
from fp4attn.reference.kvcache import CACHE_FORMATS

NAME = "fp4attn-cache"
_CACHE_ATTR = "_fp4attn_kvcache"  # set on the key states a layer's update returns


def _cache_classes():
    from transformers.cache_utils import Cache, CacheLayerMixin

    return Cache, CacheLayerMixin


def _layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class FP4AttnCacheLayer(CacheLayerMixin):
        """One layer's `fp4attn.KVCache`, created at the first update."""

        is_compileable = False
        is_sliding = False

        def __init__(self, max_cache_len: int, k_format: str, v_format: str | None, page_size: int | None):
            super().__init__()
            self.max_cache_len, self.k_format, self.v_format, self.page_size = (max_cache_len, k_format, v_format,
                                                                                page_size)
            self.kv: KVCache | None = None

        def lazy_initialization(self, key_states, value_states) -> None:
            b, h, _, d = key_states.shape
            self.kv = KVCache(b, h, d, self.max_cache_len, k_format=self.k_format, v_format=self.v_format,
                              device=key_states.device, page_size=self.page_size)
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            assert self.kv is not None  # made by lazy_initialization, with is_initialized
            self.kv.append(key_states, value_states)
            # the attention function finds the cache on the keys it is handed
            setattr(key_states, _CACHE_ATTR, self.kv)
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_seq_length(self) -> int:
            return self.kv.max_length() if self.kv is not None else 0

        def get_max_length(self) -> int:
            return self.max_cache_len

        def reset(self) -> None:
            if self.kv is not None:
                self.kv.reset()

        def reorder_cache(self, beam_idx) -> None:
            raise NotImplementedError("FP4AttnCache does not reorder (beam search); generate with num_beams=1")

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("FP4AttnCache cannot be cropped")

    return FP4AttnCacheLayer


def FP4AttnCache(config, max_cache_len: int, k_format: str = "nvfp4", v_format: str | None = None,
                 page_size: int | None = None):
    """A transformers `Cache` of fp4attn quantized KV caches, one per decoder layer of
    `config` (a model config; its text config for multimodal models), each holding up
    to `max_cache_len` tokens per sequence in `k_format` / `v_format` ("bf16", "fp8",
    "nvfp4", "mxfp4"; see `fp4attn.KVCache`). Use it with the "fp4attn-cache" attention
    implementation (`register`). The formats, `max_cache_len` and the config's head dim
    (whole blocks of a 4-bit format: `fp4attn.KVCache`) are checked here, before any
    generation."""
    Cache, _ = _cache_classes()
    layer = _layer_class()
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name, fmt in (("k_format", k_format), ("v_format", v_format or k_format)):
        if fmt not in CACHE_FORMATS:
            raise ValueError(f"FP4AttnCache: {name}={fmt!r}; accepted: {CACHE_FORMATS}")
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"FP4AttnCache: max_cache_len={max_cache_len!r}; accepted: a positive int")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    check_head_dim("FP4AttnCache", head_dim, k_format, v_format or k_format)
    layers = [layer(max_cache_len, k_format, v_format, page_size) for _ in range(text.num_hidden_layers)]
    cache = Cache(layers=layers)
    cache.fp4attn_formats = (k_format, v_format or k_format)
    return cache


_LAST_MASK: list = [None, None]  # (mask, its starts): a forward hands every layer the same mask


def _starts_of(mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's first visible key of a left-padded 2-D mask, checked once per mask."""
    if _LAST_MASK[0] is mask:
        return _LAST_MASK[1]
    valid = mask.bool()
    start = (~valid).int().cumprod(-1).sum(-1)  # the leading zeros
    keys = torch.arange(valid.shape[-1], device=valid.device)
    if not torch.equal(valid, keys[None, :] >= start[:, None]):
        raise ValueError("the fp4attn cache takes left-padded batches only (a 2-D attention mask of zeros then "
                         "ones per sequence); this mask has holes or right padding")
    _LAST_MASK[:] = [mask, start.to(torch.int32)]
    return _LAST_MASK[1]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """The "fp4attn-cache" attention function: decode of the new rows over the layer's
    quantized cache (which already holds the new tokens)."""
    kv = getattr(key, _CACHE_ATTR, None)
    if kv is None:
        raise ValueError("attn_implementation 'fp4attn-cache' needs fp4attn's cache: pass "
                         "past_key_values=FP4AttnCache(model.config, max_cache_len=...) to the model or generate()")
    if dropout:
        raise ValueError(f"fp4attn has no attention dropout (got {dropout}); call model.eval()")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("the fp4attn cache supports neither attention softcapping nor sliding windows")
    key_start = None
    if attention_mask is not None:
        if attention_mask.ndim != 2 or attention_mask.shape[-1] != kv.max_length():
            raise ValueError(f"the fp4attn cache takes a 2-D padding mask of the cache's length {kv.max_length()}; "
                             f"got shape {tuple(attention_mask.shape)}")
        key_start = _starts_of(attention_mask)
    out = decode(query, kv, causal=True, scale=scaling, key_start=key_start)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Register the "fp4attn-cache" attention implementation (with transformers' 2-D
    padding mask, which it turns into each sequence's first visible key)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME
