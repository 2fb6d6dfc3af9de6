"""diffusers: run a model's attention through fp4attn.

diffusers' attention-backend registry is closed to outside packages, so fp4attn enters
through attention processors: `FP4AttnProcessor` wraps the processor a module already
has, and runs it with `F.scaled_dot_product_attention` routed to fp4attn
(`patch_sdpa`; calls fp4attn cannot honour fall back to PyTorch with a warning).
Processors that compute attention without SDPA are unaffected.
"""

from __future__ import annotations

from fp4attn.integrations.sdpa import patch_sdpa
from fp4attn.recipes import DEFAULT_RECIPE, Recipe, get_recipe


class FP4AttnProcessor:
    """A diffusers attention processor that runs `inner` with fp4attn's SDPA."""

    def __init__(self, inner, recipe: str | Recipe = DEFAULT_RECIPE):
        self.inner = inner
        self.recipe = get_recipe(recipe)

    def __call__(self, attn, *args, **kwargs):
        with patch_sdpa(self.recipe):
            return self.inner(attn, *args, **kwargs)


def use_fp4attn(pipe_or_model, recipe: str | Recipe = DEFAULT_RECIPE):
    """Install `FP4AttnProcessor` on every attention module of a pipeline's denoiser
    (`transformer` or `unet`) or of a model; returns the model changed."""
    model = pipe_or_model
    for attr in ("transformer", "unet"):
        if getattr(pipe_or_model, attr, None) is not None:
            model = getattr(pipe_or_model, attr)
            break
    rec = get_recipe(recipe)
    modules = [m for m in model.modules() if hasattr(m, "set_processor") and hasattr(m, "processor")] \
        if hasattr(model, "modules") else []
    if not modules:
        raise TypeError(f"{type(model).__name__} has no attention processors (expected a diffusers model or pipeline)")
    for m in modules:
        m.set_processor(FP4AttnProcessor(getattr(m.processor, "inner", m.processor), rec))
    return model
