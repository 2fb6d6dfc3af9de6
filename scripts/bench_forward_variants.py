"""Forward kernel variants, checked and timed in one run.

A variant is `LAUNCH[@PROMOTE][+nopv]`: LAUNCH as FP4ATTN_FORWARD_LAUNCH takes it
(`block_m,warps,stages[,p_hw_cvt[,rowsum_mma]]`, or `default` for `ops.DEFAULT_LAUNCH`),
PROMOTE the FP8 tensor cores' QK^T promotion interval (0, none, the default and the
recipes' definition; 32 every wgmma's K; the `fast_accum` recipes only), `+nopv` accumulates O on the tensor cores instead
of adding each tile's PV into it in float32 (`pv_promote=False`). For each recipe and
variant it reports (all but TFLOP/s skipped with --no-check):

  codes   the fraction of P bytes identical to the reference's on a (1, 4, 1024, 128)
          slice, causal and not (the GPU tests' criterion)
  err     ||out - ref|| / ||ref|| on that slice (the default variant's beside it)
  lse     max |LSE - LSE of the default variant| at (1, 4, 32768, 128), non-causal:
          what a different row-sum path costs on a long row
  long    ||out - ref|| / ||ref|| and <out, ref> / <ref, ref> (a scale bias shows as a
          ratio below 1) against the reference at S = 1024, 8192, 32768 (1 x 2 heads)
  TFLOP/s kernel alone against SDPA cuDNN bf16, same run

    python scripts/bench_forward_variants.py [--variants default/64,4,3,1,1] [--recipes fp8,nvfp4-fp8]
        [--shapes 8,16,4096,128] [--causal both] [--no-check]
"""

import argparse
import os
import sys

import torch
import triton

from fp4attn.cli.bench import kernel_script_args, timing_cases
from fp4attn.formats import encode_fp8
from fp4attn.kernels.hopper.ops import LAUNCH_ENV, P_MODES, launch_forward
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS
from fp4attn.reference import reference_forward
from fp4attn.reference.encoding import P_OFFSET_LOG2

ap = argparse.ArgumentParser()
ap.add_argument("--variants", default="default/default+nopv/64,4,3,1,1/64,4,3,0")
args = kernel_script_args(ap, shapes="8,16,4096,128/2,16,16384,128", recipes="fp8,fp8-fastacc,nvfp4-fp8,fp8-directp,fp8-directp-fastacc,directp")
VARIANTS = args.variants.split("/")
RECIPES, CAUSAL = args.recipes, args.causal
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731


def parse(variant: str):
    spec, *flags = variant.split("+")
    launch, _, promote = spec.partition("@")
    if set(flags) - {"nopv"}:
        raise SystemExit(f"variant {variant!r}: the one flag is +nopv")
    return launch, int(promote or 0), "nopv" not in flags


def applies(variant: str, recipe) -> bool:
    return recipe.fast_accum or parse(variant)[1] == 0


def run(variant: str, ops, recipe, causal: bool, **kw):
    launch, promote, pv = parse(variant)
    if launch == "default":
        os.environ.pop(LAUNCH_ENV, None)
    else:
        os.environ[LAUNCH_ENV] = launch
    try:
        return launch_forward(ops, scale=ops.q.shape[-1] ** -0.5,
                              causal_offset=0 if causal else None, p_mode=P_MODES[(recipe.p, recipe.p_build)],
                              qk_promote=promote, pv_promote=pv, **kw)
    finally:
        os.environ.pop(LAUNCH_ENV, None)


def check():
    print("| recipe | causal | variant | codes | err (default) |\n|---|---|---|---|---|")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16) * 2 for _ in range(3))
    for name in RECIPES:
        r = PRESETS[name]
        ops = prepare_operands_fused(q, k, v, r)
        for causal in CAUSAL:
            ref = reference_forward(q, k, v, r, scale=128**-0.5, causal="top_left" if causal else None, return_p=True)
            want = encode_fp8(ref.p * 2.0**P_OFFSET_LOG2, "e4m3").view(torch.uint8)
            err = {}
            for var in [x for x in VARIANTS if applies(x, r)]:
                out, _, p = run(var, ops, r, causal, write_p=1)
                got = encode_fp8(p[..., :1024, :], "e4m3").view(torch.uint8)
                err[var] = ((out.float() - ref.out.float()).norm() / ref.out.float().norm()).item()
                print(f"| {name} | {causal} | {var} | {(got == want).float().mean().item():.6f} "
                      f"| {err[var]:.3e} ({err.get('default', float('nan')):.3e}) |", flush=True)
    print("\n| recipe | variant | max abs LSE diff vs default, (1,4,32768,128) | out rel diff |\n|---|---|---|---|")
    q, k, v = (torch.randn(1, 4, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in RECIPES:
        r = PRESETS[name]
        ops = prepare_operands_fused(q, k, v, r)
        out0, lse0, _ = run("default", ops, r, False)
        for var in [x for x in VARIANTS if applies(x, r) and x != "default"]:
            out, lse, _ = run(var, ops, r, False)
            rel = ((out.float() - out0.float()).norm() / out0.float().norm()).item()
            print(f"| {name} | {var} | {(lse - lse0).abs().max().item():.3e} | {rel:.3e} |", flush=True)
    print("\n| recipe | variant | S | rel err vs reference | <out,ref>/<ref,ref> |\n|---|---|---|---|---|")
    for S in (1024, 8192, 32768):
        q, k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in RECIPES:
            r = PRESETS[name]
            ref = reference_forward(q, k, v, r, scale=128**-0.5).out.float()
            ops = prepare_operands_fused(q, k, v, r)
            for var in [x for x in VARIANTS if applies(x, r)]:
                out = run(var, ops, r, False)[0].float()
                rel = ((out - ref).norm() / ref.norm()).item()
                print(f"| {name} | {var} | {S} | {rel:.3e} | {((out * ref).sum() / (ref * ref).sum()).item():.5f} |",
                      flush=True)


def timings():
    print("\n| B,H,S,D | causal | recipe | cuDNN bf16 | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|---|" + "---|" * len(VARIANTS))
    for (B, H, S, D), causal, (q, k, v), flops, base in timing_cases(args.shapes, CAUSAL, bench):
        for name in RECIPES:
            r = PRESETS[name]
            ops = prepare_operands_fused(q, k, v, r)
            cells = []
            for var in VARIANTS:
                if not applies(var, r):
                    cells.append("-")
                    continue
                ms = bench(lambda: run(var, ops, r, causal))
                cells.append(f"{flops / ms * 1e-9:.0f} ({base / ms:.2f}x)")
            print(f"| {B},{H},{S},{D} | {causal} | {name} | {flops / base * 1e-9:.0f} | " + " | ".join(cells)
                  + " |", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if not args.no_check:
        check()
    timings()
