"""The NVFP4 Q/K payload the training forward keeps, timed on the GPU: the fused
quantizer with and without the packed payload, the decode the backward runs, and a
device-to-device copy of the bf16 input for scale. Prints a Markdown table.

    python scripts/bench_nvfp4_payload.py [--shape 4,16,4096,128]
"""

import argparse

import torch
import triton

from fp4attn.kernels.hopper.quantize import decode_nvfp4_rows, quantize_qk_nvfp4

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4,16,4096,128")
shape = tuple(int(s) for s in ap.parse_args().shape.split(","))
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")  # noqa: E731

x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
n = x.numel()
_, _, codes, bscale = quantize_qk_nvfp4(x, packed=True)
rows = [("copy of the bf16 tensor", bench(lambda: x.clone()), 4 * n),
        ("quantize (bf16 grid values)", bench(lambda: quantize_qk_nvfp4(x)), 4 * n),
        ("quantize (grid values + packed payload)", bench(lambda: quantize_qk_nvfp4(x, packed=True)),
         4 * n + n // 2 + n // 16),
        ("decode the payload to grid values", bench(lambda: decode_nvfp4_rows(codes, bscale)), n // 2 + n // 16 + 2 * n)]
print(f"| {shape} | ms | GB/s (bytes in + out) |\n|---|---|---|")
for name, ms, nbytes in rows:
    print(f"| {name} | {ms:.3f} | {nbytes / ms * 1e-6:.0f} |")
