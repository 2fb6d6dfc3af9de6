"""Kernel-level variants for docs/notes/hopper-forward.md, one run: each P builder with
and without fp32 promotion of the fp8 QK accumulation, and the operand quantization's
bandwidth against a device-to-device copy. (8, 16, 4096, 128), non-causal."""

import torch
import triton

from fp4attn.kernels.hopper.operands import prepare_operands
from fp4attn.kernels.hopper.quantize import prepare_operands_fused
from fp4attn.kernels.hopper.ops import P_MODES, launch_forward
from fp4attn.recipes import PRESETS

B, H, S, D = 8, 16, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * B * H * S * S * D
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
variants = {"fp8 (exp2 P)": PRESETS["fp8"], "fp8-fastacc": PRESETS["fp8-fastacc"],
            "fp8-directp": PRESETS["fp8-directp"], "fp8-directp-fastacc": PRESETS["fp8-directp-fastacc"],
            "fp8 QK + MXFP4 P by exp2": PRESETS["fp8-directp-fastacc"].with_(p_build="exp2"),
            "nvfp4-fp8 (bf16 QK)": PRESETS["nvfp4-fp8"], "directp (bf16 QK)": PRESETS["directp"]}
print("| variant | QK promote | TFLOP/s |")
print("|---|---|---|")
for name, r in variants.items():
    ops = prepare_operands(q, k, v, r)
    for promote in (32, 0) if r.fast_accum else (0,):
        ms = bench(lambda: launch_forward(ops, scale=D**-0.5, causal_offset=None,
                                          p_mode=P_MODES[(r.p, r.p_build)], qk_promote=promote))
        print(f"| {name} | {promote} | {flops / ms * 1e-9:.0f} |")
x = torch.empty(B * H * S * D * 3, device="cuda", dtype=torch.bfloat16)
copy_ms = bench(lambda: x.clone())
print(f"\ndevice copy: {2 * x.numel() * 2 / copy_ms * 1e-6:.0f} GB/s (read + write)")
for name in ("fp8", "fp8-directp", "nvfp4-fp8"):
    r = PRESETS[name]
    out = prepare_operands(q, k, v, r)
    moved = 3 * q.numel() * 2 + sum(t.numel() * t.element_size() for t in (out.q, out.k, out.vt, out.qs, out.ks, out.vs))
    for label, prep in (("torch ops", prepare_operands), ("fused Triton", prepare_operands_fused)):
        ms = bench(lambda: prep(q, k, v, r))
        print(f"quantize {name} ({label}): {ms:.2f} ms, {moved / ms * 1e-6:.0f} GB/s (bytes in + out)")
