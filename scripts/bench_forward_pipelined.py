"""The Gluon forward (`kernels/hopper/forward_pipelined.py`, both schedules) against the
Triton one with O accumulated on the tensor cores as the Gluon kernel does
(`pv_promote=False`), one run: first the outputs on awkward shapes (the same arithmetic:
out and LSE should be identical), then kernel-alone TFLOP/s of each and SDPA cuDNN bf16 on the
bench shapes (the FP8-Q/K recipes multiply QK^T on the bf16 tensor cores, their
`-fastacc` forms on the FP8 ones).

    python scripts/bench_forward_pipelined.py [--recipes fp8,fp8-fastacc,nvfp4-fp8]
        [--shapes 8,16,4096,128/16,16,2048,64] [--causal both] [--no-check]

--no-check skips the output comparison (about half the run; the GPU test
`test_pipelined_kernel_equals_triton_kernel` makes the same one).
"""

import argparse

import triton

from fp4attn.cli.bench import (CHECK_COLUMNS, check_cases, compare_outputs, kernel_script_args,
                               timing_cases)
from fp4attn.kernels.hopper.forward_pipelined import launch_forward_pipelined
from fp4attn.kernels.hopper.ops import P_MODES, launch_forward
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.recipes import PRESETS

bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
args = kernel_script_args(argparse.ArgumentParser(), shapes="8,16,4096,128/4,32,4096,128/16,16,2048,64",
                          recipes="fp8,fp8-fastacc,nvfp4-fp8,fp8-directp,fp8-directp-fastacc,directp",
                          no_check_help="skip the output comparison on awkward shapes")
RECIPES, CAUSAL = args.recipes, args.causal


def run_both(q, k, v, r, causal_offset, schedule=0):
    ops = prepare_operands_fused(q, k, v, r)
    mode = P_MODES[(r.p, r.p_build)]
    kw = dict(scale=q.shape[-1] ** -0.5, causal_offset=causal_offset, p_mode=mode)
    # the Triton kernel with O accumulated on the tensor cores, as the Gluon kernel does
    return ops, kw, launch_forward(ops, **kw, pv_promote=False)[:2], launch_forward_pipelined(ops, **kw,
                                                                                              schedule=schedule)


if not args.no_check:
    print(f"| recipe | B,H,Hkv,Sq,Sk,D | causal | schedule | {CHECK_COLUMNS} |")
    print("|---|---|---|---|---|---|---|---|---|")
for shape, (q, k, v) in () if args.no_check else check_cases():
    Sq, Sk = shape[3:5]
    for name in RECIPES:
        for causal, schedule in ((c, s) for c in CAUSAL for s in (0, 1)):
            off = (Sk - Sq) if causal else None
            _, _, (o1, l1), (o2, l2) = run_both(q, k, v, PRESETS[name], off, schedule)
            cells = compare_outputs(o1, l1, o2, l2)
            print(f"| {name} | {','.join(map(str, shape))} | {causal} | {schedule} | {cells} |")

print("\n| B,H,S,D | causal | recipe | cuDNN bf16 | Triton | Gluon 0 | Gluon 1 |")
print("|---|---|---|---|---|---|---|")
for (B, H, S, D), causal, (q, k, v), flops, base in timing_cases(args.shapes, CAUSAL, bench):
    for name in RECIPES:
        ops, kw, _, _ = run_both(q, k, v, PRESETS[name], 0 if causal else None)
        cells = []
        for f in (lambda: launch_forward(ops, **kw, pv_promote=False), lambda: launch_forward_pipelined(ops, **kw),
                  lambda: launch_forward_pipelined(ops, **kw, schedule=1)):
            t = bench(f)
            cells.append(f"{flops / t * 1e-9:.0f} ({base / t:.2f}x)")
        print(f"| {B},{H},{S},{D} | {causal} | {name} | {flops / base * 1e-9:.0f} | " + " | ".join(cells) + " |")
