"""Hugging Face transformers: fp4attn as an attention implementation.

After `register()`, `model.set_attn_implementation("fp4attn")` or
`from_pretrained(..., attn_implementation="fp4attn-fp8")` runs the model's attention
through fp4attn: "fp4attn" uses the default recipe (`fp4attn.DEFAULT_RECIPE`) and
"fp4attn-<preset>" any preset.
Each name is registered with SDPA's mask function as well, so padded batches keep
their mask (transformers 5 builds masks per implementation name).
"""

from __future__ import annotations

import functools

from fp4attn.api import attention
from fp4attn.recipes import DEFAULT_RECIPE, PRESETS, Recipe, get_recipe

DEFAULT_NAME = "fp4attn"


def make_attention_forward(recipe: str | Recipe):
    """An attention function with transformers' signature running `recipe`."""
    rec = get_recipe(recipe)

    def fp4attn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  is_causal=None, **kwargs):
        if dropout:
            raise ValueError(f"fp4attn has no attention dropout (got {dropout}); call model.eval() or set the "
                             "config's attention dropout to 0")
        if kwargs.get("softcap") is not None:
            raise ValueError("fp4attn does not support attention softcapping")
        groups = getattr(module, "num_key_value_groups", 1)
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
        out = attention(query, key, value, attn_mask=attention_mask, causal=causal, scale=scaling, recipe=rec,
                        enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None

    return fp4attn_attention_forward


@functools.cache
def register() -> tuple[str, ...]:
    """Register "fp4attn" and "fp4attn-<preset>" for every preset; returns the names."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    names = {DEFAULT_NAME: DEFAULT_RECIPE, **{f"{DEFAULT_NAME}-{p}": p for p in PRESETS}}
    for name, preset in names.items():
        AttentionInterface.register(name, make_attention_forward(preset))
        AttentionMaskInterface.register(name, sdpa_mask)
    return tuple(names)
