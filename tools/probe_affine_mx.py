"""Affine MXFP4 P (P mode 5) on the CUDA C++ forward against what it replaces: the kernel
alone, on prepared operands, in one process beside SDPA cuDNN bf16: the Triton kernel the
routing ran it on before (P mode 5), the CUDA builds (K scaled per token as
`fp8-directp-fast-fastacc`, and per key tile), and the affine FP8 P build of the same
operands' Q/K (`fp8-affine-fastacc`, `fp8-ktile-affine-fastacc`) for the cost of the MXFP4
lookup; with --exact, the exact recipes (Q/K in bf16, QK^T on the bf16 tensor cores) on the
CUDA kernel against the Triton/Gluon kernels that run them. Median of
triton.testing.do_bench; a short table last.

    python tools/probe_affine_mx.py [--shapes "8,16,4096,128;2,16,16384,128"] [--causal] [--exact]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/ (the checking build)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8,16,4096,128;4,32,4096,128;2,16,16384,128;1,24,32768,128;16,16,2048,64;"
                                       "4,16,8192,64")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--exact", action="store_true", help="also the exact recipes, bf16 Q/K on the CUDA kernel against "
                                                        "the Triton/Gluon kernels")
    args = p.parse_args()
    from dev.forward_probe import below_cuda_ms, cell, checking_ms, cudnn_ms
    from fp4attn.cli.output import markdown_table
    from fp4attn.kernels.hopper.forward_cuda import P_MODE_BUILDS
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe

    mx = get_recipe("fp8-directp-fast-fastacc")
    mx_tile = dataclasses.replace(mx, k_scale="tile", name=None)
    # (column, recipe of the operands, P mode, CUDA build fields beyond the P mode's; None: the
    # Triton/Gluon kernel the routing runs below its CUDA key counts)
    builds = [("MX Triton", mx, 5, None),
              ("MX CUDA", mx, 5, {}),
              ("MX CUDA, subtraction", mx, 5, {"mx_subnormal": False}),
              ("MX CUDA, K per tile", mx_tile, 5, {}),
              ("FP8 affine CUDA", get_recipe("fp8-affine-fastacc"), 4, {}),
              ("FP8 affine CUDA, K per tile", get_recipe("fp8-ktile-affine-fastacc"), 4, {})]
    if args.exact:
        builds += [(f"{name} {'CUDA bf16 QK' if kw is not None else 'Triton/Gluon'}", get_recipe(name), mode, kw)
                   for name, mode in (("directp-fast", 5), ("fp8-directp-fast", 5), ("fp8-affine", 4), ("fp8", 0),
                                      ("nvfp4-fp8", 0))
                   for kw in (None, {})]
    rows = []
    for shape in args.shapes.split(";"):
        B, H, S, D = map(int, shape.split(","))
        flops = 4 * B * H * S * S * D / (2 if args.causal else 1)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16() for _ in range(3))
        base = cudnn_ms(q, k, v, args.causal)
        row = [shape, f"{flops / base * 1e-9:.0f}"]
        for _, recipe, mode, kw in builds:
            ops = prepare_operands_fused(q, k, v, recipe)
            if kw is None:
                ms = below_cuda_ms(ops, mode, fast_accum=recipe.fast_accum, causal=args.causal)
            else:
                ms = checking_ms(ops, causal=args.causal, persistent=not args.causal, **P_MODE_BUILDS[mode], **kw)
            row.append(cell(flops, ms, base))
        rows.append(row)
        print(" | ".join(row), flush=True)
    print(f"causal={args.causal}")
    print(markdown_table(["B,H,S,D", "cuDNN bf16 TFLOP/s", *(name for name, *_ in builds)], rows))


if __name__ == "__main__":
    main()
