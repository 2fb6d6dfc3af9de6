"""Causal alignment.

"top_left" (SDPA's `is_causal`): query i sees keys j <= i.
"bottom_right" (FlashAttention's `causal`): query i sees keys j <= i + (Sk - Sq), so the
last query sees every key. With Sq > Sk the first Sq - Sk queries then see no key:
their output is 0 and their LSE -inf.
"""

from __future__ import annotations

import torch

CAUSAL_MODES = ("top_left", "bottom_right")


def normalize_causal(causal: bool | str | None) -> str | None:
    """None for non-causal, else one of CAUSAL_MODES. True means "top_left" (SDPA)."""
    if causal is None or causal is False:
        return None
    if causal is True:
        return "top_left"
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return causal
    raise ValueError(f"causal={causal!r} is not supported; accepted: False, True (= 'top_left'), {CAUSAL_MODES}")


def causal_offset(mode: str | None, sq: int, sk: int) -> int | None:
    """Query i sees keys j <= i + offset; None when nothing is masked."""
    if mode is None:
        return None
    return 0 if mode == "top_left" else sk - sq


def key_mask(offset: int | None, rows: torch.Tensor, cols: torch.Tensor, sk: int) -> torch.Tensor:
    """Boolean (len(rows), len(cols)) mask of visible keys, padding keys >= sk hidden."""
    visible = (cols < sk)[None, :].expand(len(rows), len(cols))
    if offset is not None:
        visible = visible & (cols[None, :] <= rows[:, None] + offset)
    return visible


def key_mask_view(attn_mask: torch.Tensor) -> torch.Tensor | None:
    """An SDPA attn_mask as a key mask of shape (b, 1, 1, Sk) (b 1 or B), if it is one:
    by shape, or (eagerly) by content when every query row is the same, as in the
    padding masks transformers expands to (B, 1, Sq, Sk). None for any other mask."""
    shape = (1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)
    if attn_mask.ndim > 4 or shape[1] != 1:
        return None
    m = attn_mask.reshape(shape)
    if shape[2] == 1:
        return m
    if torch.compiler.is_compiling():  # a content test would be a data-dependent branch
        return None
    first = m[:, :, :1, :]
    return first if torch.equal(m, first.expand_as(m)) else None
