"""Host time against device time of the `train` attention (forward + backward) at the
GPT model step's shape, where the host's time goes, and the model step itself, in one
run. Host ms: the time to enqueue one call when nothing waits on the GPU (N calls, then
one synchronization); a call whose host ms exceed its device ms is launch-bound. The
host profile is cProfile's over the same calls (its own overhead inflates every
Python function by about the same factor: read it as shares). Prints Markdown tables.

    python scripts/profile_train_step.py [--shape 1,16,4096,128] [--steps 12] [--top 25]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl

import fp4attn
from fp4attn.cli.bench import device_kernels
from fp4attn.cli.bench_train import model_step

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="1,16,4096,128")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--top", type=int, default=25)
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


@triton.jit
def _empty_kernel(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, X: tl.constexpr):
    pass


q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
step = lambda: torch.autograd.grad(fp4attn.attention(q, k, v, recipe="train", causal=True), (q, k, v), dout)
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
    sdpa = lambda: torch.autograd.grad(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dout)
    sdpa_host = host_ms(sdpa)
ptrs = [torch.empty(64, device="cuda") for _ in range(8)]
empty = lambda: _empty_kernel[(1,)](*ptrs, *range(8), X=1)

dev, launches = device_ms(step)
wall = triton.testing.do_bench(step, warmup=5, rep=50, return_mode="median")
host = host_ms(step)
empty_host = host_ms(empty, 200)
prof = cProfile.Profile()
step()
torch.cuda.synchronize()
prof.enable()
for _ in range(20):
    step()
prof.disable()
torch.cuda.synchronize()
model = {r["impl"]: r["ms_step"] for r in model_step(["train"], steps=args.steps)}

print(f"`train` causal fwd+bwd at (B,H,S,D) = {(B, H, S, D)}; GPT step: 20 layers, dim 2048, seq 4096, batch 1")
print("| host ms per call | device ms per call | kernels per call | do_bench ms | SDPA cuDNN host ms | "
      "empty Triton launch (16 args) host ms | GPT step ms (train) | GPT step ms (SDPA cuDNN) |")
print("|---|---|---|---|---|---|---|---|")
print(f"| {host:.2f} | {dev:.2f} | {launches} | {wall:.2f} | {sdpa_host:.3f} | {empty_host:.4f} | "
      f"{model['train']:.1f} | {model['sdpa-cudnn']:.1f} |")
out = io.StringIO()
stats = pstats.Stats(prof, stream=out)
print(f"\nHost profile of 20 calls (cProfile, top {args.top} by own time, then by cumulative time):\n")
stats.sort_stats("tottime").print_stats(args.top)
stats.sort_stats("cumulative").print_stats(args.top)
print("```\n" + out.getvalue() + "```")
