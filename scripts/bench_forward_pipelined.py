"""The Gluon forward (`kernels/hopper/forward_pipelined.py`) against the Triton one, one
run: first the outputs on awkward shapes (they compute the same arithmetic, so out and
LSE should agree to fp32 summation order), then kernel-alone TFLOP/s of both and SDPA
cuDNN bf16 on the bench shapes.

    python scripts/bench_forward_pipelined.py [--recipes fp8,nvfp4-fp8,fp8-directp,directp]
        [--shapes 8,16,4096,128/16,16,2048,64] [--causal both]
"""

import argparse

import torch
import triton

from fp4attn.kernels.hopper.forward_pipelined import launch_forward_pipelined
from fp4attn.kernels.hopper.ops import P_MODES, launch_forward
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS

bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
ap = argparse.ArgumentParser()
ap.add_argument("--recipes", default="fp8,nvfp4-fp8,fp8-directp,directp")
ap.add_argument("--shapes", default="8,16,4096,128/4,32,4096,128/16,16,2048,64")
ap.add_argument("--causal", default="both", choices=("both", "no", "yes"))
args = ap.parse_args()
RECIPES = args.recipes.split(",")
CAUSAL = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]


def run_both(q, k, v, r, causal_offset):
    ops = prepare_operands_fused(q, k, v, r)
    mode = P_MODES[(r.p, r.p_build)]
    kw = dict(scale=q.shape[-1] ** -0.5, causal_offset=causal_offset, p_mode=mode)
    return ops, kw, launch_forward(ops, **kw)[:2], launch_forward_pipelined(ops, **kw)


print("| recipe | B,H,Hkv,Sq,Sk,D | causal | max abs out diff | out rel L2 diff | max abs lse diff | bf16 equal |")
print("|---|---|---|---|---|---|---|")
torch.manual_seed(0)
for B, H, Hkv, Sq, Sk, D in ((1, 2, 2, 1, 3, 128), (2, 4, 2, 113, 239, 128), (1, 3, 1, 1023, 1023, 64),
                             (1, 2, 2, 256, 4096, 128), (2, 2, 1, 640, 640, 128)):
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16) * 2
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16) * 2
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
    for name in RECIPES:
        for causal in CAUSAL:
            off = (Sk - Sq) if causal else None
            _, _, (o1, l1), (o2, l2) = run_both(q, k, v, PRESETS[name], off)
            d = (o1.float() - o2.float())
            fin = torch.isfinite(l1)
            print(f"| {name} | {B},{H},{Hkv},{Sq},{Sk},{D} | {causal} | {d.abs().max().item():.3g} | "
                  f"{(d.norm() / o1.float().norm()).item():.3g} | "
                  f"{(l1[fin] - l2[fin]).abs().max().item() if fin.any() else 0:.3g} "
                  f"(inf {torch.equal(~fin, ~torch.isfinite(l2))}) | {(o1 == o2).float().mean().item():.4f} |")

print("\n| B,H,S,D | causal | recipe | cuDNN bf16 | Triton | Gluon pipelined |")
print("|---|---|---|---|---|---|")
for B, H, S, D in (tuple(map(int, s.split(","))) for s in args.shapes.split("/")):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in CAUSAL:
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            base = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        for name in RECIPES:
            ops, kw, _, _ = run_both(q, k, v, PRESETS[name], 0 if causal else None)
            t1 = bench(lambda: launch_forward(ops, **kw))
            t2 = bench(lambda: launch_forward_pipelined(ops, **kw))
            print(f"| {B},{H},{S},{D} | {causal} | {name} | {flops / base * 1e-9:.0f} | "
                  f"{flops / t1 * 1e-9:.0f} ({base / t1:.2f}x) | {flops / t2 * 1e-9:.0f} ({base / t2:.2f}x) |")
