"""The FP8 inference quantizers' launch shapes, device time (median of
`triton.testing.do_bench`) beside a bf16 copy of one operand (read + write) at each shape:
V read once or twice (`quantize_v_t(one_pass=...)`, `_v_kernel`) at several keys and warps
a program (`V_PROGRAM`), both V formats, each form's bytes checked against the other's;
per-row FP8 Q (`_fp8_rows_kernel`) at several rows and warps a program; K with a scale
per key tile (`_fp8_tiles_kernel`) at several warps; then the whole operand quantization
of the fastest inference preset as routed. Prints Markdown tables.

    python tools/probe_v_quant.py [--shapes "8,16,4096,128;16,16,2048,64"]
"""

import argparse

import torch
import triton

from fp4attn.kernels.hopper.operands import BLOCK_N, prepare_operands_fused
from fp4attn.kernels.quantize import fp8, v_operand
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
routed = dict(v_operand.V_PROGRAM)
sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = []
for shape in args.shapes.split(";"):
    B, H, S, D = (int(s) for s in shape.split(","))
    G = B * H
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    copy = bench(lambda: v.clone())
    rows.append((shape, "bf16 copy (read + write)", copy))
    for fmt in ("fp8", "mxfp4"):
        for keys, warps in ((64, 4), (128, 4), (128, 8), (32, 4)):
            v_operand.V_PROGRAM[D] = (keys, warps)
            forms = (True, False) if -(-S // keys) <= sms else (False,)
            for one in forms:
                t = bench(lambda: v_operand.quantize_v_t(v, fmt, pad_keys_to=BLOCK_N, one_pass=one))
                rows.append((shape, f"V {fmt}, {keys} keys, {warps} warps, read {'once' if one else 'twice'}", t))
            if len(forms) == 2:
                assert same(v_operand.quantize_v_t(v, fmt, pad_keys_to=BLOCK_N, one_pass=True),
                            v_operand.quantize_v_t(v, fmt, pad_keys_to=BLOCK_N, one_pass=False)), (shape, fmt, keys)
        v_operand.V_PROGRAM.update(routed)
    x3 = q.reshape(G, S, D)
    y = torch.empty(x3.shape, device="cuda", dtype=torch.float8_e4m3fn)
    sc = torch.empty((G, S), device="cuda", dtype=torch.float32)
    none = torch.empty(0, device="cuda", dtype=torch.float32)
    camax = torch.empty(0, device="cuda", dtype=torch.int32)
    for block_r, blocks, warps in ((16, 1, 4), (32, 1, 4), (64, 1, 4), (64, 1, 8), (128, 1, 8), (16, 4, 4), (32, 4, 4)):
        grid = (-(-S // (block_r * blocks)), G)
        def f():
            return fp8._fp8_rows_kernel[grid](x3, y, sc, x3, none, camax, S, D=D, BLOCK_R=block_r, BLOCKS=blocks,
                                              WITH_DOT=False, CHANNEL_AMAX=False, HW_CVT=True, num_warps=warps)
        rows.append((shape, f"Q per row, {block_r} rows x {blocks} blocks, {warps} warps", bench(f)))
    for warps in (4, 8, 16):
        def f():
            return fp8._fp8_tiles_kernel[(-(-S // BLOCK_N), G)](x3, y, sc, S, D=D, TILE=BLOCK_N, HW_CVT=True,
                                                                num_warps=warps)
        rows.append((shape, f"K per tile, {warps} warps", bench(f)))
    rows.append((shape, f"{args.recipe} operands as routed", bench(lambda: prepare_operands_fused(q, k, v, recipe))))

print("\n| shape | what | ms |")
print("|---|---|---|")
for shape, what, t in rows:
    print(f"| {shape} | {what} | {t:.4f} |")
