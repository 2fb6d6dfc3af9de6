"""Where does the Hopper forward disagree with the reference? For one problem per
recipe: output cosine vs the reference with and without the debug output, and the
fraction of identical P bytes."""

import torch

import fp4attn.kernels.hopper.ops as ops
from fp4attn.formats import encode_fp8
from fp4attn.metrics import error_metrics
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward

torch.manual_seed(0)
for name in ["fp8", "nvfp4-fp8", "fp8-directp", "directp"]:
    for d, sq, sk in [(64, 128, 128), (128, 256, 1024), (128, 1024, 4096)]:
        q, k, v = (torch.randn(1, 2, s, d, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
        r = PRESETS[name]
        ref = reference_forward(q, k, v, r, scale=d**-0.5, return_p=True)
        want = encode_fp8(ref.p * 256, "e4m3").view(torch.uint8)
        out0, _, _ = ops.hopper_attention(q, k, v, r, scale=d**-0.5, causal_offset=None)
        out1, _, p = ops.hopper_attention(q, k, v, r, scale=d**-0.5, causal_offset=None, write_p=1)
        got = encode_fp8(p[..., :sq, :], "e4m3").view(torch.uint8)
        print(f"{name} d={d} sq={sq} sk={sk} cos plain={error_metrics(out0, ref.out)['cos']:.6f} "
              f"cos debug={error_metrics(out1, ref.out)['cos']:.6f} P same={(got == want).float().mean().item():.5f}")
