"""`patch_sdpa`: route `torch.nn.functional.scaled_dot_product_attention` to fp4attn.

The route is a `torch.overrides.TorchFunctionMode`, whose stack is per thread: a block
changes the SDPA calls of the thread that entered it and of nothing else (another
thread, or code after the block, keeps PyTorch's SDPA), and blocks nest, the innermost
deciding. `torch.nn.functional.scaled_dot_product_attention` itself is never replaced.

Calls fp4attn cannot honour go to PyTorch's own SDPA, visibly: one warning per reason
(dropout, a head dim fp4attn does not take, ...: what `fp4attn.attention` refuses),
never silently.
"""

from __future__ import annotations

import contextlib
import warnings

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fp4attn.api import _checked, attention
from fp4attn.recipes import DEFAULT_RECIPE, Recipe, get_recipe


def _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, recipe) -> str | None:
    """Why fp4attn cannot run this SDPA call (what `fp4attn.attention` would refuse), or None."""
    if dropout_p:
        return f"dropout_p={dropout_p} (fp4attn has no attention dropout)"
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal"
    try:
        _checked(query, key, value, attn_mask, None, recipe, enable_gqa, bool(is_causal))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


class _SDPAMode(TorchFunctionMode):
    """Runs `F.scaled_dot_product_attention` calls as fp4attn in `recipe`; every other
    function unchanged. While a call is handled the mode is off (the torch function mode
    stack pops it), so the fallback to PyTorch's SDPA does not come back here."""

    def __init__(self, recipe: Recipe, backend: str):
        super().__init__()
        self.recipe, self.backend = recipe, backend
        self.warned: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.sdpa(*args, **kwargs)

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        reason = _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, self.recipe)
        if reason is not None:
            if reason not in self.warned:
                self.warned.add(reason)
                warnings.warn(f"fp4attn.patch_sdpa: falling back to PyTorch SDPA for {reason}", stacklevel=3)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return attention(query, key, value, attn_mask=attn_mask, causal=is_causal, scale=scale,
                         recipe=self.recipe, enable_gqa=enable_gqa, backend=self.backend)


@contextlib.contextmanager
def patch_sdpa(recipe: str | Recipe = DEFAULT_RECIPE, backend: str = "auto"):
    """Within the block, `F.scaled_dot_product_attention` runs fp4attn in `recipe`, in
    the thread that entered the block only; blocks nest (the innermost one decides).

    Example:
        with fp4attn.patch_sdpa(recipe="fp8"):
            out = model(inputs)   # every SDPA call inside uses fp4attn

    Every torch function called in the block passes through the mode (a Python call
    each); only SDPA's are changed.
    """
    rec = get_recipe(recipe)
    with _SDPAMode(rec, backend):
        yield rec
