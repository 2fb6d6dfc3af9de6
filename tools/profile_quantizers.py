"""Where the operand quantization's time goes: for each recipe's fused quantizers
(`prepare_operands_fused`) and the training backward's operand views
(`train_op.backward_operands`), the device time of every kernel they launch (torch
profiler, CUDA activity) against the time of the whole call seen from the host
(`triton.testing.do_bench`, which includes the launch work of every torch op and
Triton kernel). A call whose host time exceeds its device time is launch-bound: its
GB/s then say nothing about the kernels. Prints Markdown tables.
With --train-shape also every kernel of one whole causal `train` forward+backward
(quantizers, forward, backward) at that shape, against cuDNN bf16's in the same run.

    python tools/profile_quantizers.py [--shape 8,16,4096,128] [--train-shape 4,16,4096,128]
"""

import argparse

import torch
import triton

from fp4attn.kernels.hopper.operands import prepare_operands_fused
from fp4attn.kernels.hopper.train_op import backward_operands, quantize_for_training
from fp4attn.recipes import PRESETS
from fp4attn.tools.benchmark import device_kernels

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="8,16,4096,128")
ap.add_argument("--recipes", default="fp8,nvfp4-fp8,fp8-directp")
ap.add_argument("--train-shape", help="B,H,S,D of a whole causal `train` forward+backward to break down")
args = ap.parse_args()
B, H, S, D = (int(s) for s in args.shape.split(","))
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")  # noqa: E731

q, k, v, dout, out = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
n_bytes = 3 * q.numel() * 2  # bf16 Q, K, V read once
copy_ms = bench(lambda: q.clone())
print(f"(B,H,S,D) = {(B, H, S, D)}; copy of one bf16 operand {copy_ms:.3f} ms, "
      f"{2 * q.numel() * 2 / copy_ms * 1e-6:.0f} GB/s (read + write)\n")
calls = {f"quantize for {r}": (lambda r=r: prepare_operands_fused(q, k, v, PRESETS[r], scale=D**-0.5))
         for r in args.recipes.split(",")}
_, saved = quantize_for_training(q, k, v, "fp8")
calls["train forward's quantization"] = lambda: quantize_for_training(q, k, v, "fp8")
calls["backward operand views (train)"] = lambda: backward_operands(dout, out, *saved)
print("| call | host-seen ms | device ms (sum of kernels) | kernels per call | GB/s of device time (bf16 Q, K, V read) |")
print("|---|---|---|---|---|")
details = {}
for name, f in calls.items():
    host = bench(f)
    kern = device_kernels(f)
    dev = sum(ms for _, ms in kern.values())
    launches = sum(n for n, _ in kern.values())
    details[name] = kern
    gbs = f"{n_bytes / dev * 1e-6:.0f}" if name.startswith("quantize") else ""
    print(f"| {name} | {host:.3f} | {dev:.3f} | {launches:.0f} | {gbs} |")
if args.train_shape:
    from fp4attn.cli.bench_train import _fwd_bwd

    tshape = tuple(int(s) for s in args.train_shape.split(","))
    tq, tk, tv = (torch.randn(tshape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    tdo = torch.randn(tshape, device="cuda", dtype=torch.bfloat16)
    for impl in ("train", "sdpa-cudnn"):
        fn = _fwd_bwd(impl)
        step = lambda fn=fn: torch.autograd.backward(fn(tq, tk, tv), tdo)  # noqa: E731
        host = bench(step)
        kern = device_kernels(step)
        name = f"{impl} causal forward+backward {tshape}"
        details[name] = kern
        print(f"| {name} | {host:.3f} | {sum(ms for _, ms in kern.values()):.3f} | "
              f"{sum(n for n, _ in kern.values()):.0f} |  |")
for name, kern in details.items():
    print(f"\n{name}:\n| kernel | launches | device ms |\n|---|---|---|")
    for kname, (n, ms) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kname[:90]} | {n:.0f} | {ms:.3f} |")
