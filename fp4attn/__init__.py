"""fp4attn: FP4 FlashAttention for PyTorch with bit-faithful NVFP4/MXFP4 numerics."""

from fp4attn.api import ReferenceFallbackWarning, attention, explain
from fp4attn.decode import decode
from fp4attn.integrations.sdpa import patch_sdpa
from fp4attn.kvcache import KVCache
from fp4attn.recipes import DEFAULT_RECIPE, PRESETS, Recipe, get_recipe

__all__ = ["DEFAULT_RECIPE", "KVCache", "PRESETS", "Recipe", "ReferenceFallbackWarning", "attention", "decode", "explain",
           "get_recipe", "patch_sdpa"]
__version__ = "0.1.0"
