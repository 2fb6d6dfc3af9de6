"""What bounds the affine FP8-P softmax on the CUDA C++ forward (docs/notes/affine-p.md):
the kernel alone, on prepared operands, in one process beside SDPA cuDNN bf16: the routed
exp2 build (fp8-fastacc), the affine form on the Triton/Gluon kernel the table runs below
`cuda_from_keys`, the affine build (fp8-affine-fastacc), the affine build without
the key-scale product and without the row maximum (timing builds, wrong outputs), and the
build without any softmax (the ceiling of loads, products and turn-taking). Median of
triton.testing.do_bench; a short table last.

    python tools/probe_affine_bound.py [--shapes "2,16,16384,128;8,16,4096,128"]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's dev/ (the checking build)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8,16,4096,128;2,16,16384,128;1,24,32768,128;4,16,8192,64")
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    from dev.forward_probe import below_cuda_ms, cell, checking_ms, cudnn_ms
    from fp4attn.kernels.hopper.operands import prepare_operands_fused
    from fp4attn.recipes import get_recipe

    builds = {"exp2 (fp8-fastacc)": {}, "affine (fp8-affine-fastacc)": {"affine_p": True},
              "affine, no key-scale product": {"affine_p": True, "affine_ablate": 1},
              "affine, no key scale, no row max": {"affine_p": True, "affine_ablate": 2},
              "no softmax": {"ablate_softmax": True}}
    rows = []
    for shape in args.shapes.split(";"):
        B, H, S, D = map(int, shape.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16() for _ in range(3))
        flops = 4 * B * H * S * S * D / (2 if args.causal else 1)
        base = cudnn_ms(q, k, v, args.causal)
        ops = prepare_operands_fused(q, k, v, get_recipe("fp8-fastacc"))
        row = [shape, f"{flops / base * 1e-9:.0f}"]
        # the Triton/Gluon kernel the table runs below `cuda_from_keys` (P mode 4: affine FP8 P)
        row.append(cell(flops, below_cuda_ms(ops, 4, fast_accum=True, causal=args.causal), base))
        row += [cell(flops, checking_ms(ops, causal=args.causal, **kw), base) for kw in builds.values()]
        rows.append(row)
        print(" | ".join(row), flush=True)
    head = ["B,H,S,D", "cuDNN bf16 TFLOP/s", "affine, Triton/Gluon kernel", *builds]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
