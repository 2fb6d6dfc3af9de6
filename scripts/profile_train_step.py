"""Host time against device time of the `train` attention (forward + backward) at the
GPT model step's shape, and the model step itself, with the backward's operand tiles by
TMA (host-built descriptors, encoded at every launch) and by pointer loads, in one run.
Host ms: the time to enqueue one call when nothing waits on the GPU (N calls, then one
synchronization); a call whose host ms exceed its device ms is launch-bound. Prints a
Markdown table.

    python scripts/profile_train_step.py [--shape 1,16,4096,128] [--steps 12]
"""

import argparse
import dataclasses
import time

import torch
import triton

import fp4attn
from fp4attn.cli.bench import device_kernels
from fp4attn.cli.bench_train import model_step
from fp4attn.kernels.hopper import training

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="1,16,4096,128")
ap.add_argument("--steps", type=int, default=12)
args = ap.parse_args()
B, H, S, D = (int(s) for s in args.shape.split(","))


def host_ms(f, n: int = 20) -> float:
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e3


def device_ms(f) -> tuple[float, int]:
    """(device ms per call summed over its kernels, kernels per call)."""
    kernels = device_kernels(f, reps=10).values()
    return sum(ms for _, ms in kernels), round(sum(n for n, _ in kernels))


q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
step = lambda: torch.autograd.grad(fp4attn.attention(q, k, v, recipe="train", causal=True), (q, k, v), dout)  # noqa: E731
default = training.BACKWARD_CONFIGS[D]
rows = []
for tma in (False, True):
    training.BACKWARD_CONFIGS[D] = dataclasses.replace(default, tma=tma)
    dev, launches = device_ms(step)
    wall = triton.testing.do_bench(step, warmup=5, rep=50, return_mode="median")
    model = {r["impl"]: r["ms_step"] for r in model_step(["train"], steps=args.steps)}
    rows.append(f"| {tma} | {host_ms(step):.2f} | {dev:.2f} | {launches} | {wall:.2f} | {model['train']:.1f} | "
                f"{model['sdpa-cudnn']:.1f} |")
training.BACKWARD_CONFIGS[D] = default
print(f"`train` causal fwd+bwd at (B,H,S,D) = {(B, H, S, D)}; GPT step: 20 layers, dim 2048, seq 4096, batch 1")
print("| backward tiles by TMA | host ms per call | device ms per call | kernels per call | do_bench ms | "
      "GPT step ms (train) | GPT step ms (SDPA cuDNN) |")
print("|---|---|---|---|---|---|---|")
print("\n".join(rows))
