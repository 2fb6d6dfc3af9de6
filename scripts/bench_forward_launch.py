"""Forward launch shapes, one run: 128-row programs of 8 warps (one per SM at 255
registers) against 64-row programs of 4 warps (two per SM, so one program's softmax
can overlap the other's products). Kernel alone, TFLOP/s and ratio to SDPA cuDNN bf16.

    python scripts/bench_forward_launch.py [--launches 128,8,3/64,4,2] [--recipes fp8,nvfp4-fp8]
        [--shapes 8,16,4096,128/16,16,2048,64] [--causal no]
"""

import argparse
import os

import torch
import triton

from fp4attn.cli.bench import _sdpa, visible_pairs
from fp4attn.kernels.hopper.ops import LAUNCH_ENV, P_MODES, launch_forward
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS

sdpa_cudnn = _sdpa("sdpa-cudnn")
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
ap = argparse.ArgumentParser()
ap.add_argument("--launches", default="128,8,3/64,4,2/64,4,2,1")
ap.add_argument("--recipes", default="nvfp4-fp8,fp8")
ap.add_argument("--shapes", default="8,16,4096,128")
ap.add_argument("--causal", default="both", choices=("both", "no", "yes"))
args = ap.parse_args()
LAUNCHES = args.launches.split("/")
RECIPES = args.recipes.split(",")
SHAPES = [tuple(map(int, s.split(","))) for s in args.shapes.split("/")]
CAUSAL = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
print("| B,H,S,D | causal | recipe | " + " | ".join(f"launch {c}" for c in LAUNCHES) + " |")
print("|---|---|---|" + "---|" * len(LAUNCHES))
for B, H, S, D in SHAPES:
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in CAUSAL:
        flops = 4 * B * H * D * visible_pairs(S, S, causal)
        base = bench(lambda: sdpa_cudnn(q, k, v, causal))
        for name in RECIPES:
            r = PRESETS[name]
            ops = prepare_operands_fused(q, k, v, r)
            cells = []
            for launch in LAUNCHES:
                os.environ[LAUNCH_ENV] = launch
                ms = bench(lambda: launch_forward(ops, scale=D**-0.5, causal_offset=0 if causal else None,
                                                  p_mode=P_MODES[(r.p, r.p_build)]))
                cells.append(f"{flops / ms * 1e-9:.0f} ({base / ms:.2f}x)")
            os.environ.pop(LAUNCH_ENV)
            print(f"| {B},{H},{S},{D} | {causal} | {name} | " + " | ".join(cells) + " |")
