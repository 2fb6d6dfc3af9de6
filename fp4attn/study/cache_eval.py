"""The study GPT evaluated token by token through a quantized KV cache.

Generation reads every earlier token's keys and values from the cache, so the accuracy
that matters for serving is the model's loss when it runs one token at a time, each
block's attention `fp4attn.decode` over an `fp4attn.KVCache` in the format under test.
`cached_loss` does that for held-out batches: the first token attends to itself, token
t to the t + 1 cached ones; the loss is the same next-byte cross-entropy as training's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp4attn.decode import decode
from fp4attn.kvcache import KVCache
from fp4attn.study.gpt import GPT


@torch.no_grad()
def cached_logits(model: GPT, x: torch.Tensor, k_format: str, v_format: str | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """Logits (B, S, vocab) of `model` over byte tokens x (B, S), run one token at a time
    with each block's keys and values in a KVCache of the given formats (a K format
    "<fmt>-rotated" is `fmt` with `KVCache(rotate_k=True)`, "<fmt>-smoothed" with
    `smooth_k=True`, "<fmt>-rotated-smoothed" with both)."""
    cfg = model.cfg
    b, s = x.shape
    heads, head_dim = cfg.heads, cfg.dim // cfg.heads
    smooth = k_format.endswith("-smoothed")
    k_format = k_format.removesuffix("-smoothed")
    rotate = k_format.endswith("-rotated")
    k_format = k_format.removesuffix("-rotated")
    caches = [KVCache(b, heads, head_dim, s, k_format=k_format, v_format=v_format, device=x.device, rotate_k=rotate,
                      smooth_k=smooth) for _ in model.blocks]
    out = []
    for t in range(s):
        h = model.tok(x[:, t:t + 1]) + model.pos(torch.full((1,), t, device=x.device))
        for blk, cache in zip(model.blocks, caches):
            q, k, v = blk.qkv(blk.ln1(h)).view(b, 1, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            y = decode(q, cache, k=k, v=v, backend=backend)  # (B, H, 1, D)
            h = h + blk.proj(y.transpose(1, 2).reshape(b, 1, cfg.dim))
            h = h + blk.mlp(blk.ln2(h))
        out.append(model.ln(h) @ model.tok.weight.T)
    return torch.cat(out, dim=1)


@torch.no_grad()
def cached_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, k_format: str, v_format: str | None = None,
                backend: str = "auto") -> float:
    """Mean next-byte cross-entropy (nats) of `cached_logits` against targets y."""
    logits = cached_logits(model, x, k_format, v_format, backend)
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
