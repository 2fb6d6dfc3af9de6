"""The per-key-tile FP8 K quantizer on the GPU against the reference, bit for bit (a quick
check before the GPU tests that use it): exit status 1 on a difference."""

import sys

import torch

from fp4attn.kernels.quantize.fp8 import quantize_k_fp8_tiles
from fp4attn.reference.operands import quantize_qk

bad = 0
g = torch.Generator(device="cuda").manual_seed(0)
for S, D in ((300, 64), (4096, 128), (239, 128), (3, 128)):
    x = (torch.randn(2, 3, S, D, device="cuda", generator=g) * 3).bfloat16()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        y, s = quantize_k_fp8_tiles(x, 128, dtype)
        ref = quantize_qk(x, "fp8", tile=128)
        ok = torch.equal(y.float(), ref.values) and torch.equal(s, ref.scale.squeeze(-1))
        bad += not ok
        print(f"S={S} D={D} {dtype}: {'identical' if ok else 'DIFFERENT'} (values equal "
              f"{(y.float() == ref.values).float().mean().item():.4f}, scales equal "
              f"{(s == ref.scale.squeeze(-1)).float().mean().item():.4f})")
sys.exit(1 if bad else 0)
