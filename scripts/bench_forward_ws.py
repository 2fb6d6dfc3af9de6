"""The warp-specialized Gluon forward (`forward_pipelined.attn_fwd_ws_kernel`: a producer
warp loading K/V^T by TMA, consumer warpgroups that wait only on mbarriers) against the
routed Triton kernel, one run: first the outputs on awkward shapes (the same arithmetic
as the Triton kernel's `pv_add` path: out and LSE should be equal up to the FMA
contraction of O's update), then kernel-alone TFLOP/s of each variant and SDPA cuDNN
bf16 on the bench shapes.

    python scripts/bench_forward_ws.py [--recipes nvfp4-fp8,fp8,directp]
        [--shapes 8,16,4096,128/2,16,16384,128] [--causal both] [--no-check]
        [--variants 0:2,0:3,2:2,1:2]

A variant is `partitions:stages` (`forward_pipelined.ws_launch`).
"""

import argparse

import torch
import triton

from fp4attn.cli.bench import kernel_script_args, timing_cases
from fp4attn.kernels.hopper.forward_pipelined import launch_forward_pipelined
from fp4attn.kernels.hopper.ops import P_MODES, launch_forward
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS

bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
ap = argparse.ArgumentParser()
ap.add_argument("--variants", default="0:2,0:3,2:2,1:2")
args = kernel_script_args(ap, shapes="8,16,4096,128/2,16,16384,128", recipes="nvfp4-fp8,fp8,directp",
                          no_check_help="skip the output comparison on awkward shapes")
VARIANTS = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]


def prepared(q, k, v, name, causal_offset):
    r = PRESETS[name]
    ops = prepare_operands_fused(q, k, v, r)
    return ops, dict(scale=q.shape[-1] ** -0.5, causal_offset=causal_offset, p_mode=P_MODES[(r.p, r.p_build)])


def ws(ops, kw, partitions, stages):
    return launch_forward_pipelined(ops, **kw, warp_specialized=True, partitions=partitions, stages=stages)


CHECK_SHAPES = ((1, 2, 2, 1, 3, 128), (2, 4, 2, 113, 239, 128), (1, 2, 2, 256, 4096, 128), (2, 2, 1, 640, 640, 128),
                (1, 3, 1, 1023, 1023, 64))
if not args.no_check:
    print("| recipe | B,H,Hkv,Sq,Sk,D | causal | variant | max abs out diff | out rel L2 diff | max abs lse diff "
          "| bf16 equal | finite |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|")
torch.manual_seed(0)
for B, H, Hkv, Sq, Sk, D in () if args.no_check else CHECK_SHAPES:
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16) * 2
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16) * 2
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
    for name in args.recipes:
        for causal in args.causal:
            ops, kw = prepared(q, k, v, name, (Sk - Sq) if causal else None)
            o1, l1 = launch_forward(ops, **kw)[:2]
            for part, stages in VARIANTS:
                o2, l2 = ws(ops, kw, part, stages)
                torch.cuda.synchronize()
                d = o1.float() - o2.float()
                fin = torch.isfinite(l1)
                print(f"| {name} | {B},{H},{Hkv},{Sq},{Sk},{D} | {causal} | {part}:{stages} | {d.abs().max().item():.3g} "
                      f"| {(d.norm() / o1.float().norm()).item():.3g} | "
                      f"{(l1[fin] - l2[fin]).abs().max().item() if fin.any() else 0:.3g} "
                      f"(inf {torch.equal(~fin, ~torch.isfinite(l2))}) | {(o1 == o2).float().mean().item():.4f} | "
                      f"{bool(torch.isfinite(o2).all())} |", flush=True)

head = " | ".join(f"WS {p}:{s}" for p, s in VARIANTS)
print(f"\n| B,H,S,D | causal | recipe | cuDNN bf16 | Triton | {head} |")
print("|---|---|---|---|---|" + "---|" * len(VARIANTS), flush=True)
for (B, H, S, D), causal, (q, k, v), flops, base in timing_cases(args.shapes, args.causal, bench):
    for name in args.recipes:
        ops, kw = prepared(q, k, v, name, 0 if causal else None)
        cells = []
        for f in [lambda: launch_forward(ops, **kw)] + [lambda p=p, s=s: ws(ops, kw, p, s) for p, s in VARIANTS]:
            t = bench(f)
            cells.append(f"{flops / t * 1e-9:.0f} ({base / t:.2f}x)")
        print(f"| {B},{H},{S},{D} | {causal} | {name} | {flops / base * 1e-9:.0f} | " + " | ".join(cells) + " |",
              flush=True)
