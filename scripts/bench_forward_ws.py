"""The warp-specialized Gluon forward (`forward_pipelined.attn_fwd_ws_kernel`: a producer
warp loading K/V^T by TMA, consumer warpgroups that wait only on mbarriers) against the
Triton kernel (the default launch with `warp_specialized` off), one run: first the outputs on awkward shapes (the same arithmetic
as the Triton kernel's `pv_add` path: out and LSE should be equal up to the FMA
contraction of O's update), then kernel-alone TFLOP/s of each variant and SDPA cuDNN
bf16 on the bench shapes.

    python scripts/bench_forward_ws.py [--recipes nvfp4-fp8,fp8,directp]
        [--shapes 8,16,4096,128/2,16,16384,128] [--causal both] [--no-check]
        [--variants 0:2,0:3,2:2,1:2]

A variant is `partitions:stages[:overlap[:promote]]` (`forward_pipelined.ws_launch`, the
kernel's OVERLAP and, for e4m3 Q/K on the FP8 tensor cores (the `fast_accum` recipes),
QK_PROMOTE: products summed by the tensor core before each float32 addition, 0 (none,
the default) or 32). The Triton kernel it is checked against runs the same promotion.
"""

import argparse
import dataclasses
import os

import torch
import triton

from fp4attn.cli.bench import (CHECK_COLUMNS, check_cases, compare_outputs, kernel_script_args,
                               timing_cases)
from fp4attn.kernels.hopper.forward_pipelined import launch_forward_pipelined
from fp4attn.kernels.hopper.ops import DEFAULT_LAUNCH, LAUNCH_ENV, P_MODES, launch_forward
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS

bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
ap = argparse.ArgumentParser()
ap.add_argument("--variants", default="0:2,0:3,2:2,1:2,2:2:1")
args = kernel_script_args(ap, shapes="8,16,4096,128/2,16,16384,128", recipes="nvfp4-fp8,fp8,directp",
                          no_check_help="skip the output comparison on awkward shapes")
VARIANTS = [tuple(int(x) for x in (v + ":0:0").split(":")[:4]) for v in args.variants.split(",")]


def prepared(q, k, v, name, causal_offset):
    r = PRESETS[name]
    ops = prepare_operands_fused(q, k, v, r)
    return ops, dict(scale=q.shape[-1] ** -0.5, causal_offset=causal_offset, p_mode=P_MODES[(r.p, r.p_build)])


def triton_kernel(ops, kw, promote=0):
    """The Triton kernel with the default launch's other fields (`launch_forward` routes
    D=128 FP8 P to the Gluon kernel itself), promoting e4m3 QK^T every `promote` products."""
    launch = DEFAULT_LAUNCH[ops.q.shape[-1], ops.q.dtype == torch.float8_e4m3fn, kw["causal_offset"] is not None]
    os.environ[LAUNCH_ENV] = ",".join(str(int(x)) for x in dataclasses.astuple(
        dataclasses.replace(launch, warp_specialized=False)))
    try:
        return launch_forward(ops, **kw, qk_promote=promote)[:2]
    finally:
        del os.environ[LAUNCH_ENV]


def ws(ops, kw, partitions, stages, overlap, promote):
    return launch_forward_pipelined(ops, **kw, warp_specialized=True, partitions=partitions, stages=stages,
                                    overlap=overlap, qk_promote=promote)


if not args.no_check:
    print(f"| recipe | B,H,Hkv,Sq,Sk,D | causal | variant | {CHECK_COLUMNS} |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|")
for shape, (q, k, v) in () if args.no_check else check_cases():
    Sq, Sk = shape[3:5]
    for name in args.recipes:
        for causal in args.causal:
            ops, kw = prepared(q, k, v, name, (Sk - Sq) if causal else None)
            for variant in VARIANTS:
                o1, l1 = triton_kernel(ops, kw, variant[3])
                o2, l2 = ws(ops, kw, *variant)
                print(f"| {name} | {','.join(map(str, shape))} | {causal} | {':'.join(map(str, variant))} | "
                      f"{compare_outputs(o1, l1, o2, l2)} |", flush=True)

head = " | ".join("WS " + ":".join(map(str, v)) for v in VARIANTS)
print(f"\n| B,H,S,D | causal | recipe | cuDNN bf16 | Triton | {head} |")
print("|---|---|---|---|---|" + "---|" * len(VARIANTS), flush=True)
for (B, H, S, D), causal, (q, k, v), flops, base in timing_cases(args.shapes, args.causal, bench):
    for name in args.recipes:
        ops, kw = prepared(q, k, v, name, 0 if causal else None)
        cells = []
        for f in [lambda: triton_kernel(ops, kw)] + [lambda v=v: ws(ops, kw, *v) for v in VARIANTS]:
            t = bench(f)
            cells.append(f"{flops / t * 1e-9:.0f} ({base / t:.2f}x)")
        print(f"| {B},{H},{S},{D} | {causal} | {name} | {flops / base * 1e-9:.0f} | " + " | ".join(cells) + " |",
              flush=True)
