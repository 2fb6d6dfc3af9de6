"""The lazy rescale of affine FP8 P on the CUDA C++ forward (Recipe.rescale="lazy",
docs/notes/affine-p.md): the kernel alone, on prepared operands with K scaled per key tile,
in one process beside SDPA cuDNN bf16: the Triton/Gluon kernel that the routing runs below
`cuda_from_keys` (exact and lazy), the exact-rescale build (fp8-ktile-affine-fastacc),
the lazy build (fp8-ktile-affine-lazy-fastacc), and the timing build without any row
maximum (wrong outputs: the ceiling the lazy build approaches where its rows never move),
on Gaussian inputs and on logits `--sharp` times sharper (q and k each scaled by its
square root), where rows move their points more often. Median of triton.testing.do_bench;
a short table last.

    python tools/probe_lazy_rescale.py [--shapes "2,16,16384,128;8,16,4096,128"] [--causal]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/ (the checking build)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8,16,4096,128;4,32,4096,128;2,16,16384,128;1,24,32768,128;4,16,8192,64")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sharp", type=float, default=6.25, help="logit sharpness of the second input kind")
    args = p.parse_args()
    from dev.forward_probe import below_cuda_ms, cell, checking_ms, cudnn_ms
    from fp4attn.cli.output import markdown_table
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe

    builds = {"exact rescale": {"affine_p": True}, "lazy rescale": {"affine_p": True, "lazy_rescale": True},
              "no row max (timing only)": {"affine_p": True, "affine_ablate": 2}}
    rows = []
    for shape in args.shapes.split(";"):
        B, H, S, D = map(int, shape.split(","))
        flops = 4 * B * H * S * S * D / (2 if args.causal else 1)
        for sharp in (1.0, args.sharp):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g) for _ in range(3))
            q, k, v = (q * sharp**0.5).bfloat16(), (k * sharp**0.5).bfloat16(), v.bfloat16()
            base = cudnn_ms(q, k, v, args.causal)
            ops = prepare_operands_fused(q, k, v, get_recipe("fp8-ktile-affine-fastacc"))
            row = [shape, f"{sharp:g}", f"{flops / base * 1e-9:.0f}"]
            # the Triton/Gluon kernel the table runs below `cuda_from_keys`: exact (P mode 4), lazy (7)
            row += [cell(flops, below_cuda_ms(ops, mode, fast_accum=True, causal=args.causal), base) for mode in (4, 7)]
            row += [cell(flops, checking_ms(ops, causal=args.causal, **kw), base) for kw in builds.values()]
            rows.append(row)
            print(" | ".join(row), flush=True)
    head = ["B,H,S,D", "logits x", "cuDNN bf16 TFLOP/s", "Triton/Gluon exact", "Triton/Gluon lazy", *builds]
    print(f"causal={args.causal}")
    print(markdown_table(head, rows))


if __name__ == "__main__":
    main()
