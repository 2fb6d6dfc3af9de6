"""Where does the Hopper Direct-P tile disagree with the reference? On exact (NVFP4)
scores, prints mismatching entries with their log2 score, block maximum and values."""


import torch

import fp4attn.kernels.hopper.ops as ops
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward
from fp4attn.reference.forward import log2_scores
from fp4attn.reference.operands import quantize_qk

torch.manual_seed(0)
d, sq, sk = 64, 128, 128
q, k, v = (torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
for name in ["directp", "nvfp4-fp8"]:
    r = PRESETS[name]
    ref = reference_forward(q, k, v, r, scale=d**-0.5, return_p=True)
    _, _, p = ops.hopper_attention(q, k, v, r, scale=d**-0.5, causal_offset=None, write_p=1)
    _, _, t = ops.hopper_attention(q, k, v, r, scale=d**-0.5, causal_offset=None, write_p=2)
    got, want = p[0, 0, :sq], ref.p[0, 0] * 256
    t_ref = log2_scores(quantize_qk(q, r.qk), quantize_qk(k, r.qk), d**-0.5, slice(None))[0, 0]
    x = t_ref - t_ref.amax(-1, keepdim=True)
    xb = x.reshape(sq, -1, 32).amax(-1)
    bad = (got != want).nonzero().tolist()
    print(name, "mismatches", len(bad), "of", got.numel(), "t maxerr", (t[0, 0, :sq] - t_ref).abs().max().item())
    for i, j in bad[:12]:
        print(f"  row {i} col {j} x={x[i, j].item():.6f} block max={xb[i, j // 32].item():.6f} "
              f"got={got[i, j].item()} want={want[i, j].item()}")
    if bad:
        cols = torch.tensor([j for _, j in bad])
        print("  mismatches by col % 32:", torch.bincount(cols % 32, minlength=32).tolist())
