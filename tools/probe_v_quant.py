"""V's quantization read once or twice (`quantize_v_t(one_pass=...)`, `_v_kernel`): each
form's bytes against the other's, then device time (median of `triton.testing.do_bench`)
of V alone at two warp counts a program, and of the whole operand quantization of the
fastest inference preset with V read once against read twice, beside a bf16 copy of V
(read + write) at each shape. Prints Markdown tables.

    python tools/probe_v_quant.py [--shapes "8,16,4096,128;16,16,2048,64"]
"""

import argparse

import torch
import triton

from fp4attn.kernels.hopper import quantize as qz
from fp4attn.recipes import PRESETS

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="8,16,4096,128;4,32,4096,128;16,16,2048,64;2,16,16384,128")
ap.add_argument("--recipe", default="fp8-ktile-affine-lazy-fastacc")
args = ap.parse_args()


def bench(f):
    return triton.testing.do_bench(f, warmup=20, rep=200, return_mode="median")


def same(a, b):
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


recipe = PRESETS[args.recipe]
v_rows, op_rows = [], []
for shape in args.shapes.split(";"):
    B, H, S, D = (int(s) for s in shape.split(","))
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    copy = bench(lambda: v.clone())
    once_ok = -(-S // 64) <= torch.cuda.get_device_properties(0).multi_processor_count
    for fmt in ("fp8", "mxfp4"):
        times = {}
        for warps in (4, 8):
            qz.V_WARPS[fmt] = warps
            for one in ((True, False) if once_ok else (False,)):
                times[warps, one] = bench(lambda: qz.quantize_v_t(v, fmt, pad_keys_to=128, one_pass=one))
        if once_ok:
            assert same(qz.quantize_v_t(v, fmt, pad_keys_to=128, one_pass=True),
                        qz.quantize_v_t(v, fmt, pad_keys_to=128, one_pass=False)), (shape, fmt)
        qz.V_WARPS.update(fp8=4, mxfp4=8)
        v_rows.append((shape, fmt, copy, times))
    whole = {}
    for one in (True, False) if once_ok else (False,):
        real = qz.quantize_v_t

        def forced(*a, one=one, **kw):
            return real(*a, **kw, one_pass=one)
        qz.quantize_v_t = forced
        whole[one] = bench(lambda: qz.prepare_operands_fused(q, k, v, recipe))
        qz.quantize_v_t = real
    op_rows.append((shape, copy, whole))

print("\n| shape | V format | bf16 copy of V (ms) | once, 4 warps | twice, 4 warps | once, 8 warps | twice, 8 warps |")
print("|---|---|---|---|---|---|---|")
for shape, fmt, copy, t in v_rows:
    cell = lambda key: f"{t[key]:.4f}" if key in t else "-"
    print(f"| {shape} | {fmt} | {copy:.4f} | {cell((4, True))} | {cell((4, False))} | {cell((8, True))} | "
          f"{cell((8, False))} |")
print(f"\n| shape | bf16 copy of V (ms) | {args.recipe} operands, V once (ms) | V twice (ms) |")
print("|---|---|---|---|")
for shape, copy, w in op_rows:
    print(f"| {shape} | {copy:.4f} | {w.get(True, float('nan')):.4f} | {w[False]:.4f} |")
