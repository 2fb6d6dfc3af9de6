"""A small GPT whose attention is fp4attn in a chosen recipe (or PyTorch SDPA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from fp4attn.api import attention


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 1024
    layers: int = 8
    dim: int = 512
    heads: int = 8  # head dim = dim // heads; 64 runs on every backend
    activation_checkpointing: bool = False  # recompute each block in the backward


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attn: str):
        super().__init__()
        self.heads, self.attn = cfg.heads, attn
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim, bias=False))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = attention(q, k, v, causal=True, recipe=self.attn)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """attn: "sdpa" (PyTorch) or an fp4attn recipe with a backward ("train", ...)."""

    def __init__(self, cfg: GPTConfig, attn: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, attn) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.ln(x) @ self.tok.weight.T
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
